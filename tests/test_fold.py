# Copyright © 2026 turboquant_mlx contributors.

"""Folding the value rotation into W_v / W_o (turboquant_mlx.fold).

The folded model with its fold-aware caches (``rotate_values=False``) must compute
what the unfolded model computes with its ordinary caches. With float weights the
fold is exact up to float rounding. Caches hold their tokens rounded to
``window_dtype`` (float16 by default) before they quantize them, and a code is a
discontinuous function of its input: the fold's different rounding of ``W_v x``
then lands a few coordinates on a neighbouring code, and over many layers such
differences grow to the size of the quantization noise itself (an unfolded model
whose ``v_proj`` is merely summed in float64 diverges as much, see the report in
``bench/fold.py``). So the end-to-end comparisons use float32 window storage on
two-layer models, and the 30-layer SmolLM2 comparison runs the two models' attention
modules in lockstep on identical inputs, where the caches must agree code for code
but for a handful of boundary cases.
"""

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

import lm_helpers
from lm_helpers import build_model
from turboquant_mlx import fallback
from turboquant_mlx.cache import TurboQuantKVCache, layer_seed, make_prompt_cache
from turboquant_mlx.fold import (
    FOLD_ATTRIBUTE,
    ValueFoldError,
    _folded_layers,
    fold_value_rotation,
    value_fold_of,
)
from turboquant_mlx.prompt_cache import PromptCacheError, save_prompt_cache
from turboquant_mlx.rotation import Rotation

QWEN2 = dict(
    model_type="qwen2",
    hidden_size=256,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    vocab_size=lm_helpers.VOCAB,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)  # head dim 64, v_proj with bias

# Logits of a folded vs an unfolded two-layer model (float32 cache storage), as a
# fraction of how far quantization moves them (against an uncompressed cache).
LOGIT_TOL = 2e-2


def _model(name, seed=0, **overrides):
    if name == "qwen2":
        module = importlib.import_module("mlx_lm.models.qwen2")
        mx.random.seed(seed)
        model = module.Model(module.ModelArgs.from_dict(dict(QWEN2, **overrides)))
        model.update(tree_map(lambda p: p * 2.0 if p.ndim == 2 else p, model.parameters()))
        mx.eval(model.parameters())
        model.eval()
        return model
    return build_model(name, seed=seed, **overrides)


def _tokens(n, seed=1):
    return mx.array(np.random.default_rng(seed).integers(0, 256, n).astype(np.int32))[None]


def _run(model, cache, tokens, prefill):
    """Prefill ``tokens[:prefill]`` in one call, then decode the rest one by one."""
    outs = [model(tokens[:, :prefill], cache=cache)]
    for t in range(prefill, tokens.shape[1]):
        outs.append(model(tokens[:, t : t + 1], cache=cache))
    mx.eval(outs)
    return outs


# ---------------------------------------------------------------------------
# The weight transform


def test_folded_weights_grouped_query_attention():
    """Distinct rotations per KV head: v_proj rows rotate per KV head, o_proj columns of
    each query head undo its own KV head's rotation (4 query heads read 2 KV heads)."""
    model = _model("llama", attention_bias=True)
    attn = model.layers[0].self_attn
    D, n_q, n_kv = 64, attn.n_heads, attn.n_kv_heads
    Rs = [Rotation(D, s).matrix() for s in (11, 12)]
    v_proj, o_proj = _folded_layers(attn, Rs, "dequantize", None)

    x = mx.random.normal((1, 7, 128), key=mx.random.key(3))
    v = attn.v_proj(x).reshape(1, 7, n_kv, D)
    v_rot = v_proj(x).reshape(1, 7, n_kv, D)
    for h in range(n_kv):
        want = np.array(v[0, :, h], dtype=np.float64) @ Rs[h].T  # bias rotated too
        np.testing.assert_allclose(np.array(v_rot[0, :, h]), want, atol=1e-5)

    q = mx.random.normal((1, n_q, 7, D), key=mx.random.key(4))
    k = mx.random.normal((1, n_kv, 7, D), key=mx.random.key(5))

    def out(o, values):
        a = mx.fast.scaled_dot_product_attention(
            q, k, values.transpose(0, 2, 1, 3), scale=D**-0.5, mask="causal"
        )
        return o(a.transpose(0, 2, 1, 3).reshape(1, 7, n_q * D))

    np.testing.assert_allclose(
        np.array(out(o_proj, v_rot)), np.array(out(attn.o_proj, v)), atol=2e-5
    )


# ---------------------------------------------------------------------------
# Folded vs unfolded models, each with its matching compressed cache

CACHE_CONFIGS = [
    dict(preset="tq4-plain"),
    dict(
        preset="tq4-plain",
        value_bits=3,
        fp16_sink_tokens=4,
        fp16_recent_tokens=16,
        fp16_layers=(1, 0),
    ),
    dict(preset="tq4-plain", center=True, query_aware_keys=True),
]


class _Lockstep(nn.Module):
    """Runs the unfolded layer's attention and, on the same input, the folded one with
    its own cache; records both outputs and passes the unfolded one on."""

    def __init__(self, base, folded, cache, record):
        super().__init__()
        self.base, self.folded = base, folded
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "_record", record)

    def __call__(self, x, mask=None, cache=None):
        want = self.base(x, mask, cache)
        got = self.folded(x, mask, self._cache)
        self._record.append((want, got))
        return want


def _lockstep(base, folded, c0, c1, tokens, prefill):
    """Runs ``base`` over ``tokens`` (prefill, then decode) with every folded attention
    module in lockstep; returns the recorded (unfolded, folded) attention outputs."""
    record = []
    for i, layer in enumerate(base.layers):
        layer.self_attn = _Lockstep(layer.self_attn, folded.layers[i].self_attn, c1[i], record)
    mx.eval(base.model(tokens[:, :prefill], cache=c0))
    for t in range(prefill, tokens.shape[1]):
        mx.eval(base.model(tokens[:, t : t + 1], cache=c0))
    for layer in base.layers:
        layer.self_attn = layer.self_attn.base
    return record


def _check_lockstep(record, c0, c1, fold, max_flip_fraction):
    """Attention outputs agree to float rounding but for a boundary code or scale; the
    caches hold the same key codes and value codes but for a few neighbouring ones."""
    for want, got in record:
        err = float(mx.abs(got - want).max()) / float(mx.abs(want).max())
        assert err < 1e-3, err  # observed: ~1e-7, up to 5e-5 at a neighbouring code
    flipped = total = 0
    for i, (a, b) in enumerate(zip(c0, c1)):
        assert type(a) is type(b)
        if not isinstance(b, TurboQuantKVCache):
            assert not fold.folds(i)
            continue
        assert fold.folds(i) and b.rotate_values is False and a.rotate_values is True
        assert b.seed == a.seed == fold.layer_seeds[i]
        n = a._n_comp
        assert n == b._n_comp
        if n == 0:
            continue
        np.testing.assert_array_equal(
            np.array(a._kv.k_codes[:, :, :n]), np.array(b._kv.k_codes[:, :, :n])
        )
        np.testing.assert_array_equal(
            np.array(a._kv.k_scales[:, :, :n]), np.array(b._kv.k_scales[:, :, :n])
        )
        bits, D = a.value_bits, a.head_dim
        va = np.array(fallback.unpack(a._kv.v_codes[:, :, :n], bits, D)).astype(np.int64)
        vb = np.array(fallback.unpack(b._kv.v_codes[:, :, :n], bits, D)).astype(np.int64)
        assert np.abs(va - vb).max() <= 1  # at most a neighbouring code
        flipped += int((va != vb).sum())
        total += va.size
        # scale = |v| / |chosen centroids|: one float16 ulp apart, more where a code moved.
        sa = np.array(a._kv.v_scales[:, :, :n], np.float32)
        sb = np.array(b._kv.v_scales[:, :, :n], np.float32)
        moved = (va != vb).any(axis=-1)
        np.testing.assert_allclose(sb[~moved], sa[~moved], rtol=1e-3)
        np.testing.assert_allclose(sb[moved], sa[moved], rtol=1e-2)
    assert total > 0 and flipped <= max_flip_fraction * total, (flipped, total)


def _assert_logits_close(base, folded, c0, c1, tokens, prefill):
    """Logits of the two models, each with its caches, differ by float rounding (CPU:
    <= 1e-5 relative in most cases), or by a code landing on its neighbour (seen: up to
    0.8% of how far quantization moves the logits)."""
    want, got = _run(base, c0, tokens, prefill), _run(folded, c1, tokens, prefill)
    exact = _run(base, [KVCache() for _ in base.layers], tokens, prefill)
    quantization = max(float(mx.abs(w - e).max()) for w, e in zip(want, exact))
    diff = max(float(mx.abs(w - g).max()) for w, g in zip(want, got))
    assert diff < LOGIT_TOL * quantization, (diff, quantization)


@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("cfg", CACHE_CONFIGS, ids=["tq4", "k4v3-window-fp16layer", "levers"])
def test_folded_model_matches_unfolded(name, cfg):
    base, folded = _model(name), _model(name)
    kw = dict(cfg, seed=5)
    fold = fold_value_rotation(folded, **kw)
    assert value_fold_of(folded) is fold and getattr(folded, FOLD_ATTRIBUTE) is fold
    # Float32 cache storage and small key blocks (prefill merges several blocks).
    run_kw = dict(kw, window_dtype=mx.float32, prefill_budget_bytes=1 << 16)
    tokens = _tokens(272)

    # End to end, each model with its own caches.
    c0, c1 = make_prompt_cache(base, **run_kw), make_prompt_cache(folded, **run_kw)
    _assert_logits_close(base, folded, c0, c1, tokens, 264)

    # Layer by layer on identical inputs: same codes but for boundary cases.
    c0, c1 = make_prompt_cache(base, **run_kw), make_prompt_cache(folded, **run_kw)
    record = _lockstep(base, folded, c0, c1, tokens, 264)
    _check_lockstep(record, c0, c1, fold, max_flip_fraction=1e-4)
    for i in fold.layer_seeds:  # the values are stored in the fold's rotated space
        k0, v0 = c0[i].dequantized_keys_values(mx.float32)
        k1, v1 = c1[i].dequantized_keys_values(mx.float32)
        np.testing.assert_array_equal(np.array(k1), np.array(k0))
        R = Rotation(64, fold.layer_seeds[i]).matrix()
        close = np.isclose(np.array(v1), np.array(v0) @ R.T, atol=1e-4, rtol=0)
        # A code on its neighbour (a boundary case, see _check_lockstep) moves all
        # coordinates of its vector once rotated back: count vectors.
        assert close.all(axis=-1).mean() > 0.99


def test_fold_from_a_prompt_cache_and_without_cache():
    base, folded = _model("llama"), _model("llama")
    cache = make_prompt_cache(folded, "tq4-plain", seed=2, window_dtype=mx.float32)
    fold = fold_value_rotation(folded, cache)
    assert fold.base_seed is None and all(c.rotate_values is False for c in cache)
    tokens = _tokens(80)
    unfolded_cache = make_prompt_cache(base, "tq4-plain", seed=2, window_dtype=mx.float32)
    _assert_logits_close(base, folded, unfolded_cache, cache, tokens, 70)
    # No cache at all: nothing stored, the folded model is the same function.
    np.testing.assert_allclose(np.array(folded(tokens)), np.array(base(tokens)), atol=1e-4, rtol=0)


def test_quantized_weights_dequantize_and_requantize():
    def quantized():
        m = _model("llama")
        nn.quantize(m, group_size=32, bits=4)
        mx.eval(m.parameters())
        return m

    base, deq, req = quantized(), quantized(), quantized()
    assert fold_value_rotation(deq, "tq4-plain", mode="dequantize").mode == "dequantize"
    assert fold_value_rotation(req, "tq4-plain", mode="requantize").mode == "requantize"
    for layer in deq.layers:
        assert type(layer.self_attn.v_proj) is nn.Linear
        assert type(layer.self_attn.o_proj) is nn.Linear
        assert layer.self_attn.v_proj.weight.dtype == mx.float32
    for layer in req.layers:
        for proj in (layer.self_attn.v_proj, layer.self_attn.o_proj):
            assert isinstance(proj, nn.QuantizedLinear)
            assert (proj.bits, proj.group_size) == (4, 32)
    tokens = _tokens(64)
    want = np.array(base(tokens))
    # dequantize: exact (the same float function).
    np.testing.assert_allclose(np.array(deq(tokens)), want, atol=1e-4, rtol=0)
    # requantize: a second rounding of W_v and W_o -- close, not exact.
    err = np.abs(np.array(req(tokens)) - want).max()
    assert 1e-4 < err < 0.5 * np.abs(want).max()


# ---------------------------------------------------------------------------
# Refusals


@pytest.fixture
def folded_llama():
    model = _model("llama")
    fold_value_rotation(model, "tq4-sink", seed=0)
    return model


def test_refuses_folding_twice(folded_llama):
    with pytest.raises(ValueFoldError, match="folded already"):
        fold_value_rotation(folded_llama, "tq4-sink", seed=0)


def test_refuses_unknown_architecture():
    model = build_model("gemma3_text")
    with pytest.raises(ValueFoldError, match="only mlx-lm's llama, qwen2, qwen3"):
        fold_value_rotation(model)
    assert value_fold_of(model) is None


def test_refuses_bad_arguments():
    model = _model("llama")
    with pytest.raises(ValueError, match="mode must be one of"):
        fold_value_rotation(model, mode="exact")
    with pytest.raises(ValueFoldError, match="nothing to fold"):
        fold_value_rotation(model, "fp16")
    cache = make_prompt_cache(model, "tq4-plain")
    model(_tokens(5), cache=cache)
    with pytest.raises(ValueFoldError, match="already holds tokens"):
        fold_value_rotation(model, cache)
    assert value_fold_of(model) is None and type(model.layers[0].self_attn.v_proj) is nn.Linear


def test_factory_refuses_caches_that_do_not_match(folded_llama):
    with pytest.raises(ValueFoldError, match="seed"):
        make_prompt_cache(folded_llama, "tq4-sink", seed=1)
    with pytest.raises(ValueFoldError, match="KVCache"):  # fp16 layer where the fold applies
        make_prompt_cache(folded_llama, "tq4-sink", fp16_layers=(1, 0))
    with pytest.raises(ValueFoldError, match="KVCache"):
        make_prompt_cache(folded_llama, "fp16")
    make_prompt_cache(folded_llama, "tq4-sink", seed=0)  # the matching one


def test_model_refuses_caches_that_do_not_match(folded_llama):
    tokens = _tokens(4)
    folded_llama(tokens)  # no cache: allowed
    with pytest.raises(ValueFoldError, match="KVCache"):
        folded_llama(tokens, cache=mlx_make_prompt_cache(folded_llama))
    built = [TurboQuantKVCache(seed=layer_seed(0, i)) for i in range(2)]
    with pytest.raises(ValueFoldError, match="rotate_values=True"):
        folded_llama(tokens, cache=built)
    built = [TurboQuantKVCache(seed=7, rotate_values=False) for i in range(2)]
    with pytest.raises(ValueFoldError, match="seed"):
        folded_llama(tokens, cache=built)
    from mlx_lm.generate import generate_step

    with pytest.raises(ValueFoldError):  # mlx-lm's own caches
        next(generate_step(tokens[0], folded_llama))


def test_unfolded_layer_refuses_unrotated_values():
    model = _model("llama")
    fold_value_rotation(model, "tq4-plain", fp16_layers=(1, 0))  # layer 0 stays unfolded
    cache = make_prompt_cache(model, "tq4-plain", fp16_layers=[])  # layer 0 compressed: rotates
    assert cache[0].rotate_values is True and cache[1].rotate_values is False
    model(_tokens(4), cache=cache)
    cache = make_prompt_cache(model, "tq4-plain", fp16_layers=[])
    cache[0] = TurboQuantKVCache(seed=layer_seed(0, 0), rotate_values=False)
    with pytest.raises(ValueFoldError, match="not folded"):
        model(_tokens(4), cache=cache)


def test_folded_prompt_cache_is_not_saved(folded_llama, tmp_path):
    cache = make_prompt_cache(folded_llama, "tq4-sink")
    folded_llama(_tokens(8), cache=cache)
    with pytest.raises(PromptCacheError, match="rotate_values=False"):
        save_prompt_cache(str(tmp_path / "c.safetensors"), cache)


# ---------------------------------------------------------------------------
# SmolLM2-135M (llama, 9 query / 3 KV heads, head dim 64, 30 layers)


class _NumpyLinear(nn.Module):
    """A float32 copy of a (quantized) linear layer multiplied by NumPy: the CPU
    wheel's matmuls are slow, and the test compares two float models anyway."""

    def __init__(self, linear):
        super().__init__()
        w = linear.weight
        if isinstance(linear, nn.QuantizedLinear):
            w = mx.dequantize(
                w,
                linear.scales,
                linear.get("biases"),
                group_size=linear.group_size,
                bits=linear.bits,
            )
        self._wt = np.ascontiguousarray(np.array(w.astype(mx.float32)).T)

    def __call__(self, x):
        xn = np.asarray(x.astype(mx.float32))
        return mx.array((xn.reshape(-1, xn.shape[-1]) @ self._wt).reshape(*xn.shape[:-1], -1))


def _numpy_linears(model):
    for layer in model.layers:
        for parent, names in (
            (layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (layer.mlp, ("gate_proj", "up_proj", "down_proj")),
        ):
            for n in names:
                setattr(parent, n, _NumpyLinear(getattr(parent, n)))


def test_smollm2_folded_matches_unfolded():
    gguf = pytest.importorskip("turboquant_mlx.gguf")
    try:
        path = gguf.default_smollm2_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF unavailable: {e}")
    base, tok = gguf.load_gguf(path)
    folded, _ = gguf.load_gguf(path)
    fold = fold_value_rotation(folded, "tq4-plain", seed=0, mode="dequantize")
    assert len(fold.layer_seeds) == 30
    _numpy_linears(base)
    _numpy_linears(folded)
    with open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8") as f:
        ids = tok.encode(f.read())[:256]
    tokens = mx.array(ids)[None]

    # Without a cache the folded model is the same function (weights dequantized).
    h0, h1 = base.model(tokens[:, :64]), folded.model(tokens[:, :64])
    l0 = base.model.embed_tokens.as_linear(h0[:, -8:])
    l1 = folded.model.embed_tokens.as_linear(h1[:, -8:])
    scale = float(mx.abs(l0).max())
    np.testing.assert_allclose(np.array(l1), np.array(l0), atol=1e-5 * scale, rtol=0)

    # With the matching compressed caches, layer by layer on identical inputs.
    c0 = make_prompt_cache(base, "tq4-plain", seed=0, window_dtype=mx.float32)
    c1 = make_prompt_cache(folded, "tq4-plain", seed=0, window_dtype=mx.float32)
    record = _lockstep(base, folded, c0, c1, tokens, 252)
    assert len(record) == 30 * 5 and all(c._n_comp == 256 for c in c1)
    _check_lockstep(record, c0, c1, fold, max_flip_fraction=1e-4)  # observed: 3 of 1.5M


# ---------------------------------------------------------------------------
# Command line


def test_cli_fold_values(tmp_path):
    import contextlib
    import io

    from turboquant_mlx.generate import main

    path = str(tmp_path / "tiny")
    lm_helpers.save_model_dir(_model("llama"), "llama", path)
    common = [
        "--model",
        path,
        "--prompt",
        "hello world, " * 20,
        "--max-tokens",
        "4",
        "--kv-preset",
        "tq4-plus",
        "--fp16-layers",
        "1:0",
        "--seed",
        "0",
    ]
    outs = {}
    for mode in ("none", "dequantize", "requantize"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            main(common + ["--fold-values", mode, "--verbose", "F"])
        outs[mode] = out.getvalue()
    assert outs["none"].strip() and outs["dequantize"] == outs["none"]  # float weights: exact
    assert outs["requantize"] == outs["none"]  # nothing quantized: requantize folds exactly
    with pytest.raises(ValueError, match="--fold-values cannot be combined"):
        main(
            common
            + [
                "--fold-values",
                "dequantize",
                "--save-prompt-cache",
                str(tmp_path / "c.safetensors"),
            ]
        )
