# Copyright © 2026 turboquant_mlx contributors.

"""What the cache's modules share: the error prefix, argument checks, head-dim
padding and small array helpers."""

import copy
from typing import Optional

import mlx.core as mx
import numpy as np

_PREFIX = "[turboquant_mlx.cache]"
_SUPPORTED_BITS = (2, 3, 4)
_ROPE_PAIRINGS = ("none", "half", "interleaved")
_HEAD_DIM_ALIGN = 32  # the kernels take head dims that are multiples of this


def padded_head_dim(head_dim: int) -> int:
    """The head dim a cache stores for a model head dim: ``head_dim`` itself where the
    kernels take it (a multiple of 32 in [32, 256]), else the next multiple of 32 for
    an even ``head_dim`` below 256 (the vectors are zero-padded; see
    :class:`TurboQuantKVCache`). Raises ValueError for other head dims."""
    d = int(head_dim)
    if d <= 0 or d % 2 or d > 256:
        raise ValueError(
            f"head dim {head_dim} is not supported (even head dims up to 256 are: "
            f"multiples of {_HEAD_DIM_ALIGN} as they are, others zero-padded to the next one)"
        )
    return -(-d // _HEAD_DIM_ALIGN) * _HEAD_DIM_ALIGN


def _pad_last(x: mx.array, d: int) -> mx.array:
    """``x`` zero-padded along its last axis to ``d``."""
    extra = d - x.shape[-1]
    if extra == 0:
        return x
    return mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def _check_int(name, value, minimum=0):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{_PREFIX} {name} must be an integer >= {minimum}, got {value!r}.")
    return int(value)


def _check_bits(name, value):
    if isinstance(value, bool) or value not in _SUPPORTED_BITS:
        raise ValueError(f"{_PREFIX} {name} must be one of 2, 3, 4, got {value!r}.")
    return int(value)


def _cat(a: Optional[mx.array], b: mx.array) -> mx.array:
    """Concatenates along the token axis; the result never views a larger buffer."""
    if a is None or a.shape[2] == 0:
        return mx.contiguous(b)
    return mx.concatenate([a, b], axis=2)


def _empty(dtype) -> mx.array:
    return mx.zeros((0,), dtype=dtype)


def _is_empty(a) -> bool:
    return a is None or a.size == 0


def deepcopy_attributes(src, dst, memo):
    """Deep-copies ``src``'s attributes into ``dst`` (a cache's ``__deepcopy__``; mlx-lm's
    prompt cache deep-copies caches). MLX dtypes cannot be copied and are shared, also
    inside tuples (a GPU prompt block's pending finiteness check holds one)."""

    def copied(value):
        if isinstance(value, mx.Dtype):
            return value
        if type(value) is tuple:
            return tuple(copied(v) for v in value)
        return copy.deepcopy(value, memo)

    for key, value in src.__dict__.items():
        dst.__dict__[key] = copied(value)
