# Copyright © 2026 turboquant_mlx contributors.

"""The code space of a layer's compressed tokens, as pure functions of arrays.

The codec quantizes keys and values after centering (``- mu``), scaling the keys by
``a`` and rotating them (values too unless ``rotate_values`` is off; see
:mod:`turboquant_mlx.cache`). These functions take queries, fp16 tokens and the
attention op's outputs to and from that space. Decode steps run them through
mx.compile (one traced graph per shape, shared by all layers): ~30 small
element-wise operations per layer and token fuse into a few kernels, which matters
on GPUs, where each launch costs microseconds. ``TURBOQUANT_COMPILE=0`` runs them
eagerly (debugging); the cache's modules read ``codespace._COMPILE`` at each call.
"""

import os

import mlx.core as mx

from .attention import dense_attention, merge_two
from .rotation import rotate_forward, rotate_inverse


def _half_queries_on_gpu(dtype) -> bool:
    """Whether rotated queries of ``dtype`` go to the op in that dtype (see
    ``TurboQuantKVCache._compressed_queries``)."""
    return dtype in (mx.float16, mx.bfloat16) and mx.default_device() == mx.gpu


_COMPILE = os.environ.get("TURBOQUANT_COMPILE", "1") != "0"


def _all_finite(keys, values):
    return mx.logical_and(mx.all(mx.isfinite(keys)), mx.all(mx.isfinite(values)))


def _to_code_space(keys, values, mu_k, mu_v, key_scale, signs, matrix, rot_scale, rotate_values):
    """Keys and values ``(B, H_kv, n, D)`` as the codec quantizes them, float32:
    centered (``mu_k``/``mu_v`` or None), keys scaled by ``a`` (or None), rotated
    (values only when ``rotate_values``)."""
    keys = keys.astype(mx.float32)
    values = values.astype(mx.float32)
    if mu_k is not None:
        keys = keys - mu_k
        values = values - mu_v
    if key_scale is not None:
        keys = keys * key_scale
    keys = rotate_forward(keys, signs, matrix, rot_scale)
    if rotate_values:
        values = rotate_forward(values, signs, matrix, rot_scale)
    return keys, values


def _queries_to_codes(q, key_scale, signs, matrix, rot_scale, keep_dtype):
    """Queries ``(B, H_q, L, D)`` in the space of the stored keys: divided by the
    per-channel key scale ``a`` (``(B, H_kv, 1, D)`` or None), then rotated; float32,
    or the queries' dtype when ``keep_dtype``."""
    dtype = q.dtype if keep_dtype else mx.float32
    q = q.astype(mx.float32)
    if key_scale is not None:
        B, n_q, L, D = q.shape
        H = key_scale.shape[1]
        q = (q.reshape(B, H, n_q // H, L, D) / key_scale[:, :, None]).reshape(B, n_q, L, D)
    return rotate_forward(q, signs, matrix, rot_scale).astype(dtype)


def _codes_to_model(out_rot, lse, q, signs, matrix, rot_scale, mu_k, mu_v, scale):
    """``(out, lse)`` of the compressed segment in the model's space, from the op's
    output and lse on the stored (rotated, centered, scaled) keys and values.

    ``signs``/``matrix`` (both None when values are stored unrotated) undo the value
    rotation; the keys' rotation is in the queries. Centering shifted every score of a
    query by ``-scale * (q . mu_k)`` and every value by ``-mu_v``; the normalized
    output of a softmax is unchanged by the former and a convex combination, so
    ``mu_v`` comes back as is.
    """
    out = (
        out_rot
        if signs is None and matrix is None
        else rotate_inverse(out_rot, signs, matrix, rot_scale)
    )
    if mu_k is None:
        return out, lse
    B, n_q, L, D = q.shape
    H = mu_k.shape[1]
    G = n_q // H
    qg = q.astype(mx.float32).reshape(B, H, G, L, D)
    shift = (qg @ mu_k[:, :, None].swapaxes(-1, -2))[..., 0]  # (B, H, G, L)
    lse = lse + scale * shift.reshape(B, n_q, L)
    seen = (lse > float("-inf"))[..., None]  # rows without a visible key stay 0
    out = out.reshape(B, H, G, L, D) + mu_v[:, :, None]
    out = mx.where(seen, out.reshape(B, n_q, L, D), 0.0)
    return out, lse


def _decode_output(out_rot, lse, q, signs, matrix, rot_scale, mu_k, mu_v, scale, dense_k, dense_v):
    """The layer's attention output ``(B, H_q, L, D)`` float32: the compressed
    segment's result merged with attention over the fp16 segments ``dense_k`` /
    ``dense_v`` (lists of ``(B, H_kv, n, D)``, possibly empty), which every query
    sees whole."""
    part = _codes_to_model(out_rot, lse, q, signs, matrix, rot_scale, mu_k, mu_v, scale)
    if not dense_k:
        return part[0].astype(mx.float32)
    k = dense_k[0] if len(dense_k) == 1 else mx.concatenate(dense_k, axis=2)
    v = dense_v[0] if len(dense_v) == 1 else mx.concatenate(dense_v, axis=2)
    return merge_two(dense_attention(q, k, v, scale), part)[0]


def _decode_inputs(
    q, key_scale, signs, matrix, rot_scale, keep_dtype, mu_k, mu_v, rotate_values, dense_k, dense_v
):
    """The op's inputs for a decode step whose fp16 segments (sinks, window; lists of
    ``(B, H_kv, n, D)``) go in as its tail, for ops on code-space queries: the queries
    in code space and the segments as the codec would quantize them (centered, scaled,
    rotated), float32. Scores and values of the tail are then in the compressed
    tokens' space, so one softmax covers both: centering shifts every score of a query
    by the same amount."""
    q_codes = _queries_to_codes(q, key_scale, signs, matrix, rot_scale, keep_dtype)
    if not dense_k:
        return q_codes, None, None
    k = dense_k[0] if len(dense_k) == 1 else mx.concatenate(dense_k, axis=2)
    v = dense_v[0] if len(dense_v) == 1 else mx.concatenate(dense_v, axis=2)
    tail_k, tail_v = _to_code_space(
        k, v, mu_k, mu_v, key_scale, signs, matrix, rot_scale, rotate_values
    )
    return q_codes, tail_k, tail_v


def _tail_decode_output(out_rot, signs, matrix, rot_scale, mu_v, like):
    """The layer's output ``(B, H_q, L, D)`` in ``like``'s dtype from the op's output over the
    compressed tokens and a tail: every row saw a key, so ``mu_v`` comes back as is.
    The rows are grouped by KV head first, so that the rotation's last step, ``mu_v``
    and the cast fuse into one kernel."""
    B, n_q, L, D = out_rot.shape
    H = 1 if mu_v is None else mu_v.shape[1]
    out = out_rot.reshape(B, H, n_q // H, L, D)
    if signs is not None or matrix is not None:
        out = rotate_inverse(out, signs, matrix, rot_scale)
    if mu_v is not None:
        out = out + mu_v[:, :, None]
    return out.astype(like.dtype).reshape(B, n_q, L, D)


_fused_all_finite = mx.compile(_all_finite)
_fused_to_code_space = mx.compile(_to_code_space)
_fused_queries_to_codes = mx.compile(_queries_to_codes)
_fused_decode_output = mx.compile(_decode_output)
_fused_decode_inputs = mx.compile(_decode_inputs)
_fused_tail_decode_output = mx.compile(_tail_decode_output)
