# Copyright © 2026 turboquant_mlx contributors.

"""Tests of the NumPy reference codec, of Rotation and of reference attention."""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

from turboquant_mlx import codebook, reference
from turboquant_mlx.rotation import Rotation

HEAD_DIMS = (64, 96, 128, 256)
BITS = (2, 3, 4)
ROTATION_DIMS = (64, 96, 128, 256, 80, 160)


# ---------------------------------------------------------------------------
# pack / unpack


def pack_with_big_integer(codes, bits):
    """Packs one vector through a Python integer holding the whole bit stream."""
    stream = 0
    for i, code in enumerate(codes):
        stream |= int(code) << (i * bits)
    num_words = len(codes) * bits // 32
    return np.array([(stream >> (32 * w)) & 0xFFFFFFFF for w in range(num_words)], dtype=np.uint32)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_pack_unpack_round_trip(head_dim, bits):
    levels = 1 << bits
    rng = np.random.default_rng(head_dim + bits)
    random_codes = rng.integers(0, levels, (3, 5, head_dim)).astype(np.uint8)
    # Every coordinate takes every value: row v holds (v + i) mod levels.
    shifts = (np.arange(levels)[:, None] + np.arange(head_dim)[None, :]) % levels
    constant = np.repeat(np.arange(levels)[:, None], head_dim, axis=1)
    for codes in (random_codes, shifts.astype(np.uint8), constant.astype(np.uint8)):
        words = reference.pack(codes, bits)
        assert words.dtype == np.uint32
        assert words.shape == codes.shape[:-1] + (head_dim * bits // 32,)
        unpacked = reference.unpack(words, bits, head_dim)
        assert unpacked.dtype == np.uint8
        np.testing.assert_array_equal(unpacked, codes)
        flat_codes = codes.reshape(-1, head_dim)
        flat_words = words.reshape(-1, words.shape[-1])
        for vector_codes, vector_words in zip(flat_codes, flat_words):
            np.testing.assert_array_equal(vector_words, pack_with_big_integer(vector_codes, bits))


def test_pack_layout_examples():
    # 4-bit: nibble i of word 0 is code i, least significant first.
    codes = np.arange(64, dtype=np.uint8) % 16
    words = reference.pack(codes, 4)
    assert words[0] == 0x76543210 and words[1] == 0xFEDCBA98

    # 3-bit: exactly D * 3 / 32 words; code 10 takes bits 30, 31 of word 0 and
    # bit 0 of word 1.
    codes = np.zeros(128, dtype=np.uint8)
    codes[10] = 0b101
    words = reference.pack(codes, 3)
    assert words.shape == (12,)
    assert words[0] == 1 << 30 and words[1] == 1 and not words[2:].any()
    codes[10] = 0b011
    words = reference.pack(codes, 3)
    assert words[0] == 3 << 30 and words[1] == 0

    # 2-bit: code 16 starts word 1.
    codes = np.zeros(64, dtype=np.uint8)
    codes[16] = 2
    np.testing.assert_array_equal(reference.pack(codes, 2), [0, 2, 0, 0])


def test_pack_errors():
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.reference\].*48"):
        reference.pack(np.zeros(48, np.uint8), 3)
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.reference\].*8"):
        reference.pack(np.full(64, 8, np.uint8), 3)
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.reference\].*5"):
        reference.pack(np.zeros(64, np.uint8), 5)
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.reference\]"):
        reference.unpack(np.zeros(7, np.uint32), 3, 64)


# ---------------------------------------------------------------------------
# quantize / dequantize


def quantize_one_naively(y, c, bits):
    """Scalar float32 transcription of the quantizer of ARCHITECTURE.md."""
    t = [(c[k] + c[k + 1]) * np.float32(0.5) for k in range(len(c) - 1)]
    norm = np.float32(0)
    for value in y:
        norm = np.float32(norm + value * value)
    norm = np.sqrt(norm)
    inv = np.float32(1) / norm if norm > 0 else np.float32(0)
    codes = []
    for value in y:
        u = np.float32(value * inv)
        codes.append(sum(1 for boundary in t if u > boundary))
    cn = np.float32(0)
    for code in codes:
        cn = np.float32(cn + c[code] * c[code])
    cn = np.sqrt(cn)
    scale = np.float32(norm / cn) if cn > 0 else np.float32(0)
    return np.array(codes, np.uint8), np.float16(scale)


@pytest.mark.parametrize("bits", BITS)
def test_quantize_matches_naive_transcription(bits):
    head_dim = 64
    c = np.array(codebook.centroids(head_dim, bits))
    rng = np.random.default_rng(bits)
    y = (3.0 * rng.standard_normal((16, head_dim))).astype(np.float32)
    codes, scales = reference.quantize(y, c, bits)
    assert codes.dtype == np.uint8 and codes.shape == y.shape
    assert scales.dtype == np.float16 and scales.shape == (16,)
    for row, row_codes, row_scale in zip(y, codes, scales):
        expected_codes, expected_scale = quantize_one_naively(row, c, bits)
        np.testing.assert_array_equal(row_codes, expected_codes)
        # Summation order may move the float32 norm by an ulp, hence 1 float16 ulp.
        assert abs(float(row_scale) - float(expected_scale)) <= float(np.spacing(expected_scale))


@pytest.mark.parametrize("bits", BITS)
def test_quantize_picks_nearest_centroid_and_ties_go_low(bits):
    head_dim = 128
    levels = 1 << bits
    c = np.array(codebook.centroids(head_dim, bits))
    rng = np.random.default_rng(10 + bits)
    y = rng.standard_normal((64, head_dim)).astype(np.float32)
    codes, _ = reference.quantize(y, c, bits)
    u = y / np.linalg.norm(y, axis=-1, keepdims=True)
    distance = np.abs(u[..., None] - c)
    chosen = np.take_along_axis(distance, codes[..., None].astype(np.intp), -1)[..., 0]
    assert np.all(chosen <= distance.min(axis=-1) + 1e-7)

    # A unit basis vector: its zeros sit exactly on the middle boundary 0.
    e0 = np.zeros(head_dim, np.float32)
    e0[0] = 1.0
    codes, scales = reference.quantize(e0, c, bits)
    assert codes[0] == levels - 1
    assert np.all(codes[1:] == levels // 2 - 1)

    # The zero vector gets scale 0 and dequantizes to zeros.
    codes, scales = reference.quantize(np.zeros((2, head_dim), np.float32), c, bits)
    assert np.all(scales == 0)
    assert not reference.dequantize(codes, scales, c).any()


def quantization_errors(head_dim, bits, count=2000):
    """Quantizes Gaussian vectors through Rotation and returns per-vector errors."""
    rotation = Rotation(head_dim, seed=head_dim * 10 + bits)
    c = np.array(codebook.centroids(head_dim, bits))
    rng = np.random.default_rng(head_dim * 100 + bits)
    # Varied norms, as real keys have.
    x = rng.standard_normal((count, head_dim)) * rng.uniform(0.1, 30.0, (count, 1))
    x = x.astype(np.float32)
    y = np.array(rotation.forward(mx.array(x)))
    codes, scales = reference.quantize(y, c, bits)
    y_hat = reference.dequantize(codes, scales, c)
    x_hat = np.array(rotation.inverse(mx.array(y_hat)))
    squared_norm = np.sum(x.astype(np.float64) ** 2, axis=-1)
    error = np.sum((x.astype(np.float64) - x_hat) ** 2, axis=-1)
    return error / squared_norm, y, y_hat


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_mse_matches_lloyd_max_distortion(head_dim, bits):
    relative_error, _, _ = quantization_errors(head_dim, bits)
    mse_per_coordinate = np.mean(relative_error) / head_dim
    ratio = mse_per_coordinate / codebook.lloyd_max_distortion(head_dim, bits)
    assert 0.9 < ratio < 1.1, f"MSE / distortion = {ratio:.4f}"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_scale_preserves_norm(head_dim, bits):
    _, y, y_hat = quantization_errors(head_dim, bits, count=500)
    norm = np.linalg.norm(y.astype(np.float64), axis=-1)
    norm_hat = np.linalg.norm(y_hat.astype(np.float64), axis=-1)
    # float16 rounds to a relative half-ulp of 2^-11; allow float32 noise on top.
    np.testing.assert_allclose(norm_hat, norm, rtol=2.0**-11 + 1e-6)


# ---------------------------------------------------------------------------
# Rotation


@pytest.mark.parametrize("head_dim", ROTATION_DIMS)
def test_rotation_is_orthogonal(head_dim):
    rotation = Rotation(head_dim, seed=3)
    assert rotation.head_dim == head_dim and rotation.seed == 3
    assert rotation.uses_hadamard == (head_dim in (64, 96, 128, 256))

    r = rotation.matrix()
    assert r.dtype == np.float64 and r.shape == (head_dim, head_dim)
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-12)

    rng = np.random.default_rng(head_dim)
    x = rng.standard_normal((4, 7, head_dim)).astype(np.float32)
    y = rotation.forward(mx.array(x))
    assert y.dtype == mx.float32 and y.shape == x.shape
    y = np.array(y)
    np.testing.assert_allclose(y, x.astype(np.float64) @ r.T, atol=1e-5)
    np.testing.assert_allclose(y, reference.rotate(x, r), atol=1e-5)
    np.testing.assert_allclose(np.array(rotation.inverse(mx.array(y))), x, atol=1e-5)
    np.testing.assert_allclose(
        np.array(rotation.inverse(mx.array(x))), reference.unrotate(x, r), atol=1e-5
    )
    np.testing.assert_allclose(
        np.array(rotation.forward(rotation.inverse(mx.array(x)))), x, atol=1e-5
    )


@pytest.mark.parametrize("head_dim", [64, 96, 128, 256])
def test_hadamard_matrix_is_symmetric(head_dim):
    """The inverse transform relies on H = H^T for the sizes that use it."""
    h = np.array(mx.hadamard_transform(mx.eye(head_dim), scale=1.0))
    np.testing.assert_array_equal(h, h.T)
    np.testing.assert_array_equal(np.abs(h), 1.0)
    r = Rotation(head_dim, seed=0).matrix()
    np.testing.assert_allclose(np.abs(r), 1.0 / math.sqrt(head_dim), rtol=1e-15)


@pytest.mark.parametrize("head_dim", ROTATION_DIMS)
def test_rotation_depends_only_on_seed(head_dim):
    x = mx.array(np.random.default_rng(0).standard_normal((3, head_dim)), mx.float32)
    a, b, other = Rotation(head_dim, 11), Rotation(head_dim, 11), Rotation(head_dim, 12)
    np.testing.assert_array_equal(a.matrix(), b.matrix())
    np.testing.assert_array_equal(np.array(a.forward(x)), np.array(b.forward(x)))
    assert np.abs(a.matrix() - other.matrix()).max() > 0.01
    assert np.abs(np.array(a.forward(x)) - np.array(other.forward(x))).max() > 0.01


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_rotation_accepts_half_inputs(dtype):
    rotation = Rotation(128, seed=1)
    x = mx.random.normal((2, 128), key=mx.random.key(0)).astype(dtype)
    y = rotation.forward(x)
    assert y.dtype == mx.float32
    np.testing.assert_allclose(
        np.array(y), np.array(x.astype(mx.float32)) @ rotation.matrix().T, atol=1e-5
    )


def test_rotation_errors():
    for head_dim in (0, -64, 2.5):
        with pytest.raises(ValueError, match=rf"^\[turboquant_mlx\.rotation\].*{head_dim}"):
            Rotation(head_dim, seed=0)
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.rotation\].*-1"):
        Rotation(64, seed=-1)
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.rotation\].*\(2, 32\)"):
        Rotation(64, seed=0).forward(mx.zeros((2, 32)))


# ---------------------------------------------------------------------------
# attention


def naive_attention(q, k, v, scale, kv_len, causal, mask=None):
    """Row-by-row softmax attention written straight from its definition."""
    batch, num_q_heads, q_len, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    if mask is not None:
        mask = np.broadcast_to(mask, (batch, num_q_heads, q_len, kv_len))
    out = np.zeros((batch, num_q_heads, q_len, head_dim))
    lse = np.full((batch, num_q_heads, q_len), -np.inf)
    for b, h, i in itertools.product(range(batch), range(num_q_heads), range(q_len)):
        scores, values = [], []
        for j in range(kv_len):
            if causal and j > kv_len - q_len + i:
                continue
            score = scale * float(np.dot(q[b, h, i], k[b, h // group, j]))
            if mask is not None:
                if mask.dtype == np.bool_:
                    if not mask[b, h, i, j]:
                        continue
                else:
                    score += float(mask[b, h, i, j])
            if score == -np.inf:
                continue
            scores.append(score)
            values.append(v[b, h // group, j])
        if scores:
            weights = np.exp(scores)
            out[b, h, i] = weights @ np.array(values) / weights.sum()
            lse[b, h, i] = math.log(weights.sum())
    return out, lse


def random_qkv(rng, batch, num_q_heads, num_kv_heads, q_len, capacity, head_dim=16):
    q = rng.standard_normal((batch, num_q_heads, q_len, head_dim))
    k = rng.standard_normal((batch, num_kv_heads, capacity, head_dim))
    v = rng.standard_normal((batch, num_kv_heads, capacity, head_dim))
    return q, k, v


def check_attention(q, k, v, kv_len, causal, mask=None):
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = reference.attention(q, k, v, scale, kv_len, causal, mask)
    expected_out, expected_lse = naive_attention(q, k, v, scale, kv_len, causal, mask)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    np.testing.assert_allclose(out, expected_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected_lse))
    finite = np.isfinite(expected_lse)
    np.testing.assert_allclose(lse[finite], expected_lse[finite], rtol=1e-12)
    return out, lse


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_gqa_and_causal(num_q_heads, num_kv_heads, q_len, causal):
    rng = np.random.default_rng(num_q_heads * 7 + q_len)
    q, k, v = random_qkv(rng, 2, num_q_heads, num_kv_heads, q_len, capacity=20)
    check_attention(q, k, v, kv_len=13, causal=causal)


def test_attention_reads_the_right_kv_head():
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 4, 2, 1, capacity=6)
    out, _ = reference.attention(q, k, v, 0.0, 6, False)
    # Zero scale: uniform weights, so out is the mean of the KV head's values.
    np.testing.assert_allclose(out[0, 1, 0], v[0, 0].mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(out[0, 2, 0], v[0, 1].mean(axis=0), rtol=1e-12)


def test_attention_causal_with_short_cache():
    # kv_len < L: the first queries see no key at all.
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 1, 2, 1, q_len=4, capacity=8)
    out, lse = check_attention(q, k, v, kv_len=2, causal=True)
    assert np.all(np.isneginf(lse[:, :, :2])) and not out[:, :, :2].any()
    assert np.all(np.isfinite(lse[:, :, 2:]))


def test_attention_bool_mask():
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 2, 4, 2, q_len=3, capacity=12)
    mask = rng.uniform(size=(2, 1, 3, 10)) < 0.6
    mask[1, 0, 2] = False  # a fully masked row
    out, lse = check_attention(q, k, v, kv_len=10, causal=False, mask=mask)
    assert np.all(np.isneginf(lse[1, :, 2])) and not out[1, :, 2].any()
    check_attention(q, k, v, kv_len=10, causal=True, mask=mask)


def test_attention_additive_mask():
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, 1, 4, 2, q_len=3, capacity=9)
    mask = rng.uniform(-3.0, 3.0, size=(3, 9))
    mask[0, ::2] = -np.inf
    mask[1, :] = -np.inf  # a fully masked row
    out, lse = check_attention(q, k, v, kv_len=9, causal=False, mask=mask)
    assert np.all(np.isneginf(lse[:, :, 1])) and not out[:, :, 1].any()
    check_attention(q, k, v, kv_len=9, causal=True, mask=mask.astype(np.float32))


def test_attention_empty_cache():
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, 1, 2, 2, q_len=1, capacity=4)
    out, lse = check_attention(q, k, v, kv_len=0, causal=False)
    assert np.all(np.isneginf(lse)) and not out.any()


def test_attention_in_rotated_space_matches_original():
    """q.k is invariant under the rotation, so out is R times the original out."""
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, 1, 4, 2, q_len=2, capacity=7, head_dim=64)
    r = Rotation(64, seed=4).matrix()
    rotated = [reference.rotate(a, r) for a in (q, k, v)]
    out_rot, lse_rot = reference.attention(*rotated, 0.125, 7, True)
    out, lse = reference.attention(q, k, v, 0.125, 7, True)
    np.testing.assert_allclose(reference.unrotate(out_rot, r), out, atol=1e-12)
    np.testing.assert_allclose(lse_rot, lse, rtol=1e-12)


def test_attention_errors():
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 1, 3, 2, q_len=1, capacity=4)
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.reference\].*3"):
        reference.attention(q, k, v, 1.0, 4, False)
    q, k, v = random_qkv(rng, 1, 4, 2, q_len=1, capacity=4)
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.reference\].*5"):
        reference.attention(q, k, v, 1.0, 5, False)
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.reference\]"):
        reference.attention(q, k, v, 1.0, 4, False, mask=np.ones((3, 4), bool))


# ---------------------------------------------------------------------------
# sizes


def test_bytes_per_token():
    assert reference.bytes_per_token(128, 4, 4) == 2 * (64 + 2)
    assert reference.bytes_per_token(128, 3, 3) == 2 * (48 + 2)
    assert reference.bytes_per_token(64, 3, 4) == (24 + 2) + (32 + 2)
    assert reference.bytes_per_token(256, 2, 2) == 2 * (64 + 2)
    # Matches the packed storage actually produced.
    words = reference.pack(np.zeros(96, np.uint8), 3)
    assert words.nbytes + 2 == reference.bytes_per_token(96, 3, 3) // 2
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.reference\].*1"):
        reference.bytes_per_token(128, 1, 4)
