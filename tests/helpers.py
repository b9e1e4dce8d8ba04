# Copyright © 2026 turboquant_mlx contributors.

"""Shared helpers of the op tests: inputs, poisoned caches built by the NumPy
reference, and comparisons that know where float32 rounding may legitimately differ.

Everything that defines an expected value here goes through ``reference.py`` (NumPy),
never through the ops under test.
"""

import mlx.core as mx
import numpy as np

from turboquant_mlx import _ext, codebook, reference

# Poison written into cache slots that an op must neither read nor write.
POISON_WORD = np.uint32(0xDEADBEEF)
# A float16 NaN with a payload: any read of it turns a result into NaN, and its exact
# bit pattern shows that a slot was left untouched.
POISON_SCALE_BITS = np.uint16(0x7E5A)


def boundary_rtol(head_dim):
    """Relative distance to a decision boundary within which a code may flip.

    u = y / ||y|| depends on the order in which ||y||^2 is summed: float32 recursive
    summation of D positive terms is off by at most (D - 1) ulp-halves, the square
    root halves that, and 1/norm and the product add an ulp each. Two implementations
    with different orders may differ by twice that: about (D + 8) * 2^-24, 1.6e-5 at
    D = 256 (in practice far less).
    """
    return (head_dim + 8) * 2.0**-24


def centroids_np(head_dim, bits):
    """float32 NumPy codebook, as every implementation uses it."""
    return codebook.lloyd_max_centroids(head_dim, bits).astype(np.float32)


def to_np(a):
    """NumPy copy of an MLX array (bfloat16 goes through float32)."""
    if a.dtype == mx.bfloat16:
        a = a.astype(mx.float32)
    return np.array(a)


def random_tokens(rng, shape, spread=True):
    """Gaussian float32 tokens of varied norms, with a zero vector among them.

    With ``spread`` the per-vector norms span four orders of magnitude, as keys and
    values of a real model do; vector 0 of every (batch, head) row is all zeros.
    """
    x = rng.standard_normal(shape).astype(np.float32)
    if spread:
        x *= np.exp(rng.uniform(-4.6, 4.6, shape[:-1] + (1,))).astype(np.float32)
        x[..., 0, :] = 0.0
    return x


def poisoned_cache(rng, batch, heads, capacity, head_dim, bits):
    """(words, scales) NumPy cache buffers full of poison."""
    words = np.full((batch, heads, capacity, head_dim * bits // 32), POISON_WORD, np.uint32)
    # Random bits in half the slots: poison must not look like one constant pattern.
    noise = rng.integers(0, 2**32, words.shape, dtype=np.uint64).astype(np.uint32)
    words = np.where(rng.random(words.shape[:3] + (1,)) < 0.5, noise, words)
    scales = np.full((batch, heads, capacity), POISON_SCALE_BITS, np.uint16).view(np.float16)
    return words, scales


def reference_cache(rng, batch, heads, capacity, length, head_dim, bits, x=None):
    """A cache whose first ``length`` slots hold reference-quantized tokens.

    Returns:
        (words, scales, dequantized): NumPy buffers of the whole capacity (slots
        ``length..capacity-1`` poisoned) and the float32 reference dequantization of
        the valid slots, shape ``(batch, heads, length, head_dim)``.
    """
    c = centroids_np(head_dim, bits)
    if x is None:
        x = rng.standard_normal((batch, heads, length, head_dim)).astype(np.float32)
    codes, scales = reference.quantize(x, c, bits)
    words, all_scales = poisoned_cache(rng, batch, heads, capacity, head_dim, bits)
    words[:, :, :length] = reference.pack(codes, bits)
    all_scales[:, :, :length] = scales
    return words, all_scales, reference.dequantize(codes, scales, c)


def near_boundary(x, centroids):
    """Bool mask (..., D) of coordinates within boundary_rtol of a decision boundary.

    A boundary at exactly 0 is never ambiguous: the sign of u is the sign of y.
    """
    y = np.asarray(x, np.float64)
    norm = np.sqrt(np.sum(y * y, axis=-1, keepdims=True))
    u = np.divide(y, norm, out=np.zeros_like(y), where=norm > 0)
    t = codebook.boundaries_f32(centroids).astype(np.float64)
    rtol = boundary_rtol(y.shape[-1])
    return np.any(np.abs(u[..., None] - t) < rtol * np.abs(t), axis=-1)


def assert_codes_and_scales(words, scales, x, bits, max_ambiguous=1e-3):
    """Checks packed codes and scales against the reference quantization of ``x``.

    Codes must be equal everywhere except at coordinates within rounding distance of
    a boundary (asserted rare); scales must be equal as float16, 1 ulp allowed for
    summation order, except in vectors with such a coordinate (a flipped code changes
    the norm correction).
    """
    x = np.asarray(x, np.float32)
    head_dim = x.shape[-1]
    c = centroids_np(head_dim, bits)
    want_codes, want_scales = reference.quantize(x, c, bits)
    got_codes = reference.unpack(np.asarray(words), bits, head_dim)
    ambiguous = near_boundary(x, c)
    assert ambiguous.sum() <= max(2, max_ambiguous * ambiguous.size), (
        f"{ambiguous.sum()} of {ambiguous.size} coordinates near a boundary"
    )
    mismatch = (got_codes != want_codes) & ~ambiguous
    assert not mismatch.any(), (
        f"{mismatch.sum()} codes differ, first at {np.argwhere(mismatch)[0]}: "
        f"got {got_codes[mismatch][:8]}, want {want_codes[mismatch][:8]}"
    )
    assert_scales_close(scales, want_scales, skip=ambiguous.any(axis=-1))


def assert_scales_close(got, want, skip=None):
    """float16 scales equal up to 1 ulp, and exactly equal for nearly all of them."""
    got = np.asarray(got, np.float16).view(np.uint16).astype(np.int32)
    want = np.asarray(want, np.float16).view(np.uint16).astype(np.int32)
    keep = np.ones(got.shape, bool) if skip is None else ~skip
    ulps = np.abs(got - want)[keep]
    assert ulps.size == 0 or ulps.max() <= 1, f"scales differ by up to {ulps.max()} ulp"
    # A rounding-mode mismatch (truncation, say) would be off by one ulp half the time.
    off = int(np.count_nonzero(ulps))
    assert off <= max(2, 0.01 * ulps.size), f"{off} of {ulps.size} scales 1 ulp off"


def graph_nodes(path, *outputs):
    """Labels of the graph nodes that compute ``outputs`` (``mx.export_to_dot`` into
    ``path``)."""
    import re

    mx.export_to_dot(str(path), *outputs)
    return re.findall(r'label ="([^"]+)"', path.read_text())


def assert_op_error(excinfo, op, *needles):
    """The message starts with the op's prefix and contains every needle."""
    msg = str(excinfo.value)
    assert msg.startswith(f"[turboquant_mlx.{op}]"), msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


# The CUDA build runs float16 / bfloat16 queries at head dims 64, 128, 256 (key bits >=
# value bits) on tensor cores: float16 queries and centroids, float16 probabilities,
# float32 accumulation. Its error against the float64 reference is that of half-precision
# products (~1e-3 of max |v|), the precision class of MLX's float16 SDPA;
# the "attention" kernel override "portable" selects the exact kernel for them. The
# simdgroup-matrix kernel (metal/tq_attention_simd.h: Metal's path for those queries and
# head dims, any bit widths; on CUDA with the override "simd") is of the same class.
TENSOR_CORE_RTOL = 4e-3


def tensor_core_path(q_dtype, head_dim, key_bits, value_bits, device=None):
    """Whether compressed_attention on ``device`` (default: MLX's default device) runs
    the CUDA tensor-core kernel for these queries and bit widths."""
    device = mx.default_device() if device is None else device
    return (
        device == mx.gpu
        and _ext.gpu_backend() == "cuda"
        and q_dtype in (mx.float16, mx.bfloat16)
        and head_dim in (64, 128, 256)
        and key_bits >= value_bits
        and _ext._kernel_overrides()["attention"] is None
    )


def simd_path(q_dtype, head_dim, device=None):
    """Whether compressed_attention on ``device`` (default: MLX's default device) runs the
    simdgroup-matrix kernel: Metal's default for float16 / bfloat16 queries at head dims
    64, 128, 256 (the "attention" kernel override "portable" turns it off), CUDA's with
    the override "simd"."""
    device = mx.default_device() if device is None else device
    if (
        device != mx.gpu
        or q_dtype not in (mx.float16, mx.bfloat16)
        or head_dim not in (64, 128, 256)
    ):
        return False
    backend, kernel = _ext.gpu_backend(), _ext._kernel_overrides()["attention"]
    if backend == "metal":
        return kernel != "portable"
    return backend == "cuda" and kernel == "simd"


def attention_rtol(q_dtype, head_dim, key_bits, value_bits, exact=1e-5, device=None):
    """Tolerance of compressed_attention against the reference (relative to max |v|)."""
    if tensor_core_path(q_dtype, head_dim, key_bits, value_bits, device) or simd_path(
        q_dtype, head_dim, device
    ):
        return TENSOR_CORE_RTOL
    return exact
