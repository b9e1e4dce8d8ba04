# Copyright © 2026 turboquant_mlx contributors.

"""NumPy reference of the TurboQuant codec and of attention on its output.

Written for clarity, not speed, and independent of MLX: tests check the
primitives, kernels and fallbacks against these functions. The arithmetic of
:func:`quantize` follows ``docs/ARCHITECTURE.md`` step by step in float32, the
bit layout of :func:`pack` is the storage layout of the cache, and
:func:`attention` works in float64 on already dequantized keys and values.
"""

import numpy as np

_ERROR_PREFIX = "[turboquant_mlx.reference]"
_SUPPORTED_BITS = (2, 3, 4)


def _check_bits(bits):
    if isinstance(bits, bool) or bits not in _SUPPORTED_BITS:
        raise ValueError(f"{_ERROR_PREFIX} bits must be one of 2, 3, 4, got {bits!r}.")


def _check_packable(head_dim, bits):
    if head_dim <= 0 or (head_dim * bits) % 32 != 0:
        raise ValueError(
            f"{_ERROR_PREFIX} head_dim * bits must be a positive multiple of 32, "
            f"got head_dim={head_dim}, bits={bits}."
        )


def _check_centroids(centroids_f32, bits):
    c = np.asarray(centroids_f32, dtype=np.float32)
    if c.shape != (1 << bits,):
        raise ValueError(
            f"{_ERROR_PREFIX} expected {1 << bits} centroids for bits={bits}, got shape {c.shape}."
        )
    return c


def rotate(x: np.ndarray, rotation_matrix: np.ndarray) -> np.ndarray:
    """Returns ``R x`` along the last axis, computed in float64.

    Args:
        x: Array of shape ``(..., D)``.
        rotation_matrix: The ``(D, D)`` matrix ``R``, e.g. ``Rotation.matrix()``.

    Returns:
        A float64 array of shape ``(..., D)``.
    """
    return np.asarray(x, dtype=np.float64) @ np.asarray(rotation_matrix, np.float64).T


def unrotate(y: np.ndarray, rotation_matrix: np.ndarray) -> np.ndarray:
    """Returns ``R^T y`` along the last axis (the inverse of :func:`rotate`), in float64."""
    return np.asarray(y, dtype=np.float64) @ np.asarray(rotation_matrix, np.float64)


def quantize(y_rot: np.ndarray, centroids_f32: np.ndarray, bits: int):
    """Quantizes rotated vectors to codes and one norm-correcting scale each.

    Every step is float32 arithmetic, as in the kernels:
    ``norm = sqrt(sum(y^2))``, ``inv = 1 / norm`` (0 for a zero vector),
    ``u = y * inv``, ``code = #{k : u > t_k}`` with the float32 midpoints ``t_k``
    (a tie goes to the lower code), ``cn = sqrt(sum(c[code]^2))`` and
    ``scale = norm / cn`` (0 if ``cn`` is 0), stored as float16. The sums use
    NumPy's summation order; another order may change the last bit of a norm.

    Args:
        y_rot: Rotated vectors of shape ``(..., D)``; converted to float32.
        centroids_f32: The ``2**bits`` ascending centroids; converted to float32.
        bits: Bits per code, one of 2, 3, 4.

    Returns:
        A tuple ``(codes, scales)``: uint8 codes of shape ``(..., D)`` and
        float16 scales of shape ``(...)``.
    """
    _check_bits(bits)
    c = _check_centroids(centroids_f32, bits)
    y = np.asarray(y_rot, dtype=np.float32)
    boundaries = (c[:-1] + c[1:]) * np.float32(0.5)

    norm = np.sqrt(np.sum(y * y, axis=-1, dtype=np.float32))
    with np.errstate(divide="ignore"):
        inv = np.where(norm > 0, np.float32(1) / norm, np.float32(0)).astype(np.float32)
    u = y * inv[..., None]
    codes = np.sum(u[..., None] > boundaries, axis=-1).astype(np.uint8)

    chosen = c[codes]
    cn = np.sqrt(np.sum(chosen * chosen, axis=-1, dtype=np.float32))
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(cn > 0, norm / cn, np.float32(0)).astype(np.float32)
    return codes, scale.astype(np.float16)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Packs codes into uint32 words as one LSB-first bit stream per vector.

    The code of coordinate ``i`` occupies stream bits ``[i * bits, (i + 1) * bits)``
    and stream bit ``k`` is bit ``k % 32`` of word ``k // 32``; with 3 bits a code
    may straddle two words.

    Args:
        codes: Integer codes of shape ``(..., D)``, each below ``2**bits``.
        bits: Bits per code, one of 2, 3, 4.

    Returns:
        A uint32 array of shape ``(..., D * bits // 32)``.
    """
    _check_bits(bits)
    codes = np.asarray(codes)
    head_dim = codes.shape[-1]
    _check_packable(head_dim, bits)
    if codes.size and (codes.min() < 0 or codes.max() >= 1 << bits):
        raise ValueError(
            f"{_ERROR_PREFIX} codes must lie in [0, {1 << bits}) for bits={bits}, "
            f"got range [{codes.min()}, {codes.max()}]."
        )
    codes = codes.astype(np.uint32)
    # Bit j of code i is stream bit i * bits + j.
    stream = (codes[..., :, None] >> np.arange(bits, dtype=np.uint32)) & 1
    stream = stream.reshape(*codes.shape[:-1], head_dim * bits // 32, 32)
    return np.sum(stream << np.arange(32, dtype=np.uint32), axis=-1, dtype=np.uint32)


def unpack(words: np.ndarray, bits: int, head_dim: int) -> np.ndarray:
    """Inverts :func:`pack`.

    Args:
        words: uint32 words of shape ``(..., head_dim * bits // 32)``.
        bits: Bits per code, one of 2, 3, 4.
        head_dim: Number of codes per vector.

    Returns:
        A uint8 array of codes of shape ``(..., head_dim)``.
    """
    _check_bits(bits)
    _check_packable(head_dim, bits)
    words = np.asarray(words, dtype=np.uint32)
    if words.ndim == 0 or words.shape[-1] != head_dim * bits // 32:
        raise ValueError(
            f"{_ERROR_PREFIX} expected {head_dim * bits // 32} words per vector for "
            f"head_dim={head_dim}, bits={bits}, got shape {words.shape}."
        )
    stream = (words[..., :, None] >> np.arange(32, dtype=np.uint32)) & 1
    stream = stream.reshape(*words.shape[:-1], head_dim, bits)
    codes = np.sum(stream << np.arange(bits, dtype=np.uint32), axis=-1)
    return codes.astype(np.uint8)


def dequantize(codes: np.ndarray, scales: np.ndarray, centroids_f32: np.ndarray) -> np.ndarray:
    """Returns the rotated-space vectors ``float(scale) * c[code]`` in float32.

    Args:
        codes: Integer codes of shape ``(..., D)``.
        scales: Scales of shape ``(...)`` (float16 as stored).
        centroids_f32: The codebook; converted to float32.

    Returns:
        A float32 array of shape ``(..., D)``.
    """
    c = np.asarray(centroids_f32, dtype=np.float32)
    scales = np.asarray(scales).astype(np.float32)
    return scales[..., None] * c[np.asarray(codes, dtype=np.intp)]


def attention(
    q_rot: np.ndarray,
    k_hat: np.ndarray,
    v_hat: np.ndarray,
    scale: float,
    kv_len: int,
    causal: bool,
    mask=None,
    tail_k=None,
    tail_v=None,
):
    """Scaled dot-product attention in float64, with the cache's conventions.

    Args:
        q_rot: Queries of shape ``(B, H_q, L, D)``.
        k_hat: Keys of shape ``(B, H_kv, N, D)`` with ``N >= kv_len``; only the
            first ``kv_len`` keys are used.
        v_hat: Values of the same shape as ``k_hat``.
        scale: Factor applied to ``q . k``.
        kv_len: Number of valid keys.
        causal: If true, query ``i`` sees key ``j`` only when
            ``j <= kv_len - L + i``.
        mask: Optional bool (True = keep) or additive mask, broadcastable to
            ``(B, H_q, L, kv_len)``. An additive mask is added after scaling.
        tail_k, tail_v: Optional extra keys and values ``(B, H_kv, T, D)`` that every
            query sees, after the ``kv_len`` keys (neither causal nor mask applies).

    Returns:
        A tuple ``(out, lse)``: ``out`` of shape ``(B, H_q, L, D)`` and ``lse``, the
        natural log-sum-exp of the scaled masked scores, of shape ``(B, H_q, L)``,
        both float64. Query head ``h`` reads KV head ``h // (H_q // H_kv)``. A row
        without any visible key gets ``out = 0`` and ``lse = -inf``.
    """
    q = np.asarray(q_rot, dtype=np.float64)
    k = np.asarray(k_hat, dtype=np.float64)
    v = np.asarray(v_hat, dtype=np.float64)
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"{_ERROR_PREFIX} expected 4-D q and equal-shape 4-D k, v, got "
            f"q {q.shape}, k {k.shape}, v {v.shape}."
        )
    batch, num_q_heads, q_len, _ = q.shape
    num_kv_heads = k.shape[1]
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"{_ERROR_PREFIX} H_q={num_q_heads} is not a multiple of H_kv={num_kv_heads}."
        )
    if not 0 <= kv_len <= k.shape[2]:
        raise ValueError(f"{_ERROR_PREFIX} kv_len must lie in [0, {k.shape[2]}], got {kv_len}.")

    # Give every query head its own copy of the KV head it reads.
    group = num_q_heads // num_kv_heads
    k = np.repeat(k[:, :, :kv_len], group, axis=1)
    v = np.repeat(v[:, :, :kv_len], group, axis=1)

    scores = scale * (q @ np.swapaxes(k, -1, -2))
    keep = np.ones((batch, num_q_heads, q_len, kv_len), dtype=bool)
    if causal:
        i = np.arange(q_len)[:, None]
        j = np.arange(kv_len)[None, :]
        keep &= j <= kv_len - q_len + i
    if mask is not None:
        mask = np.asarray(mask)
        try:
            mask = np.broadcast_to(mask, keep.shape)
        except ValueError:
            raise ValueError(
                f"{_ERROR_PREFIX} mask of shape {mask.shape} does not broadcast to {keep.shape}."
            ) from None
        if mask.dtype == np.bool_:
            keep &= mask
        else:
            scores = scores + mask.astype(np.float64)
    scores = np.where(keep, scores, -np.inf)
    if tail_k is not None:
        tk = np.repeat(np.asarray(tail_k, dtype=np.float64), group, axis=1)
        tv = np.repeat(np.asarray(tail_v, dtype=np.float64), group, axis=1)
        scores = np.concatenate([scores, scale * (q @ np.swapaxes(tk, -1, -2))], axis=-1)
        v = np.concatenate([v, tv], axis=2)

    # Softmax with the row maximum subtracted; rows without a visible key
    # (maximum -inf) are set to out = 0, lse = -inf explicitly.
    row_max = np.max(scores, axis=-1, initial=-np.inf)
    visible = np.isfinite(row_max)
    shift = np.where(visible, row_max, 0.0)
    weights = np.exp(scores - shift[..., None])
    total = np.sum(weights, axis=-1)
    safe_total = np.where(visible, total, 1.0)
    out = (weights @ v) / safe_total[..., None]
    out = np.where(visible[..., None], out, 0.0)
    with np.errstate(divide="ignore"):
        lse = np.where(visible, shift + np.log(safe_total), -np.inf)
    return out, lse


def bytes_per_token(head_dim: int, key_bits: int, value_bits: int) -> int:
    """Bytes one token occupies per KV head: packed codes plus a float16 scale, K and V.

    Args:
        head_dim: Head dimension ``D``.
        key_bits: Bits per key coordinate.
        value_bits: Bits per value coordinate.

    Returns:
        ``(D * key_bits / 8 + 2) + (D * value_bits / 8 + 2)``.
    """
    _check_bits(key_bits)
    _check_bits(value_bits)
    _check_packable(head_dim, key_bits)
    _check_packable(head_dim, value_bits)
    return (head_dim * key_bits // 8 + 2) + (head_dim * value_bits // 8 + 2)
