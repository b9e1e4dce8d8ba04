"""Plain-MLX implementations of the compressed-cache ops.

They follow docs/ARCHITECTURE.md exactly and run on any MLX device: they are what a GPU
stream uses when this build has no GPU kernels, and the reference the kernels are tested
against for the shapes they support. They materialize dequantized K/V, so they are slow
and use memory proportional to the cache; the kernels never do.
"""

from functools import lru_cache

import mlx.core as mx
import numpy as np

__all__ = [
    "pack",
    "unpack",
    "rotate",
    "quantize",
    "quantize_append",
    "dequantize",
    "compressed_attention",
]


@lru_cache(maxsize=None)
def _bit_layout(head_dim: int, bits: int):
    """Word index, bit offset and straddle info of each coordinate in the bit stream."""
    pos = np.arange(head_dim) * bits
    word, off = pos // 32, pos % 32
    straddles = off + bits > 32
    next_word = np.minimum(word + 1, head_dim * bits // 32 - 1)
    hi_shift = np.where(straddles, 32 - off, 0)
    words = head_dim * bits // 32
    # Coordinates contributing to each word: their low part, and straddling high parts.
    members = [np.nonzero(word == w)[0] for w in range(words)]
    spill = [np.nonzero(straddles & (next_word == w))[0] for w in range(words)]
    return word, off, next_word, straddles, hi_shift, members, spill


def unpack(words: mx.array, bits: int, head_dim: int) -> mx.array:
    """Codes (uint32, one per coordinate) from packed words (..., head_dim*bits/32)."""
    word, off, next_word, straddles, hi_shift, _, _ = _bit_layout(head_dim, bits)
    lo = mx.right_shift(mx.take(words, mx.array(word), axis=-1), mx.array(off.astype(np.uint32)))
    hi = mx.left_shift(
        mx.take(words, mx.array(next_word), axis=-1), mx.array(hi_shift.astype(np.uint32))
    )
    hi = mx.where(mx.array(straddles), hi, mx.zeros_like(hi))
    return mx.bitwise_and(mx.bitwise_or(lo, hi), mx.array((1 << bits) - 1, dtype=mx.uint32))


def pack(codes: mx.array, bits: int) -> mx.array:
    """Packs codes (..., D) into uint32 words (..., D*bits/32), LSB-first bit stream."""
    head_dim = codes.shape[-1]
    word, off, _, _, hi_shift, members, spill = _bit_layout(head_dim, bits)
    codes = codes.astype(mx.uint32)
    lo = mx.left_shift(codes, mx.array(off.astype(np.uint32)))  # bits past 31 drop out
    hi = mx.right_shift(codes, mx.array(np.where(hi_shift > 0, hi_shift, 31).astype(np.uint32)))
    out = []
    for w in range(len(members)):
        # Bit fields of different coordinates are disjoint, so a sum is an OR.
        acc = mx.sum(mx.take(lo, mx.array(members[w]), axis=-1), axis=-1)
        if len(spill[w]):
            acc = acc + mx.sum(mx.take(hi, mx.array(spill[w]), axis=-1), axis=-1)
        out.append(acc.astype(mx.uint32))
    return mx.stack(out, axis=-1)


def rotate(x: mx.array, signs, inverse: bool = False) -> mx.array:
    """``R x`` (or ``R^T x``) in float32 for ``R = H diag(signs) / sqrt(D)``, as the
    ops' ``rotation_signs`` define it."""
    D = x.shape[-1]
    s_np = np.asarray(signs, dtype=np.float32)
    if D & (D - 1) or s_np.shape != (D,) or not np.all(np.abs(s_np) == 1.0):
        raise ValueError(
            f"[turboquant_mlx.rotate] rotation_signs must be {D} values of +1 or -1 for a "
            f"power-of-two head dim; got {s_np.shape[0] if s_np.ndim == 1 else s_np.shape} "
            f"values for head dim {D}."
        )
    s = mx.array(s_np)
    x = x.astype(mx.float32)
    scale = x.shape[-1] ** -0.5
    if inverse:
        return s * mx.hadamard_transform(x, scale=scale)
    return mx.hadamard_transform(s * x, scale=scale)


def _boundaries(centroids: mx.array) -> mx.array:
    c = centroids.astype(mx.float32)
    return (c[:-1] + c[1:]) * 0.5


def quantize(x_rot: mx.array, centroids: mx.array, bits: int):
    """Codes (uint32, per coordinate) and float16 scales of rotated vectors (..., D)."""
    y = x_rot.astype(mx.float32)
    c = centroids.astype(mx.float32)
    norm = mx.sqrt(mx.sum(y * y, axis=-1, keepdims=True))
    inv = mx.where(norm > 0, 1.0 / mx.where(norm > 0, norm, 1.0), 0.0)
    u = y * inv
    codes = mx.sum(u[..., None] > _boundaries(c), axis=-1).astype(mx.uint32)
    chosen = c[codes]
    cn = mx.sqrt(mx.sum(chosen * chosen, axis=-1, keepdims=True))
    scale = mx.where(cn > 0, norm / mx.where(cn > 0, cn, 1.0), 0.0)
    return codes, scale[..., 0].astype(mx.float16)


def _check_finite(x: mx.array, op: str = "quantize_append"):
    if not mx.all(mx.isfinite(x)).item():
        raise ValueError(
            f"[turboquant_mlx.{op}] input has non-finite values (NaN or Inf); nothing was written."
        )


def _check_scales(x: mx.array, scales: mx.array, op: str = "quantize_append"):
    """Refuses tokens whose float16 scale (norm / ||c||) overflows to inf."""
    overflow = np.array(mx.logical_not(mx.isfinite(scales)))
    if overflow.any():
        y = x.astype(mx.float32)
        norms = np.array(mx.sqrt(mx.sum(y * y, axis=-1)))
        b, h, t = np.argwhere(overflow)[0]
        raise ValueError(
            f"[turboquant_mlx.{op}] token {t} of head {h} (batch {b}) has norm "
            f"{norms[b, h, t]:g}: its scale exceeds the float16 range (65504); "
            "nothing was written."
        )


def quantize_append(
    codes, scales, x_rot, centroids, offset: int, bits: int, *, op: str = "quantize_append"
):
    """Fallback of ops.quantize_append on rotated tokens (same contract; costs a buffer
    copy; refusals name ``op``). ops.quantize_append centers and rotates model-space
    tokens first."""
    _check_finite(x_rot, op)
    q, s = quantize(x_rot, centroids, bits)
    _check_scales(x_rot, s, op)
    length = x_rot.shape[2]
    codes = mx.array(codes)
    scales = mx.array(scales)
    codes[:, :, offset : offset + length, :] = pack(q, bits)
    scales[:, :, offset : offset + length] = s
    return codes, scales


def dequantize(
    codes,
    scales,
    centroids,
    bits: int,
    start: int,
    length: int,
    dtype=mx.float32,
    before: int = 0,
    after: int = 0,
    prefix=None,
    suffix=None,
):
    """Rotated-space vectors of tokens [start, start+length) in ``dtype``, at slots
    [before, before+length) of (B, H, before+length+after, D); the other slots are the
    rows of ``prefix`` / ``suffix`` where given, else zeros. (The kernels' ``into``, a
    reused output buffer, has no counterpart here: the result is a new array.)"""
    head_dim = codes.shape[-1] * 32 // bits
    words = codes[:, :, start : start + length, :]
    idx = unpack(words, bits, head_dim)
    values = centroids.astype(mx.float32)[idx]
    out = (values * scales[:, :, start : start + length, None].astype(mx.float32)).astype(dtype)

    def around(rows, n):
        return rows if rows is not None else mx.zeros(out.shape[:2] + (n, head_dim), dtype)

    parts = [x for x in (around(prefix, before), out, around(suffix, after)) if x.shape[2]]
    if len(parts) <= 1:
        return parts[0] if parts else out
    return mx.concatenate(parts, axis=2)


def compressed_attention(
    q,
    k_codes,
    k_scales,
    v_codes,
    v_scales,
    k_centroids,
    v_centroids,
    kv_len: int,
    scale: float,
    key_bits: int,
    value_bits: int,
    causal: bool = True,
    mask=None,
    tail_k=None,
    tail_v=None,
    rotation_signs=None,
    rotate_output: bool = True,
    key_mean=None,
    value_mean=None,
):
    """Fallback of ops.compressed_attention (same contract): the compressed tokens are
    dequantized into the queries' space (rotated back with ``rotation_signs``, the
    means added back), the tail joins them, and plain attention runs over all."""
    B, n_q, L, D = q.shape
    n_kv = k_codes.shape[1]
    G = n_q // n_kv
    k = dequantize(k_codes, k_scales, k_centroids, key_bits, 0, kv_len)
    v = dequantize(v_codes, v_scales, v_centroids, value_bits, 0, kv_len)
    if rotation_signs is not None:
        k = rotate(k, rotation_signs, inverse=True)
        if rotate_output:
            v = rotate(v, rotation_signs, inverse=True)
    if key_mean is not None:
        k = k + key_mean.astype(mx.float32)
        v = v + value_mean.astype(mx.float32)
    q = q.astype(mx.float32).reshape(B, n_kv, G, L, D)
    scores = (q @ k[:, :, None].swapaxes(-1, -2)) * scale  # (B, n_kv, G, L, kv_len)
    scores = scores.reshape(B, n_q, L, kv_len)
    neg_inf = mx.array(-np.inf, dtype=mx.float32)
    if causal:
        limit = kv_len - L + mx.arange(L)[:, None]
        scores = mx.where(mx.arange(kv_len)[None, :] <= limit, scores, neg_inf)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, neg_inf)
        else:
            scores = scores + mask.astype(mx.float32)
    if tail_k is not None and tail_k.shape[2] > 0:
        T = tail_k.shape[2]
        tail_scores = (q @ tail_k.astype(mx.float32)[:, :, None].swapaxes(-1, -2)) * scale
        scores = mx.concatenate(
            [mx.broadcast_to(scores, (B, n_q, L, kv_len)), tail_scores.reshape(B, n_q, L, T)],
            axis=-1,
        )
        v = mx.concatenate([v, tail_v.astype(mx.float32)], axis=2)
        kv_len += T
    lse = mx.logsumexp(scores, axis=-1)
    # A row that sees no key is 0 with lse -inf; a NaN score (a NaN query, say) makes
    # its row NaN, as the CPU kernel does.
    visible = lse != neg_inf
    probs = mx.exp(scores - mx.where(visible, lse, 0.0)[..., None])
    probs = mx.where(visible[..., None], probs, 0.0)
    out = probs.reshape(B, n_kv, G, L, kv_len) @ v[:, :, None]
    return out.reshape(B, n_q, L, D), lse
