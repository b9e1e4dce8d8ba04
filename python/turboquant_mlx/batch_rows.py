# Copyright © 2026 turboquant_mlx contributors.

"""The batch cache's per-row bookkeeping: sinks, calibration and quantization of the
tokens that leave the fp16 window (see :mod:`turboquant_mlx.batch`)."""

from typing import List

import mlx.core as mx

from ._batch_common import _PREFIX


class _RowSettling:
    """Part of :class:`~turboquant_mlx.batch.BatchTurboQuantKVCache`: works on its attributes."""

    # -- settling: sinks, calibration, quantization -----------------------------------

    def _real(self, b: int) -> int:
        return self._idx - self._pad[b]

    def _settle(self):
        """Brings every row to its layout after new tokens (none while a right-padded
        block waits for :meth:`finalize`): captures sinks, calibrates the rows that
        hold enough tokens, quantizes what left the window."""
        if not self._dirty or self._rpad is not None or self._dk is None:
            return
        self._dirty = False
        S, R = self.fp16_sink_tokens, self.fp16_recent_tokens
        B, idx = len(self._pad), self._idx
        pad = self._pad
        self._capture_sinks([idx] * B)
        self._calibrate_rows([idx] * B)
        # What left the window is quantized: each calibrated row's columns up to
        # idx - R (all of them without a window).
        self._compress_to([max(pad[b] + S, idx - R) for b in range(B)])
        self._update_need()

    def _capture_sinks(self, ends: List[int]):
        """Copies each row's first ``S`` real tokens (those before ``ends[b]``) into
        the sinks."""
        S, pad = self.fp16_sink_tokens, self._pad
        want = [min(S, max(0, e - p)) for e, p in zip(ends, pad)]
        if not any(w > n for w, n in zip(want, self._ns)):
            return
        d0, idx = self._d0, self._idx
        s = mx.arange(S)
        cols = mx.clip(mx.array(pad)[:, None] + s[None, :] - d0, 0, idx - d0 - 1)
        cols = mx.broadcast_to(cols[:, None, :, None], self._sk.shape)
        new = (
            (s[None, :] >= mx.array(self._ns)[:, None]) & (s[None, :] < mx.array(want)[:, None])
        )[:, None, :, None]
        self._sk = mx.where(new, mx.take_along_axis(self._dk, cols, axis=2), self._sk)
        self._sv = mx.where(new, mx.take_along_axis(self._dv, cols, axis=2), self._sv)
        self._ns = [max(w, n) for w, n in zip(want, self._ns)]

    def _prepare_block(self, L: int):
        """Before a prompt block's attention, as the single cache at this call: a row
        that now holds ``calibration_tokens`` non-sink tokens (the block's included)
        calibrates, and the older tokens are seen as stored with the block in (those
        it pushed out of the window compressed); the block itself is attended as it
        arrived."""
        S, R = self.fp16_sink_tokens, self.fp16_recent_tokens
        rp = self._rpad or [0] * len(self._pad)
        ends = [self._idx - r for r in rp]
        start = self._idx - L
        # Without a window, the single cache answers a block of at most
        # decode_max_queries tokens as single-token steps, which read the block's
        # tokens quantized too (a calibrated row's).
        steps = [
            R == 0 and c and 0 < e - start <= self.decode_max_queries
            for c, e in zip(self._cal, ends)
        ]
        self._capture_sinks(ends)
        self._calibrate_rows(ends)
        self._compress_to(
            [max(p + S, e if st else min(e - R, start)) for p, e, st in zip(self._pad, ends, steps)]
        )

    def _calibrate_rows(self, ends: List[int]):
        """Calibrates the rows that hold ``calibration_tokens`` non-sink tokens before
        column ``ends[b]``, from all of them (the single cache's rule)."""
        S, d0 = self.fp16_sink_tokens, self._d0
        pad = self._pad
        fresh = [
            b
            for b in range(len(pad))
            if not self._cal[b] and ends[b] - pad[b] - S >= self.calibration_tokens
        ]
        if not fresh:
            return
        mk, mv = [], []
        for b in range(len(pad)):
            if b in fresh:
                a = pad[b] + S - d0
                # (Contiguous, as the single cache reduces its held tokens.)
                k = mx.contiguous(self._dk[b : b + 1, :, a : ends[b] - d0])
                v = mx.contiguous(self._dv[b : b + 1, :, a : ends[b] - d0])
                mk.append(mx.mean(k.astype(mx.float32), axis=2, keepdims=True))
                mv.append(mx.mean(v.astype(mx.float32), axis=2, keepdims=True))
            else:
                mk.append(self._mu_k[b : b + 1])
                mv.append(self._mu_v[b : b + 1])
        self._mu_k = mx.concatenate(mk, axis=0)
        self._mu_v = mx.concatenate(mv, axis=0)
        for b in fresh:
            self._cal[b] = True
        self._floor = self._idx  # (trim never goes back before a calibration)

    def _compress_to(self, targets: List[int]):
        """Quantizes each calibrated row's columns ``[cend_b, targets_b)`` and moves
        its compressed end there. Columns a row does not own (its padding and sinks,
        a row not calibrated) may take codes it never sees; a row's valid codes are
        never written."""
        S, d0 = self.fp16_sink_tokens, self._d0
        B = len(self._pad)
        work = [b for b in range(B) if self._cal[b] and targets[b] > self._cend[b]]
        if not work:
            return
        lo = min(self._cend[b] for b in work)
        hi = max(targets[b] for b in work)
        # One append over [lo, hi) when it writes no row's valid codes: every row
        # with work starts at lo, every other row's codes lie outside [lo, hi).
        simple = all(self._cend[b] == lo for b in work) and all(
            self._cend[b] <= lo or hi <= self._pad[b] + S
            for b in range(B)
            if self._cal[b] and b not in work
        )
        if lo < d0:
            raise RuntimeError(f"{_PREFIX} internal: columns from {lo} are gone (first {d0}).")
        if simple:
            self._quantize(lo, hi)
        else:
            starts = [self._cend[b] if b in work else hi for b in range(B)]
            ends = [targets[b] if b in work else hi for b in range(B)]
            self._quantize_rows(lo, hi, starts, ends)
        for b in work:
            self._cend[b] = targets[b]

    def _update_need(self):
        """The first column a row may still need in fp16: its sinks to come, its held
        tokens before calibration, its window and rollback columns after."""
        S, R = self.fp16_sink_tokens, self.fp16_recent_tokens
        need = []
        for b, p in enumerate(self._pad):
            if self._ns[b] < S:
                need.append(p + self._ns[b])
            else:
                window = self._idx - R - self.rollback_tokens
                need.append(max(p + S, min(self._cend[b], window)))
        self._dlo = max(self._d0, min(min(need), self._idx)) if need else self._idx

    def _quantize(self, start: int, end: int):
        """Quantizes fp16 columns ``[start, end)`` of every row into the codes."""
        self._ensure_codes(end)
        d0 = self._d0
        self._kv.write(
            self._dk[:, :, start - d0 : end - d0],
            self._dv[:, :, start - d0 : end - d0],
            start,
            key_signs=self._signs,
            value_signs=self._signs if self.rotate_values else None,
            key_mean=self._mu_k,
            value_mean=self._mu_v,
        )

    def _quantize_rows(self, lo: int, end: int, starts: List[int], ends: List[int]):
        """Quantizes columns ``[starts_b, ends_b)`` of each row ``b`` (within ``[lo,
        end)``) and keeps every other code: after a calibration or a right-padded
        block the rows' valid codes end at different columns."""
        self._ensure_codes(end)
        d0 = self._d0
        self._kv.write_rows(
            self._dk[:, :, lo - d0 : end - d0],
            self._dv[:, :, lo - d0 : end - d0],
            lo,
            starts,
            ends,
            key_signs=self._signs,
            value_signs=self._signs if self.rotate_values else None,
            means=(self._mu_k, self._mu_v),
        )
