# Copyright © 2026 turboquant_mlx contributors.

"""Names the batch cache's modules share (see :mod:`turboquant_mlx.batch`)."""

import mlx.core as mx

_PREFIX = "[turboquant_mlx.batch]"
_MASK_MEMO = {}  # the last decode step's compressed-column mask and its layout

# The single cache's settings a batch keeps (all of them but the runtime ones).
_SETTINGS = (
    "key_bits",
    "value_bits",
    "seed",
    "fp16_sink_tokens",
    "fp16_recent_tokens",
    "rollback_tokens",
    "center",
    "query_aware_keys",
    "rope_pairing",
    "rope_dims",
    "calibration_tokens",
    "rotate_values",
)


def _settings_of(cache) -> dict:
    return {name: getattr(cache, name) for name in _SETTINGS}


def _roll_rows(x: mx.array, shifts: mx.array) -> mx.array:
    """Each row ``b`` of ``x`` ``(B, H, N, ...)`` rolled right by ``shifts[b]`` on axis 2."""
    n = x.shape[2]
    idx = (mx.arange(n)[None, :] - shifts[:, None]) % n  # (B, N)
    idx = idx.reshape(idx.shape[:1] + (1, n) + (1,) * (x.ndim - 3))
    return mx.take_along_axis(x, mx.broadcast_to(idx, x.shape), axis=2)
