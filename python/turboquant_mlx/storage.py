# Copyright © 2026 turboquant_mlx contributors.

"""The compressed segment of :class:`~turboquant_mlx.cache.TurboQuantKVCache`: its
buffers (packed codes and float16 scales per token, grown in ``step`` chunks),
appending tokens to them (quantizing in place where the buffers are the cache's
own), reading them back, and the cache's byte counts.
"""

import math
from typing import Tuple

import mlx.core as mx

from . import codespace
from ._common import _PREFIX, _check_int
from .codespace import _fused_to_code_space, _to_code_space


class StorageMixin:
    """The compressed segment's buffers, appends and read-back, and the byte counts
    (module docstring). A part of :class:`TurboQuantKVCache`, on its attributes."""

    def reserve(self, tokens: int):
        """Hints the total number of tokens this cache will hold.

        The compressed buffers are then allocated once at that size instead of
        growing (each growth copies the buffers).
        """
        self._reserve_tokens = _check_int("tokens", tokens)
        if self._kv is not None:
            self._ensure_capacity(self._reserve_tokens - self.fp16_sink_tokens)

    def _ensure_capacity(self, needed: int):
        cap = self._kv.capacity
        if needed <= cap:
            return
        new_cap = max(
            needed, int(math.ceil(cap * self.growth)), self._reserve_tokens - self.fp16_sink_tokens
        )
        new_cap = -(-new_cap // self.step) * self.step
        self._kv.grow(new_cap, self._n_comp, *self._batch_heads)

    def _quantize(self, keys: mx.array, values: mx.array):
        """Appends tokens to the compressed segment."""
        n = keys.shape[2]
        if n == 0:
            return
        signs = self._op_signs()
        if signs is not None:
            # Model-space tokens as they are: the op centers and rotates them.
            self._append_code_space(keys, values, signs, self._mu_k, self._mu_v)
            return
        # Decode-sized appends have a fixed shape: compiled (see codespace._COMPILE).
        fn = (
            _fused_to_code_space
            if codespace._COMPILE and n <= self.decode_max_queries
            else _to_code_space
        )
        k_rot, v_rot = fn(
            keys,
            values,
            self._mu_k,
            self._mu_v,
            self._key_scale,
            *self._codec.rotation.params(),
            self.rotate_values,
        )
        self._append_code_space(k_rot, v_rot)

    def _op_signs(self):
        """The signs for ops that apply the rotation themselves, or None: then the ops
        take model-space tokens, queries and tails, center the tokens and undo the
        centering themselves (power-of-two head dims; not with query-aware keys,
        whose per-channel scale the ops do not apply)."""
        if self.query_aware_keys:
            return None
        return self._codec.rotation.kernel_signs

    def _append_code_space(
        self, k_rot: mx.array, v_rot: mx.array, signs=None, mu_k=None, mu_v=None
    ):
        """Appends tokens in code space (see :func:`_to_code_space`), or, with
        ``signs``, model-space tokens that the op centers (``mu_k``/``mu_v``, or
        None) and rotates."""
        n = k_rot.shape[2]
        self._ensure_capacity(self._n_comp + n)
        self._kv.write(
            k_rot,
            v_rot,
            self._n_comp,
            key_signs=signs,
            value_signs=signs if self.rotate_values else None,
            key_mean=mu_k,
            value_mean=mu_v,
        )
        self._n_comp += n

    def _dequantized(self, start, length, dtype):
        """Keys and values of compressed tokens ``[start, start+length)`` in the model's
        space (unrotated, unscaled, mean added back)."""
        k, v = self._kv.decoded(start, length)
        k = self._codec.rotation.inverse(k)
        if self.rotate_values:
            v = self._codec.rotation.inverse(v)
        if self._key_scale is not None:
            k = k / self._key_scale
        if self._mu_k is not None:
            k = k + self._mu_k
            v = v + self._mu_v
        return k.astype(dtype), v.astype(dtype)

    def dequantized_keys_values(self, dtype=None) -> Tuple[mx.array, mx.array]:
        """All cached keys and values ``(B, H_kv, offset, D)`` in position order, as
        attention sees them (fp16 segments as stored, the rest dequantized).

        Materializes a full-precision copy: meant for tests, debugging and export.
        """
        if self.offset == 0:
            raise ValueError(f"{_PREFIX} the cache is empty.")
        ns, c, wpos = self._layout()
        dtype = dtype or (
            self._sink_k.dtype if ns else self._win_k.dtype if self.offset > wpos else mx.float32
        )
        ks, vs = [], []
        if ns:
            ks.append(self._sink_k.astype(dtype))
            vs.append(self._sink_v.astype(dtype))
        if c:
            k, v = self._dequantized(0, c, dtype)
            ks.append(k)
            vs.append(v)
        if self.offset > wpos:
            i0 = wpos - self._win_start
            ks.append(self._win_k[:, :, i0:].astype(dtype))
            vs.append(self._win_v[:, :, i0:].astype(dtype))
        k, v = mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)
        if self._codec.padded:
            k, v = k[..., : self._codec.model_dim], v[..., : self._codec.model_dim]
        return k, v

    @property
    def nbytes(self) -> int:
        """Bytes of every buffer the cache holds (allocated capacity included): the
        compressed segment, the fp16 sinks and window (its whole buffer), the levers,
        and the decode steps' copies of the sinks and window."""
        window = (self._win_k, self._win_v)
        if self._win_buf is not None and self._win_buf.view is self._win_k:
            window = (self._win_buf.keys, self._win_buf.values)
        arrays = (self._sink_k, self._sink_v) + window + self._lever_arrays()
        code_space = []
        if self._code_tail is not None:
            code_space += [self._code_tail.keys, self._code_tail.values]
        if self._ring is not None:
            code_space += [self._ring.keys, self._ring.values]
        for _, k, v in self._ring_tokens:
            code_space += [k, v]
        if self._calib_undo is not None:  # (the tokens held before the calibration)
            code_space += self._calib_undo[1:3]
        compressed = 0 if self._kv is None else self._kv.nbytes
        return compressed + sum(a.nbytes for a in arrays + tuple(code_space) if a is not None)

    @property
    def used_nbytes(self) -> int:
        """Bytes of the stored tokens (capacity not yet used is not counted)."""
        total = 0 if self._kv is None else self._kv.used_nbytes(self._n_comp)
        for a in (self._sink_k, self._sink_v, self._win_k, self._win_v) + self._lever_arrays():
            if a is not None:
                total += a.nbytes
        return total

    def dense_nbytes(self, bytes_per_element: int = 2) -> int:
        """Bytes an uncompressed cache of the same tokens would hold (default fp16)."""
        if self._codec is None:
            return 0
        B, H = self._batch_heads
        return 2 * B * H * self.offset * self._codec.model_dim * bytes_per_element
