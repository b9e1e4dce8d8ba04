# Copyright © 2026 turboquant_mlx contributors.

"""Calibration of the levers of :class:`~turboquant_mlx.cache.TurboQuantKVCache`:
mean centering (``center``) and query-aware key scaling (``query_aware_keys``).

Until calibration the cache holds its non-sink tokens unquantized and adds up the
energies of the queries it attends with; calibration fixes ``mu_k``, ``mu_v`` and the
key scale ``a`` from them (:mod:`turboquant_mlx.cache` gives the maths), and keeps
what a trim back before the calibration point needs to undo it. A decode or
verification block that reaches the calibration point is split there
(:meth:`CalibrationMixin._attend_calibrating`).
"""

from typing import Optional

import mlx.core as mx


def _mask_rows(mask, a: int, b: int, L: int):
    """Rows ``[a, b)`` of an attention mask for ``L`` queries (masks without a row
    per query apply to every row as they are)."""
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == L and L > 1:
        return mask[..., a:b, :]
    return mask


class CalibrationMixin:
    """The levers' calibration, its undo and the query energies it reads (module
    docstring). A part of :class:`TurboQuantKVCache`, on its attributes."""

    @property
    def calibrated(self) -> bool:
        """Whether the levers' transform is fixed (always True without levers)."""
        return self._calibrated

    @property
    def key_mean(self) -> Optional[mx.array]:
        """``mu_k`` ``(B, H_kv, 1, D)`` float32, or None (no centering / not calibrated)."""
        return self._model_channels(self._mu_k)

    @property
    def value_mean(self) -> Optional[mx.array]:
        """``mu_v`` ``(B, H_kv, 1, D)`` float32, or None."""
        return self._model_channels(self._mu_v)

    @property
    def key_scale(self) -> Optional[mx.array]:
        """The key scale ``a`` ``(B, H_kv, 1, D)`` float32, or None (identity)."""
        return self._model_channels(self._key_scale)

    def _model_channels(self, a: Optional[mx.array]) -> Optional[mx.array]:
        """``a`` without the padded channels (see :class:`TurboQuantKVCache`)."""
        if a is None or self._codec is None or a.shape[-1] == self._codec.model_dim:
            return a
        return a[..., : self._codec.model_dim]

    def _held_tokens(self) -> int:
        """Non-sink tokens held (all unquantized while not calibrated)."""
        return max(0, self.offset - self.fp16_sink_tokens)

    def _observe_queries(self, queries: mx.array, q0: int):
        """Adds the energies of queries at positions ``>= fp16_sink_tokens`` (the
        queries are at positions ``[q0, q0 + L)``)."""
        if not self.query_aware_keys:
            return
        B, n_q, L, D = queries.shape
        skip = max(0, self.fp16_sink_tokens - q0)
        if skip >= L:
            return
        marks = self._q_marks
        marks.append((q0 + skip, self._q_energy, self._q_count))
        while marks[0][0] < q0 - self.rollback_tokens:
            marks.pop(0)  # no exact trim reaches back there
        q = queries[:, :, skip:] if skip else queries
        H = self._batch_heads[1]
        G = n_q // H
        q = q.astype(mx.float32).reshape(B, H, G * (L - skip), D)
        e = mx.sum(q * q, axis=2)
        self._q_energy = e if self._q_energy is None else self._q_energy + e
        self._q_count += G * (L - skip)

    def _trim_queries(self, new: int):
        """Takes the energies of the queries at positions ``>= new`` back out (exact where
        they came in steps or blocks that start at or after ``new``)."""
        marks = self._q_marks
        i = len(marks)
        while i and marks[i - 1][0] >= new:
            i -= 1
        if i < len(marks):
            _, self._q_energy, self._q_count = marks[i]
            del marks[i:]

    def _pair_mean(self, e: mx.array) -> mx.array:
        """Averages channel energies ``(..., D)`` over the RoPE pairs."""
        D = e.shape[-1]
        d = min(self.rope_dims or D, D)
        if self.rope_pairing == "none" or d < 2:
            return e
        if self.rope_pairing == "half":
            h = d // 2
            m = (e[..., :h] + e[..., h : 2 * h]) * 0.5
            parts = [m, m]
            if 2 * h < D:
                parts.append(e[..., 2 * h :])
        else:  # interleaved
            h = d // 2
            pairs = e[..., : 2 * h].reshape(e.shape[:-1] + (h, 2))
            m = mx.mean(pairs, axis=-1, keepdims=True)
            parts = [mx.broadcast_to(m, pairs.shape).reshape(e.shape[:-1] + (2 * h,))]
            if 2 * h < D:
                parts.append(e[..., 2 * h :])
        return mx.concatenate(parts, axis=-1)

    key_scale_max = 8.0  # a is clamped to [1/key_scale_max, key_scale_max]

    def _key_scale_from(self, q_energy: mx.array, k_energy: mx.array) -> mx.array:
        """``a`` ``(B, H, 1, D)`` from mean query and (centered) key energies ``(B, H, D)``
        (computed on the model's channels; 1 on padded channels)."""
        D = q_energy.shape[-1]
        if self._codec is not None and self._codec.model_dim < D:
            m = self._codec.model_dim
            a = self._key_scale_from(q_energy[..., :m], k_energy[..., :m])
            return mx.concatenate([a, mx.ones(a.shape[:-1] + (D - m,), a.dtype)], axis=-1)
        sq = self._pair_mean(q_energy)
        sk = self._pair_mean(k_energy)
        # Regularize channels without energy (a few calibration tokens) relative to
        # the head's mean energy.
        sq = sq + 1e-3 * mx.mean(sq, axis=-1, keepdims=True) + 1e-30
        sk = sk + 1e-3 * mx.mean(sk, axis=-1, keepdims=True) + 1e-30
        r = mx.sqrt(sq / sk)
        a2 = r / mx.mean(r, axis=-1, keepdims=True)
        lim = float(self.key_scale_max) ** 2
        a2 = mx.clip(a2, 1.0 / lim, lim)
        a2 = mx.where(mx.isfinite(a2), a2, 1.0)
        return mx.sqrt(a2)[:, :, None, :]

    def _attend_calibrating(self, queries, scale, mask, sinks):
        """A decode or verification block before calibration, as single-token steps at
        its positions would run: the queries' energies are added one position at a time,
        and if the block holds the position at which the cache holds
        ``calibration_tokens`` non-sink tokens, the levers are calibrated there, from
        the tokens up to that position and the queries up to it: the block's later
        tokens and queries (drafts that verification may reject) take no part. Queries
        before that position see the uncalibrated cache, the others the calibrated
        one."""
        L = queries.shape[2]
        q0 = self.offset - L
        if self._held_tokens() < self.calibration_tokens:
            for i in range(L):
                self._observe_queries(queries[:, :, i : i + 1], q0 + i)
            return self._attend_step(queries, scale, mask, sinks)
        # Rows of the queries before the calibrating position (the update calibrates a
        # cache that already held that many tokens, so that position is in the block).
        k = min(max(self.fp16_sink_tokens + self.calibration_tokens - 1 - q0, 0), L - 1)
        for i in range(k + 1):
            self._observe_queries(queries[:, :, i : i + 1], q0 + i)
        outs = []
        if k:
            outs.append(
                self._attend_block(queries[:, :, :k], q0, scale, _mask_rows(mask, 0, k, L), sinks)
            )
        self._calibrate(end=q0 + k + 1)
        outs.append(self._attend_step(queries[:, :, k:], scale, _mask_rows(mask, k, L, L), sinks))
        if len(outs) == 1:
            return outs[0]
        return mx.concatenate([o.astype(mx.float32) for o in outs], axis=2)

    def _calibrate(self, end: Optional[int] = None):
        """Fixes ``mu`` and ``a`` from the held tokens before position ``end`` (default:
        all of them) and the queries seen, then stores the held tokens as the calibrated
        layout says (:mod:`turboquant_mlx.cache`).

        Until ``rollback_tokens`` tokens after ``end`` have arrived (calibrated at a
        prompt block's attention call: until the next update), the cache keeps what it
        needs to undo this: a trim back before ``end`` returns it to the uncalibrated
        cache that never saw the trimmed tokens (see :meth:`trim`)."""
        S = self.fp16_sink_tokens
        n = self._held_tokens()
        hk, hv = self._win_k, self._win_v
        m = n if end is None else max(0, min(n, end - S))
        if m:
            # (Contiguous, as single-token steps would have them: the same reduction.)
            ck, cv = (
                (hk, hv) if m == n else (mx.contiguous(hk[:, :, :m]), mx.contiguous(hv[:, :, :m]))
            )
            k = ck.astype(mx.float32)
            if self.center:
                self._mu_k = mx.mean(k, axis=2, keepdims=True)
                self._mu_v = mx.mean(cv.astype(mx.float32), axis=2, keepdims=True)
                k = k - self._mu_k
            if self.query_aware_keys and self._q_count:
                self._key_scale = self._key_scale_from(
                    self._q_energy / self._q_count, mx.mean(k * k, axis=2)
                )
        self._calib_undo = (S + m, hk, hv, self._q_marks, self._q_energy, self._q_count)
        # (_fresh: the last update was a prompt block, whose queries are calibrating.)
        self._calib_in_prompt = end is None and self._fresh is not None
        self._calibrated = True
        self._drop_code_space()
        self._q_energy, self._q_count, self._q_marks = None, 0, []
        self._win_k = self._win_v = None
        self._win_start = S
        self._n_comp = 0
        self._kv.private = False  # slots from 0 on are written again
        if n:
            self._store(hk, hv, S)

    def _uncalibrate(self, new: int):
        """Back to the uncalibrated cache of the first ``new`` tokens (``new`` before
        the calibration point; see :meth:`_calibrate`)."""
        _, hk, hv, marks, q_energy, q_count = self._calib_undo
        self._calib_undo = None
        held = max(0, new - self.fp16_sink_tokens)
        self._calibrated = False
        self._mu_k = self._mu_v = self._key_scale = None
        self._q_marks, self._q_energy, self._q_count = marks, q_energy, q_count
        self._drop_code_space()
        self._n_comp = 0
        self._kv.private = False  # slots from 0 on are written again
        self._win_k = hk[:, :, :held] if held else None
        self._win_v = hv[:, :, :held] if held else None
        self._win_buf = None
        self._win_start = self.fp16_sink_tokens

    def _lever_arrays(self):
        return (self._mu_k, self._mu_v, self._key_scale, self._q_energy)
