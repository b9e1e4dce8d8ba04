# Copyright © 2026 turboquant_mlx contributors.

"""The GPU kernels (CUDA build here; the Metal build shares their bodies) against the
CPU backend and the NumPy reference.

Every test runs its op on the GPU stream and is skipped where MLX has no GPU or this
build has no GPU kernels. Quantization must match the CPU backend bit for bit (same
inputs, same arithmetic order); attention must match the float64 NumPy reference on the
dequantized cache to float32 accuracy (float32 queries, and every query dtype on the
portable kernel), or to half-precision accuracy on CUDA's tensor-core kernel and on the
simdgroup-matrix kernel (float16 / bfloat16 queries, see TENSOR_CORE_RTOL), over lengths
that take the single-pass and the split-K paths.

The simdgroup-matrix kernel (metal/tq_attention_simd.h) is Metal's path for float16 /
bfloat16 queries at head dims 64, 128, 256; the CUDA build runs the same kernel body on
its emulation of simdgroup matrices when a test asks for it (the "attention" kernel
override of ``_ext._set_kernel_override``). Tests
parametrized over ``kernel`` run their cases on it ("simd": the float32 cases with
float16 / bfloat16 queries instead), on the portable kernel ("simt") and on the build's
default choice.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from helpers import (
    attention_rtol,
    centroids_np,
    poisoned_cache,
    random_tokens,
    reference_cache,
    to_np,
)
from test_rotation_in_ops import run_model_space_attention
from turboquant_mlx import _ext, ops, reference
from turboquant_mlx.rotation import Rotation

HAS_GPU_KERNELS = mx.is_available(mx.gpu) and _ext.gpu_available()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_GPU_KERNELS, reason="no MLX GPU or no GPU kernels in this build"),
]

HEAD_DIMS = (64, 96, 128, 256)
BITS = (2, 3, 4)
BIT_PAIRS = ((2, 2), (3, 3), (4, 4), (4, 2), (3, 4), (2, 4), (4, 3))


def gpu():
    return mx.Device(mx.gpu)


def select_kernel(kernel_override, kernel):
    """Selects the attention kernel of the ``kernel`` parameter: "simd" the
    simdgroup-matrix kernel (CUDA: on its emulation; Metal's default), "simt" the
    portable one, "default" the build's own choice."""
    if kernel == "simd":
        kernel_override("attention", "simd")
    elif kernel == "simt":
        kernel_override("attention", "portable")


def query_dtype(kernel, case):
    """float32 queries, or for the simdgroup-matrix kernel (which takes half queries)
    float16 / bfloat16 by the parity of ``case``."""
    return (mx.float16, mx.bfloat16)[case % 2] if kernel == "simd" else mx.float32


def bits_of(a):
    """Raw bits of an MLX uint32 / float16 array as NumPy, for exact comparison."""
    a = np.array(a)
    return a.view(np.uint16) if a.dtype == np.float16 else a


# ---------------------------------------------------------------------------
# quantize_append: bit-exact against the CPU backend


def quantize_both(words, scales, x, c, offset, bits, keep_inputs=False):
    """Runs quantize_append on the CPU and on the GPU from the same NumPy inputs."""
    results = []
    for device in (mx.Device(mx.cpu), mx.Device(mx.gpu)):
        codes_in, scales_in = mx.array(words), mx.array(scales)
        mx.eval(codes_in, scales_in)
        out = ops.quantize_append(
            codes_in, scales_in, mx.array(x), mx.array(c), offset, bits, stream=device
        )
        if not keep_inputs:
            del codes_in, scales_in
        mx.eval(*out)
        results.append((bits_of(out[0]), bits_of(out[1])))
    return results


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_quantize_append_bit_exact_vs_cpu(head_dim, bits):
    rng = np.random.default_rng(100 * head_dim + bits)
    batch, heads, length, capacity, offset = 2, 3, 37, 50, 5
    words, scales = poisoned_cache(rng, batch, heads, capacity, head_dim, bits)
    x = random_tokens(rng, (batch, heads, length, head_dim))
    c = centroids_np(head_dim, bits)
    (cpu_w, cpu_s), (gpu_w, gpu_s) = quantize_both(words, scales, x, c, offset, bits)
    np.testing.assert_array_equal(gpu_w, cpu_w)
    np.testing.assert_array_equal(gpu_s, cpu_s)
    # Slots outside [offset, offset + length) keep their poison.
    untouched = np.ones(capacity, bool)
    untouched[offset : offset + length] = False
    np.testing.assert_array_equal(gpu_w[:, :, untouched], words[:, :, untouched])
    np.testing.assert_array_equal(gpu_s[:, :, untouched], scales.view(np.uint16)[:, :, untouched])


@pytest.mark.parametrize("in_place", (False, True), ids=("nodes", "in_place"))
@pytest.mark.parametrize("x_dtype", (mx.float32, mx.float16, mx.bfloat16))
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", (32, 64, 128, 256))
def test_quantize_append_rotating_bit_exact_vs_cpu(head_dim, bits, x_dtype, in_place):
    # Model-space tokens rotated by the kernels: the GPU's butterflies pair the same
    # operands as the CPU backend's, so codes and scales still match bit for bit. With
    # in_place the GPU's one launch writes both buffers (the CPU reference: one node
    # per buffer).
    rng = np.random.default_rng(300 * head_dim + bits)
    batch, heads, length, capacity, offset = 2, 3, 21, 30, 4
    words, scales = poisoned_cache(rng, batch, heads, capacity, head_dim, bits)
    x = mx.array(random_tokens(rng, (batch, heads, length, head_dim))).astype(x_dtype)
    signs = Rotation(head_dim, seed=bits).kernel_signs
    c = mx.array(centroids_np(head_dim, bits))
    results = []
    for device in (mx.Device(mx.cpu), gpu()):
        out = ops.quantize_append(
            mx.array(words),
            mx.array(scales),
            x,
            c,
            offset,
            bits,
            rotation_signs=signs,
            in_place=in_place and device.type == mx.gpu,
            stream=device,
        )
        mx.eval(*out)
        results.append((bits_of(out[0]), bits_of(out[1])))
    (cpu_w, cpu_s), (gpu_w, gpu_s) = results
    np.testing.assert_array_equal(gpu_w, cpu_w)
    np.testing.assert_array_equal(gpu_s, cpu_s)
    assert not np.array_equal(cpu_w, words)  # something was written


@pytest.mark.parametrize("x_dtype", (mx.float32, mx.float16))
@pytest.mark.parametrize("head_dim", (64, 128))
def test_quantize_append_kv_bit_exact_vs_cpu(head_dim, x_dtype):
    # A layer's keys and values in one node (one launch per tensor: 4-bit keys rotated
    # and centered, 3-bit values centered): the GPU's codes and scales match the CPU's
    # two separate appends bit for bit, and only the appended slots change.
    rng = np.random.default_rng(400 + head_dim)
    batch, heads, length, capacity, offset = 2, 3, 5, 16, 7
    kw, ksc = poisoned_cache(rng, batch, heads, capacity, head_dim, 4)
    vw, vsc = poisoned_cache(rng, batch, heads, capacity, head_dim, 3)
    keys = mx.array(random_tokens(rng, (batch, heads, length, head_dim))).astype(x_dtype)
    values = mx.array(random_tokens(rng, (batch, heads, length, head_dim))).astype(x_dtype)
    mk, mv = (
        mx.array(rng.standard_normal((batch, heads, 1, head_dim)).astype(np.float32))
        for _ in range(2)
    )
    ck, cv = mx.array(centroids_np(head_dim, 4)), mx.array(centroids_np(head_dim, 3))
    signs = Rotation(head_dim, seed=5).kernel_signs
    cpu = mx.Device(mx.cpu)
    want = []
    for w, sc, x, c, bits, sg, m in (
        (kw, ksc, keys, ck, 4, signs, mk),
        (vw, vsc, values, cv, 3, None, mv),
    ):
        out = ops.quantize_append(
            mx.array(w), mx.array(sc), x, c, offset, bits, rotation_signs=sg, mean=m, stream=cpu
        )
        mx.eval(*out)
        want += [bits_of(o) for o in out]
    got = ops.quantize_append_kv(
        mx.array(kw),
        mx.array(ksc),
        mx.array(vw),
        mx.array(vsc),
        keys,
        values,
        ck,
        cv,
        offset,
        4,
        3,
        key_rotation_signs=signs,
        key_mean=mk,
        value_mean=mv,
        stream=gpu(),
    )
    mx.eval(*got)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits_of(g), w)
    untouched = np.ones(capacity, bool)
    untouched[offset : offset + length] = False
    np.testing.assert_array_equal(bits_of(got[2])[:, :, untouched], vw[:, :, untouched])


@pytest.mark.parametrize("x_dtype", (mx.float16, mx.bfloat16))
def test_kv_as_one_launch_bit_exact_vs_cpu(x_dtype):
    # Keys and values of the same bits and shape go to the GPU as one launch per node
    # (the append and the token write). They match the CPU bit for bit, and only the
    # written slots change.
    rng = np.random.default_rng(410)
    batch, heads, length, capacity, offset, head_dim = 2, 3, 5, 16, 7, 128
    kw, ksc = poisoned_cache(rng, batch, heads, capacity, head_dim, 4)
    vw, vsc = poisoned_cache(rng, batch, heads, capacity, head_dim, 4)
    keys = mx.array(random_tokens(rng, (batch, heads, length, head_dim))).astype(x_dtype)
    values = mx.array(random_tokens(rng, (batch, heads, length, head_dim))).astype(x_dtype)
    mk, mv = (
        mx.array(rng.standard_normal((batch, heads, 1, head_dim)).astype(np.float32))
        for _ in range(2)
    )
    c = mx.array(centroids_np(head_dim, 4))
    signs = Rotation(head_dim, seed=6).kernel_signs
    cpu = mx.Device(mx.cpu)
    want = []
    for w, sc, x, m in ((kw, ksc, keys, mk), (vw, vsc, values, mv)):
        out = ops.quantize_append(
            mx.array(w), mx.array(sc), x, c, offset, 4, rotation_signs=signs, mean=m, stream=cpu
        )
        mx.eval(*out)
        want += [bits_of(o) for o in out]
    got = ops.quantize_append_kv(
        mx.array(kw),
        mx.array(ksc),
        mx.array(vw),
        mx.array(vsc),
        keys,
        values,
        c,
        c,
        offset,
        4,
        4,
        key_rotation_signs=signs,
        value_rotation_signs=signs,
        key_mean=mk,
        value_mean=mv,
        stream=gpu(),
    )
    mx.eval(*got)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits_of(g), w)

    # The token write (a window preset's ring): the buffers' other slots keep their bits.
    kbuf, vbuf = (
        rng.standard_normal((batch, heads, capacity, head_dim)).astype(np.float32) for _ in range(2)
    )
    kbuf, vbuf = mx.array(kbuf).astype(x_dtype), mx.array(vbuf).astype(x_dtype)
    mx.eval(kbuf, vbuf)
    raw = lambda a: np.array(a.view(mx.uint16))  # noqa: E731
    want_k, want_v = raw(kbuf).copy(), raw(vbuf).copy()
    want_k[:, :, offset : offset + length] = raw(keys)
    want_v[:, :, offset : offset + length] = raw(values)
    out_k, out_v = ops.write_tokens_kv(kbuf, vbuf, keys, values, offset, stream=gpu())
    mx.eval(out_k, out_v)
    np.testing.assert_array_equal(raw(out_k), want_k)
    np.testing.assert_array_equal(raw(out_v), want_v)


@pytest.mark.parametrize("x_dtype", (mx.float16, mx.bfloat16))
@pytest.mark.parametrize("bits", ((4, 4), (4, 2)))
@pytest.mark.parametrize("length,strided", ((1, False), (3, False), (3, True)))
def test_ring_append_bit_exact_vs_cpu(x_dtype, bits, length, strided):
    # A window ring's exchange (one node: the slots' tokens quantized, then the new
    # tokens written there) matches the CPU bit for bit: the codes and scales, and the
    # rings, whose other slots keep their bits. On CUDA the quantize kernel writes each
    # new token over the slot it has read (keys and values one launch, or one each
    # when their bits differ); new tokens strided along the token axis are read in
    # place.
    rng = np.random.default_rng(411 + length)
    batch, heads, capacity, offset, head_dim, slots, slot = 2, 3, 16, 7, 128, 36, 9
    kb, vb = bits
    kw, ksc = poisoned_cache(rng, batch, heads, capacity, head_dim, kb)
    vw, vsc = poisoned_cache(rng, batch, heads, capacity, head_dim, vb)
    rings = [
        mx.array(random_tokens(rng, (batch, heads, slots, head_dim))).astype(x_dtype)
        for _ in range(2)
    ]
    step = 2 if strided else 1
    new = [
        mx.array(random_tokens(rng, (batch, heads, step * length, head_dim))).astype(x_dtype)[
            :, :, ::step
        ]
        for _ in range(2)
    ]
    mk, mv = (
        mx.array(rng.standard_normal((batch, heads, 1, head_dim)).astype(np.float32))
        for _ in range(2)
    )
    ck, cv = mx.array(centroids_np(head_dim, kb)), mx.array(centroids_np(head_dim, vb))
    signs = Rotation(head_dim, seed=8).kernel_signs
    mx.eval(*rings, *new)

    def run(stream):
        out = ops.ring_append_kv(
            mx.array(kw),
            mx.array(ksc),
            mx.array(vw),
            mx.array(vsc),
            mx.array(rings[0]),
            mx.array(rings[1]),
            new[0],
            new[1],
            ck,
            cv,
            offset,
            slot,
            kb,
            vb,
            key_rotation_signs=signs,
            value_rotation_signs=signs,
            key_mean=mk,
            value_mean=mv,
            stream=stream,
        )
        mx.eval(*out)
        return [bits_of(o) for o in out[:4]] + [np.array(o.view(mx.uint16)) for o in out[4:]]

    want, got = run(mx.Device(mx.cpu)), run(gpu())
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    ring_k = np.array(rings[0].view(mx.uint16)).copy()
    ring_k[:, :, slot : slot + length] = np.array(new[0].view(mx.uint16))
    np.testing.assert_array_equal(got[4], ring_k)


def strided_last_axis(a):
    """The same values as a view whose last axis is not contiguous."""
    v = mx.swapaxes(mx.array(np.ascontiguousarray(np.swapaxes(np.asarray(a), -1, -2))), -1, -2)
    assert v.shape == tuple(np.asarray(a).shape)
    return v


def test_ops_read_inputs_strided_along_the_last_axis():
    # GPU ops take inputs in any layout: a strided token or query is copied in eval.
    rng = np.random.default_rng(5)
    head_dim, bits = 128, 4
    words, scales = poisoned_cache(rng, 1, 2, 12, head_dim, bits)
    x = random_tokens(rng, (1, 2, 5, head_dim))
    c = mx.array(centroids_np(head_dim, bits))
    outs = []
    for device, xin in ((mx.Device(mx.cpu), mx.array(x)), (gpu(), strided_last_axis(x))):
        out = ops.quantize_append(mx.array(words), mx.array(scales), xin, c, 3, bits, stream=device)
        mx.eval(*out)
        outs.append([bits_of(o) for o in out])
    np.testing.assert_array_equal(outs[1][0], outs[0][0])
    np.testing.assert_array_equal(outs[1][1], outs[0][1])

    k_words, k_scales, _ = reference_cache(rng, 1, 2, 40, 33, head_dim, bits)
    q = (2.0 * rng.standard_normal((1, 8, 1, head_dim))).astype(np.float32)
    results = []
    for device, qin in ((mx.Device(mx.cpu), mx.array(q)), (gpu(), strided_last_axis(q))):
        out, lse = ops.compressed_attention(
            qin,
            mx.array(k_words),
            mx.array(k_scales),
            mx.array(k_words),
            mx.array(k_scales),
            c,
            c,
            33,
            0.1,
            bits,
            bits,
            True,
            stream=device,
        )
        mx.eval(out, lse)
        results.append((np.array(out), np.array(lse)))
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", BITS)
def test_quantize_append_near_boundaries_bit_exact(bits):
    # Coordinates placed on and next to decision boundaries: the GPU must take the
    # same side as the CPU (same float32 arithmetic, same tie rule).
    head_dim = 128
    rng = np.random.default_rng(7 + bits)
    c = centroids_np(head_dim, bits)
    t = (c[:-1] + c[1:]) * np.float32(0.5)
    x = rng.standard_normal((1, 2, 64, head_dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=-1, keepdims=True)
    pick = rng.integers(0, len(t), x.shape)
    nudge = rng.integers(-2, 3, x.shape).astype(np.float32) * np.float32(1e-7)
    x = np.where(rng.random(x.shape) < 0.3, t[pick] + nudge, x).astype(np.float32)
    words, scales = poisoned_cache(rng, 1, 2, 64, head_dim, bits)
    (cpu_w, cpu_s), (gpu_w, gpu_s) = quantize_both(words, scales, x, c, 0, bits)
    np.testing.assert_array_equal(gpu_w, cpu_w)
    np.testing.assert_array_equal(gpu_s, cpu_s)


def test_quantize_append_copies_a_referenced_buffer():
    # With the input buffers still referenced the GPU node must copy, not overwrite.
    rng = np.random.default_rng(3)
    head_dim, bits = 96, 3
    words, scales = poisoned_cache(rng, 1, 2, 20, head_dim, bits)
    x = random_tokens(rng, (1, 2, 4, head_dim))
    c = centroids_np(head_dim, bits)
    codes_in, scales_in = mx.array(words), mx.array(scales)
    mx.eval(codes_in, scales_in)
    out = ops.quantize_append(codes_in, scales_in, mx.array(x), mx.array(c), 7, bits, stream=gpu())
    mx.eval(*out)
    np.testing.assert_array_equal(np.array(codes_in), words)
    np.testing.assert_array_equal(bits_of(scales_in), scales.view(np.uint16))
    (cpu_w, cpu_s), _ = quantize_both(words, scales, x, c, 7, bits)
    np.testing.assert_array_equal(bits_of(out[0]), cpu_w)
    np.testing.assert_array_equal(bits_of(out[1]), cpu_s)


# ---------------------------------------------------------------------------
# dequantize: exact against the CPU backend


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_dequantize_matches_cpu(head_dim, bits):
    rng = np.random.default_rng(head_dim + 10 * bits)
    words, scales, _ = reference_cache(rng, 2, 3, 40, 33, head_dim, bits)
    c = mx.array(centroids_np(head_dim, bits))
    got = ops.dequantize(mx.array(words), mx.array(scales), c, bits, 3, 29, stream=gpu())
    want = ops.dequantize(
        mx.array(words), mx.array(scales), c, bits, 3, 29, stream=mx.Device(mx.cpu)
    )
    np.testing.assert_array_equal(np.array(got), np.array(want))
    # The prefill's form: half-precision output with free slots around the tokens.
    for dtype in (mx.float16, mx.bfloat16):
        kw = dict(dtype=dtype, before=4, after=37)
        got = ops.dequantize(mx.array(words), mx.array(scales), c, bits, 3, 29, stream=gpu(), **kw)
        want = ops.dequantize(
            mx.array(words), mx.array(scales), c, bits, 3, 29, stream=mx.Device(mx.cpu), **kw
        )
        assert got.dtype == dtype and got.shape == want.shape
        np.testing.assert_array_equal(
            np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        )
        # ... and with the rows around the tokens copied in, into a reused buffer.
        prefix = mx.array(rng.standard_normal((2, 3, 4, head_dim))).astype(dtype)
        suffix = mx.array(rng.standard_normal((2, 3, 37, head_dim))).astype(dtype)
        into = mx.full((2 * 3 * 70 * head_dim,), 5.0, dtype)
        mx.eval(prefix, suffix, into)
        got = ops.dequantize(
            mx.array(words),
            mx.array(scales),
            c,
            bits,
            3,
            29,
            dtype=dtype,
            prefix=prefix,
            suffix=suffix,
            into=into,
            stream=gpu(),
        )
        want = mx.concatenate([prefix, want[:, :, 4:33], suffix], axis=2)
        np.testing.assert_array_equal(
            np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))
        )
        np.testing.assert_array_equal(
            np.array(into[: got.size].astype(mx.float32)),
            np.array(want.astype(mx.float32)).reshape(-1),
        )


def test_cuda_pool_counts_and_bounds_what_it_keeps():
    # The CUDA backend allocates its outputs outside MLX's allocator. It counts them
    # (what is in use returns to its level once the arrays are gone), and of freed
    # buffers it keeps at most 1 GiB: a long prompt's decoded keys and values grow by a
    # block each time, so no size comes twice, and keeping them all ran a 128k prompt
    # out of device memory.
    if _ext.gpu_backend() != "cuda":
        pytest.skip("only the CUDA backend allocates outside MLX's allocator")
    H, D, bits, n = 8, 128, 4, 65536
    words = mx.zeros((1, H, n, D * bits // 32), mx.uint32)
    scales = mx.ones((1, H, n), mx.float16)
    c = mx.array(centroids_np(D, bits))
    mx.eval(words, scales)
    mx.synchronize()
    before = _ext.gpu_pool_memory(reset_peak=True)
    largest = 0
    for length in range(32768, n + 1, 4096):  # float32 outputs of 128 to 256 MiB, 9 sizes
        out = ops.dequantize(words, scales, c, bits, 0, length, stream=gpu())
        mx.eval(out)
        largest = max(largest, out.nbytes)
        assert float(out[0, H - 1, length - 1, 0].item()) == float(c[0].item())
        del out
    mx.synchronize()
    active, peak, held = _ext.gpu_pool_memory()
    assert active == before[0]
    assert largest <= peak - before[0] <= 2 * largest  # one output at a time
    assert held <= 1 << 30


# ---------------------------------------------------------------------------
# attention: against the float64 reference on the dequantized cache


def make_mask(kind, rng, batch, q_heads, q_len, kv_len):
    if kind is None:
        return None
    family, shape = kind
    shapes = {
        "kv": (kv_len,),
        "L,kv": (q_len, kv_len),
        "B,1,1,kv": (batch, 1, 1, kv_len),
        "1,Hq,L,1": (1, q_heads, q_len, 1),
        "B,Hq,L,kv": (batch, q_heads, q_len, kv_len),
    }[shape]
    if family == "bool":
        keep = rng.random(shapes) < 0.7
        return mx.array(keep)
    add = (2.0 * rng.standard_normal(shapes)).astype(np.float32)
    add[rng.random(shapes) < 0.2] = -np.inf
    m = mx.array(add)
    return m.astype(mx.float16) if family == "float16" else m


def run_attention(
    rng,
    *,
    batch=1,
    kv_heads=2,
    group=4,
    q_len=1,
    kv_len=17,
    head_dim=128,
    key_bits=4,
    value_bits=4,
    causal=True,
    mask=None,
    q_dtype=mx.float32,
    capacity=None,
    tail=0,
    gapped=False,
    scale_offset=0,
    q_offset=0,
):
    capacity = capacity or kv_len + 3
    q_heads = kv_heads * group
    k_words, k_scales, k_hat = reference_cache(
        rng, batch, kv_heads, capacity, kv_len, head_dim, key_bits
    )
    v_words, v_scales, v_hat = reference_cache(
        rng, batch, kv_heads, capacity, kv_len, head_dim, value_bits
    )
    q = mx.array(2.0 * rng.standard_normal((batch, q_heads, q_len, head_dim))).astype(q_dtype)
    if q_offset:  # query rows that start mid-buffer: element `q_offset` of wider rows
        wide = mx.zeros((batch, q_heads, q_len, head_dim + q_offset), q_dtype)
        wide[..., q_offset:] = q
        q = wide[..., q_offset:]
    m = make_mask(mask, rng, batch, q_heads, q_len, kv_len)
    scale = 1.0 / math.sqrt(head_dim)
    caches = [mx.array(a) for a in (k_words, k_scales, v_words, v_scales)]
    if gapped:  # views with gaps between tokens: rows of wider buffers, every other scale
        for i in (0, 2):
            a = np.array(caches[i])
            wide = np.zeros(a.shape[:3] + (a.shape[3] + 4,), a.dtype)
            wide[..., : a.shape[3]] = a
            caches[i] = mx.array(wide)[..., : a.shape[3]]
        for i in (1, 3):
            a = np.array(caches[i])
            wide = np.zeros(a.shape[:2] + (2 * a.shape[2],), a.dtype)
            wide[..., ::2] = a
            caches[i] = mx.array(wide)[..., ::2]
    if scale_offset:  # scales that start mid-buffer: element `scale_offset` of wider rows
        for i in (1, 3):
            a = np.array(caches[i])
            wide = np.zeros(a.shape[:2] + (a.shape[2] + scale_offset,), a.dtype)
            wide[..., scale_offset:] = a
            caches[i] = mx.array(wide)[..., scale_offset:]
    tail_k = tail_v = None
    if tail:
        # in the queries' dtype, as the op takes it (the reference reads the same values)
        tail_k = to_np(
            mx.array(2.0 * rng.standard_normal((batch, kv_heads, tail, head_dim))).astype(q_dtype)
        ).astype(np.float32)
        tail_v = to_np(
            mx.array(rng.standard_normal((batch, kv_heads, tail, head_dim))).astype(q_dtype)
        ).astype(np.float32)
    out, lse = ops.compressed_attention(
        q,
        *caches,
        mx.array(centroids_np(head_dim, key_bits)),
        mx.array(centroids_np(head_dim, value_bits)),
        kv_len,
        scale,
        key_bits,
        value_bits,
        causal,
        m,
        tail_k=None if tail_k is None else mx.array(tail_k),
        tail_v=None if tail_v is None else mx.array(tail_v),
        stream=gpu(),
    )
    mx.eval(out, lse)
    ref_out, ref_lse = reference.attention(
        to_np(q),
        k_hat,
        v_hat,
        scale,
        kv_len,
        causal,
        None if m is None else to_np(m),
        tail_k,
        tail_v,
    )
    if tail:
        v_hat = np.concatenate([v_hat[:, :, :kv_len], tail_v], axis=2)
    return np.array(out), np.array(lse), ref_out, ref_lse, v_hat


def assert_attention_close(out, lse, ref_out, ref_lse, v_hat, rtol=1e-5):
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    hidden = ref_lse == -np.inf
    np.testing.assert_array_equal(lse == -np.inf, hidden)
    assert (out[hidden] == 0).all()
    v_size = max(float(np.abs(v_hat).max()), 1e-30)
    err = np.abs(out - ref_out).max() / v_size
    assert err <= rtol, f"out: max error {err:.3g} of max |v|"
    lse_err = np.abs(lse[~hidden] - ref_lse[~hidden]) / np.maximum(1.0, np.abs(ref_lse[~hidden]))
    assert lse_err.size == 0 or lse_err.max() <= rtol, f"lse: error {lse_err.max():.3g}"


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("group", (1, 4, 8))
@pytest.mark.parametrize("kv_len", (1, 17, 127, 4097, 70000))
def test_attention_lengths_and_gqa(kernel_override, kv_len, group, kernel):
    select_kernel(kernel_override, kernel)
    rng = np.random.default_rng(kv_len + group)
    for q_len in sorted({1, min(kv_len, 3), min(kv_len, 8)}):
        q_dtype = query_dtype(kernel, q_len)
        result = run_attention(
            rng,
            kv_len=kv_len,
            group=group,
            q_len=q_len,
            kv_heads=2 if kv_len > 5000 else 3,
            q_dtype=q_dtype,
        )
        exact = 2e-5 if kv_len > 5000 else 1e-5
        assert_attention_close(*result, rtol=rtol_for(q_dtype, 128, 4, 4, exact))


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("key_bits,value_bits", BIT_PAIRS)
def test_attention_bit_widths_and_head_dims(
    kernel_override, key_bits, value_bits, head_dim, kernel
):
    select_kernel(kernel_override, kernel)
    case = BIT_PAIRS.index((key_bits, value_bits)) * len(HEAD_DIMS) + HEAD_DIMS.index(head_dim)
    rng = np.random.default_rng(case)
    q_dtype = query_dtype(kernel, case)
    for kv_len in (127, 3000):
        result = run_attention(
            rng,
            batch=2,
            group=(1, 4, 8)[case % 3],
            q_len=1 + case % 8,
            kv_len=kv_len,
            head_dim=head_dim,
            key_bits=key_bits,
            value_bits=value_bits,
            causal=case % 2 == 0,
            q_dtype=q_dtype,
        )
        assert_attention_close(*result, rtol=rtol_for(q_dtype, head_dim, key_bits, value_bits))


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("q_len", range(1, 9))
def test_attention_causal_q_len(kernel_override, q_len, kernel):
    select_kernel(kernel_override, kernel)
    rng = np.random.default_rng(50 + q_len)
    q_dtype = query_dtype(kernel, q_len)
    for kv_len in (q_len, 33, 2049):
        if kv_len < q_len:
            continue
        result = run_attention(rng, q_len=q_len, kv_len=kv_len, group=4, q_dtype=q_dtype)
        assert_attention_close(*result, rtol=rtol_for(q_dtype, 128, 4, 4))


MASKS = (
    ("bool", "kv"),
    ("bool", "L,kv"),
    ("bool", "B,Hq,L,kv"),
    ("float32", "B,1,1,kv"),
    ("float32", "1,Hq,L,1"),
    ("float32", "B,Hq,L,kv"),
    ("float16", "L,kv"),
)


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("mask", MASKS, ids=[":".join(m) for m in MASKS])
def test_attention_masks(kernel_override, mask, causal, kernel):
    select_kernel(kernel_override, kernel)
    rng = np.random.default_rng(hash(mask) % 1000 + causal)
    q_dtype = query_dtype(kernel, MASKS.index(mask) + causal)
    for kv_len in (40, 3001):
        result = run_attention(
            rng,
            batch=2,
            q_len=3,
            kv_len=kv_len,
            mask=mask,
            causal=causal,
            head_dim=64,
            q_dtype=q_dtype,
        )
        assert_attention_close(*result, rtol=rtol_for(q_dtype, 64, 4, 4))


@pytest.mark.parametrize("kernel", ("default", "simd"))
def test_attention_fully_masked_rows(kernel_override, kernel):
    select_kernel(kernel_override, kernel)
    q_dtype = query_dtype(kernel, 0)
    rng = np.random.default_rng(9)
    batch, kv_heads, group, q_len, kv_len, head_dim = 2, 2, 4, 3, 2500, 64
    q_heads = kv_heads * group
    keep = rng.random((batch, q_heads, q_len, kv_len)) < 0.5
    keep[0, 1, :] = False
    keep[1, 5, 2] = False
    keep[1, 6, 1] = False
    keep[1, 6, 1, -2:] = True  # only the last keys: most splits see nothing
    k_words, k_scales, k_hat = reference_cache(rng, batch, kv_heads, kv_len, kv_len, head_dim, 4)
    v_words, v_scales, v_hat = reference_cache(rng, batch, kv_heads, kv_len, kv_len, head_dim, 3)
    q = mx.array(rng.standard_normal((batch, q_heads, q_len, head_dim)).astype(np.float32))
    q = q.astype(q_dtype)
    out, lse = ops.compressed_attention(
        q,
        mx.array(k_words),
        mx.array(k_scales),
        mx.array(v_words),
        mx.array(v_scales),
        mx.array(centroids_np(head_dim, 4)),
        mx.array(centroids_np(head_dim, 3)),
        kv_len,
        0.125,
        4,
        3,
        False,
        mx.array(keep),
        stream=gpu(),
    )
    ref_out, ref_lse = reference.attention(to_np(q), k_hat, v_hat, 0.125, kv_len, False, keep)
    assert (ref_lse == -np.inf).any()
    assert_attention_close(
        np.array(out), np.array(lse), ref_out, ref_lse, v_hat, rtol=rtol_for(q_dtype, 64, 4, 3)
    )


def rtol_for(q_dtype, head_dim, key_bits, value_bits, exact=1e-5):
    return attention_rtol(q_dtype, head_dim, key_bits, value_bits, exact, device=mx.gpu)


@pytest.mark.parametrize("kernel", ("default", "simt", "simd"))
@pytest.mark.parametrize("q_dtype", (mx.float32, mx.float16, mx.bfloat16))
def test_attention_query_dtypes(kernel_override, q_dtype, kernel):
    select_kernel(kernel_override, kernel)
    rng = np.random.default_rng(11)
    for kv_len in (50, 5000):
        result = run_attention(rng, q_len=4, kv_len=kv_len, q_dtype=q_dtype, group=8)
        assert_attention_close(*result, rtol=rtol_for(q_dtype, 128, 4, 4))


HALF_CASES = (
    # kv_len, group, q_len, causal
    (1, 1, 1, True),
    (17, 4, 1, True),
    (127, 8, 3, False),  # 24 rows: two blocks of 16
    (4097, 4, 8, True),
    (20000, 8, 1, True),
)


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
@pytest.mark.parametrize(
    "key_bits,value_bits", ((4, 4), (4, 3), (4, 2), (3, 3), (3, 2), (2, 2), (3, 4))
)
def test_attention_half_queries(kernel_override, head_dim, key_bits, value_bits, kernel):
    select_kernel(kernel_override, kernel)
    case = head_dim + 10 * key_bits + value_bits
    rng = np.random.default_rng(case)
    for i, (kv_len, group, q_len, causal) in enumerate(HALF_CASES):
        q_dtype = (mx.float16, mx.bfloat16)[(case + i) % 2]
        result = run_attention(
            rng,
            batch=1 + i % 2,
            kv_heads=2,
            group=group,
            q_len=q_len,
            kv_len=kv_len,
            head_dim=head_dim,
            key_bits=key_bits,
            value_bits=value_bits,
            causal=causal,
            q_dtype=q_dtype,
        )
        assert_attention_close(*result, rtol=rtol_for(q_dtype, head_dim, key_bits, value_bits))


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("head_dim,key_bits,value_bits", ((128, 4, 4), (64, 3, 2), (256, 4, 3)))
def test_attention_half_queries_gapped_cache(
    kernel_override, head_dim, key_bits, value_bits, kernel
):
    # Cache views whose tokens are not adjacent in memory: the tensor-core kernel reads
    # dense rows, so the op hands it dense copies.
    select_kernel(kernel_override, kernel)
    rng = np.random.default_rng(head_dim + key_bits)
    for kv_len, group in ((40, 4), (1500, 8)):
        result = run_attention(
            rng,
            kv_len=kv_len,
            group=group,
            head_dim=head_dim,
            key_bits=key_bits,
            value_bits=value_bits,
            q_dtype=mx.float16,
            gapped=True,
        )
        assert_attention_close(*result, rtol=rtol_for(mx.float16, head_dim, key_bits, value_bits))


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("head_dim", (64, 128))
@pytest.mark.parametrize("scale_offset", (1, 3, 8))
def test_attention_half_queries_unaligned_scales(kernel_override, head_dim, scale_offset, kernel):
    # K4V4's tensor-core kernel copies scales in 16-byte chunks from the boundary below
    # each iteration's first one: scale rows at any 2-byte offset, lengths that end
    # mid-chunk and mid-tile, one or several splits.
    select_kernel(kernel_override, kernel)
    rng = np.random.default_rng(head_dim + scale_offset)
    for kv_len, group in ((5, 4), (40, 4), (1500, 8), (4103, 4)):
        result = run_attention(
            rng,
            batch=2,
            kv_len=kv_len,
            group=group,
            head_dim=head_dim,
            q_dtype=mx.float16,
            scale_offset=scale_offset,
        )
        assert_attention_close(*result, rtol=rtol_for(mx.float16, head_dim, 4, 4))


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("q_offset", (1, 4))
def test_attention_half_queries_unaligned_query_rows(kernel_override, q_offset, kernel):
    # The tensor-core kernel reads query rows in 16-byte loads; rows that do not start
    # on a 16-byte boundary are copied first.
    select_kernel(kernel_override, kernel)
    rng = np.random.default_rng(40 + q_offset)
    for q_dtype in (mx.float16, mx.bfloat16):
        result = run_attention(
            rng,
            batch=2,
            q_len=2,
            kv_len=700,
            group=4,
            q_dtype=q_dtype,
            q_offset=q_offset,
        )
        assert_attention_close(*result, rtol=rtol_for(q_dtype, 128, 4, 4))


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("splits", ("3", "36"))
def test_attention_half_queries_merge_with_tail(kernel_override, splits, kernel):
    # 4-bit keys split over the tensor-core kernel's blocks, merged by the merge kernel
    # launched after it, which attends to the tail too.
    select_kernel(kernel_override, kernel)
    kernel_override("splits", splits)
    rng = np.random.default_rng(7 + int(splits))
    for head_dim, q_dtype, tail in (
        (128, mx.float16, 0),
        (64, mx.bfloat16, 36),
        (256, mx.float16, 5),
    ):
        result = run_attention(
            rng,
            batch=2,
            q_len=1,
            kv_len=9000,
            group=4,
            head_dim=head_dim,
            q_dtype=q_dtype,
            tail=tail,
        )
        assert_attention_close(*result, rtol=rtol_for(q_dtype, head_dim, 4, 4))


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("mask", MASKS, ids=[":".join(m) for m in MASKS])
def test_attention_half_queries_masks(kernel_override, mask, kernel):
    select_kernel(kernel_override, kernel)
    rng = np.random.default_rng(hash(mask) % 1000)
    for kv_len, head_dim in ((40, 64), (3001, 128)):
        result = run_attention(
            rng,
            batch=2,
            q_len=3,
            kv_len=kv_len,
            mask=mask,
            causal=True,
            head_dim=head_dim,
            q_dtype=mx.float16,
        )
        assert_attention_close(*result, rtol=rtol_for(mx.float16, head_dim, 4, 4))


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("splits", ("1", "3", "64"))
def test_attention_half_queries_forced_splits(kernel_override, splits, kernel):
    select_kernel(kernel_override, kernel)
    kernel_override("splits", splits)
    rng = np.random.default_rng(100 + int(splits))
    for kv_len in (1, 130, 9000):
        q_len = min(kv_len, 2)
        result = run_attention(rng, kv_len=kv_len, q_len=q_len, group=4, q_dtype=mx.bfloat16)
        assert_attention_close(*result, rtol=rtol_for(mx.bfloat16, 128, 4, 4))


@pytest.mark.parametrize("kernel", ("default", "simd"))
def test_attention_half_queries_large_magnitude(kernel_override, kernel):
    # bfloat16 queries beyond float16's range: the tensor-core kernel scales them down
    # by a power of two and the scores back up.
    select_kernel(kernel_override, kernel)
    rng = np.random.default_rng(77)
    k_words, k_scales, k_hat = reference_cache(rng, 1, 2, 64, 64, 128, 4)
    v_words, v_scales, v_hat = reference_cache(rng, 1, 2, 64, 64, 128, 4)
    # scale * log2(e) * |q| reaches ~5e4 (> 2^14): the scaled-down path is taken.
    q = mx.array(1e5 * rng.standard_normal((1, 8, 1, 128)).astype(np.float32)).astype(mx.bfloat16)
    scale = 1.0 / math.sqrt(128)
    out, lse = ops.compressed_attention(
        q,
        mx.array(k_words),
        mx.array(k_scales),
        mx.array(v_words),
        mx.array(v_scales),
        mx.array(centroids_np(128, 4)),
        mx.array(centroids_np(128, 4)),
        64,
        scale,
        4,
        4,
        False,
        stream=gpu(),
    )
    ref_out, ref_lse = reference.attention(to_np(q), k_hat, v_hat, scale, 64, False)
    out, lse = np.array(out), np.array(lse)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_attention_close(out, lse, ref_out, ref_lse, v_hat, rtol=1e-2)


@pytest.mark.parametrize("kernel", ("default", "simd"))
@pytest.mark.parametrize("splits", ("1", "3", "64"))
def test_attention_forced_split_counts(kernel_override, splits, kernel):
    # The split count is a tuning choice; every choice must give the same result.
    select_kernel(kernel_override, kernel)
    kernel_override("splits", splits)
    rng = np.random.default_rng(int(splits))
    q_dtype = query_dtype(kernel, int(splits))
    for kv_len in (1, 130, 9000):
        q_len = min(kv_len, 2)
        result = run_attention(rng, kv_len=kv_len, q_len=q_len, group=4, q_dtype=q_dtype)
        assert_attention_close(*result, rtol=rtol_for(q_dtype, 128, 4, 4))


@pytest.mark.parametrize("splits", ("auto", "1", "3"))
@pytest.mark.parametrize("kernel", ("default", "simt", "simd"))
@pytest.mark.parametrize("q_dtype", (mx.float32, mx.float16, mx.bfloat16))
def test_attention_with_tail(kernel_override, q_dtype, kernel, splits):
    # The tail joins the split-K merge; one split must still write partials for it.
    select_kernel(kernel_override, kernel)
    if splits != "auto":
        kernel_override("splits", splits)
    rng = np.random.default_rng(7 + len(splits))
    for kv_len, head_dim, tail, q_len, causal in (
        (17, 64, 1, 1, True),
        (300, 128, 52, 1, True),
        (9000, 128, 36, 4, False),
        (4097, 256, 256, 8, True),
    ):
        result = run_attention(
            rng,
            kv_len=kv_len,
            q_len=q_len,
            group=4,
            head_dim=head_dim,
            tail=tail,
            causal=causal,
            q_dtype=q_dtype,
        )
        assert_attention_close(*result, rtol=rtol_for(q_dtype, head_dim, 4, 4))


@pytest.mark.parametrize("splits", ("auto", "1"))
@pytest.mark.parametrize("kernel", ("default", "simt", "simd"))
@pytest.mark.parametrize("q_dtype", (mx.float32, mx.float16, mx.bfloat16))
@pytest.mark.parametrize("head_dim", (64, 128, 256))
def test_attention_model_space_queries(kernel_override, head_dim, q_dtype, kernel, splits):
    # rotation_signs: the kernels rotate the queries (the tensor-core kernel in its
    # query fragments, the portable one in its registers) and the merge rotates the
    # compressed tokens' output back, also with a single split; the tail is in model
    # space and joins after. Centered: the merge adds the means back.
    select_kernel(kernel_override, kernel)
    if splits != "auto":
        kernel_override("splits", splits)
    rng = np.random.default_rng(head_dim + 7)
    rtol = rtol_for(q_dtype, head_dim, 4, 4)
    if q_dtype == mx.bfloat16:
        rtol *= 8  # the model-space tail carries bfloat16's 8-bit mantissa
    for kv_len, q_len, tail, rotate_output, centered in (
        (40, 1, 0, True, False),
        (6000, 3, 0, False, False),
        (900, 2, 12, True, False),
        (5000, 1, 36, True, True),
        (300, 2, 0, True, True),
        (64, 1, 36, False, True),
    ):
        out, lse, ref_out, ref_lse, v_max = run_model_space_attention(
            rng,
            head_dim=head_dim,
            q_dtype=q_dtype,
            kv_len=kv_len,
            q_len=q_len,
            tail=tail,
            rotate_output=rotate_output,
            group=8 if head_dim == 128 else 4,
            stream=gpu(),
            centered=centered,
        )
        err = np.abs(out - ref_out).max() / v_max
        assert err <= rtol, f"kv_len {kv_len}: out error {err:.3g} of max |v|"
        np.testing.assert_allclose(lse, ref_lse, rtol=rtol, atol=rtol)


# ---------------------------------------------------------------------------
# the CUDA emulation of Metal's simdgroup matrices (metal/tq_portable.h)


def metal_lane_layout():
    """Row and first column of the two elements each of the 32 lanes holds of an 8x8
    simdgroup matrix, as Metal lays them out (MLX's steel/attn/mma.h, get_coord)."""
    lane = np.arange(32)
    qid = lane // 4
    row = (qid & 4) + (lane // 2) % 4
    col = (qid & 2) * 2 + (lane % 2) * 2
    return row, col


def held(m):
    """What the lanes hold of the 8x8 matrix m: [lane][2] flattened."""
    row, col = metal_lane_layout()
    return np.stack([m[row, col], m[row, col + 1]], axis=1).ravel()


def test_metal_lane_layout_covers_the_matrix_once():
    row, col = metal_lane_layout()
    cells = sorted(zip(np.r_[row, row].tolist(), np.r_[col, col + 1].tolist()))
    assert cells == [(r, c) for r in range(8) for c in range(8)]


@pytest.mark.skipif(_ext.gpu_backend() != "cuda", reason="emulation of the CUDA build")
def test_simdgroup_matrix_emulation():
    # One warp runs load (plain, transposed, half, at an origin of a wider matrix),
    # multiply-accumulate (float and half inputs) and store (plain, transposed), and
    # the diagonal constructor; every lane's elements must be those of Metal's layout.
    rng = np.random.default_rng(28)
    a, b, c = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3))
    got = np.array(
        _ext._simdgroup_matrix_check(a.ravel().tolist(), b.ravel().tolist(), c.ravel().tolist()),
        np.float32,
    ).reshape(8, 64)
    a16 = a.astype(np.float16).astype(np.float32)
    b16 = b.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(got[0], held(a))
    np.testing.assert_array_equal(got[1], held(a.T))
    np.testing.assert_array_equal(got[2], held(a16))
    np.testing.assert_array_equal(got[3], held(b))
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(got[4].reshape(8, 8), want, rtol=0, atol=1e-5)
    want16 = a16.astype(np.float64) @ b16.astype(np.float64) + c
    np.testing.assert_allclose(got[5].reshape(8, 8), want16, rtol=0, atol=1e-5)
    np.testing.assert_allclose(got[6].reshape(8, 8), want.T, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(got[7].reshape(8, 8), 2.5 * np.eye(8, dtype=np.float32))
    with pytest.raises(ValueError, match="_simdgroup_matrix_check"):
        _ext._simdgroup_matrix_check([1.0], b.ravel().tolist(), c.ravel().tolist())


def test_attention_matches_cpu_op():
    # Same inputs through the CPU kernel and the GPU kernel.
    rng = np.random.default_rng(5)
    batch, kv_heads, group, q_len, kv_len, head_dim = 1, 2, 4, 2, 3333, 128
    k_words, k_scales, _ = reference_cache(rng, batch, kv_heads, kv_len, kv_len, head_dim, 3)
    v_words, v_scales, _ = reference_cache(rng, batch, kv_heads, kv_len, kv_len, head_dim, 4)
    q = rng.standard_normal((batch, kv_heads * group, q_len, head_dim)).astype(np.float32)
    results = []
    for device in (mx.Device(mx.cpu), mx.Device(mx.gpu)):
        out, lse = ops.compressed_attention(
            mx.array(q),
            mx.array(k_words),
            mx.array(k_scales),
            mx.array(v_words),
            mx.array(v_scales),
            mx.array(centroids_np(head_dim, 3)),
            mx.array(centroids_np(head_dim, 4)),
            kv_len,
            0.09,
            3,
            4,
            True,
            stream=device,
        )
        results.append((np.array(out), np.array(lse)))
    (co, cl), (go, gl) = results
    np.testing.assert_allclose(go, co, rtol=0, atol=1e-5 * np.abs(co).max())
    np.testing.assert_allclose(gl, cl, rtol=1e-5)
