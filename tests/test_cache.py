# Copyright © 2026 turboquant_mlx contributors.

"""Unit tests of TurboQuantKVCache, the segment merge, presets, factory and save/load.

Attention outputs are compared with mlx's own attention on keys and values that the
NumPy reference codec reconstructs (lm_helpers.DequantizedReferenceCache), fed the
identical tokens, so the tolerance is float32 rounding.
"""

import collections
import copy
import sys
import types
import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache

from lm_helpers import DequantizedReferenceCache, build_model, row_mask
from turboquant_mlx.attention import dense_attention, merge_attention
from turboquant_mlx.cache import (
    PRESETS,
    KVPreset,
    TurboQuantKVCache,
    cache_nbytes,
    get_preset,
    layer_seed,
    make_prompt_cache,
)
from turboquant_mlx.prompt_cache import PromptCacheError, load_prompt_cache, save_prompt_cache

TOL = 2e-5


def _rand(rng, shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


_LEVER_KEYS = ("center", "query_aware_keys", "rope_pairing", "rope_dims", "calibration_tokens")


def _has_levers(cfg):
    return cfg.get("center", False) or cfg.get("query_aware_keys", False)


def _biased(rng, shape, dtype=mx.float32, seed_shape=None):
    """Random vectors with a large common mean and unequal channel scales (what the
    levers act on): mean and scales per (B, H) head, drawn from ``seed_shape``'s rng."""
    B, H, n, D = shape
    mean = np.random.default_rng(1234).standard_normal((1, H, 1, D)) * 3.0
    chan = np.exp(np.random.default_rng(4321).standard_normal((1, H, 1, D)))
    x = mean + chan * rng.standard_normal(shape)
    return mx.array(x.astype(np.float32)).astype(dtype)


def _queries(rng, shape, dtype=mx.float32):
    """Random queries with a small mean and unequal channel scales (not the keys')."""
    chan = np.exp(np.random.default_rng(999).standard_normal((1, 1, 1, shape[-1])))
    x = 0.3 + chan * rng.standard_normal(shape)
    return mx.array(x.astype(np.float32)).astype(dtype)


def _filled(rng, chunks, B=1, H=2, D=64, dtype=mx.float32, attend=None, **cfg):
    """A TurboQuant cache fed random chunks, and what attention must see.

    Returns ``(cache, K, V)``: K/V are the cache's contents in position order as
    reconstructed by ``cache.dequantized_keys_values`` after they are checked against
    the NumPy reference codec (test_contents_match_reference_codec), so the attention
    tests compare against mlx's attention on identical inputs.

    With a lever (``center``/``query_aware_keys``) the tokens have a large mean and
    unequal channel scales, and by default (``attend``) every chunk is followed by a
    causal attention call of as many random queries, as in a model (the calibration
    sees them); after each call the contents are checked against the reference (which
    saw the same queries) and the call's output against mlx's attention on them.
    """
    cfg.setdefault("key_bits", 4)
    cfg.setdefault("value_bits", 4)
    cfg.setdefault("seed", 9)
    budget = cfg.pop("prefill_budget_bytes", None)
    levers = _has_levers(cfg)
    attend = levers if attend is None else attend
    cache = TurboQuantKVCache(prefill_budget_bytes=budget, **cfg)
    ref = DequantizedReferenceCache(
        cfg["key_bits"],
        cfg["value_bits"],
        cfg["seed"],
        cfg.get("fp16_sink_tokens", 0),
        cfg.get("fp16_recent_tokens", 0),
        **{k: cfg[k] for k in _LEVER_KEYS if k in cfg},
    )
    make = _biased if levers else _rand
    for n in chunks:
        k = make(rng, (B, H, n, D), dtype)
        v = make(rng, (B, H, n, D), dtype)
        cache.update_and_fetch(k, v)
        ref.update_and_fetch(k, v)
        if attend:
            q = (
                _queries(rng, (B, 2 * H, n, D), dtype)
                if levers
                else _rand(rng, (B, 2 * H, n, D), dtype)
            )
            got = np.array(cache.attention(q, 0.1, "causal").astype(mx.float32))
            ref.attend(q, 0.1, "causal")
            _check_contents(cache, ref)
            if n > cache.decode_max_queries:
                Kc, Vc = _seen_by_block(cache, k, v)
                want = np.array(_expected(q, Kc, Vc, 0.1, "causal"))
            else:
                want = np.array(
                    _expected_steps(
                        cache,
                        _arrived(cache, ref),
                        q,
                        0.1,
                        "causal",
                        calibrated_at=ref.calibrated_until,
                    )
                )
            tol = (TOL if dtype == mx.float32 else 2e-2) * _magnitude(want)
            np.testing.assert_allclose(got, want, atol=tol, rtol=0, err_msg=f"chunk of {n}")
    _check_contents(cache, ref)
    K, V = cache.dequantized_keys_values(mx.float32)
    cache.arrived = _arrived(cache, ref)  # (for _expected_steps)
    return cache, K, V


def _arrived(cache, ref):
    """Every token the cache holds as it arrived (rounded to its fp16 storage dtype),
    float32, from the reference that was fed the same tokens."""
    return mx.array(ref.k), mx.array(ref.v)


def _expected_steps(cache, arrived, q, scale, mask, sinks=None, calibrated_at=None):
    """What the last ``L <= decode_max_queries`` positions' queries ``q`` must get: each
    sees the cache as a single-token step at its position would, the non-sink tokens
    before ``p + 1 - fp16_recent_tokens`` through their codes (as
    ``dequantized_keys_values`` shows them) and the others as they arrived
    (``arrived``, see _arrived); except tokens older than the window buffer (its
    ``rollback_tokens`` slack), which exist only quantized. Queries before the position
    whose step calibrated the levers (``calibrated_at``: one past it, as
    DequantizedReferenceCache.calibrated_until) see every token as it arrived. For a
    cache that saw no trims."""
    K, V = cache.dequantized_keys_values(mx.float32)
    Ka, Va = arrived
    N, L = cache.offset, q.shape[2]
    S, R = cache.fp16_sink_tokens, cache.fp16_recent_tokens
    oldest = max(S, N - R - cache.rollback_tokens)  # first position held in fp16
    pos = np.arange(N)
    outs = []
    for i in range(L):
        p = N - L + i
        if not cache.calibrated or (calibrated_at is not None and p < calibrated_at - 1):
            exact = pos >= 0
        elif R:
            exact = (pos < S) | (pos >= max(S, p + 1 - R, oldest))
        else:
            exact = pos < S
        sel = mx.array(exact)[None, None, :, None]
        Ki, Vi = mx.where(sel, Ka, K), mx.where(sel, Va, V)
        outs.append(
            _expected(q[:, :, i : i + 1], Ki, Vi, scale, row_mask(mask, L, i, pos, p), sinks)
        )
    return mx.concatenate(outs, axis=2)


def _seen_by_block(cache, k, v):
    """Keys and values that the queries of the block ``k, v`` just appended see: the
    cache's contents, except that a prefill block (more than ``decode_max_queries``
    tokens) sees itself as it arrived (rounded to the fp16 storage dtype)."""
    K, V = cache.dequantized_keys_values(mx.float32)
    n = k.shape[2]
    if n <= cache.decode_max_queries:
        return K, V
    P = cache.offset - n

    def arrived(x):
        return x.astype(cache.window_dtype).astype(mx.float32)

    return (
        mx.concatenate([K[:, :, :P], arrived(k)], axis=2),
        mx.concatenate([V[:, :, :P], arrived(v)], axis=2),
    )


def _check_contents(cache, ref):
    """The cache holds what the reference codec produces, position by position.

    fp16 positions must be bit-exact. A quantized coordinate whose input lies within
    float32 rounding of a decision boundary may take the neighbouring code (the
    reference rotates in float64, the cache in float32), so up to 0.5% of the
    quantized vectors may differ slightly.
    """
    K, V = cache.dequantized_keys_values(mx.float32)
    pos = np.arange(cache.offset)
    exact = (pos < ref.sinks) | (pos >= max(ref.sinks, cache.offset - ref.recent))
    assert cache.calibrated == ref.calibrated
    if not ref.calibrated:
        exact[:] = True
    # The levers' statistics: float32 in the cache, float64 in the reference.
    for got, want in (
        (cache.key_mean, ref.mu_k),
        (cache.value_mean, ref.mu_v),
        (cache.key_scale, ref.a),
    ):
        assert (got is None) == (want is None)
        if got is not None:
            np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    if exact.all():
        np.testing.assert_array_equal(np.array(K), ref.k)
        np.testing.assert_array_equal(np.array(V), ref.v)
        return
    for got, raw, want in ((K, ref.k, ref.k_hat), (V, ref.v, ref.v_hat)):
        got = np.array(got)
        np.testing.assert_array_equal(got[:, :, exact], raw[:, :, exact])
        diff = np.abs(got[:, :, ~exact] - want[:, :, ~exact])
        close = diff <= 1e-5 * (1 + np.abs(want[:, :, ~exact]))
        bad_vectors = ~np.all(close, axis=-1)
        assert bad_vectors.sum() <= max(1, 0.005 * bad_vectors.size), bad_vectors.sum()
        # A neighbouring code moves a vector by a fraction of one codebook step.
        w = want[:, :, ~exact]
        rel = np.linalg.norm(got[:, :, ~exact] - w, axis=-1) / np.linalg.norm(w, axis=-1)
        assert np.all(rel[bad_vectors] < 0.1), rel[bad_vectors]


def _magnitude(x):
    """Tolerances scale with the data: float32 rounding is relative (the levers'
    test data have large means)."""
    return max(1.0, float(np.abs(np.array(x)).max()))


def _expected(q, K, V, scale, mask, sinks=None):
    return mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32),
        K.astype(mx.float32),
        V.astype(mx.float32),
        scale=scale,
        mask=mask,
        sinks=sinks,
    )


# ---------------------------------------------------------------------------
# merge


def test_merge_attention_equals_attention_over_the_union():
    rng = np.random.default_rng(0)
    B, Hq, Hkv, L, D = 2, 4, 2, 5, 32
    q = _rand(rng, (B, Hq, L, D))
    sizes = [3, 17, 6]
    ks = [_rand(rng, (B, Hkv, n, D)) for n in sizes]
    vs = [_rand(rng, (B, Hkv, n, D)) for n in sizes]
    mask = mx.array(rng.random((B, Hq, L, sum(sizes))) > 0.3)
    mask[:, :, 2, :] = False  # a row without any visible key
    mask[:, :, 3, :3] = False  # a row whose first segment is empty
    parts, p0 = [], 0
    for k, v, n in zip(ks, vs, sizes):
        parts.append(dense_attention(q, k, v, 0.3, mask[..., p0 : p0 + n]))
        p0 += n
    out, lse = merge_attention(parts)
    full_out, full_lse = dense_attention(
        q, mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2), 0.3, mask
    )
    np.testing.assert_allclose(np.array(out), np.array(full_out), atol=1e-5)
    np.testing.assert_allclose(np.array(lse), np.array(full_lse), atol=1e-5)
    assert np.all(np.array(out)[:, :, 2] == 0) and np.all(np.isneginf(np.array(lse)[:, :, 2]))
    # Against mlx's attention where every row has a visible key.
    rows = mx.array([0, 1, 3, 4])
    want = _expected(
        q[:, :, rows], mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2), 0.3, mask[:, :, rows]
    )
    np.testing.assert_allclose(np.array(out)[:, :, [0, 1, 3, 4]], np.array(want), atol=1e-5)


# ---------------------------------------------------------------------------
# attention on the cache vs the reference


LAYOUTS = [
    dict(),
    dict(key_bits=3, value_bits=2),
    dict(fp16_sink_tokens=4),
    dict(fp16_recent_tokens=10, rollback_tokens=3),
    dict(fp16_sink_tokens=2, fp16_recent_tokens=6, key_bits=4, value_bits=3),
]
# The levers, alone and with sinks / windows. The fill schedule is 37, 1, 5, 1, 20
# tokens: calibration in the first call by default, in the last one with 48 tokens.
LEVER_LAYOUTS = [
    dict(center=True),
    dict(query_aware_keys=True, calibration_tokens=8),
    dict(center=True, query_aware_keys=True, fp16_sink_tokens=4),
    dict(
        center=True,
        query_aware_keys=True,
        fp16_sink_tokens=2,
        fp16_recent_tokens=6,
        key_bits=3,
        value_bits=3,
        rope_pairing="interleaved",
    ),
    dict(
        center=True,
        query_aware_keys=True,
        fp16_sink_tokens=3,
        calibration_tokens=48,
        key_bits=3,
        value_bits=2,
        rope_pairing="none",
    ),
]


def _masks(rng, L, N, B, Hq):
    bool_mask = mx.array(rng.random((B, Hq, L, N)) > 0.2)
    bool_mask[..., 0] = True
    additive = mx.where(mx.array(rng.random((L, N)) > 0.3), 0.0, -1e9)
    additive[:, 0] = 0.0
    return [None, "causal", bool_mask, additive]


def _layout_id(c):
    return "-".join(f"{k[:4]}{v}" for k, v in c.items()) or "plain"


@pytest.mark.parametrize("layout", LAYOUTS + LEVER_LAYOUTS, ids=_layout_id)
@pytest.mark.parametrize("L", [1, 3, 8, 9, 40])
def test_attention_matches_reference(layout, L):
    rng = np.random.default_rng(L)
    B, Hq, H, D = 2, 4, 2, 64
    cache, K, V = _filled(rng, [37, 1, 5, 1, 20], B=B, H=H, D=D, **layout)
    N = cache.offset
    q = _rand(rng, (B, Hq, L, D))
    sinks = _rand(rng, (Hq,))
    tol = TOL * _magnitude(V)

    def expected(mask, sinks=None):
        # Decode and verification blocks: each query as a single-token step sees the cache.
        if L <= cache.decode_max_queries:
            return _expected_steps(cache, cache.arrived, q, 0.2, mask, sinks)
        return _expected(q, K, V, 0.2, mask, sinks)

    for mask in _masks(rng, L, N, B, Hq):
        want = expected(mask)
        got = cache.attention(q, scale=0.2, mask=mask)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=tol, err_msg=str(mask)[:20])
    want = expected("causal", sinks=sinks)
    np.testing.assert_allclose(
        np.array(cache.attention(q, 0.2, "causal", sinks=sinks)), np.array(want), atol=tol
    )


@pytest.mark.parametrize("D", [64, 160], ids=["op-rotation", "host-rotation"])
@pytest.mark.parametrize(
    "layout",
    [LAYOUTS[0], LAYOUTS[3], LEVER_LAYOUTS[3]],
    ids=["plain", "window", "levers-sink-window"],
)
def test_rotation_in_or_around_the_ops(layout, D):
    # Power-of-two head dims rotate inside the ops (the plain cache's step is then one
    # call, a window preset's a ring step); other head dims rotate around them. Both
    # must give what attention over the stored tokens gives, step after step.
    rng = np.random.default_rng(17)
    cache, _, _ = _filled(rng, [45], B=1, H=2, D=D, **layout)
    assert (cache._op_signs() is not None) == (D == 64 and not cache.query_aware_keys)
    for step in range(40):
        cache.update_and_fetch(_rand(rng, (1, 2, 1, D)), _rand(rng, (1, 2, 1, D)))
        q = _rand(rng, (1, 4, 1, D))
        got = cache.attention(q, 0.2, None)  # every step, as a model does
        if step % 13 == 12:
            K, V = cache.dequantized_keys_values(mx.float32)
            want = _expected(q, K, V, 0.2, None)
            np.testing.assert_allclose(np.array(got), np.array(want), atol=TOL * _magnitude(V))


def _record_op_tails(monkeypatch):
    """A list that receives the ``tail_k`` (or None) of every compressed_attention call
    the cache makes from now on."""
    import turboquant_mlx.cache as tq_cache

    tails = []
    op = tq_cache.ops.compressed_attention

    def spy(*args, **kwargs):
        tails.append(kwargs.get("tail_k"))
        return op(*args, **kwargs)

    monkeypatch.setattr(tq_cache.ops, "compressed_attention", spy)
    return tails


@pytest.mark.parametrize("D", [64, 160], ids=["hadamard", "dense-rotation"])
@pytest.mark.parametrize(
    "layout",
    [LAYOUTS[0], LAYOUTS[3], LEVER_LAYOUTS[2], LEVER_LAYOUTS[3]],
    ids=["plain", "window", "levers-sink", "levers-sink-window"],
)
def test_compiled_decode_equals_eager(monkeypatch, layout, D):
    # Decode steps run the query and output transforms through mx.compile; they must
    # give what the eager functions give, and both what mlx's attention gives.
    from turboquant_mlx import codespace

    tails = _record_op_tails(monkeypatch)
    rng = np.random.default_rng(D)
    cache, K, V = _filled(rng, [37, 1, 5, 1, 20], B=1, H=2, D=D, **layout)
    for L in (1, 4):
        q = _rand(rng, (1, 4, L, D))
        monkeypatch.setattr(codespace, "_COMPILE", True)
        tails.clear()
        fused = np.array(cache.attention(q, 0.2, "causal"))
        # The fp16 sinks and window go into the op as its tail, unless the window holds
        # some of the queries (causal among them: attended to apart).
        dense = layout.get("fp16_sink_tokens", 0) + (
            min(layout.get("fp16_recent_tokens", 0), cache.offset) if L == 1 else 0
        )
        in_window = L > 1 and layout.get("fp16_recent_tokens", 0) > 0
        lengths = [None if t is None else t.shape[2] for t in tails]
        assert lengths == [None if in_window or dense == 0 else dense], lengths
        monkeypatch.setattr(codespace, "_COMPILE", False)
        eager = np.array(cache.attention(q, 0.2, "causal"))
        np.testing.assert_allclose(fused, eager, atol=1e-6 * _magnitude(V))
        want = _expected_steps(cache, cache.arrived, q, 0.2, "causal")
        np.testing.assert_allclose(fused, np.array(want), atol=TOL * _magnitude(V))


@pytest.mark.parametrize("budget", [1, None], ids=["query-per-chunk", "one-call"])
@pytest.mark.parametrize(
    "layout",
    LAYOUTS[:1] + LAYOUTS[3:] + LEVER_LAYOUTS[2:4],
    ids=["plain", "window", "sink-window", "levers-sink", "levers-sink-window"],
)
def test_prefill_in_query_chunks_matches_reference(layout, budget):
    # On the CPU MLX's attention materializes its scores, so the prefill sends its
    # queries in chunks within prefill_budget_bytes (1 byte: one query per chunk).
    rng = np.random.default_rng(5)
    B, Hq, H, D = 1, 4, 2, 64
    cache, K, V = _filled(rng, [150, 70], B=B, H=H, D=D, prefill_budget_bytes=budget, **layout)
    q = _rand(rng, (B, Hq, 70, D))
    # The 70 queries of the block just appended see it as it arrived (_seen_by_block);
    # 71 queries (the last 71 positions) see the cache as stored.
    k, v = _rand(rng, (B, H, 70, D)), _rand(rng, (B, H, 70, D))
    cache.update_and_fetch(k, v)
    Kb, Vb = _seen_by_block(cache, k, v)
    K, V = cache.dequantized_keys_values(mx.float32)
    q71 = _rand(rng, (B, Hq, 71, D))
    for mask in _masks(rng, 70, cache.offset, B, Hq):
        got = cache.attention(q, scale=0.125, mask=mask)
        want = _expected(q, Kb, Vb, 0.125, mask)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=TOL * _magnitude(V))
    assert not np.allclose(np.array(Kb), np.array(K))  # the block's keys were compressed
    for mask in _masks(rng, 71, cache.offset, B, Hq):
        got = cache.attention(q71, scale=0.125, mask=mask)
        want = _expected(q71, K, V, 0.125, mask)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=TOL * _magnitude(V))


def _attention_f64(q, K, V, scale, mask, sinks=None):
    """Softmax attention in float64 (NumPy), GQA, mlx-lm's mask conventions."""
    q, K, V = (np.array(x.astype(mx.float32), dtype=np.float64) for x in (q, K, V))
    B, Hq, L, D = q.shape
    G = Hq // K.shape[1]
    K, V = np.repeat(K, G, axis=1), np.repeat(V, G, axis=1)
    N = K.shape[2]
    scores = scale * q @ K.swapaxes(-1, -2)
    if isinstance(mask, str):
        scores = np.where(np.arange(N)[None, :] <= N - L + np.arange(L)[:, None], scores, -np.inf)
    elif mask is not None:
        m = np.array(mask.astype(mx.float32) if mask.dtype != mx.bool_ else mask)
        scores = np.where(m, scores, -np.inf) if mask.dtype == mx.bool_ else scores + m
    if sinks is not None:
        col = np.broadcast_to(np.array(sinks, dtype=np.float64)[None, :, None, None], (B, Hq, L, 1))
        scores = np.concatenate([col, scores], axis=-1)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return p[..., -N:] @ V


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize(
    "layout", [LAYOUTS[0], LAYOUTS[4], LEVER_LAYOUTS[3]], ids=["plain", "sink-window", "levers"]
)
def test_prefill_blocks_match_float64_reference(layout, dtype):
    # A long prompt read in blocks (the last one odd) on top of a cache that already
    # holds a prompt and decoded tokens: each block's output against float64 attention
    # over what the NumPy reference codec says the block must see (the cache as stored
    # before the block, the block as it arrived), causal, with an explicit mask and with
    # attention-sink logits.
    rng = np.random.default_rng(11)
    B, Hq, H, D = 1, 4, 2, 64
    cache, _, _ = _filled(rng, [60, 1, 1], B=B, H=H, D=D, dtype=dtype, **layout)
    ref = DequantizedReferenceCache(
        layout.get("key_bits", 4),
        layout.get("value_bits", 4),
        9,
        layout.get("fp16_sink_tokens", 0),
        layout.get("fp16_recent_tokens", 0),
        **{k: layout[k] for k in _LEVER_KEYS if k in layout},
    )
    # The reference replays the cache's history (same tokens, same calibration).
    ref.k, ref.v = (np.array(x) for x in cache.dequantized_keys_values(mx.float32))
    ref.offset, ref._dtype, ref.calibrated = cache.offset, dtype, True
    ref.mu_k = None if cache.key_mean is None else np.array(cache.key_mean, np.float64)
    ref.mu_v = None if cache.value_mean is None else np.array(cache.value_mean, np.float64)
    ref.a = None if cache.key_scale is None else np.array(cache.key_scale, np.float64)
    levers = _has_levers(layout)
    make = _biased if levers else _rand
    # float32: a coordinate within rounding of a decision boundary may take the
    # neighbouring code (the reference rotates in float64; _check_contents)
    tol = {mx.float32: 5e-4, mx.float16: 1e-2, mx.bfloat16: 5e-2}[dtype]
    for n in (256, 256, 189):
        k, v = make(rng, (B, H, n, D), dtype), make(rng, (B, H, n, D), dtype)
        cache.update_and_fetch(k, v)
        ref.update_and_fetch(k, v)
        K, V = ref.fetch(ref.fresh_from)
        q = _queries(rng, (B, Hq, n, D), dtype) if levers else _rand(rng, (B, Hq, n, D), dtype)
        bool_mask = mx.array(rng.random((B, Hq, n, cache.offset)) > 0.3)
        bool_mask[..., 0] = True
        sinks = _rand(rng, (Hq,))
        for mask, sk in (("causal", None), (bool_mask, None), ("causal", sinks)):
            got = np.array(cache.attention(q, 0.125, mask, sinks=sk).astype(mx.float32))
            want = _attention_f64(q, K, V, 0.125, mask, None if sk is None else np.array(sk))
            np.testing.assert_allclose(
                got,
                want,
                atol=tol * _magnitude(want),
                rtol=0,
                err_msg=f"block of {n}, mask {type(mask)}, sinks {sk is not None}",
            )


def test_prefill_refuses_a_mask_of_the_wrong_shape():
    rng = np.random.default_rng(0)
    cache, _, _ = _filled(rng, [40], attend=False)
    q = _rand(rng, (1, 4, 20, 64))
    cache.update_and_fetch(_rand(rng, (1, 2, 20, 64)), _rand(rng, (1, 2, 20, 64)))
    with pytest.raises(ValueError, match=r"mask .* 7 queries"):
        cache.attention(q, 0.125, mx.ones((1, 4, 7, cache.offset), dtype=mx.bool_))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_inputs(dtype):
    rng = np.random.default_rng(3)
    cache, K, V = _filled(rng, [30, 1], dtype=dtype, fp16_sink_tokens=2, fp16_recent_tokens=4)
    assert cache._sink_k.dtype == dtype and cache._win_k.dtype == dtype
    for L in (1, 12):
        q = _rand(rng, (1, 2, L, 64), dtype)
        got = cache.attention(q, 0.125, "causal" if L > 1 else None)
        assert got.dtype == dtype
        want = _expected(q, K, V, 0.125, "causal" if L > 1 else None)
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want), atol=2e-2)


def test_prefill_temporary_is_one_layer_copy_shared_by_every_layer():
    # The prefill's temporary is one layer's keys and values in the queries' dtype (the
    # fp16 segments copied in by the decoding kernel), plus the scores of one query
    # chunk within the budget. Every layer decodes into the same two buffers: a second
    # layer of the same shapes allocates only its scores, even while the first layer's
    # operands are still referenced (as when the GPU has several layers in flight),
    # and the first decode step frees the buffers.
    from turboquant_mlx import prefill

    rng = np.random.default_rng(1)
    B, H, Hq, D, N, L = 1, 2, 4, 64, 16384, 64
    budget = 1 << 20
    layers = [
        TurboQuantKVCache(
            4, 4, seed=s, prefill_budget_bytes=budget, fp16_sink_tokens=4, fp16_recent_tokens=32
        )
        for s in (1, 2)
    ]
    for cache in layers:
        for _ in range(N // 4096):
            cache.update_and_fetch(_rand(rng, (B, H, 4096, D)), _rand(rng, (B, H, 4096, D)))
    mx.eval([c.state for c in layers])
    q = _rand(rng, (B, Hq, L, D))
    mx.eval(q)
    layer_bytes = 2 * B * H * N * D * 4  # the layer's K and V in float32
    prefill.release_scratch()
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = layers[0].attention(q, 0.125, "causal")
    mx.eval(out)
    first = mx.get_peak_memory() - base
    # (a second copy of the decoded tokens would add layer_bytes / 2 or more; the
    # buffers are allocated with room to grow)
    assert layer_bytes / 2 < first < prefill._SCRATCH_GROWTH * layer_bytes + 6 * budget
    held = [layers[0]._prefill_operands(q)]
    mx.eval(held)
    mx.synchronize()
    before_second = mx.get_active_memory()
    mx.reset_peak_memory()
    held.append(layers[1]._prefill_operands(q))
    out = layers[1].attention(q, 0.125, "causal")
    mx.eval(held, out)
    assert mx.get_peak_memory() - before_second < layer_bytes / 4 + 6 * budget
    del held, out
    # The first decode step releases the buffers.
    layers[0].update_and_fetch(_rand(rng, (B, H, 1, D)), _rand(rng, (B, H, 1, D)))
    mx.eval(layers[0].attention(_rand(rng, (B, Hq, 1, D)), 0.125, None))
    mx.synchronize()
    mx.clear_cache()
    assert mx.get_active_memory() - base < layer_bytes / 4
    # The compressed cache itself: 4-bit codes + fp16 scale, K and V, and the fp16 tokens.
    assert layers[0].nbytes < 2 * B * H * N * (D * 4 // 8 + 2) + 2 * B * H * 200 * D * 2


# ---------------------------------------------------------------------------
# protocol


def test_protocol_basics_and_no_bits_attribute():
    cache = TurboQuantKVCache(4, 3, seed=2)
    assert not hasattr(cache, "bits")
    assert cache.empty() and cache.size() == 0 and cache.nbytes == 0 and cache.is_trimmable()
    rng = np.random.default_rng(0)
    k, v = _rand(rng, (1, 2, 5, 64)), _rand(rng, (1, 2, 5, 64))
    rk, rv = cache.update_and_fetch(k, v)
    assert rk is k and rv is v
    assert not cache.empty() and cache.size() == cache.offset == 5
    ref = KVCache()
    ref.update_and_fetch(k, v)
    for args in [(1,), (4,), (4, True), (1, False, 3), (6, False, 3), (6, True, 3)]:
        kw = dict(zip(("return_array", "window_size"), args[1:]))
        a = cache.make_mask(args[0], **kw)
        b = ref.make_mask(args[0], **dict(dict(return_array=False, window_size=None), **kw))
        assert (a is None and b is None) or isinstance(a, str) and a == b or mx.array_equal(a, b)
    with pytest.raises(ValueError, match="head dim"):
        cache.update_and_fetch(_rand(rng, (1, 2, 1, 64)), _rand(rng, (1, 2, 1, 32)))
    with pytest.raises(ValueError, match="do not match"):
        cache.update_and_fetch(_rand(rng, (1, 3, 1, 64)), _rand(rng, (1, 3, 1, 64)))
    with pytest.raises(ValueError, match="mask covers"):
        cache.attention(_rand(rng, (1, 2, 1, 64)), 1.0, mx.ones((1, 3), dtype=mx.bool_))
    with pytest.raises(ValueError, match="empty cache"):
        TurboQuantKVCache().attention(_rand(rng, (1, 2, 1, 64)), 1.0)
    with pytest.raises(ValueError, match="key_bits"):
        TurboQuantKVCache(key_bits=5)
    with pytest.raises(ValueError, match="head dim 47"):  # (even dims are padded to 32k)
        TurboQuantKVCache(3, 3).update_and_fetch(
            _rand(rng, (1, 1, 1, 47)), _rand(rng, (1, 1, 1, 47))
        )


def test_capacity_grows_geometrically_and_reserve_preallocates():
    rng = np.random.default_rng(0)
    cache = TurboQuantKVCache(4, 4)
    caps = []
    for _ in range(40):
        cache.update_and_fetch(_rand(rng, (1, 1, 64, 64)), _rand(rng, (1, 1, 64, 64)))
        caps.append(cache._kv.k_codes.shape[2])
    growths = sorted(set(caps))
    assert growths[0] == 256 and all(b >= 1.25 * a for a, b in zip(growths, growths[1:]))
    reserved = TurboQuantKVCache(4, 4, fp16_sink_tokens=4)
    reserved.reserve(3000)
    for _ in range(40):
        reserved.update_and_fetch(_rand(rng, (1, 1, 64, 64)), _rand(rng, (1, 1, 64, 64)))
        assert reserved._kv.k_codes.shape[2] == 3072  # one allocation, rounded to the step


@pytest.mark.parametrize("preset", [None, "tq4"])
def test_decode_appends_reuse_the_cache_buffers(preset):
    # Each decode step (append one token, attend, evaluate) must append in place: a
    # copy of the cache's buffers per token is O(context) and, at long context, costs
    # more than the attention. The primitives count every copy they make.
    from turboquant_mlx import _ext

    rng = np.random.default_rng(0)
    if preset is None:
        cache = TurboQuantKVCache(4, 4)
    else:
        cache = TurboQuantKVCache(**get_preset(preset).layer_configs(4)[1])
    cache.reserve(600)
    cache.update_and_fetch(_rand(rng, (1, 2, 512, 64)), _rand(rng, (1, 2, 512, 64)))
    mx.eval(cache._kv.k_codes, cache._kv.v_codes)
    before = _ext.buffer_copies()
    for _ in range(8):
        k, v = _rand(rng, (1, 2, 1, 64), mx.float16), _rand(rng, (1, 2, 1, 64), mx.float16)
        cache.update_and_fetch(k, v)
        out = cache.attention(_rand(rng, (1, 4, 1, 64), mx.float16), scale=0.125)
        mx.eval(out)
        # The GPU backends drop their references to a kernel's buffers asynchronously
        # after it completes; an append evaluated before that copies (rarely, on CUDA).
        mx.synchronize()
    assert _ext.buffer_copies() == before
    # Pipelined decoding: MLX holds the buffers until the previous step's kernels have
    # run, so they are never donatable when the next append is evaluated (held here,
    # deterministically). The cache's appends still write them in place, and the slots
    # an older reader can see never change.
    held = [cache._kv.k_codes, cache._kv.k_scales, cache._kv.v_codes, cache._kv.v_scales]
    n = cache._n_comp
    snapshot = [np.array(a[:, :, :n]) for a in held]
    for _ in range(40):  # the window (tq4) hands tokens to the compressed segment
        cache.update_and_fetch(_rand(rng, (1, 2, 1, 64)), _rand(rng, (1, 2, 1, 64)))
        mx.eval(cache._kv.k_codes, cache._kv.k_scales, cache._kv.v_codes, cache._kv.v_scales)
    assert cache._n_comp > n
    assert _ext.buffer_copies() == before
    now = [cache._kv.k_codes, cache._kv.k_scales, cache._kv.v_codes, cache._kv.v_scales]
    for old, new, snap in zip(held, now, snapshot):
        np.testing.assert_array_equal(np.array(old[:, :, :n]), snap)
        np.testing.assert_array_equal(np.array(old), np.array(new))  # one buffer


@pytest.mark.parametrize("preset", ("plain", "tq4", "tq4-two-nodes"))
def test_decode_step_appends_in_one_node(tmp_path, monkeypatch, preset):
    # A decode step's append of keys and values is one graph node (the host's cost of a
    # short-context step is per node); the window preset's token that leaves the window
    # too, and where the build has the ring exchange (CPU, CUDA) that node also writes
    # the new token into the ring: the step has no other write. Without the exchange
    # (tq4-two-nodes, as a build without it runs) the append and the write are a node
    # each.
    from helpers import graph_nodes
    from turboquant_mlx import cache as cache_module
    from turboquant_mlx import ops

    if not ops.has_kernels():
        pytest.skip("the plain-MLX fallback builds no primitives")
    if preset == "tq4-two-nodes":
        monkeypatch.setattr(cache_module.ops, "has_ring_append", lambda *a: False)
    rng = np.random.default_rng(2)
    cfg = {} if preset == "plain" else dict(fp16_sink_tokens=4, fp16_recent_tokens=8, center=True)
    cache = TurboQuantKVCache(4, 4, **cfg)
    cache.update_and_fetch(_rand(rng, (1, 2, 40, 64)), _rand(rng, (1, 2, 40, 64)))
    mx.eval(cache.attention(_rand(rng, (1, 4, 8, 64)), 0.1, None))
    for _ in range(12):  # the window's prefill tokens leave it
        cache.update_and_fetch(_rand(rng, (1, 2, 1, 64)), _rand(rng, (1, 2, 1, 64)))
        mx.eval(cache.attention(_rand(rng, (1, 4, 1, 64)), 0.1, None))
    n = cache._n_comp
    cache.update_and_fetch(_rand(rng, (1, 2, 1, 64)), _rand(rng, (1, 2, 1, 64)))
    assert cache._n_comp == n + 1
    out = cache.attention(_rand(rng, (1, 4, 1, 64)), 0.1, None)
    labels = graph_nodes(
        tmp_path / "g.dot",
        out,
        cache._kv.k_codes,
        cache._kv.k_scales,
        cache._kv.v_codes,
        cache._kv.v_scales,
    )
    writes = [x for x in labels if x.startswith(("QuantizeAppend", "RingAppend", "WriteTokens"))]
    if preset == "plain":
        assert writes == ["QuantizeAppendKV"]
    elif preset == "tq4":
        assert writes == ["RingAppendKV"]
    else:
        assert sorted(writes) == ["QuantizeAppendKV", "WriteTokensKV"]


def test_trim_then_append_leaves_earlier_arrays_unchanged():
    # After a trim the next appends write slots that arrays taken before it (state,
    # dequantized tokens) still show: that append copies the buffers once instead of
    # writing them in place.
    rng = np.random.default_rng(1)
    cache = TurboQuantKVCache(4, 4)
    cache.update_and_fetch(_rand(rng, (1, 2, 30, 64)), _rand(rng, (1, 2, 30, 64)))
    state = cache.state[:4]
    snapshot = [np.array(a) for a in state]
    keys, values = cache.dequantized_keys_values()
    before = np.array(keys)
    assert cache.trim(10) == 10
    cache.update_and_fetch(_rand(rng, (1, 2, 10, 64)), _rand(rng, (1, 2, 10, 64)))
    mx.eval(cache._kv.k_codes, cache._kv.k_scales, cache._kv.v_codes, cache._kv.v_scales)
    for a, snap in zip(state, snapshot):
        np.testing.assert_array_equal(np.array(a), snap)
    np.testing.assert_array_equal(np.array(keys), before)
    # Later appends are in place again.
    from turboquant_mlx import _ext

    copies = _ext.buffer_copies()
    held = cache._kv.k_codes
    cache.update_and_fetch(_rand(rng, (1, 2, 1, 64)), _rand(rng, (1, 2, 1, 64)))
    mx.eval(cache._kv.k_codes)
    assert _ext.buffer_copies() == copies  # though `held` still references the buffer
    del held


@pytest.mark.parametrize("copier", (copy.deepcopy, copy.copy), ids=("deepcopy", "copy"))
@pytest.mark.parametrize("window", (4, 0))
def test_copy_is_independent(window, copier):
    # A copy shares the mx.array buffers; neither cache may then append to them in
    # place, or the two would write the same slots.
    rng = np.random.default_rng(0)
    cache, _, _ = _filled(rng, [20], fp16_recent_tokens=window)
    twin = copier(cache)
    q = _rand(rng, (1, 2, 1, 64))
    before = np.array(cache.attention(q, 0.1))
    twin.update_and_fetch(_rand(rng, (1, 2, 9, 64)), _rand(rng, (1, 2, 9, 64)))
    twin_before = np.array(twin.attention(q, 0.1))  # (evaluates the append)
    assert cache.offset == 20 and twin.offset == 29
    np.testing.assert_array_equal(np.array(cache.attention(q, 0.1)), before)
    cache.update_and_fetch(_rand(rng, (1, 2, 9, 64)), _rand(rng, (1, 2, 9, 64)))
    mx.eval(cache.attention(q, 0.1))
    np.testing.assert_array_equal(np.array(twin.attention(q, 0.1)), twin_before)


@pytest.mark.parametrize(
    "layout", LAYOUTS + LEVER_LAYOUTS, ids=range(len(LAYOUTS) + len(LEVER_LAYOUTS))
)
def test_trim_equals_never_having_the_tokens(layout):
    rng = np.random.default_rng(2)
    keys = _rand(rng, (1, 2, 60, 64))
    vals = _rand(rng, (1, 2, 60, 64))
    junk_k, junk_v = _rand(rng, (1, 2, 3, 64)), _rand(rng, (1, 2, 3, 64))
    a = TurboQuantKVCache(**dict(dict(key_bits=4, value_bits=4, seed=1), **layout))
    b = TurboQuantKVCache(**dict(dict(key_bits=4, value_bits=4, seed=1), **layout))
    for c in (a, b):
        c.update_and_fetch(keys[:, :, :30], vals[:, :, :30])
    a.update_and_fetch(junk_k, junk_v)
    assert a.trim(3) == 3 and a.offset == 30
    for c in (a, b):
        c.update_and_fetch(keys[:, :, 30:31], vals[:, :, 30:31])
        c.update_and_fetch(keys[:, :, 31:], vals[:, :, 31:])
    ka, va = a.dequantized_keys_values()
    kb, vb = b.dequantized_keys_values()
    assert mx.array_equal(ka, kb) and mx.array_equal(va, vb)
    q = _rand(rng, (1, 4, 2, 64))
    assert mx.allclose(a.attention(q, 0.1, "causal"), b.attention(q, 0.1, "causal"), atol=1e-6)


def test_trim_beyond_rollback_and_to_zero():
    rng = np.random.default_rng(4)
    cache, _, _ = _filled(rng, [40], fp16_sink_tokens=3, fp16_recent_tokens=5, rollback_tokens=2)
    assert cache.trim(12) == 12 and cache.offset == 28
    # The window lost tokens that exist only quantized now; attention still covers all.
    k, v = cache.dequantized_keys_values()
    assert k.shape[2] == 28
    cache.update_and_fetch(_rand(rng, (1, 2, 4, 64)), _rand(rng, (1, 2, 4, 64)))
    assert cache.dequantized_keys_values()[0].shape[2] == 32
    assert cache.trim(100) == 32 and cache.offset == 0
    cache.update_and_fetch(_rand(rng, (1, 2, 9, 64)), _rand(rng, (1, 2, 9, 64)))
    assert cache.offset == 9 and cache._sink_k.shape[2] == 3
    assert cache.attention(_rand(rng, (1, 2, 1, 64)), 0.1).shape == (1, 2, 1, 64)


# ---------------------------------------------------------------------------
# state, save and load


def _assert_same_cache(a, b):
    assert type(a) is type(b)
    if isinstance(a, TurboQuantKVCache):
        assert a._config_values() == b._config_values()
        for x, y in zip(a._state_arrays(), b._state_arrays()):
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y)
    else:
        for x, y in zip(a.state, b.state):
            if isinstance(x, mx.array):
                assert mx.array_equal(x, y)
            else:
                assert x == y


STATE_LAYOUTS = (
    LAYOUTS
    + [dict(fp16_sink_tokens=50)]
    + LEVER_LAYOUTS
    + [
        dict(center=True, query_aware_keys=True, calibration_tokens=100),  # not calibrated yet
        dict(center=True, query_aware_keys=True, fp16_sink_tokens=50, calibration_tokens=1),
    ]
)


@pytest.mark.parametrize("layout", STATE_LAYOUTS, ids=range(len(STATE_LAYOUTS)))
def test_state_round_trip(layout):
    rng = np.random.default_rng(6)
    cache, _, _ = _filled(rng, [33, 1, 4], **layout)
    if layout.get("calibration_tokens") == 100:
        assert not cache.calibrated and cache._queries.count == 2 * 38
    new = TurboQuantKVCache.from_state(cache.state)
    _assert_same_cache(cache, new)
    q = _rand(rng, (1, 2, 3, 64))
    assert mx.array_equal(new.attention(q, 0.1, "causal"), cache.attention(q, 0.1, "causal"))
    # Older mlx-lm: arrays in `state`, integers as strings in `meta_state`; either order.
    arrays, meta = cache.state[:12], cache.meta_state
    assert all(isinstance(s, str) for s in meta)
    _assert_same_cache(cache, TurboQuantKVCache.from_state(arrays, meta))
    legacy = TurboQuantKVCache.__new__(TurboQuantKVCache)
    legacy.state = arrays
    legacy.meta_state = meta
    _assert_same_cache(cache, legacy)
    # Continuing works the same on both (past the calibration where there is one).
    for n in (2, 70):
        k, v = _rand(rng, (1, 2, n, 64)), _rand(rng, (1, 2, n, 64))
        cache.update_and_fetch(k, v)
        new.update_and_fetch(k, v)
        q = _rand(rng, (1, 2, n, 64))
        assert mx.array_equal(new.attention(q, 0.1, "causal"), cache.attention(q, 0.1, "causal"))
        _assert_same_cache(cache, new)
    assert cache.calibrated


def test_empty_state_round_trip_and_bad_states():
    cache = TurboQuantKVCache(3, 2, seed=4, fp16_recent_tokens=8)
    new = TurboQuantKVCache.from_state(cache.state)
    assert new.empty() and new.offset == 0 and (new.key_bits, new.value_bits) == (3, 2)
    rng = np.random.default_rng(0)
    full, _, _ = _filled(rng, [20])
    state = full.state
    with pytest.raises(ValueError, match="entries"):
        TurboQuantKVCache.from_state(state[:5])
    bad = list(state)
    bad[12 + 7] = 21  # offset beyond the stored tokens
    with pytest.raises(ValueError, match="inconsistent"):
        TurboQuantKVCache.from_state(bad)
    bad = list(state)
    bad[0] = bad[0][:, :, :-1]
    with pytest.raises(ValueError, match="inconsistent"):
        TurboQuantKVCache.from_state(bad)
    with pytest.raises(ValueError, match="no configuration"):
        TurboQuantKVCache.from_state(state[:12])
    bad = list(state)
    bad[12] = 4
    with pytest.raises(ValueError, match="version 4"):
        TurboQuantKVCache.from_state(bad)
    # Format 1 (8 arrays, 10 integers, no levers) still loads.
    v1 = state[:8] + [1] + state[13:22]
    old = TurboQuantKVCache.from_state(v1)
    _assert_same_cache(full, old)
    # Lever arrays must match the configuration and the layout.
    levered, _, _ = _filled(rng, [40], center=True, query_aware_keys=True)
    state = levered.state
    assert levered.key_mean.shape == levered.key_scale.shape == (1, 2, 1, 64)
    for i, value in [
        (8, state[8][..., :-1]),
        (10, state[10].astype(mx.float16)),
        (12 + 10, 0),
        (12 + 11, 0),
        (12 + 15, 0),
    ]:
        bad = list(state)
        bad[i] = value
        with pytest.raises(ValueError, match="inconsistent"):
            TurboQuantKVCache.from_state(bad)


def test_refused_state_leaves_the_cache_unchanged():
    rng = np.random.default_rng(14)
    cache, _, _ = _filled(rng, [30, 1], fp16_sink_tokens=2, fp16_recent_tokens=5)
    twin = copy.deepcopy(cache)
    other, _, _ = _filled(
        rng, [20], key_bits=3, value_bits=2, seed=9, fp16_recent_tokens=4, center=True
    )
    for i, value in (
        (7, other.state[7][:, :, 1:]),  # its window values one token short
        (12 + 9, 99),
    ):  # window_start past the offset
        bad = list(other.state)
        bad[i] = value
        with pytest.raises(ValueError, match="inconsistent"):
            cache.state = bad
        assert cache._config_values() == twin._config_values()
        for x, y in zip(cache._state_arrays(), twin._state_arrays()):
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y)
    # ... and it goes on as its twin does.
    for n in (1, 12):
        k, v, q = _rand(rng, (1, 2, n, 64)), _rand(rng, (1, 2, n, 64)), _rand(rng, (1, 4, n, 64))
        for c in (cache, twin):
            c.update_and_fetch(k, v)
        assert mx.array_equal(cache.attention(q, 0.1, "causal"), twin.attention(q, 0.1, "causal"))


def test_levers_calibrate_at_update_without_queries():
    # No attention call between updates (no hook): the update that finds
    # calibration_tokens held tokens calibrates; without queries there is no key scale.
    rng = np.random.default_rng(11)
    cache, K, V = _filled(
        rng,
        [20, 10, 3],
        attend=False,
        center=True,
        query_aware_keys=True,
        fp16_sink_tokens=2,
        calibration_tokens=28,
    )
    assert cache.calibrated and cache.key_scale is None
    assert cache._n_comp == 31  # the 28 held tokens, then the 3 new ones
    q = _rand(rng, (1, 4, 1, 64))
    np.testing.assert_allclose(
        np.array(cache.attention(q, 0.1)),
        np.array(_expected(q, K, V, 0.1, None)),
        atol=TOL * _magnitude(V),
    )


def test_key_scale_is_tied_over_rope_pairs_normalized_and_clamped():
    rng = np.random.default_rng(12)
    for pairing, partner in (("half", lambda i: (i + 32) % 64), ("interleaved", lambda i: i ^ 1)):
        cache, _, _ = _filled(rng, [40], center=True, query_aware_keys=True, rope_pairing=pairing)
        a = np.array(cache.key_scale)[0, 0, 0]
        np.testing.assert_array_equal(a, a[[partner(i) for i in range(64)]])
        assert abs(np.mean(a * a) - 1) < 0.05 and np.ptp(a) > 0.2
    # Partial RoPE: only the first rope_dims channels are paired.
    cache, _, _ = _filled(rng, [40], center=True, query_aware_keys=True, rope_dims=16)
    a = np.array(cache.key_scale)[0, 0, 0]
    np.testing.assert_array_equal(a[:8], a[8:16])
    assert not np.array_equal(a[16:24], a[24:32])
    # Extreme energies are clamped to [1/8, 8] (here the lower bound is reached; the
    # normalization keeps a^2 <= D/2 for a pair).
    cache = TurboQuantKVCache(4, 4, query_aware_keys=True, calibration_tokens=4)
    k = np.ones((1, 1, 8, 64), np.float32) * rng.standard_normal((1, 1, 8, 1))
    k[..., :2] *= 1e4
    q = np.ones((1, 1, 8, 64), np.float32)
    q[..., 2:4] *= 1e4
    cache.update_and_fetch(mx.array(k), mx.array(k))
    cache.attention(mx.array(q), 0.1, "causal")
    a = np.array(cache.key_scale)[0, 0, 0]
    assert a.min() >= 1 / 8 * (1 - 1e-6) and a.max() <= 8 * (1 + 1e-6)
    assert a[0] == pytest.approx(1 / 8) and a[2] > 3


def test_levers_reduce_attention_error():
    # Exact transforms, so they can only help the codec: on data with a common mean and
    # unequal channel scales (as real keys have), both levers cut the error of the
    # attention output against exact attention on the unquantized tokens.
    rng = np.random.default_rng(13)
    k = _biased(rng, (1, 2, 256, 64))
    v = _biased(rng, (1, 2, 256, 64))
    # The last 200 positions' queries: fewer than the block, so they see it as stored.
    q = _queries(rng, (1, 4, 200, 64))
    exact = np.array(_expected(q, k.astype(mx.float16), v.astype(mx.float16), 0.1, "causal"))
    errors = []
    for levers in (dict(), dict(center=True), dict(center=True, query_aware_keys=True)):
        cache = TurboQuantKVCache(3, 3, seed=1, **levers)
        cache.update_and_fetch(k, v)
        out = np.array(cache.attention(q, 0.1, "causal"))
        errors.append(np.linalg.norm(out - exact) / np.linalg.norm(exact))
    assert errors[1] < 0.8 * errors[0] and errors[2] < 0.9 * errors[1], errors


def _mixed_cache(rng):
    """A prompt cache with compressed, fp16 and quantized layers."""
    tq1, _, _ = _filled(rng, [25, 1], fp16_sink_tokens=2, fp16_recent_tokens=5)
    tq2, _, _ = _filled(rng, [26], key_bits=3, value_bits=2, seed=123456789)
    kv = KVCache()
    kv.update_and_fetch(_rand(rng, (1, 2, 26, 64)), _rand(rng, (1, 2, 26, 64)))
    return [tq1, tq2, kv]


def test_save_load_exact_and_mlx_lm_compatible(tmp_path):
    rng = np.random.default_rng(8)
    cache = _mixed_cache(rng)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache, {"model": "tiny", "note": "x"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"model": "tiny", "note": "x"}
    for a, b in zip(cache, loaded):
        _assert_same_cache(a, b)
    # mlx-lm's loader reads the same file (the class is registered with mlx-lm).
    assert mlx_cache.TurboQuantKVCache is TurboQuantKVCache
    for a, b in zip(cache, mlx_cache.load_prompt_cache(path)):
        _assert_same_cache(a, b)
    # ... and files written by mlx-lm load with allow_unverified.
    path2 = str(tmp_path / "m.safetensors")
    mlx_cache.save_prompt_cache(path2, cache, {"model": "tiny"})
    with pytest.raises(PromptCacheError, match="no checksum"):
        load_prompt_cache(path2)
    for a, b in zip(cache, load_prompt_cache(path2, allow_unverified=True)):
        _assert_same_cache(a, b)


def test_corrupted_or_truncated_file_is_refused(tmp_path):
    rng = np.random.default_rng(9)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, _mixed_cache(rng))
    data = open(path, "rb").read()
    header_len = int.from_bytes(data[:8], "little")

    def write(blob):
        p = str(tmp_path / "bad.safetensors")
        with open(p, "wb") as f:
            f.write(blob)
        return p

    for cut in (len(data) - 1, len(data) // 2, 8 + header_len // 2, 5):
        with pytest.raises(PromptCacheError, match="cannot be read"):
            load_prompt_cache(write(data[:cut]))
    # Flip one byte in several places of the data section.
    for pos in (8 + header_len + 3, (8 + header_len + len(data)) // 2, len(data) - 1):
        blob = bytearray(data)
        blob[pos] ^= 0x10
        with pytest.raises(PromptCacheError, match="checksum mismatch"):
            load_prompt_cache(write(bytes(blob)))
    # Alter metadata in the header (same length, still valid JSON).
    text = data[8 : 8 + header_len].decode()
    assert '"1.0":"TurboQuantKVCache"' in text
    altered = text.replace('"1.2":"KVCache"', '"1.2":"KVCachf"')
    assert altered != text
    with pytest.raises(PromptCacheError, match="checksum mismatch"):
        load_prompt_cache(write(data[:8] + altered.encode() + data[8 + header_len :]))
    with pytest.raises(FileNotFoundError):
        load_prompt_cache(str(tmp_path / "missing.safetensors"))


_IMPORT_ORDERS = {
    "mlx_lm first": "from mlx_lm.models import cache as mlx_cache\nimport turboquant_mlx\n",
    "turboquant_mlx first": "import turboquant_mlx\nfrom mlx_lm.models import cache as mlx_cache\n",
}


@pytest.mark.parametrize("order", sorted(_IMPORT_ORDERS))
def test_importing_the_package_lets_mlx_lm_load_the_file(tmp_path, order):
    # `import turboquant_mlx` alone (not turboquant_mlx.cache) registers the class name
    # with mlx-lm, whichever of the two is imported first.
    import json
    import os
    import subprocess

    import turboquant_mlx

    cache = _mixed_cache(np.random.default_rng(10))
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    script = _IMPORT_ORDERS[order] + (
        "import json, sys\n"
        "assert 'turboquant_mlx.cache' not in sys.modules\n"
        "caches = mlx_cache.load_prompt_cache(sys.argv[1])\n"
        "print(json.dumps([[type(c).__module__, type(c).__name__, c.offset] for c in caches]))\n"
    )
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(turboquant_mlx.__file__))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-c", script, path], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == [[type(c).__module__, type(c).__name__, c.offset] for c in cache]


def _forge(tmp_path, src, arrays=None, meta=None):
    """A copy of the prompt-cache file ``src`` with arrays and metadata entries replaced
    (``None`` removes one) and a valid checksum, as anyone can compute it."""
    from turboquant_mlx import prompt_cache

    a, m = mx.load(src, return_metadata=True)
    for table, edits in ((a, arrays), (m, meta)):
        for key, value in (edits or {}).items():
            if value is None:
                del table[key]
            else:
                table[key] = value(table[key]) if callable(value) else value
    m[prompt_cache._FLAT_CHECKSUM_KEY] = prompt_cache._checksum(a, m)
    out = str(tmp_path / "forged.safetensors")
    mx.save_safetensors(out, a, m)
    return out


def _levered_cache(rng):
    tq, _, _ = _filled(rng, [40], center=True, query_aware_keys=True, fp16_recent_tokens=4)
    return [tq]


def _extra_first_token(a):
    return mx.concatenate([a[:, :, :1], a], axis=2)


# Cache 0 of _mixed_cache: 2 sinks, a window of 5 (+16 rollback) tokens, all 21 held,
# 19 compressed tokens, offset 26. State entries: 0-11 arrays, 12 + i configuration
# value i (7 offset, 9 window_start). Cache 2 is mlx-lm's KVCache.
FORGED = {
    "window keys one token longer than values": (
        _mixed_cache,
        {"0.7": lambda a: a[:, :, 1:]},
        r"cache 0 .*window_keys .*window_values",
    ),
    "window values in another dtype": (
        _mixed_cache,
        {"0.7": lambda a: a.astype(mx.bfloat16)},
        r"cache 0 .*window_values of dtype",
    ),
    "sinks in float32, window in float16": (
        _mixed_cache,
        {k: lambda a: a.astype(mx.float32) for k in ("0.4", "0.5")},
        r"cache 0 .*window_keys of dtype",
    ),
    "key codes one word too wide": (
        _mixed_cache,
        {"0.0": lambda a: mx.concatenate([a, a[..., :1]], axis=-1)},
        r"cache 0 .*k_codes of shape \(1, 2, 19, 9\)",
    ),
    "window beyond its capacity": (
        _mixed_cache,
        {"0.6": _extra_first_token, "0.7": _extra_first_token, "0.21": mx.array(4)},
        r"cache 0 .*window of 22 tokens .*capacity 21",
    ),
    "non-integral offset": (
        _mixed_cache,
        {"0.19": mx.array(26.5)},
        r"cache 0 .*offset is not an integer",
    ),
    "configuration value out of range": (
        _mixed_cache,
        {"0.17": mx.array(2**63 - 1)},
        r"cache 0 .*fp16_recent_tokens .*out of range",
    ),
    "kv cache offset beyond its tokens": (
        _mixed_cache,
        {"2.2": mx.array(300)},
        r"cache 2 \(KVCache\).*offset 300 beyond",
    ),
    "calibrated centered cache without means": (
        _levered_cache,
        {k: mx.array([], dtype=mx.float32) for k in ("0.8", "0.9")},
        r"cache 0 .*no key_mean",
    ),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_forged_state_with_a_valid_checksum_is_refused(tmp_path, case):
    make, arrays, message = FORGED[case]
    src = str(tmp_path / "c.safetensors")
    save_prompt_cache(src, make(np.random.default_rng(11)))
    load_prompt_cache(src)  # the original loads
    path = _forge(tmp_path, src, arrays=arrays)
    with pytest.raises(PromptCacheError, match=message) as err:
        load_prompt_cache(path)
    assert "forged.safetensors" in str(err.value)


def test_forged_metadata_is_refused_without_building_it(tmp_path):
    import tracemalloc

    src = str(tmp_path / "c.safetensors")
    save_prompt_cache(src, _mixed_cache(np.random.default_rng(12)))
    cases = [
        # tree_unflatten would build lists of 2e7 (or 1e9) entries for these.
        (dict(meta={"1.20000000": "KVCache"}), r"cache class indices are not 0\.\.3"),
        (dict(arrays={"20000000.0": mx.array(1.0)}), r"belongs to cache 20000000, .* 3 caches"),
        (dict(meta={"1.1000000000": "KVCache"}), r"unexpected metadata key '1\.1000000000'"),
        (dict(meta={"2.1.0": "0.99"}), r"names array '0\.99'"),
        (dict(meta={"2.1.1": "pickle"}), r"unknown scalar kind 'pickle'"),
        (dict(meta={"1.2": "deque"}), r"cache 2: unknown cache class 'deque'"),
        (dict(arrays={"0.29": mx.array([1.0])}), r"cache 0 \(TurboQuantKVCache\): configuration"),
        (dict(arrays={"0.3": None}), r"cache 0 state indices are not 0\.\.27 \(index 3 is missing"),
        (dict(arrays={"0.12": mx.array([2, 2])}), r"scalar '0\.12' has shape \(2,\)"),
    ]
    for edits, message in cases:
        path = _forge(tmp_path, src, **edits)
        tracemalloc.start()
        try:
            with pytest.raises(PromptCacheError, match=message):
                load_prompt_cache(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, (edits, peak)


# ---------------------------------------------------------------------------
# presets and factory


def test_window_variant_of_a_preset():
    # PRESET@wN: the preset with its last N tokens in fp16, everything else equal.
    p = get_preset("tq3@w128")
    assert p.fp16_recent_tokens == 128 and p.name == "tq3@w128"
    assert (p.key_bits, p.value_bits, p.center, p.fp16_sink_tokens) == (4, 2, True, 4)
    model = build_model("llama", num_hidden_layers=2)
    caches = make_prompt_cache(model, preset="tq4@w8")
    assert all(c.fp16_recent_tokens == 8 for c in caches)
    for bad in ("tq4@w", "tq4@wx", "fp16@w8", "nope@w8"):
        with pytest.raises(ValueError, match="PRESET@wN"):
            get_preset(bad)


def test_presets_table():
    with pytest.raises(ValueError, match="valid presets: fp16, tq4, tq3"):
        get_preset("tq5")
    assert {"fp16", "tq4", "tq3", "tq4-sink", "tq3-sink"} <= set(PRESETS)
    assert PRESETS["tq4-plain"].bits_per_coordinate(64, 4096) == pytest.approx(4.25)
    assert PRESETS["tq3-plain"].bits_per_coordinate(128, 1000) == pytest.approx(3.125)
    # The headline presets stay within their budgets (4.5 / 3.5 bits) from 3k tokens on,
    # at any depth (no per-layer schedule) and head dim.
    for name, budget in (("tq4", 4.5), ("tq3", 3.5)):
        for ctx in (3072, 8192, 131072):
            for layers, head_dim in ((30, 64), (2, 64), (64, 128), (40, 256)):
                assert PRESETS[name].bits_per_coordinate(head_dim, ctx, num_layers=layers) <= budget
        assert PRESETS[name].layer_schedule == ()
    # Their fp16 window (32 tokens + 16 rollback) is a fixed cost per layer: at most
    # its own 16 bits spread over the context, and it amortizes.
    for name, base in (("tq4", "tq4-nowindow"), ("tq3", "tq3-nowindow")):
        extras = []
        for ctx in (3072, 32768, 131072):
            extras.append(
                PRESETS[name].bits_per_coordinate(64, ctx, num_layers=30)
                - PRESETS[base].bits_per_coordinate(64, ctx, num_layers=30)
            )
            assert 0 < extras[-1] <= 48 * 16 / ctx
        assert extras == sorted(extras, reverse=True)
    assert PRESETS["fp16"].bits_per_coordinate(64, 10) == 16
    p = KVPreset("x", 4, 4, fp16_sink_tokens=4, fp16_recent_tokens=60, fp16_layers=(1, 1))
    # 1000 tokens: 4 sinks + 60 window + 16 rollback in fp16, 936 compressed.
    per_layer = (936 * 2 * (64 * 4 + 16) + 80 * 2 * 64 * 16) / (2 * 64 * 1000)
    assert p.bits_per_coordinate(64, 1000) == pytest.approx(per_layer)
    assert p.bits_per_coordinate(64, 1000, num_layers=30) == pytest.approx(
        (2 * 16 + 28 * per_layer) / 30
    )
    assert p.bits_per_coordinate(64, 10) == 16  # everything still fp16
    # Levers: three float32 vectors per KV head and layer; nothing quantized before
    # calibration_tokens non-sink tokens.
    lev = KVPreset("y", 4, 4, fp16_sink_tokens=4, center=True, query_aware_keys=True)
    want = ((4096 - 4) * 2 * (64 * 4 + 16) + 4 * 2 * 64 * 16 + 3 * 64 * 32) / (2 * 64 * 4096)
    assert lev.bits_per_coordinate(64, 4096) == pytest.approx(want)
    assert lev.bits_per_coordinate(64, 30) == 16


def test_factory_options():
    model = build_model("llama", num_hidden_layers=6)
    types_of = lambda cache: ["tq" if isinstance(c, TurboQuantKVCache) else "kv" for c in cache]  # noqa: E731
    assert types_of(make_prompt_cache(model, "fp16")) == ["kv"] * 6
    assert types_of(make_prompt_cache(model, "tq4-nowindow", fp16_layers=(1, 2))) == [
        "kv",
        "tq",
        "tq",
        "tq",
        "kv",
        "kv",
    ]
    assert types_of(make_prompt_cache(model, "tq4-nowindow", fp16_layers={0, -1})) == [
        "kv",
        "tq",
        "tq",
        "tq",
        "tq",
        "kv",
    ]
    plus = make_prompt_cache(model, "tq4-plus")
    assert types_of(plus) == ["kv", "tq", "tq", "tq", "tq", "kv"]
    assert plus[1].fp16_sink_tokens == 4 and plus[1].fp16_recent_tokens == 64
    cache = make_prompt_cache(
        model,
        "k3v3",
        key_bits=4,
        seed=5,
        layer_overrides={
            0: "tq4",
            2: (2, 3),
            3: {"value_bits": 4, "fp16_sink_tokens": 1},
            -1: "fp16",
        },
    )
    assert types_of(cache) == ["tq", "tq", "tq", "tq", "tq", "kv"]
    assert [(c.key_bits, c.value_bits) for c in cache[:5]] == [
        (4, 4),
        (4, 3),
        (2, 3),
        (4, 4),
        (4, 3),
    ]
    assert cache[3].fp16_sink_tokens == 1
    seeds = [c.seed for c in cache[:5]]
    assert len(set(seeds)) == 5 and seeds[1] == layer_seed(5, 1)
    assert [c.seed for c in make_prompt_cache(model, "tq4-nowindow", seed=5)] == [
        layer_seed(5, i) for i in range(6)
    ]
    # fp16 preset with explicit bits compresses with those bits.
    assert types_of(make_prompt_cache(model, "fp16", key_bits=4)) == ["tq"] * 6
    with pytest.raises(ValueError, match="valid presets"):
        make_prompt_cache(model, "nope")
    with pytest.raises(ValueError, match="layer 9 cannot be overridden"):
        make_prompt_cache(model, "tq4", layer_overrides={9: "fp16"})
    # Rotating caches (max_kv_size on a model without make_cache) are left alone.
    gemma = build_model("gemma3_text")
    with pytest.raises(ValueError, match="not a full-attention"):
        make_prompt_cache(gemma, "tq4", layer_overrides={0: "tq3"})


def test_layer_schedule():
    """A preset's per-layer schedule by relative depth: points pick the nearest layer,
    ranges every layer inside; fp16_layers win; explicit bit widths switch it off."""
    sched = ((0.35, "fp16"), ((0.5, 1.0), (4, 2)), (1.0, {"value_bits": 3}))
    p = KVPreset(
        "s", 4, 4, fp16_sink_tokens=4, center=True, fp16_layers=(1, 0), layer_schedule=sched
    )
    cfgs = p.layer_configs(30)
    assert cfgs[0] is None and cfgs[10] is None  # fp16_layers, then round(0.35 * 29) = 10
    assert [c["value_bits"] for c in cfgs[15:29]] == [2] * 14 and cfgs[14]["value_bits"] == 4
    assert cfgs[29]["value_bits"] == 3 and cfgs[29]["center"] and cfgs[29]["fp16_sink_tokens"] == 4

    # bits: the average of the layers' own accounting
    def per(vb):
        preset = KVPreset("o", 4, vb, fp16_sink_tokens=4, center=True)
        return preset.bits_per_coordinate(64, 3072)

    want = (2 * 16 + 13 * per(4) + 14 * per(2) + per(3)) / 30
    assert p.bits_per_coordinate(64, 3072, num_layers=30) == pytest.approx(want)
    assert p.bits_per_coordinate(64, 3072) == pytest.approx(per(4))  # one compressed layer
    # The factory applies the same schedule on a 6-layer model.
    model = build_model("llama", num_hidden_layers=6)
    cache = make_prompt_cache(model, p)
    assert [
        None if not isinstance(c, TurboQuantKVCache) else (c.key_bits, c.value_bits) for c in cache
    ] == [None, (4, 4), None, (4, 2), (4, 2), (4, 3)]  # round(0.35 * 5) = 2
    assert [type(c) is KVCache for c in cache] == [c is None for c in p.layer_configs(6)]
    # Explicit bits: uniform; explicit fp16_layers replace the preset's, schedule stays.
    assert {(c.key_bits, c.value_bits) for c in make_prompt_cache(model, p, value_bits=3)[1:]} == {
        (4, 3)
    }
    c2 = make_prompt_cache(model, p, fp16_layers=())
    assert isinstance(c2[0], TurboQuantKVCache) and not isinstance(c2[2], TurboQuantKVCache)
    c3 = make_prompt_cache(model, p, layer_overrides={2: (3, 3)})
    assert (c3[2].key_bits, c3[2].value_bits) == (3, 3)
    with pytest.raises(ValueError, match="not in"):
        KVPreset("bad", 4, 4, layer_schedule=((1.5, "fp16"),)).layer_configs(4)
    # (where, spec, min_layers): skipped on shallower models
    deep = KVPreset("d", 4, 4, layer_schedule=((0.5, "fp16", 8),))
    assert deep.layer_configs(8)[4] is None and None not in deep.layer_configs(7)


def test_factory_levers_and_rope_pairing():
    model = build_model("llama", num_hidden_layers=2)
    plain = KVPreset("plain", 4, 4)
    levered = KVPreset("lev", 3, 3, center=True, query_aware_keys=True)
    c = make_prompt_cache(model, plain)
    assert not c[0].center and not c[0].query_aware_keys and c[0].calibrated
    c = make_prompt_cache(model, levered, calibration_tokens=7)
    assert c[0].center and c[0].query_aware_keys and not c[0].calibrated
    assert (c[0].rope_pairing, c[0].rope_dims, c[0].calibration_tokens) == ("half", 64, 7)
    c = make_prompt_cache(
        model, levered, query_aware_keys=False, rope_pairing="none", layer_overrides={1: plain}
    )
    assert c[0].center and not c[0].query_aware_keys and c[0].rope_pairing == "none"
    assert not c[1].center and not c[1].query_aware_keys
    c = make_prompt_cache(model, plain, layer_overrides={1: {"center": True}})
    assert not c[0].center and c[1].center
    # Traditional (interleaved) RoPE, partial RoPE.
    trad = build_model("llama", num_hidden_layers=2, rope_traditional=True)
    assert make_prompt_cache(trad, levered)[0].rope_pairing == "interleaved"
    nxt = build_model("qwen3_next")
    tq = [x for x in make_prompt_cache(nxt, levered) if isinstance(x, TurboQuantKVCache)]
    assert tq and all((x.rope_pairing, x.rope_dims) == ("half", 16) for x in tq)


def test_factory_refuses_models_that_bypass_the_hook():
    module = types.ModuleType("tq_test_custom_model")
    sys.modules[module.__name__] = module
    try:
        exec(
            "import mlx.nn as nn\n"
            "class Model(nn.Module):\n"
            "    def __init__(self):\n"
            "        super().__init__()\n"
            "        self.layers = [nn.Linear(2, 2), nn.Linear(2, 2)]\n",
            module.__dict__,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = make_prompt_cache(module.Model(), "tq4")
        assert all(type(c) is KVCache for c in cache)
        assert any("bypassed" in str(w.message) for w in caught)
    finally:
        del sys.modules[module.__name__]


def test_cache_nbytes_report():
    rng = np.random.default_rng(0)
    cache = _mixed_cache(rng)
    report = cache_nbytes(cache)
    assert report["total"] == sum(c.nbytes for c in cache)
    assert report["compressed_layers"] == cache[0].nbytes + cache[1].nbytes
    assert report["dense_equivalent"] == 2 * 2 * 26 * 64 * 2 * 2 + cache[2].nbytes


@pytest.mark.parametrize("L", [1, 2, 5, 8])
def test_queries_cover_the_whole_short_cache(L):
    # Fewer compressed tokens than queries: early queries see only sinks / nothing compressed.
    rng = np.random.default_rng(L)
    levers = dict(center=True, query_aware_keys=True, calibration_tokens=1)
    for layout in (
        dict(),
        dict(fp16_sink_tokens=2),
        dict(fp16_sink_tokens=1, fp16_recent_tokens=2),
        dict(levers, fp16_sink_tokens=2),
        dict(levers, fp16_sink_tokens=1, fp16_recent_tokens=2),
    ):
        cache, K, V = _filled(rng, [L], **layout)
        q = _rand(rng, (1, 4, L, 64))
        want = _expected_steps(cache, cache.arrived, q, 0.3, "causal")
        np.testing.assert_allclose(
            np.array(cache.attention(q, 0.3, "causal")), np.array(want), atol=TOL * _magnitude(V)
        )


def test_decode_with_a_window_longer_than_the_op_tail(monkeypatch):
    # Sinks + window beyond MAX_TAIL_TOKENS: the decode step attends to them apart and
    # merges (no tail); the result still matches mlx's attention on the cache contents.
    import turboquant_mlx.cache as tq_cache

    tails = _record_op_tails(monkeypatch)
    rng = np.random.default_rng(12)
    window = tq_cache.MAX_TAIL_TOKENS
    cache, K, V = _filled(
        rng, [400, 1, 1], B=1, H=2, D=64, center=True, fp16_sink_tokens=2, fp16_recent_tokens=window
    )
    q = _rand(rng, (1, 4, 1, 64))
    tails.clear()
    got = cache.attention(q, 0.2, "causal")
    assert tails == [None]  # 2 + 256 fp16 tokens: more than the op's tail takes
    want = _expected(q, K, V, 0.2, "causal")
    np.testing.assert_allclose(np.array(got), np.array(want), atol=TOL * _magnitude(V))


def test_sinks_only_tail_is_transformed_once(monkeypatch):
    # Without a window the tail is the sinks, the same tokens at every step: the step
    # reuses the previous step's code-space tail and transforms only the queries.
    rng = np.random.default_rng(21)
    cache, K, V = _filled(rng, [40], B=1, H=2, D=64, center=True, fp16_sink_tokens=4)
    tails = _record_op_tails(monkeypatch)
    for _ in range(3):
        k, v = _rand(rng, (1, 2, 1, 64)), _rand(rng, (1, 2, 1, 64))
        cache.update_and_fetch(k, v)
        q = _rand(rng, (1, 4, 1, 64))
        got = cache.attention(q, 0.2, "causal")
        K, V = cache.dequantized_keys_values(mx.float32)
        want = _expected(q, K, V, 0.2, "causal")
        np.testing.assert_allclose(np.array(got), np.array(want), atol=TOL * _magnitude(V))
    assert tails[0].shape[2] == 4 and tails[1] is tails[0] and tails[2] is tails[0]


@pytest.mark.parametrize("mode", ["ring-append", "op-rotation", "host-rotation"])
def test_window_tokens_leave_without_reading_the_window(monkeypatch, mode):
    # The window token that leaves at a decode step is quantized from what the cache
    # kept of it: with the rotation in the ops, from its ring slot in the node that
    # writes the new token there (ring-append), or, in a build without that node
    # (op-rotation), from the token as it arrived (so that the append does not hold the
    # window buffer the step writes into); around the ops (host-rotation: a head dim
    # that is not a power of two), the code-space copy in the last step's tail (not
    # transformed again). The stored codes must be those of a cache that makes no
    # attention calls.
    from turboquant_mlx import ops

    if mode != "ring-append":
        monkeypatch.setattr(ops, "has_ring_append", lambda *a: False)
    cfg = dict(
        center=True,
        fp16_sink_tokens=4,
        fp16_recent_tokens=8,
        rollback_tokens=2,
        key_bits=4,
        value_bits=3,
        seed=3,
        calibration_tokens=16,
    )
    rng = np.random.default_rng(4)
    B, H, D = 1, 2, 160 if mode == "host-rotation" else 64
    attending, storing = TurboQuantKVCache(**cfg), TurboQuantKVCache(**cfg)
    k, v = _rand(rng, (B, H, 40, D)) + 2.0, _rand(rng, (B, H, 40, D))
    for c in (attending, storing):
        c.update_and_fetch(k, v)
    attending.attention(_rand(rng, (B, 2 * H, 40, D)), 0.125, "causal")
    # (the storing cache calibrates on the same 36 tokens at its next update)
    quantized, arrived, exchanged = [], [], []
    quantize, ring_append = attending._quantize, attending._ring_append

    def counted_ring_append(*a):  # (rk, rv, P, first, end, signs)
        done = ring_append(*a)
        if done:
            exchanged.append(a[2])
        return done

    for step in range(20):
        if step == 1:  # the first decode step has no tail from a previous one
            monkeypatch.setattr(
                attending, "_quantize", lambda *a: quantized.append(a) or quantize(*a)
            )
            monkeypatch.setattr(attending, "_ring_append", counted_ring_append)
        k, v = _rand(rng, (B, H, 1, D)) + 2.0, _rand(rng, (B, H, 1, D))
        for c in (attending, storing):
            c.update_and_fetch(k, v)
        arrived.append(attending._new_token)
        attending.attention(_rand(rng, (B, 2 * H, 1, D)), 0.125, "causal")
    if mode == "ring-append" and ops.has_ring_append():
        # from step 1 on the ring (started by step 0's tail) is in sync: every token
        # leaves from its slot
        assert quantized == [] and len(exchanged) == 19
    elif mode != "host-rotation":
        # the 12 tokens that left after arriving alone (steps 8-19): each from its own
        # arrays; the 7 before them came with the prefill
        assert len(quantized) == 19 and exchanged == []
        from_arrival = [any(a[0] is t[0] and a[1] is t[1] for t in arrived) for a in quantized]
        assert from_arrival == [False] * 7 + [True] * 12
    else:
        assert quantized == []  # every leaving token came from the tail
    assert attending._n_comp == storing._n_comp == 40 + 20 - 4 - 8
    for a, b in zip(attending.state, storing.state):
        np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("op_rotation", [True, False], ids=["op-rotation", "host-rotation"])
def test_ring_decode_equals_rebuilding_the_tail(monkeypatch, op_rotation):
    # Single-token steps keep the tail as a ring (the new token takes the leaving
    # token's slot) and append to the window in place. Over several wraps of the ring
    # and rebuilds of the window buffer, every output, the codes and the window must be
    # those of a cache that rebuilds its tail from the fp16 window at every step.
    # (The ring is in model space with the rotation in the ops, else in code space:
    # host-rotation takes a head dim that is not a power of two.)
    cfg = dict(
        center=True,
        fp16_sink_tokens=3,
        fp16_recent_tokens=8,
        rollback_tokens=4,
        calibration_tokens=16,
        seed=5,
    )
    rng = np.random.default_rng(31)
    B, H, D = 1, 2, 64 if op_rotation else 160
    ring, rebuild = TurboQuantKVCache(**cfg), TurboQuantKVCache(**cfg)
    k, v = _rand(rng, (B, H, 30, D)), _rand(rng, (B, H, 30, D))
    q = _rand(rng, (B, 2 * H, 30, D))
    for c in (ring, rebuild):
        c.update_and_fetch(k, v)
        c.attention(q, 0.125, "causal")
    tails = _record_op_tails(monkeypatch)
    steps = 3 * TurboQuantKVCache.window_slack // 2
    for step in range(steps):
        k, v = _rand(rng, (B, H, 1, D)), _rand(rng, (B, H, 1, D))
        q = _rand(rng, (B, 2 * H, 1, D))
        rebuild._drop_code_space()
        outs = []
        for c in (ring, rebuild):
            c.update_and_fetch(k, v)
            outs.append(np.array(c.attention(q, 0.125, "causal")))
        np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"step {step}")
        K, V = rebuild.dequantized_keys_values(mx.float32)
        np.testing.assert_allclose(
            outs[1], np.array(_expected(q, K, V, 0.125, "causal")), atol=TOL * _magnitude(V)
        )
    for a, b in zip(ring.state, rebuild.state):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    assert all(t.shape[2] == 3 + 8 for t in tails)  # sinks + window, every step
    # Ring steps concatenate nothing but the window's rebuilds: with the rotation in the
    # ops, from the ring once every R steps (keys and values, at most 3 inputs each: the
    # older tokens kept and the ring's two runs); around the ops, the window buffer's
    # rebuild once every window_slack steps.
    concatenations = []
    concatenate = mx.concatenate
    monkeypatch.setattr(
        mx,
        "concatenate",
        lambda arrays, *a, **kw: (
            concatenations.append(len(arrays)) or concatenate(arrays, *a, **kw)
        ),
    )
    for _ in range(TurboQuantKVCache.window_slack):
        ring.update_and_fetch(_rand(rng, (B, H, 1, D)), _rand(rng, (B, H, 1, D)))
        ring.attention(_rand(rng, (B, 2 * H, 1, D)), 0.125, "causal")
    if op_rotation:
        assert len(concatenations) == 2 * TurboQuantKVCache.window_slack // 8
        assert max(concatenations) <= 3
    else:
        assert len(concatenations) == 2
    # nbytes counts the window (its whole buffer where it has one) and the ring.
    ring_bytes = 2 * B * H * (3 + 8) * D * (2 if op_rotation else 4)
    assert ring._ring[0].nbytes + ring._ring[1].nbytes == ring_bytes
    buf = ring._win_buf
    window = buf[:2] if buf is not None and buf[3] is ring._win_k else (ring._win_k, ring._win_v)
    if not op_rotation:
        assert buf[0].shape[2] > ring._win_k.shape[2]
    assert ring.nbytes >= ring.used_nbytes - ring._win_k.nbytes - ring._win_v.nbytes + (
        sum(a.nbytes for a in window) + ring_bytes
    )


@pytest.mark.parametrize("ring_append", [True, False], ids=["ring-append", "write-only"])
@pytest.mark.parametrize("sinks", [0, 3])
def test_ring_written_in_place_matches_slice_updates(monkeypatch, sinks, ring_append):
    # A model-space ring step writes the new token into the ring in place: in the node
    # that also quantizes the leaving token from its slot (RingAppendKV), or, in a
    # build without that node (write-only), in a WriteTokensKV node of its own. Outputs,
    # codes and window must be bit-identical to slice updates' (what a build without
    # the write kernel does), also when several steps are built before anything is
    # evaluated (each write must follow the previous step's attention, which read the
    # slot it overwrites, and the exchange's append must read the slot before its
    # write) and when the ring started from the window alone (no sinks: the ring must
    # not be the window's buffer).
    import turboquant_mlx.ops as tq_ops

    has_write_kernel = tq_ops._has_write_kernel
    if not ring_append:
        monkeypatch.setattr(tq_ops, "has_ring_append", lambda *a: False)

    cfg = dict(
        center=True,
        fp16_sink_tokens=sinks,
        fp16_recent_tokens=8,
        rollback_tokens=4,
        calibration_tokens=16,
        seed=7,
    )
    rng = np.random.default_rng(41 + sinks)
    # (one KV head without sinks: the window's slice is then row-contiguous, which the
    # write would take as it is, were it the ring)
    B, H, D = 1, 1 if sinks == 0 else 2, 64
    in_place, lazy, slices = (TurboQuantKVCache(**cfg) for _ in range(3))
    writes = []  # the `after` of each in-place ring write
    for name in ("write_tokens_kv", "ring_append_kv"):
        monkeypatch.setattr(
            tq_ops,
            name,
            lambda *a, _op=getattr(tq_ops, name), **kw: (
                (tq_ops._has_write_kernel is has_write_kernel and writes.append(kw.get("after")))
                or _op(*a, **kw)
            ),
        )

    def step(c, k, v, q):
        # (the reference cache as a build without the write kernel runs it)
        monkeypatch.setattr(
            tq_ops, "_has_write_kernel", has_write_kernel if c is not slices else lambda *a: False
        )
        c.update_and_fetch(k, v)
        return c.attention(q, 0.125, "causal")

    # (31 tokens: without sinks the first ring is the window as it lies, unrotated)
    k, v = _rand(rng, (B, H, 31, D)), _rand(rng, (B, H, 31, D))
    q = _rand(rng, (B, 2 * H, 31, D))
    for c in (in_place, lazy, slices):
        mx.eval(step(c, k, v, q))
    pending = []  # the lazy cache's outputs, evaluated every 5 steps
    for i in range(40):
        k, v = _rand(rng, (B, H, 1, D)), _rand(rng, (B, H, 1, D))
        q = _rand(rng, (B, 2 * H, 1, D))
        mx.eval(k, v, q)
        want = np.array(step(slices, k, v, q))
        np.testing.assert_array_equal(np.array(step(in_place, k, v, q)), want, err_msg=f"step {i}")
        # the window as stored (its pending tokens not yet written): untouched by the
        # ring's writes
        np.testing.assert_array_equal(
            np.array(in_place._win_k_stored), np.array(slices._win_k_stored), err_msg=f"step {i}"
        )
        pending.append((step(lazy, k, v, q), want))
        if i % 5 == 4:
            mx.eval([o for o, _ in pending])  # (the newest first in the graph's order)
            for j, (o, w) in enumerate(pending):
                np.testing.assert_array_equal(np.array(o), w, err_msg=f"step {i}, {j}")
            pending = []
    assert len(writes) == 2 * 40 - 2  # both in-place caches, every step but the first
    # after the last step's attention, and, once every R steps, the window rebuilt from
    # the ring (keys and values)
    assert {len(a) for a in writes} == {1, 3}
    for c in (in_place, lazy):
        for a, b in zip(c.state, slices.state):
            np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy])
def test_copies_decode_apart_on_their_own_rings(copier):
    # A copy taken while single-token steps run on the ring shares the ring's buffer;
    # each cache then decodes its own tokens as a cache that was never copied does
    # (the ring is written in place, so neither may write the shared one).
    cfg = dict(
        center=True,
        fp16_sink_tokens=3,
        fp16_recent_tokens=8,
        rollback_tokens=4,
        calibration_tokens=16,
        seed=3,
    )
    rng = np.random.default_rng(57)
    B, H, D = 1, 2, 64
    k, v = _rand(rng, (B, H, 30, D)), _rand(rng, (B, H, 30, D))
    q = _rand(rng, (B, 2 * H, 30, D))
    first = [_rand(rng, (B, H, 1, D)) for _ in range(6)] + [_rand(rng, (B, 2 * H, 1, D))]
    caches = [TurboQuantKVCache(**cfg) for _ in range(3)]
    for c in caches:
        c.update_and_fetch(k, v)
        mx.eval(c.attention(q, 0.125, "causal"))
        for i in range(3):  # ring steps
            c.update_and_fetch(first[2 * i], first[2 * i + 1])
            mx.eval(c.attention(first[6], 0.125, "causal"))
    original, never_copied_a, never_copied_b = caches
    assert original._ring is not None
    twin = copier(original)
    for step in range(12):
        outs = []
        for pair in ((original, never_copied_a), (twin, never_copied_b)):
            k, v = _rand(rng, (B, H, 1, D)), _rand(rng, (B, H, 1, D))
            q = _rand(rng, (B, 2 * H, 1, D))
            for c in pair:
                c.update_and_fetch(k, v)
            outs.append([np.array(c.attention(q, 0.125, "causal")) for c in pair])
        for got, want in outs:
            np.testing.assert_array_equal(got, want, err_msg=f"step {step}")


def test_deferred_window_writes_match_immediate_ones(monkeypatch):
    # With model-space tails, a single token's window write is deferred (a ring step
    # reads the ring, not the window) and done on the window's next read, or from the
    # ring once R tokens wait. Whatever reads the window in between (a verify step,
    # trim, state, dequantized_keys_values) must see what immediate writes give.
    cfg = dict(
        center=True,
        fp16_sink_tokens=4,
        fp16_recent_tokens=8,
        rollback_tokens=4,
        calibration_tokens=16,
        seed=9,
    )
    rng = np.random.default_rng(23)
    B, H, D = 1, 2, 64
    deferred, immediate = TurboQuantKVCache(**cfg), TurboQuantKVCache(**cfg)
    monkeypatch.setattr(immediate, "_defer_window_write", lambda *a: False)
    k, v = _rand(rng, (B, H, 30, D)), _rand(rng, (B, H, 30, D))
    q = _rand(rng, (B, 2 * H, 30, D))
    for c in (deferred, immediate):
        c.update_and_fetch(k, v)
        c.attention(q, 0.125, "causal")
    windows = []
    pending_seen = 0
    deferred_from_the_start = []
    for step in range(230):
        # a verify step reads the window; the last 80 steps read nothing but the ring
        L = 3 if step % 37 == 36 and step < 150 else 1
        k, v = _rand(rng, (B, H, L, D)), _rand(rng, (B, H, L, D))
        q = _rand(rng, (B, 2 * H, L, D))
        outs = []
        for c in (deferred, immediate):
            c.update_and_fetch(k, v)
            outs.append(np.array(c.attention(q, 0.125, "causal")))
        pending_seen = max(pending_seen, len(deferred._win_pending))
        if step < 3:
            deferred_from_the_start.append(len(deferred._win_pending))
        np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"step {step}")
        # (the first window's tokens came with the prefill: they leave from the window
        # buffer, and the new tokens' writes are deferred from the first step on; the
        # first step syncs them, as its tail is built from the window)
        if 10 <= step < 20:
            windows.append(deferred._win_k_stored)
        if step % 50 == 20 and step < 150:
            assert [c.trim(2) for c in (deferred, immediate)] == [2, 2]
        if step % 50 == 40 and step < 150:
            ka, va = deferred.dequantized_keys_values(mx.float32)
            kb, vb = immediate.dequantized_keys_values(mx.float32)
            np.testing.assert_array_equal(np.array(ka), np.array(kb))
            np.testing.assert_array_equal(np.array(va), np.array(vb))
    assert deferred_from_the_start == [0, 1, 2]
    # steps 10-19 (no reads of the window): written once, from the ring
    assert len({id(w) for w in windows}) <= 2
    assert pending_seen == cfg["fp16_recent_tokens"] - 1
    # Appends without attention calls (no ring steps): window_slack tokens wait, then
    # one write of those that are still in the window.
    for step in range(TurboQuantKVCache.window_slack + 6):
        k, v = _rand(rng, (B, H, 1, D)), _rand(rng, (B, H, 1, D))
        for c in (deferred, immediate):
            c.update_and_fetch(k, v)
        pending_seen = max(pending_seen, len(deferred._win_pending))
    assert pending_seen == TurboQuantKVCache.window_slack - 1
    for a, b in zip(deferred.state, immediate.state):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    restored = TurboQuantKVCache.from_state(deferred.state)
    q = _rand(rng, (B, 2 * H, 1, D))
    np.testing.assert_array_equal(
        np.array(restored.attention(q, 0.125, "causal")),
        np.array(immediate.attention(q, 0.125, "causal")),
    )


# ---------------------------------------------------------------------------
# speculative decoding: verification blocks and trims

# Every compressed preset: those with an fp16 window (which a verification block's
# later tokens push its earlier queries' tokens out of) and those without (whose levers
# calibrate inside a verification block all the same).
SPECULATIVE_PRESETS = [n for n, p in PRESETS.items() if p.compressed]


def _preset_cache(name, **kw):
    p = PRESETS[name]
    return TurboQuantKVCache(
        p.key_bits,
        p.value_bits,
        seed=5,
        fp16_sink_tokens=p.fp16_sink_tokens,
        fp16_recent_tokens=p.fp16_recent_tokens,
        center=p.center,
        query_aware_keys=p.query_aware_keys,
        **kw,
    )


def _same_contents(a, b, what):
    assert a.offset == b.offset and a.calibrated == b.calibrated, what
    ka, va = a.dequantized_keys_values()
    kb, vb = b.dequantized_keys_values()
    for x, y in ((ka, kb), (va, vb)):
        np.testing.assert_array_equal(np.array(x), np.array(y), err_msg=what)
    assert a._queries.count == b._queries.count, what
    for x, y in zip(a._lever_arrays(), b._lever_arrays()):
        assert (x is None) == (y is None), what
        if x is not None:
            np.testing.assert_array_equal(np.array(x), np.array(y), err_msg=what)


@pytest.mark.parametrize("preset", SPECULATIVE_PRESETS)
def test_verification_and_trim_equal_single_token_steps(preset):
    # Speculative decoding: a block of the next token and 3 drafts is verified, then the
    # rejected drafts (0 to 3) are trimmed. Each query of the block must get what a
    # single-token step at its position gets (it sees the same tokens quantized and the
    # same in fp16), and after the trim the cache must be the one that decoded the
    # accepted tokens one at a time: the same tokens quantized from the same fp16
    # values, and the levers calibrated at the same position from the same tokens and
    # queries (not from drafts). The prompt is short, so that the calibration (at the
    # 32nd non-sink token) falls inside a verification block; a prefill block later
    # brings the window close to full, so that the later blocks push tokens out of it.
    p = PRESETS[preset]
    R = p.fp16_recent_tokens
    rng = np.random.default_rng(8)
    B, H, D = 1, 2, 64
    T = 10 + 40 + (R + 8) + 40
    K, V = _biased(rng, (B, H, T, D)), _biased(rng, (B, H, T, D))
    Q = _queries(rng, (B, 2 * H, T, D))
    spec, plain = _preset_cache(preset), _preset_cache(preset)
    for c in (spec, plain):
        c.update_and_fetch(K[:, :, :10], V[:, :, :10])
        c.attention(Q[:, :, :10], 0.125, "causal")
    pos, rounds = 10, 0
    pattern = [3, 0, 1, 2, 3, 3, 0, 2, 1, 0]  # drafts accepted per round
    tol = 1e-5 * _magnitude(V)

    def verify_until(end):
        nonlocal pos, rounds
        while pos < end:
            accepted = pattern[rounds % len(pattern)]
            rounds += 1
            n = accepted + 1  # tokens kept: the verified token and the accepted drafts
            junk = [_rand(rng, (B, H, 4 - n, D)) for _ in range(2)] + [
                _rand(rng, (B, 2 * H, 4 - n, D))
            ]
            spec.update_and_fetch(
                mx.concatenate([K[:, :, pos : pos + n], junk[0]], axis=2),
                mx.concatenate([V[:, :, pos : pos + n], junk[1]], axis=2),
            )
            got = spec.attention(
                mx.concatenate([Q[:, :, pos : pos + n], junk[2]], axis=2), 0.125, "causal"
            )
            assert spec.trim(4 - n) == 4 - n
            for i in range(n):
                plain.update_and_fetch(
                    K[:, :, pos + i : pos + i + 1], V[:, :, pos + i : pos + i + 1]
                )
                want = plain.attention(Q[:, :, pos + i : pos + i + 1], 0.125, "causal")
                np.testing.assert_allclose(
                    np.array(got[:, :, i : i + 1]),
                    np.array(want),
                    atol=tol,
                    rtol=0,
                    err_msg=f"position {pos + i}",
                )
            pos += n
            _same_contents(spec, plain, f"after the block at {pos - n}, {4 - n} trimmed")

    verify_until(50)
    if p.center:
        assert spec.calibrated  # (in a verification block)
    for c in (spec, plain):
        c.update_and_fetch(K[:, :, pos : pos + R + 8], V[:, :, pos : pos + R + 8])
        c.attention(Q[:, :, pos : pos + R + 8], 0.125, "causal")
    pos += R + 8
    verify_until(T - 4)
    assert spec._n_comp > 0


# ---------------------------------------------------------------------------
# refused updates


def _arrays_in(x):
    """The mx.arrays in an attribute value (nested in tuples, lists, deques)."""
    if isinstance(x, mx.array):
        return [x]
    if isinstance(x, (tuple, list, collections.deque)):
        return [a for y in x for a in _arrays_in(y)]
    return []


def _snapshot(cache):
    """The cache's attributes (the objects themselves), the contents of its lists and
    the values of every array it holds."""
    cache._state_arrays()  # (writes pending window tokens: reading the window does)
    attrs = dict(cache.__dict__)
    seqs = {k: list(v) for k, v in attrs.items() if isinstance(v, (list, collections.deque))}
    values = {k: [np.array(a) for a in _arrays_in(v)] for k, v in attrs.items()}
    return attrs, seqs, values


def _assert_unchanged(cache, snapshot, what):
    attrs, seqs, values = snapshot
    assert cache.__dict__.keys() == attrs.keys(), what
    for k, v in attrs.items():
        assert cache.__dict__[k] is v, f"{what}: {k}"
    for k, v in seqs.items():
        assert len(cache.__dict__[k]) == len(v) and all(
            x is y for x, y in zip(cache.__dict__[k], v)
        ), f"{what}: {k}"
    for k, v in values.items():
        for a, b in zip(_arrays_in(cache.__dict__[k]), v):
            np.testing.assert_array_equal(np.array(a), b, err_msg=f"{what}: {k}")


_REFUSAL_CONFIGS = {
    "plain": dict(),
    "sinks-window": dict(
        fp16_sink_tokens=4, fp16_recent_tokens=8, center=True, calibration_tokens=16
    ),
    "query-aware": dict(
        fp16_sink_tokens=2,
        fp16_recent_tokens=6,
        center=True,
        query_aware_keys=True,
        calibration_tokens=16,
        key_bits=3,
        value_bits=3,
    ),
    "uncalibrated": dict(fp16_recent_tokens=8, center=True, calibration_tokens=100),
}


def _bad_updates(rng, L, D=64):
    """``(kind, keys, values)`` that update_and_fetch must refuse, ``L`` tokens."""

    def tok(*shape):
        return _rand(rng, shape or (1, 2, L, D))

    out = []
    for kind, which, value in (
        ("nan key", 0, np.nan),
        ("nan value", 1, np.nan),
        ("inf key", 0, np.inf),
        ("-inf value", 1, -np.inf),
        ("beyond float16", 0, 1e6),
    ):
        kv = [tok(), tok()]
        x = np.array(kv[which])
        x[0, 1, L - 1, 5] = value
        kv[which] = mx.array(x)
        out.append((kind, *kv))
    out += [
        ("head dim", tok(1, 2, L, 32), tok(1, 2, L, 32)),
        ("kv heads", tok(1, 3, L, D), tok(1, 3, L, D)),
        ("keys and values apart", tok(), tok(1, 2, L + 1, D)),
        ("three dimensions", tok(2, L, D), tok(2, L, D)),
    ]
    return out


@pytest.mark.parametrize("point", ["empty", "prefill", "decode", "verify", "after-trim"])
@pytest.mark.parametrize("config", list(_REFUSAL_CONFIGS))
def test_refused_update_leaves_the_cache_unchanged(config, point):
    # A refused update_and_fetch (non-finite keys or values, tokens beyond the fp16
    # storage's range, wrong shapes) raises and changes nothing: offset, buffers,
    # window, ring, counters. The cache then goes on as one that never saw the call.
    cfg = dict(dict(key_bits=4, value_bits=4, seed=3), **_REFUSAL_CONFIGS[config])
    L = {"empty": 20, "prefill": 20, "decode": 1, "verify": 4, "after-trim": 1}[point]
    steps = dict(
        empty=[],
        prefill=[24],
        decode=[24] + [1] * 12,
        verify=[24, 1, 1, 4],
        **{"after-trim": [24] + [1] * 12},
    )[point]

    def history(seed):
        rng = np.random.default_rng(seed)
        cache = TurboQuantKVCache(**cfg)
        cache.check_finite = "always"  # decode and verify steps on a GPU too
        for n in steps:
            cache.update_and_fetch(_biased(rng, (1, 2, n, 64)), _biased(rng, (1, 2, n, 64)))
            mx.eval(cache.attention(_queries(rng, (1, 4, n, 64)), 0.125, "causal"))
        if point == "after-trim":
            assert cache.trim(5) == 5
        return cache

    rng = np.random.default_rng(99)
    for kind, k, v in _bad_updates(rng, L):
        if point == "empty" and kind in ("head dim", "kv heads"):
            continue  # (an empty cache takes any)
        cache, twin = history(1), history(1)
        snapshot = _snapshot(cache)
        _snapshot(twin)  # (the same reads)
        with pytest.raises(ValueError, match="update_and_fetch|do not match|head dim"):
            cache.update_and_fetch(k, v)
        _assert_unchanged(cache, snapshot, kind)
        for n in (L, 1, 3):
            k, v = _biased(rng, (1, 2, n, 64)), _biased(rng, (1, 2, n, 64))
            q = _queries(rng, (1, 4, n, 64))
            outs = []
            for c in (cache, twin):
                c.update_and_fetch(k, v)
                outs.append(np.array(c.attention(q, 0.125, "causal")))
            np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"{kind}, then {n}")
            assert np.isfinite(outs[0]).all()
        _assert_same_cache(cache, twin)


def test_default_finiteness_check():
    # By default a prompt block is checked: on the CPU before anything changes; on a
    # GPU without waiting for it (a host read per layer and block would stall the
    # prompt), by the next update, which takes the block back out and raises. A decode
    # step is checked on the CPU, whose append kernels would refuse it after the cache
    # counted it, but not on a GPU (a host read per layer would stall pipelined decoding).
    rng = np.random.default_rng(4)
    cache = TurboQuantKVCache(4, 4, seed=1, fp16_recent_tokens=8)
    assert cache.check_finite == "auto"
    cache.update_and_fetch(_rand(rng, (1, 2, 24, 64)), _rand(rng, (1, 2, 24, 64)))
    bad = np.array(_rand(rng, (1, 2, 9, 64)))
    bad[0, 0, 0, 7] = np.nan
    with pytest.raises(ValueError, match="update_and_fetch"):
        cache.update_and_fetch(mx.array(bad), _rand(rng, (1, 2, 9, 64)))
        cache.update_and_fetch(_rand(rng, (1, 2, 1, 64)), _rand(rng, (1, 2, 1, 64)))
    assert cache.offset == 24
    step = (mx.array(bad[:, :, :1]), _rand(rng, (1, 2, 1, 64)))
    if mx.default_device() == mx.cpu:
        with pytest.raises(ValueError, match="update_and_fetch"):
            cache.update_and_fetch(*step)
        assert cache.offset == 24
    else:
        cache.update_and_fetch(*step)
        assert cache.offset == 25  # not read on the host
    cache.check_finite = "sometimes"
    with pytest.raises(ValueError, match="check_finite"):
        cache.update_and_fetch(_rand(rng, (1, 2, 1, 64)), _rand(rng, (1, 2, 1, 64)))


@pytest.mark.parametrize("copier", [copy.copy, copy.deepcopy], ids=["copy", "deepcopy"])
def test_copy_while_a_prompt_check_is_pending(copier):
    # The GPU's way (forced here): a prompt block's finiteness check waits for the next
    # update, holding the cache's dtype. A copy taken meanwhile (mlx-lm's prompt cache
    # deep-copies caches after a prompt) carries the pending check: each cache takes
    # the bad block back out at its own next update.
    rng = np.random.default_rng(6)
    cache = TurboQuantKVCache(key_bits=4, value_bits=4, seed=1, fp16_recent_tokens=16)
    cache._defer_prompt_check = True
    cache.update_and_fetch(_rand(rng, (1, 2, 24, 64)), _rand(rng, (1, 2, 24, 64)))
    bad = np.array(_rand(rng, (1, 2, 12, 64)))
    bad[0, 0, 2, 7] = np.nan
    cache.update_and_fetch(mx.array(bad), _rand(rng, (1, 2, 12, 64)))
    twin = copier(cache)
    for c in (cache, twin):
        with pytest.raises(ValueError, match=r"\[24, 36\).*taken back out"):
            c.update_and_fetch(_rand(rng, (1, 2, 1, 64)), _rand(rng, (1, 2, 1, 64)))
        assert c.offset == 24


@pytest.mark.parametrize("when", ["next block", "decode step", "after trim"])
def test_deferred_prompt_check_takes_the_block_back_out(when):
    # The GPU's way (forced here): a non-finite prompt block is stored unread; the next
    # update reads the check, takes the block back out and raises, and the cache then
    # goes on as one that never saw the block. A trim that drops the block first drops
    # its check too. (The window holds the whole bad block: no append kernel sees it.)
    rng = np.random.default_rng(5)
    cfg = dict(key_bits=4, value_bits=4, seed=1, fp16_recent_tokens=64)
    cache, twin = TurboQuantKVCache(**cfg), TurboQuantKVCache(**cfg)
    cache._defer_prompt_check = True
    first = (_rand(rng, (1, 2, 24, 64)), _rand(rng, (1, 2, 24, 64)))
    for c in (cache, twin):
        c.update_and_fetch(*first)
    bad = np.array(_rand(rng, (1, 2, 12, 64)))
    bad[0, 1, 5, 3] = np.inf
    cache.update_and_fetch(mx.array(bad), _rand(rng, (1, 2, 12, 64)))  # not read yet
    assert cache.offset == 36
    n = {"next block": 10, "decode step": 1, "after trim": 1}[when]
    nxt = (_rand(rng, (1, 2, n, 64)), _rand(rng, (1, 2, n, 64)))
    if when == "after trim":
        assert cache.trim(12) == 12
        cache.update_and_fetch(*nxt)
    else:
        with pytest.raises(ValueError, match=r"update_and_fetch.*\[24, 36\).*taken back out"):
            cache.update_and_fetch(*nxt)
        assert cache.offset == 24
        cache.update_and_fetch(*nxt)
    twin.update_and_fetch(*nxt)
    q = _queries(rng, (1, 4, n, 64))
    np.testing.assert_array_equal(
        np.array(cache.attention(q, 0.125, "causal")), np.array(twin.attention(q, 0.125, "causal"))
    )


@pytest.mark.parametrize("preset", ["tq4", "k4v3", "tq3", "tq4-plain"])
def test_never_allocates_more_than_fp16_once_decoding(preset):
    # From the first decode step on, a compressed cache holds fewer bytes than mlx-lm's
    # fp16 cache of the same tokens, whatever the prompt's length (allocations grow
    # with the tokens held). Before the fix, the fp16 copy of a prompt block that
    # calibrated the levers stayed for rollback_tokens decode steps: tq4 held 1.28x
    # fp16's bytes after a 4000-token prompt.
    p = get_preset(preset)
    rng = np.random.default_rng(0)
    for n in (5, 40, 100, 300, 1000, 4000):
        fp16 = KVCache()
        cache = TurboQuantKVCache(
            p.key_bits,
            p.value_bits,
            fp16_sink_tokens=p.fp16_sink_tokens,
            fp16_recent_tokens=p.fp16_recent_tokens,
            center=p.center,
        )
        k = mx.array(rng.standard_normal((1, 3, n, 64)), mx.float16)
        for c in (fp16, cache):
            c.update_and_fetch(k, k)
        cache.attention(mx.array(rng.standard_normal((1, 9, n, 64)), mx.float16), 0.125, "causal")
        for _ in range(3):
            x = mx.array(rng.standard_normal((1, 3, 1, 64)), mx.float16)
            for c in (fp16, cache):
                c.update_and_fetch(x, x)
            cache.attention(mx.array(rng.standard_normal((1, 9, 1, 64)), mx.float16), 0.125)
            mx.eval(cache.state, fp16.state)
            assert cache.nbytes < fp16.nbytes, (preset, n, cache.nbytes, fp16.nbytes)
