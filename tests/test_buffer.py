# Copyright © 2026 turboquant_mlx contributors.

"""The codec and the compressed buffer the caches are made of, against the NumPy
reference codec."""

import mlx.core as mx
import numpy as np
import pytest
from helpers import assert_codes_and_scales, centroids_np, random_tokens

from turboquant_mlx import reference
from turboquant_mlx.buffer import CompressedKV
from turboquant_mlx.codec import Codec


def test_codec_pads_and_refuses_with_the_head_dim_named():
    codec = Codec(80, 4, 3, seed=5)
    assert (codec.model_dim, codec.head_dim, codec.padded) == (80, 96, True)
    assert codec.rotation.head_dim == 96
    assert np.allclose(np.array(codec.key_centroids), centroids_np(96, 4))
    assert np.allclose(np.array(codec.value_centroids), centroids_np(96, 3))
    # Codes are packed into 32-bit words: 96 coordinates of 4 and 3 bits.
    assert (codec.key_words, codec.value_words) == (12, 9)
    assert codec.token_bytes() == 4 * (12 + 9) + 4
    assert not Codec(128, 4, 4, seed=0).padded
    with pytest.raises(ValueError, match="head dim 81"):
        Codec(81, 4, 4, seed=0)
    with pytest.raises(ValueError, match="head dim 512"):
        Codec(512, 4, 4, seed=0)


@pytest.mark.parametrize("private", [True, False], ids=["in-place", "copying"])
@pytest.mark.parametrize("key_bits,value_bits", [(4, 4), (4, 3), (2, 3)])
def test_written_codes_match_the_reference(private, key_bits, value_bits):
    rng = np.random.default_rng(key_bits * 10 + value_bits)
    B, H, D = 2, 3, 64
    codec = Codec(D, key_bits, value_bits, seed=1)
    buf = CompressedKV(codec)
    buf.grow(16, 0, B, H)
    assert buf.capacity == 16 and buf.private
    k1, v1 = random_tokens(rng, (B, H, 5, D)), random_tokens(rng, (B, H, 5, D))
    k2, v2 = random_tokens(rng, (B, H, 3, D)), random_tokens(rng, (B, H, 3, D))
    buf.write(mx.array(k1), mx.array(v1), 0)
    buf.private = private  # the second write through the in-place or the copying ops
    buf.write(mx.array(k2), mx.array(v2), 5)
    assert buf.private
    k, v = np.concatenate([k1, k2], axis=2), np.concatenate([v1, v2], axis=2)
    kc, ks, vc, vs = (np.array(a) for a in buf.arrays)
    assert_codes_and_scales(kc[:, :, :8], ks[:, :, :8], k, key_bits)
    assert_codes_and_scales(vc[:, :, :8], vs[:, :, :8], v, value_bits)
    assert not kc[:, :, 8:].any() and not ks[:, :, 8:].any()  # slots not written
    # Read back: the reference's dequantization of what was stored.
    dk, dv = buf.decoded(2, 6)
    want_k = reference.dequantize(
        reference.unpack(kc[:, :, 2:8], key_bits, D), ks[:, :, 2:8], centroids_np(D, key_bits)
    )
    want_v = reference.dequantize(
        reference.unpack(vc[:, :, 2:8], value_bits, D), vs[:, :, 2:8], centroids_np(D, value_bits)
    )
    np.testing.assert_allclose(np.array(dk), want_k, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.array(dv), want_v, rtol=1e-6, atol=1e-7)
    assert buf.used_nbytes(8) == B * H * 8 * codec.token_bytes()
    assert buf.nbytes == B * H * 16 * codec.token_bytes()


def test_growth_keeps_the_slots_asked_for():
    rng = np.random.default_rng(3)
    codec = Codec(32, 3, 3, seed=2)
    buf = CompressedKV(codec)
    buf.grow(4, 0, 1, 2)
    k = random_tokens(rng, (1, 2, 4, 32))
    buf.write(mx.array(k), mx.array(k), 0)
    before = [np.array(a) for a in buf.arrays]
    buf.private = False
    buf.grow(12, 3, 1, 2)  # keeps slots [0, 3), zeros after
    assert buf.capacity == 12 and buf.private
    for old, new in zip(before, buf.arrays):
        new = np.array(new)
        np.testing.assert_array_equal(new[:, :, :3], old[:, :, :3])
        assert not new[:, :, 3:].any()


def test_write_rows_keeps_each_rows_own_codes():
    rng = np.random.default_rng(4)
    B, H, D = 3, 2, 32
    codec = Codec(D, 4, 2, seed=0)
    buf = CompressedKV(codec)
    buf.grow(8, 0, B, H)
    old_k, old_v = random_tokens(rng, (B, H, 8, D)), random_tokens(rng, (B, H, 8, D))
    buf.write(mx.array(old_k), mx.array(old_v), 0)
    kept = [np.array(a) for a in buf.arrays]
    new_k, new_v = random_tokens(rng, (B, H, 4, D)), random_tokens(rng, (B, H, 4, D))
    # Columns [2, 6); row 0 takes [2, 6), row 1 [4, 6), row 2 none.
    buf.write_rows(
        mx.array(new_k),
        mx.array(new_v),
        2,
        [2, 4, 6],
        [6, 6, 6],
        key_signs=None,
        value_signs=None,
        means=(None, None),
    )
    got = [np.array(a) for a in buf.arrays]
    fresh = CompressedKV(codec)
    fresh.grow(4, 0, B, H)
    fresh.write(mx.array(new_k), mx.array(new_v), 0)
    new = [np.array(a) for a in fresh.arrays]
    for g, old, n in zip(got, kept, new):
        np.testing.assert_array_equal(g[0, :, 2:6], n[0])
        np.testing.assert_array_equal(g[1, :, 4:6], n[1, :, 2:4])
        np.testing.assert_array_equal(g[1, :, :4], old[1, :, :4])
        np.testing.assert_array_equal(g[2], old[2])
        np.testing.assert_array_equal(g[0, :, :2], old[0, :, :2])


def _pair_mean_np(e, pairing, rope_dims):
    d = min(rope_dims or e.shape[-1], e.shape[-1])
    out = e.copy()
    h = d // 2
    if pairing == "half":
        m = (e[..., :h] + e[..., h : 2 * h]) / 2
        out[..., :h] = m
        out[..., h : 2 * h] = m
    elif pairing == "interleaved":
        m = (e[..., 0 : 2 * h : 2] + e[..., 1 : 2 * h : 2]) / 2
        out[..., 0 : 2 * h : 2] = m
        out[..., 1 : 2 * h : 2] = m
    return out


@pytest.mark.parametrize("pairing,rope_dims", [("half", 0), ("interleaved", 0), ("half", 48)])
def test_key_scale_matches_its_formula(pairing, rope_dims):
    from turboquant_mlx.levers import key_scale_from

    rng = np.random.default_rng(7)
    q = rng.uniform(0.01, 4.0, (1, 2, 64)).astype(np.float32)
    k = rng.uniform(0.01, 4.0, (1, 2, 64)).astype(np.float32)
    q[0, 0, 5] = 1e6  # a channel whose ratio the limit clamps
    got = key_scale_from(
        mx.array(q), mx.array(k), model_dim=64, pairing=pairing, rope_dims=rope_dims, limit=8.0
    )
    sq, sk = (_pair_mean_np(x.astype(np.float64), pairing, rope_dims) for x in (q, k))
    sq = sq + 1e-3 * sq.mean(-1, keepdims=True)
    sk = sk + 1e-3 * sk.mean(-1, keepdims=True)
    r = np.sqrt(sq / sk)
    want = np.sqrt(np.clip(r / r.mean(-1, keepdims=True), 1 / 64, 64))[:, :, None, :]
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5)
    assert np.array(got).max() <= 8.0 + 1e-5


def test_query_energies_trim_takes_later_queries_back_out():
    from turboquant_mlx.levers import QueryEnergies

    rng = np.random.default_rng(8)
    qs = [mx.array(rng.standard_normal((1, 4, n, 32)).astype(np.float32)) for n in (6, 1, 1, 3)]
    e = QueryEnergies()
    positions = [0, 6, 7, 8]
    for q, p in zip(qs, positions):
        e.observe(q, p, first=2, kv_heads=2, keep=16)
    # Positions 0 and 1 are sinks: 4 of the first block's queries count, 2 per KV head.
    assert e.count == 2 * (4 + 1 + 1 + 3)
    want = sum(
        (np.array(q)[:, :, max(0, 2 - p) :] ** 2).reshape(1, 2, -1, 32).sum(2)
        for q, p in zip(qs, positions)
    )
    np.testing.assert_allclose(np.array(e.energy), want, rtol=1e-5)
    e.trim(7)  # the steps at 7 and 8 go
    assert e.count == 2 * (4 + 1)
    want = sum(
        (np.array(q)[:, :, max(0, 2 - p) :] ** 2).reshape(1, 2, -1, 32).sum(2)
        for q, p in zip(qs[:2], positions[:2])
    )
    np.testing.assert_allclose(np.array(e.energy), want, rtol=1e-5)
