# Copyright © 2026 turboquant_mlx contributors.

"""quantize_append and compressed_attention with ``rotation_signs``: model-space
inputs that the kernels rotate themselves (and an output they rotate back), against
the NumPy reference applied to inputs rotated in float64 with ``Rotation.matrix()``.

Runs on MLX's default device (``pytest --device gpu`` for the GPU kernels;
tests/test_gpu.py also compares the GPU against the CPU backend).
"""

import copy
import math
import pickle

import mlx.core as mx
import numpy as np
import pytest

from helpers import (
    assert_op_error,
    attention_rtol,
    centroids_np,
    poisoned_cache,
    random_tokens,
    reference_cache,
    to_np,
)
from turboquant_mlx import fallback, ops, reference
from turboquant_mlx.rotation import Rotation

# |u - t| below which a code may legitimately differ from the float64 reference: the
# float32 rotation (log2(D) rounded butterflies) and norm move u = y / ||y|| by a few
# 2^-24 at most.
ROTATED_U_ATOL = 4e-6


def assert_quantized_rotation(words, scales, x, rotation, bits):
    """Codes and scales of model-space tokens ``x`` quantized after ``R``."""
    D = x.shape[-1]
    c = centroids_np(D, bits)
    y = (np.asarray(x, np.float64) @ rotation.matrix().T).astype(np.float32)
    want_codes, want_scales = reference.quantize(y, c, bits)
    got_codes = reference.unpack(np.asarray(words), bits, D)
    y64 = y.astype(np.float64)
    norm = np.sqrt(np.sum(y64 * y64, axis=-1, keepdims=True))
    u = np.divide(y64, norm, out=np.zeros_like(y64), where=norm > 0)
    t = ((c[:-1] + c[1:]) * 0.5).astype(np.float64)
    # (a zero vector stays exactly zero: never ambiguous)
    ambiguous = np.any(np.abs(u[..., None] - t) < ROTATED_U_ATOL, axis=-1) & (norm > 0)
    assert ambiguous.sum() <= max(2, 1e-3 * ambiguous.size)
    mismatch = (got_codes != want_codes) & ~ambiguous
    assert not mismatch.any(), f"{mismatch.sum()} codes differ from the reference"
    keep = ~ambiguous.any(axis=-1)
    got_s = np.asarray(scales, np.float32)[keep]
    want_s = want_scales.astype(np.float32)[keep]
    np.testing.assert_allclose(got_s, want_s, rtol=2e-3, atol=0)


@pytest.mark.parametrize("x_dtype", (mx.float32, mx.float16))
@pytest.mark.parametrize("bits", (2, 3, 4))
@pytest.mark.parametrize("head_dim", (32, 64, 128, 256))
def test_quantize_append_rotates_model_space_tokens(head_dim, bits, x_dtype):
    rng = np.random.default_rng(7 * head_dim + bits)
    batch, heads, length, capacity, offset = 1, 3, 9, 16, 4
    rotation = Rotation(head_dim, seed=head_dim + bits)
    words, scales = poisoned_cache(rng, batch, heads, capacity, head_dim, bits)
    x = mx.array(random_tokens(rng, (batch, heads, length, head_dim))).astype(x_dtype)
    codes, out_scales = ops.quantize_append(
        mx.array(words),
        mx.array(scales),
        x,
        mx.array(centroids_np(head_dim, bits)),
        offset,
        bits,
        rotation_signs=rotation.kernel_signs,
    )
    got_words, got_scales = np.array(codes), np.array(out_scales)
    written = slice(offset, offset + length)
    assert_quantized_rotation(
        got_words[:, :, written], got_scales[:, :, written], to_np(x), rotation, bits
    )
    # the other slots are untouched
    np.testing.assert_array_equal(got_words[:, :, :offset], words[:, :, :offset])
    np.testing.assert_array_equal(
        got_words[:, :, offset + length :], words[:, :, offset + length :]
    )


def run_model_space_attention(
    rng,
    *,
    head_dim,
    q_dtype,
    kv_len,
    q_len=1,
    group=4,
    kv_heads=2,
    tail=0,
    rotate_output=True,
    key_bits=4,
    value_bits=4,
    centered=False,
    stream=None,
):
    """compressed_attention on model-space queries and a model-space tail (in the
    queries' dtype), and the float64 reference over the compressed tokens rotated back
    to model space (keys always, values when ``rotate_output``), the means added back
    when ``centered``, and the tail."""
    rotation = Rotation(head_dim, seed=3 * head_dim + kv_len)
    R = rotation.matrix()
    capacity = kv_len + 5
    k_words, k_scales, k_hat = reference_cache(
        rng, 1, kv_heads, capacity, kv_len, head_dim, key_bits
    )
    v_words, v_scales, v_hat = reference_cache(
        rng, 1, kv_heads, capacity, kv_len, head_dim, value_bits
    )
    q = mx.array(2.0 * rng.standard_normal((1, kv_heads * group, q_len, head_dim))).astype(q_dtype)
    tail_k = tail_v = None
    if tail:
        tail_k = mx.array(2.0 * rng.standard_normal((1, kv_heads, tail, head_dim))).astype(q_dtype)
        tail_v = mx.array(rng.standard_normal((1, kv_heads, tail, head_dim))).astype(q_dtype)
    mu_k = mu_v = None
    if centered:
        mu_k = rng.standard_normal((1, kv_heads, 1, head_dim)).astype(np.float32)
        mu_v = (0.5 * rng.standard_normal((1, kv_heads, 1, head_dim))).astype(np.float32)
    scale = 1.0 / math.sqrt(head_dim)
    out, lse = ops.compressed_attention(
        q,
        mx.array(k_words),
        mx.array(k_scales),
        mx.array(v_words),
        mx.array(v_scales),
        mx.array(centroids_np(head_dim, key_bits)),
        mx.array(centroids_np(head_dim, value_bits)),
        kv_len,
        scale,
        key_bits,
        value_bits,
        True,
        None,
        tail_k=tail_k,
        tail_v=tail_v,
        rotation_signs=rotation.kernel_signs,
        rotate_output=rotate_output,
        key_mean=None if mu_k is None else mx.array(mu_k),
        value_mean=None if mu_v is None else mx.array(mu_v),
        stream=stream,
    )
    k_model = k_hat.astype(np.float64) @ R
    v_model = v_hat.astype(np.float64) @ R if rotate_output else v_hat.astype(np.float64)
    if centered:
        k_model = k_model + mu_k
        v_model = v_model + mu_v
    tk = None if tail_k is None else to_np(tail_k).astype(np.float64)
    tv = None if tail_v is None else to_np(tail_v).astype(np.float64)
    ref_out, ref_lse = reference.attention(
        to_np(q).astype(np.float64), k_model, v_model, scale, kv_len, True, None, tk, tv
    )
    v_all = (
        v_model[:, :, :kv_len]
        if tv is None
        else np.concatenate([v_model[:, :, :kv_len], tv], axis=2)
    )
    return np.array(out), np.array(lse), ref_out, ref_lse, float(np.abs(v_all).max())


@pytest.mark.parametrize("rotate_output", (True, False))
@pytest.mark.parametrize("q_dtype", (mx.float32, mx.float16))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_attention_on_model_space_queries(head_dim, q_dtype, rotate_output):
    rng = np.random.default_rng(head_dim)
    rtol = attention_rtol(q_dtype, head_dim, 4, 4)
    for kv_len, q_len, tail in ((17, 1, 0), (3000, 3, 0), (300, 1, 12)):
        out, lse, ref_out, ref_lse, v_max = run_model_space_attention(
            rng,
            head_dim=head_dim,
            q_dtype=q_dtype,
            kv_len=kv_len,
            q_len=q_len,
            tail=tail,
            rotate_output=rotate_output,
        )
        err = np.abs(out - ref_out).max() / v_max
        assert err <= rtol, f"kv_len {kv_len}: out error {err:.3g} of max |v|"
        np.testing.assert_allclose(lse, ref_lse, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("q_dtype", (mx.float32, mx.float16, mx.bfloat16))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_attention_adds_the_means_back(head_dim, q_dtype):
    # A mean-centered cache: compressed tokens stored minus mu_k / mu_v, a model-space
    # tail that was not; out and lse are those of the uncentered keys and values.
    rng = np.random.default_rng(5 * head_dim)
    rtol = attention_rtol(q_dtype, head_dim, 4, 4)
    if q_dtype == mx.bfloat16:
        rtol *= 8  # the tail and queries carry bfloat16's 8-bit mantissa
    for kv_len, q_len, tail, rotate_output in (
        (40, 1, 36, True),
        (5000, 1, 36, True),
        (300, 2, 0, True),
        (700, 1, 5, False),
    ):
        out, lse, ref_out, ref_lse, v_max = run_model_space_attention(
            rng,
            head_dim=head_dim,
            q_dtype=q_dtype,
            kv_len=kv_len,
            q_len=q_len,
            tail=tail,
            rotate_output=rotate_output,
            centered=True,
        )
        err = np.abs(out - ref_out).max() / v_max
        assert err <= rtol, f"kv_len {kv_len}, tail {tail}: out error {err:.3g} of max |v|"
        np.testing.assert_allclose(lse, ref_lse, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("bits", (2, 4))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_quantize_append_subtracts_the_mean(head_dim, bits):
    # x - mean, then rotated, as the codec quantizes a centered cache's tokens: the same
    # codes and scales as appending the centered tokens themselves.
    rng = np.random.default_rng(11 * head_dim + bits)
    batch, heads, length, capacity, offset = 2, 3, 5, 8, 2
    rotation = Rotation(head_dim, seed=bits)
    words, scales = poisoned_cache(rng, batch, heads, capacity, head_dim, bits)
    x = random_tokens(rng, (batch, heads, length, head_dim)).astype(np.float32)
    mean = rng.standard_normal((batch, heads, 1, head_dim)).astype(np.float32)
    cent = mx.array(centroids_np(head_dim, bits))
    got = ops.quantize_append(
        mx.array(words),
        mx.array(scales),
        mx.array(x),
        cent,
        offset,
        bits,
        rotation_signs=rotation.kernel_signs,
        mean=mx.array(mean),
    )
    want = ops.quantize_append(
        mx.array(words),
        mx.array(scales),
        mx.array(x - mean),
        cent,
        offset,
        bits,
        rotation_signs=rotation.kernel_signs,
    )
    np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))
    np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]))
    # (test_quantize_append_rotates_model_space_tokens checks `want` against the reference)


def test_mean_arguments_are_checked():
    rng = np.random.default_rng(3)
    D, bits = 64, 4
    words, scales = poisoned_cache(rng, 1, 2, 8, D, bits)
    cent = mx.array(centroids_np(D, bits))
    x = mx.array(random_tokens(rng, (1, 2, 1, D)))
    with pytest.raises(ValueError) as e:
        ops.quantize_append(
            mx.array(words), mx.array(scales), x, cent, 0, bits, mean=mx.zeros((1, 2, D))
        )
    assert_op_error(e, "quantize_append", "mean must have shape (1, 2, 1, 64)")
    if mx.default_device() == mx.cpu:  # (GPU appends do not check values: no sync)
        bad = np.zeros((1, 2, 1, D), np.float32)
        bad[0, 1, 0, 7] = np.nan
        with pytest.raises(ValueError) as e:
            mx.eval(
                ops.quantize_append(
                    mx.array(words), mx.array(scales), x, cent, 0, bits, mean=mx.array(bad)
                )
            )
        assert_op_error(e, "quantize_append", "mean has a non-finite value", "head 1")
    q = mx.zeros((1, 4, 1, D))
    args = (
        q,
        mx.array(words),
        mx.array(scales),
        mx.array(words),
        mx.array(scales),
        cent,
        cent,
        4,
        0.125,
        bits,
        bits,
        False,
    )
    with pytest.raises(ValueError) as e:
        ops.compressed_attention(*args, key_mean=mx.zeros((1, 2, 1, D)))
    assert_op_error(e, "compressed_attention", "key_mean and value_mean must be given together")
    with pytest.raises(ValueError) as e:
        ops.compressed_attention(
            *args, key_mean=mx.zeros((1, 2, 1, D)), value_mean=mx.zeros((1, 4, 1, D))
        )
    assert_op_error(e, "compressed_attention", "value_mean must have shape (1, 2, 1, 64)")


def test_fallback_rotation_matches_rotation_class():
    rotation = Rotation(128, seed=5)
    x = mx.array(np.random.default_rng(0).standard_normal((2, 3, 128)).astype(np.float32))
    np.testing.assert_allclose(
        np.array(fallback.rotate(x, rotation.kernel_signs)),
        np.array(rotation.forward(x)),
        atol=1e-6,
    )
    np.testing.assert_allclose(
        np.array(fallback.rotate(x, rotation.kernel_signs, inverse=True)),
        np.array(rotation.inverse(x)),
        atol=1e-6,
    )


def test_kernel_signs_only_for_power_of_two_hadamard():
    assert len(Rotation(64, seed=0).kernel_signs) == 64
    assert Rotation(96, seed=0).kernel_signs is None  # 12 * 2^3: Hadamard, not 2^k
    assert Rotation(80, seed=0).kernel_signs is None  # dense matrix


def test_rotation_signs_object_is_a_sequence_that_copies_and_pickles():
    signs = Rotation(64, seed=3).kernel_signs
    assert isinstance(signs, ops.RotationSigns)
    values = list(signs)
    assert len(values) == 64 and set(values) == {-1.0, 1.0}
    assert signs[-1] == values[-1]
    with pytest.raises(IndexError):
        signs[64]
    # immutable: copies are the object itself; a pickle keeps the signs
    assert copy.copy(signs) is signs and copy.deepcopy(signs) is signs
    restored = pickle.loads(pickle.dumps(signs))
    assert isinstance(restored, ops.RotationSigns) and list(restored) == values


def test_rotation_signs_object_and_plain_list_quantize_alike():
    rng = np.random.default_rng(11)
    rotation = Rotation(64, seed=11)
    words, scales, c = _tiny_cache(64)
    x = mx.array(random_tokens(rng, (1, 1, 3, 64)))
    outs = [
        ops.quantize_append(words, scales, x, c, 2, 4, rotation_signs=signs)
        for signs in (rotation.kernel_signs, list(rotation.kernel_signs))
    ]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    # and both rotate as the reference does
    assert_quantized_rotation(
        np.array(outs[0][0])[:, :, 2:5], np.array(outs[0][1])[:, :, 2:5], to_np(x), rotation, 4
    )


def _tiny_cache(head_dim, bits=4):
    words = mx.zeros((1, 1, 8, head_dim * bits // 32), dtype=mx.uint32)
    scales = mx.zeros((1, 1, 8), dtype=mx.float16)
    return words, scales, mx.array(centroids_np(head_dim, bits))


@pytest.mark.parametrize(
    "head_dim,signs,needles",
    (
        (96, [1.0] * 96, ("power-of-two", "96")),
        (64, [1.0] * 63, ("one sign per coordinate", "64", "63")),
        (64, [1.0] * 63 + [0.5], ("+1 or -1", "0.5", "63")),
    ),
)
def test_bad_rotation_signs_are_refused(head_dim, signs, needles):
    words, scales, c = _tiny_cache(head_dim)
    x = mx.ones((1, 1, 1, head_dim))
    with pytest.raises(ValueError) as excinfo:
        ops.quantize_append(
            words, scales, x, c, 0, 4, rotation_signs=signs, stream=mx.Device(mx.cpu)
        )
    assert_op_error(excinfo, "quantize_append", *needles)
    with pytest.raises(ValueError) as excinfo:
        ops.compressed_attention(
            x,
            words,
            scales,
            words,
            scales,
            c,
            c,
            1,
            0.1,
            4,
            4,
            rotation_signs=signs,
            stream=mx.Device(mx.cpu),
        )
    assert_op_error(excinfo, "compressed_attention", *needles)
