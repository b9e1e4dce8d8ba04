# Copyright © 2026 turboquant_mlx contributors.

"""The compressed buffer of one layer: keys and values as TurboQuant codes.

:class:`CompressedKV` holds, for ``B`` sequences (rows) and ``H`` KV heads, the packed codes
(``(B, H, capacity, words)`` uint32) and the float16 scales (``(B, H, capacity)``) of
keys and values, the :class:`~turboquant_mlx.codec.Codec` they were written with, and
whether the arrays are the buffer's alone. Token slots are addressed explicitly: the
single-sequence cache fills ``[0, n)`` in order, the batch cache addresses columns
shared by its rows. Both caches append, grow, read back and count bytes through it.

Writing in place. MLX holds an op's inputs until the device has run it, so the
buffers are never free to donate while the previous step runs, and an append that
waited for donation would copy the whole cache. The ops instead write in place when
the buffer says it is ``private``: the arrays are this buffer's alone and every slot
from the write position on is free. Whoever breaks that (a deep copy sharing the
arrays, a trim or re-calibration rewriting slots older arrays may still read, arrays
set from a caller's state) clears the flag; the next write then goes through the
copying ops once, and the buffer is private again.
"""

from typing import Optional, Tuple

import mlx.core as mx

from . import ops
from .codec import Codec

__all__ = ["CompressedKV"]


class CompressedKV:
    """Codes and scales of keys and values, written and read with ``codec`` (module
    docstring); no arrays until the first :meth:`grow` or :meth:`replace`."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.k_codes = self.k_scales = self.v_codes = self.v_scales = None
        self.private = True

    def replace(self, arrays, private: bool):
        """Sets ``(k_codes, k_scales, v_codes, v_scales)`` (Nones: empty): new arrays of
        this buffer's own (``private``), or arrays someone else may hold (a caller's
        state, views of the old ones)."""
        self._set(arrays)
        self.private = private

    @property
    def arrays(self) -> Tuple[Optional[mx.array], ...]:
        """``(k_codes, k_scales, v_codes, v_scales)``, the ops' buffer arguments."""
        return self.k_codes, self.k_scales, self.v_codes, self.v_scales

    def _set(self, arrays):
        self.k_codes, self.k_scales, self.v_codes, self.v_scales = arrays

    @property
    def capacity(self) -> int:
        return 0 if self.k_codes is None else self.k_codes.shape[2]

    def grow(self, capacity: int, keep: int, batch: int, heads: int):
        """Reallocates to ``capacity`` slots of ``batch`` rows and ``heads`` heads,
        keeping the first ``keep`` slots (the rest are zero). A growth copies: callers
        grow in chunks."""
        c = self.codec

        def grown(buf, tail, dtype):
            fresh = mx.zeros((batch, heads, capacity - keep) + tail, dtype=dtype)
            if buf is None or keep == 0:
                return fresh
            return mx.concatenate([buf[:, :, :keep], fresh], axis=2)

        self._set(
            (
                grown(self.k_codes, (c.key_words,), mx.uint32),
                grown(self.k_scales, (), mx.float16),
                grown(self.v_codes, (c.value_words,), mx.uint32),
                grown(self.v_scales, (), mx.float16),
            )
        )
        self.private = True  # new arrays

    def write(
        self,
        keys: mx.array,
        values: mx.array,
        start: int,
        *,
        key_signs=None,
        value_signs=None,
        key_mean=None,
        value_mean=None,
    ):
        """Quantizes ``(B, H, n, D)`` keys and values into slots ``[start, start + n)``
        (within the capacity). ``keys``/``values`` are in code space, or, with
        ``key_signs``/``value_signs`` (the codec's kernel signs), model space for the op
        to center on ``key_mean``/``value_mean`` (None: not centered) and rotate."""
        c = self.codec
        if self.private:
            # Written in place, keys and values in one node.
            self._set(
                ops.quantize_append_kv(
                    *self.arrays,
                    keys,
                    values,
                    c.key_centroids,
                    c.value_centroids,
                    start,
                    c.key_bits,
                    c.value_bits,
                    key_rotation_signs=key_signs,
                    value_rotation_signs=value_signs,
                    key_mean=key_mean,
                    value_mean=value_mean,
                )
            )
        else:
            self._set(
                self._quantized_apart(
                    self.arrays, keys, values, start, key_signs, value_signs, key_mean, value_mean
                )
            )
        # Without in_place the outputs reused buffers nothing else held, or are copies.
        self.private = True

    def _quantized_apart(
        self, arrays, keys, values, start, key_signs, value_signs, key_mean, value_mean
    ):
        """``arrays`` ``(k_codes, k_scales, v_codes, v_scales)`` with the tokens quantized
        into slots from ``start``, keys and values by one :func:`ops.quantize_append`
        each (the copying path: the outputs are new arrays where the inputs are held)."""
        c = self.codec
        kc, ks, vc, vs = arrays
        kc, ks = ops.quantize_append(
            kc,
            ks,
            keys,
            c.key_centroids,
            start,
            c.key_bits,
            rotation_signs=key_signs,
            mean=key_mean,
        )
        vc, vs = ops.quantize_append(
            vc,
            vs,
            values,
            c.value_centroids,
            start,
            c.value_bits,
            rotation_signs=value_signs,
            mean=value_mean,
        )
        return kc, ks, vc, vs

    def write_rows(self, keys, values, lo: int, starts, ends, *, key_signs, value_signs, means):
        """Quantizes columns ``[lo, lo + n)`` and keeps, for each row ``b``, only the
        new codes of columns ``[starts[b], ends[b])``: the others keep theirs (a batch
        whose rows' valid codes end at different columns)."""
        c = self.codec
        B, H, n = keys.shape[:3]
        fresh = (
            mx.zeros((B, H, n, c.key_words), mx.uint32),
            mx.zeros((B, H, n), mx.float16),
            mx.zeros((B, H, n, c.value_words), mx.uint32),
            mx.zeros((B, H, n), mx.float16),
        )
        new = self._quantized_apart(fresh, keys, values, 0, key_signs, value_signs, *means)
        end = lo + n
        cols = mx.arange(lo, end)[None, :]
        keep = (cols >= mx.array(starts)[:, None]) & (cols < mx.array(ends)[:, None])
        keep = keep[:, None, :]  # (B, 1, n)
        merged = []
        for buf, part in zip(self.arrays, new):
            k_ = keep if part.ndim == 3 else keep[..., None]
            buf[:, :, lo:end] = mx.where(k_, part, buf[:, :, lo:end])
            merged.append(buf)
        self._set(merged)
        self.private = True

    def ring_write(
        self,
        ring_keys,
        ring_values,
        keys,
        values,
        start: int,
        slot: int,
        *,
        key_signs,
        value_signs,
        key_mean,
        value_mean,
        after,
    ):
        """One node (:func:`ops.ring_append_kv`): the ring token at ``slot`` is quantized
        into slot ``start`` and the new ``keys``/``values`` take its place in the ring.
        Returns the ring's new ``(keys, values)``."""
        c = self.codec
        *codes, ring_k, ring_v = ops.ring_append_kv(
            *self.arrays,
            ring_keys,
            ring_values,
            keys,
            values,
            c.key_centroids,
            c.value_centroids,
            start,
            slot,
            c.key_bits,
            c.value_bits,
            key_rotation_signs=key_signs,
            value_rotation_signs=value_signs,
            key_mean=key_mean,
            value_mean=value_mean,
            after=after,
        )
        self._set(codes)
        self.private = True
        return ring_k, ring_v

    def decoded(
        self,
        start: int,
        length: int,
        dtype=mx.float32,
        key_rows=(None, None),
        value_rows=(None, None),
        into=(None, None),
    ):
        """Keys and values of slots ``[start, start + length)`` as stored (rotated,
        centered, scaled): :func:`ops.dequantize` of both in ``dtype``, each with its
        ``(prefix, suffix)`` rows around the tokens and the buffer it is written
        ``into`` (the prefill's)."""
        c = self.codec
        k = ops.dequantize(
            self.k_codes,
            self.k_scales,
            c.key_centroids,
            c.key_bits,
            start,
            length,
            dtype=dtype,
            prefix=key_rows[0],
            suffix=key_rows[1],
            into=into[0],
        )
        v = ops.dequantize(
            self.v_codes,
            self.v_scales,
            c.value_centroids,
            c.value_bits,
            start,
            length,
            dtype=dtype,
            prefix=value_rows[0],
            suffix=value_rows[1],
            into=into[1],
        )
        return k, v

    def attention(
        self,
        queries: mx.array,
        length: int,
        scale: float,
        causal: bool = False,
        mask=None,
        *,
        tail=(None, None),
        rotation_signs=None,
        rotate_output: bool = True,
        means=(None, None),
        out_dtype=None,
    ):
        """``(out, lse)`` of :func:`ops.compressed_attention` over slots ``[0, length)``
        and a ``tail`` ``(keys, values)``: queries in code space, or in model space with
        ``rotation_signs`` (the op rotates; ``rotate_output`` where values are stored
        rotated) and the ``means`` the tokens were centered on."""
        c = self.codec
        return ops.compressed_attention(
            queries,
            *self.arrays,
            c.key_centroids,
            c.value_centroids,
            length,
            scale,
            c.key_bits,
            c.value_bits,
            causal,
            mask,
            tail_k=tail[0],
            tail_v=tail[1],
            rotation_signs=rotation_signs,
            rotate_output=rotate_output,
            key_mean=means[0],
            value_mean=means[1],
            out_dtype=out_dtype,
        )

    @property
    def nbytes(self) -> int:
        """Bytes allocated (the whole capacity)."""
        return sum(a.nbytes for a in self.arrays if a is not None)

    def used_nbytes(self, tokens: int) -> int:
        """Bytes of ``tokens`` slots of every row and head."""
        if self.k_codes is None:
            return 0
        B, H = self.k_codes.shape[:2]
        return B * H * tokens * self.codec.token_bytes()
