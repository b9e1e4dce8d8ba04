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

from .levers import QueryEnergies, key_scale_from


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
        if self.query_aware_keys:
            self._queries.observe(
                queries, q0, self.fp16_sink_tokens, self._batch_heads[1], self.rollback_tokens
            )

    key_scale_max = 8.0  # a is clamped to [1/key_scale_max, key_scale_max]

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
            queries = self._queries
            if self.query_aware_keys and queries.count:
                self._key_scale = key_scale_from(
                    queries.energy / queries.count,
                    mx.mean(k * k, axis=2),
                    model_dim=self._codec.model_dim,
                    pairing=self.rope_pairing,
                    rope_dims=self.rope_dims,
                    limit=self.key_scale_max,
                )
        self._calib_undo = (S + m, hk, hv, self._queries)
        # (_fresh: the last update was a prompt block, whose queries are calibrating.)
        self._calib_in_prompt = end is None and self._fresh is not None
        self._calibrated = True
        self._drop_code_space()
        self._queries = QueryEnergies()
        self._win_k = self._win_v = None
        self._win_start = S
        self._n_comp = 0
        self._kv.private = False  # slots from 0 on are written again
        if n:
            self._store(hk, hv, S)

    def _uncalibrate(self, new: int):
        """Back to the uncalibrated cache of the first ``new`` tokens (``new`` before
        the calibration point; see :meth:`_calibrate`)."""
        _, hk, hv, queries = self._calib_undo
        self._calib_undo = None
        held = max(0, new - self.fp16_sink_tokens)
        self._calibrated = False
        self._mu_k = self._mu_v = self._key_scale = None
        self._queries = queries
        self._drop_code_space()
        self._n_comp = 0
        self._kv.private = False  # slots from 0 on are written again
        self._win_k = hk[:, :, :held] if held else None
        self._win_v = hv[:, :, :held] if held else None
        self._win_buf = None
        self._win_start = self.fp16_sink_tokens

    def _lever_arrays(self):
        return (self._mu_k, self._mu_v, self._key_scale, self._queries.energy)
