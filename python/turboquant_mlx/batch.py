# Copyright © 2026 turboquant_mlx contributors.

"""A batch of compressed caches for mlx-lm's batched generation.

:class:`BatchTurboQuantKVCache` is to :class:`~turboquant_mlx.cache.TurboQuantKVCache`
what mlx-lm's ``BatchKVCache`` is to ``KVCache``: ``TurboQuantKVCache.merge`` returns
one, and it follows mlx-lm's batch protocol (``prepare``/``finalize`` around a
right-padded prompt block, ``merge``, ``extract``, ``filter``, ``extend``,
``make_mask``, ``trim``, ``state``/``meta_state``), so that
``mlx_lm.generate.batch_generate`` and ``BatchGenerator`` run unchanged on
compressed caches. Linear-attention and rotating layers keep mlx-lm's own batch
caches.

Layout. The ``B`` rows share one axis of *columns* ``[0, idx)``; row ``b``'s tokens
are left-padded, position ``p`` at column ``pad_b + p``. Per row, as in the single
cache: positions ``[0, S)`` are fp16 sinks, then the compressed tokens, then an fp16
window of the last ``R``. Every row ends at column ``idx``, so the window (the last
``R`` columns) is aligned across rows, and a calibrated row's compressed columns are
``[pad_b + S, cend_b)`` with ``cend_b = idx - R`` after every decode step (rows differ
only where they start, and in between a prompt block's rows and a calibration):

* the compressed buffers are column-indexed ``(B, H_kv, capacity, words)``: one
  ``quantize_append`` node writes every row's token that leaves the window, centered
  by the row's own means; columns a row does not own (its padding and sinks, a row
  not yet calibrated) hold codes it never sees;
* the sinks live apart, ``(B, H_kv, S, D)`` by position (row ``b``'s first real
  tokens sit at different columns);
* an fp16 column buffer holds the window (plus ``rollback_tokens`` columns for
  ``trim``) and, for a row not yet calibrated, every token it holds.

A layer's decode step is one ``compressed_attention`` call over all rows, with a
boolean mask ``(B, 1, 1, W)`` that keeps row ``b``'s columns ``[pad_b + S, cend_b)``
(``W = max cend``) and the sinks and window as the op's tail, when every row holds
its full sinks and window. Otherwise (short rows, rows not yet calibrated, prompt
blocks) the fp16 part is a masked dense attention over the sinks and the fp16
columns each row sees, merged with the op's compressed part by log-sum-exp. A prompt
block of more than 8 queries over compressed tokens decodes those columns once (the
layer's temporary, as the single cache's prefill does). Padding never reaches
attention, the calibration means or the sinks.

Each row follows the single cache's rules on its own tokens: it calibrates
(``center``) at the first attention call that finds ``calibration_tokens`` non-sink
tokens, from all of them; a decode step sees the cache as stored; the queries of a
prompt block see the block as it arrived and older tokens as stored with the block
in. Without a window, a calibrated row that brings at most ``decode_max_queries``
tokens reads them quantized, causally, as the single cache's single-token steps do.
With a window, the single cache answers such a short block as single-token steps
(each query with its own window) where a row of a batch prompt block sees it as a
prompt block: they differ only for a row whose cache holds compressed tokens before
the block (a prompt longer than the prefill step ending in a short chunk, a cache
merged with history), and, without a window but with ``center``, for a row that
calibrates inside such a block.

Not supported (refused by ``merge``): ``query_aware_keys`` (preset ``k3v3``), head
dims the kernels do not rotate themselves (not a power of two, or stored padded).
"""

import copy
import sys
from typing import List

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from . import codebook, ops
from .attention import (
    dense_attention, ensure_hook, merge_attention, register_cache_class,
)
from .rotation import Rotation

__all__ = ["BatchTurboQuantKVCache"]

_PREFIX = "[turboquant_mlx.batch]"
_MASK_MEMO = {}  # the last decode step's compressed-column mask and its layout

# The single cache's settings a batch keeps (all of them but the runtime ones).
_SETTINGS = (
    "key_bits", "value_bits", "seed", "fp16_sink_tokens", "fp16_recent_tokens",
    "rollback_tokens", "center", "query_aware_keys", "rope_pairing", "rope_dims",
    "calibration_tokens", "rotate_values",
)



def _settings_of(cache) -> dict:
    return {name: getattr(cache, name) for name in _SETTINGS}


def _roll_rows(x: mx.array, shifts: mx.array) -> mx.array:
    """Each row ``b`` of ``x`` ``(B, H, N, ...)`` rolled right by ``shifts[b]`` on axis 2."""
    n = x.shape[2]
    idx = (mx.arange(n)[None, :] - shifts[:, None]) % n  # (B, N)
    idx = idx.reshape(idx.shape[:1] + (1, n) + (1,) * (x.ndim - 3))
    return mx.take_along_axis(x, mx.broadcast_to(idx, x.shape), axis=2)


class BatchTurboQuantKVCache(_BaseCache):
    """The compressed caches of one layer for ``B`` left-padded sequences (see the
    module docstring). Build it with ``TurboQuantKVCache.merge(caches)``.

    Attributes (mlx-lm's batch protocol):
        offset: ``(B,)`` int32, each row's position of the next token (RoPE).
        left_padding: ``(B,)`` int32.
    """

    step = 256  # capacity granularity of the buffers (tokens)
    decode_max_queries = 8  # the op's most queries per call

    def __init__(self, settings: dict, left_padding: List[int], window_dtype=None):
        self._settings = dict(settings)
        for name, value in self._settings.items():
            setattr(self, name, value)
        if self.query_aware_keys:
            raise ValueError(
                f"{_PREFIX} query_aware_keys (e.g. preset k3v3) is not supported in a batch; "
                "use a preset without it (tq4, k4v3, tq3, ...)."
            )
        self.window_dtype = window_dtype
        self._pad = [int(p) for p in left_padding]
        if any(p < 0 for p in self._pad):
            raise ValueError(f"{_PREFIX} left_padding must be >= 0, got {self._pad}.")
        self._rpad = None  # right padding of the prompt block under way (prepare)
        self._idx = 0  # columns
        self._dk = self._dv = None  # fp16 columns [_d0, _d0 + capacity)
        self._d0 = 0
        self._dlo = 0  # first column a row may still need in the fp16 buffer
        self._sk = self._sv = None  # (B, H, S, D) sinks by position
        self._ns = [0] * len(self._pad)  # sinks held per row
        self._kc = self._ks = self._vc = self._vs = None  # column-indexed codes
        # Row b's compressed columns are [pad_b + S, cend_b) (empty before its
        # calibration); its fp16 columns start at cend_b.
        self._cend = [p + self.fp16_sink_tokens for p in self._pad]
        self._floor = 0  # trim never goes below this column
        no_levers = not self.center
        self._cal = [no_levers] * len(self._pad)
        self._mu_k = self._mu_v = None  # (B, H, 1, D) float32 (zeros: not calibrated)
        self._dirty = False  # tokens arrived since the last _settle
        # Whether the codes / the fp16 buffers are this cache's alone, so that appends
        # may write them in place (a deep copy shares them until filter or a rebuild).
        self._private = True
        self._dpriv = True
        self._head_dim = None
        self._arrays = None  # cached (left_padding, offset) arrays
        self._single = None  # the single caches' class (extract builds them; set by merge)

    # -- mlx-lm's attributes ----------------------------------------------------------

    @property
    def _W(self) -> int:
        """The compressed columns' end over all rows (the op's ``kv_len``)."""
        return max(self._cend) if self._cend else 0

    @property
    def batch_size(self) -> int:
        return len(self._pad)

    def _index_arrays(self):
        if self._arrays is None:
            self._arrays = (mx.array(self._pad, dtype=mx.int32),
                            mx.array([self._idx - p for p in self._pad], dtype=mx.int32))
        return self._arrays

    @property
    def left_padding(self) -> mx.array:
        return self._index_arrays()[0]

    @property
    def offset(self) -> mx.array:
        return self._index_arrays()[1]

    def _changed(self):
        self._arrays = None

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self._dk is None

    def is_trimmable(self) -> bool:
        return True

    # -- storage ----------------------------------------------------------------------

    def _init_storage(self, B, H, D, dtype):
        rotation = Rotation(D, self.seed)
        if rotation.kernel_signs is None:
            raise ValueError(
                f"{_PREFIX} head dim {D} is not supported in a batch: the kernels rotate "
                "power-of-two head dims only (32, 64, 128, 256)."
            )
        for bits in (self.key_bits, self.value_bits):
            ops.words_per_token(D, bits)  # (refuses an unsupported head dim)
        self._head_dim = D
        self._H = H
        self._rotation = rotation
        self._signs = rotation.kernel_signs
        self._k_centroids = codebook.centroids(D, self.key_bits)
        self._v_centroids = codebook.centroids(D, self.value_bits)
        self.window_dtype = dtype
        S = self.fp16_sink_tokens
        self._dk = mx.zeros((B, H, self.step, D), dtype)
        self._dv = mx.zeros((B, H, self.step, D), dtype)
        self._d0 = self._dlo = self._idx
        if S:
            self._sk = mx.zeros((B, H, S, D), dtype)
            self._sv = mx.zeros((B, H, S, D), dtype)
        if self.center:
            self._mu_k = mx.zeros((B, H, 1, D), mx.float32)
            self._mu_v = mx.zeros((B, H, 1, D), mx.float32)
        self._private = self._dpriv = True

    def _write_columns(self, keys, values):
        """Writes ``(B, H, L, D)`` at columns ``[idx, idx + L)`` of the fp16 buffer."""
        L = keys.shape[2]
        end = self._idx + L
        if end > self._d0 + self._dk.shape[2]:
            # Rebuild from the first column still needed (drops what left the window).
            lo = min(self._dlo, self._idx)
            keep = self._idx - lo
            cap = -(-(keep + L + self.step) // self.step) * self.step
            B, H, _, D = self._dk.shape
            pad = mx.zeros((B, H, cap - keep, D), self._dk.dtype)
            a = lo - self._d0
            self._dk = mx.concatenate([self._dk[:, :, a : a + keep], pad], axis=2)
            self._dv = mx.concatenate([self._dv[:, :, a : a + keep], pad], axis=2)
            self._d0 = lo
            self._dpriv = True
        j = self._idx - self._d0
        if self._dpriv:
            # In place, one node: readers of the buffer look only at columns < idx.
            self._dk, self._dv = ops.write_tokens_kv(self._dk, self._dv, keys, values, j)
        else:
            # (MLX copies a buffer that something else holds: then it is ours.)
            self._dk[:, :, j : j + L] = keys
            self._dv[:, :, j : j + L] = values
            self._dpriv = True

    def _ensure_codes(self, needed: int):
        cap = 0 if self._kc is None else self._kc.shape[2]
        if needed <= cap:
            return
        new_cap = -(-max(needed, int(cap * 1.25)) // self.step) * self.step
        B, H, D = len(self._pad), self._H, self._head_dim
        wk = ops.words_per_token(D, self.key_bits)
        wv = ops.words_per_token(D, self.value_bits)

        def grow(buf, tail, dtype):
            fresh = mx.zeros((B, H, new_cap - cap) + tail, dtype)
            return fresh if buf is None else mx.concatenate([buf, fresh], axis=2)

        self._kc = grow(self._kc, (wk,), mx.uint32)
        self._ks = grow(self._ks, (), mx.float16)
        self._vc = grow(self._vc, (wv,), mx.uint32)
        self._vs = grow(self._vs, (), mx.float16)
        self._private = True

    # -- the protocol -----------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Stores new tokens ``(B, H_kv, L, D)`` at the next ``L`` columns and returns
        them unchanged (attention reads the cache through :meth:`attention`)."""
        ensure_hook(sys._getframe(1).f_globals)
        B = len(self._pad)
        if keys.ndim != 4 or keys.shape[:3] != values.shape[:3] or keys.shape[0] != B:
            raise ValueError(
                f"{_PREFIX} update_and_fetch expects keys and values (B={B}, H, L, D) with "
                f"equal B, H, L; got {tuple(keys.shape)} and {tuple(values.shape)}."
            )
        if keys.shape[-1] != values.shape[-1]:
            raise ValueError(
                f"{_PREFIX} keys and values must have the same head dim; got "
                f"{keys.shape[-1]} and {values.shape[-1]}."
            )
        if self._head_dim is not None and (keys.shape[1], keys.shape[3]) != (
                self._H, self._head_dim):
            raise ValueError(
                f"{_PREFIX} new tokens {tuple(keys.shape)} do not match the cache "
                f"(H_kv, D) = {(self._H, self._head_dim)}."
            )
        given = keys, values
        dtype = self.window_dtype
        if dtype is None:
            dtype = keys.dtype if keys.dtype in (mx.float16, mx.bfloat16) else mx.float16
        keys = keys.astype(dtype)
        values = values.astype(dtype)
        L = keys.shape[2]
        rp = self._rpad or [0] * B
        if any(rp) or any(p > self._idx for p in self._pad):
            # Padding is garbage: stored as zeros, so that nothing non-finite can reach
            # the codec when those columns are quantized for other rows.
            cols = mx.arange(self._idx, self._idx + L)[None, :]
            keep = (cols >= mx.array(self._pad)[:, None]) & (
                cols < mx.array([self._idx + L - r for r in rp])[:, None])
            keep = keep[:, None, :, None]
            keys = mx.where(keep, keys, 0)
            values = mx.where(keep, values, 0)
        # As the single cache's check_finite="auto": every prompt block, and on the CPU
        # (whose append kernels would refuse them later) every update, before anything
        # changes.
        if L > self.decode_max_queries or mx.default_device() == mx.cpu:
            if not mx.all(mx.isfinite(keys) & mx.isfinite(values)).item():
                raise ValueError(
                    f"{_PREFIX} update_and_fetch refused: new keys or values are not finite "
                    f"in the cache's {dtype} storage (NaN, Inf or out of range); the cache "
                    "is unchanged."
                )
        if self._head_dim is None:
            self._init_storage(B, keys.shape[1], keys.shape[3], dtype)
        self._settle()  # (a prompt block's quantization, if no finalize came)
        self._write_columns(keys, values)
        self._idx += L
        self._changed()
        self._dirty = True
        return given

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        """mlx-lm's announcement of a prompt block: ``left_padding`` (only on an empty
        cache) or ``right_padding`` (undone by :meth:`finalize`)."""
        if left_padding is not None:
            if not self.empty():
                raise ValueError(
                    f"{_PREFIX} left padding can only be added to an empty cache.")
            self._pad = [p + int(q) for p, q in zip(self._pad, left_padding)]
            self._cend = [p + self.fp16_sink_tokens for p in self._pad]
            self._changed()
        if right_padding is not None and max(right_padding) > 0:
            self._settle()
            self._rpad = [int(r) for r in right_padding]

    def finalize(self):
        """Moves each row's right padding to its left (after a right-padded block)."""
        if self._rpad is not None:
            shifts = mx.array(self._rpad, dtype=mx.int32)
            n = self._idx - self._d0
            self._dk = _roll_rows(self._dk[:, :, :n], shifts)
            self._dv = _roll_rows(self._dv[:, :, :n], shifts)
            if self._kc is not None:
                self._kc, self._ks, self._vc, self._vs = (
                    _roll_rows(a, shifts) for a in (self._kc, self._ks, self._vc, self._vs))
            self._private = self._dpriv = True
            # Each row's codes moved with it; its fp16 columns before d0 + shift are
            # what wrapped around (its right padding), so its codes stay as they are.
            self._cend = [c + r for c, r in zip(self._cend, self._rpad)]
            self._floor = max(self._floor, self._d0 + max(self._rpad))
            self._dirty = True
            self._pad = [p + r for p, r in zip(self._pad, self._rpad)]
            self._rpad = None
            self._changed()
        self._settle()

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        """What the model passes back to attention: ``None`` / ``"causal"`` (the cache
        masks the padding itself), or with ``return_array`` mlx-lm's batch mask."""
        if window_size is not None:
            raise ValueError(f"{_PREFIX} sliding-window masks are not supported.")
        if return_array:
            return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding)
        return None if N == 1 else "causal"

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
        new = ((s[None, :] >= mx.array(self._ns)[:, None])
               & (s[None, :] < mx.array(want)[:, None]))[:, None, :, None]
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
        steps = [R == 0 and c and 0 < e - start <= self.decode_max_queries
                 for c, e in zip(self._cal, ends)]
        self._capture_sinks(ends)
        self._calibrate_rows(ends)
        self._compress_to([max(p + S, e if st else min(e - R, start))
                           for p, e, st in zip(self._pad, ends, steps)])

    def _calibrate_rows(self, ends: List[int]):
        """Calibrates the rows that hold ``calibration_tokens`` non-sink tokens before
        column ``ends[b]``, from all of them (the single cache's rule)."""
        S, d0 = self.fp16_sink_tokens, self._d0
        pad = self._pad
        fresh = [b for b in range(len(pad)) if not self._cal[b]
                 and ends[b] - pad[b] - S >= self.calibration_tokens]
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
            for b in range(B) if self._cal[b] and b not in work)
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
        k = self._dk[:, :, start - d0 : end - d0]
        v = self._dv[:, :, start - d0 : end - d0]
        v_signs = self._signs if self.rotate_values else None
        if self._private:
            self._kc, self._ks, self._vc, self._vs = ops.quantize_append_kv(
                self._kc, self._ks, self._vc, self._vs, k, v, self._k_centroids,
                self._v_centroids, start, self.key_bits, self.value_bits,
                key_rotation_signs=self._signs, value_rotation_signs=v_signs,
                key_mean=self._mu_k, value_mean=self._mu_v,
            )
        else:
            self._kc, self._ks = ops.quantize_append(
                self._kc, self._ks, k, self._k_centroids, start, self.key_bits,
                rotation_signs=self._signs, mean=self._mu_k)
            self._vc, self._vs = ops.quantize_append(
                self._vc, self._vs, v, self._v_centroids, start, self.value_bits,
                rotation_signs=v_signs, mean=self._mu_v)
            self._private = True

    def _quantize_rows(self, lo: int, end: int, starts: List[int], ends: List[int]):
        """Quantizes columns ``[starts_b, ends_b)`` of each row ``b`` (within ``[lo,
        end)``) and keeps every other code: after a calibration or a right-padded
        block the rows' valid codes end at different columns."""
        self._ensure_codes(end)
        n, d0 = end - lo, self._d0
        B, H, D = len(self._pad), self._H, self._head_dim
        k = self._dk[:, :, lo - d0 : end - d0]
        v = self._dv[:, :, lo - d0 : end - d0]
        wk = ops.words_per_token(D, self.key_bits)
        wv = ops.words_per_token(D, self.value_bits)
        kc, ks = ops.quantize_append(
            mx.zeros((B, H, n, wk), mx.uint32), mx.zeros((B, H, n), mx.float16), k,
            self._k_centroids, 0, self.key_bits, rotation_signs=self._signs, mean=self._mu_k)
        vc, vs = ops.quantize_append(
            mx.zeros((B, H, n, wv), mx.uint32), mx.zeros((B, H, n), mx.float16), v,
            self._v_centroids, 0, self.value_bits,
            rotation_signs=self._signs if self.rotate_values else None, mean=self._mu_v)
        cols = mx.arange(lo, end)[None, :]
        keep = (cols >= mx.array(starts)[:, None]) & (cols < mx.array(ends)[:, None])
        keep = keep[:, None, :]  # (B, 1, n)
        for name, new in (("_kc", kc), ("_ks", ks), ("_vc", vc), ("_vs", vs)):
            buf = getattr(self, name)
            k_ = keep if new.ndim == 3 else keep[..., None]
            buf[:, :, lo:end] = mx.where(k_, new, buf[:, :, lo:end])
            setattr(self, name, buf)
        self._private = True

    # -- attention --------------------------------------------------------------------

    def _comp_lo(self) -> List[int]:
        """Each row's first compressed column."""
        return [p + self.fp16_sink_tokens for p in self._pad]

    def _dense_lo(self) -> List[int]:
        """Each row's first column of the fp16 buffer that attention sees (its sinks
        to come while it holds fewer than ``S`` of them, else its compressed end)."""
        S = self.fp16_sink_tokens
        return [p + n if n < S else c for p, n, c in zip(self._pad, self._ns, self._cend)]

    def attention(self, queries: mx.array, scale: float, mask=None, sinks=None) -> mx.array:
        """Attention of ``queries`` ``(B, H_q, L, D)`` (the last ``L`` columns) over
        every row's tokens; ``(B, H_q, L, D)`` in the queries' dtype."""
        if self._head_dim is None or self._idx == 0:
            raise ValueError(f"{_PREFIX} attention on an empty cache.")
        B, n_q, L, D = queries.shape
        if B != len(self._pad) or D != self._head_dim or n_q % self._H:
            raise ValueError(
                f"{_PREFIX} queries {tuple(queries.shape)} do not match the cache "
                f"(B, H_kv, D) = {(len(self._pad), self._H, self._head_dim)}."
            )
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"{_PREFIX} unknown mask mode {mask!r}.")
            mask = None
        elif mask is not None:
            if mask.dtype != mx.bool_ or mask.shape[-1] != self._idx:
                raise ValueError(
                    f"{_PREFIX} an array mask must be boolean over the {self._idx} columns, "
                    f"got {mask.dtype} {tuple(mask.shape)}."
                )
        if L == 1 and self._rpad is None:
            self._settle()  # a decode step sees the cache as stored
        else:
            self._prepare_block(L)
        if mask is None and sinks is None and L == 1 and self._rpad is None:
            out = self._attend_one_call(queries, scale)
            if out is not None:
                return out
        parts = []
        comp = self._compressed_part(queries, scale, mask)
        if comp is not None:
            parts.append(comp)
        parts.append(self._dense_part(queries, scale, mask))
        if sinks is not None:
            lse = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, -1, 1), (B, n_q, L))
            parts.append((mx.zeros((B, n_q, L, D), mx.float32), lse))
        return merge_attention(parts)[0].astype(queries.dtype)

    def _op(self, queries, scale, op_mask, tail=(None, None), final=False):
        return ops.compressed_attention(
            queries, self._kc, self._ks, self._vc, self._vs, self._k_centroids,
            self._v_centroids, self._W, scale, self.key_bits, self.value_bits, False,
            op_mask, tail_k=tail[0], tail_v=tail[1], rotation_signs=self._signs,
            rotate_output=self.rotate_values, key_mean=self._mu_k, value_mean=self._mu_v,
            out_dtype=queries.dtype if final else None,
        )

    def _comp_mask(self, L: int, lo: List[int], mask=None, a: int = 0):
        """Bool ``(B, 1, 1|L, W - a)``: row b's compressed columns ``[lo_b, cend_b)``
        from column ``a`` (causal for a block: a row's block may be compressed), or
        None when every row sees all ``W``."""
        W = self._W
        if (mask is None and L == 1 and all(x == 0 for x in lo)
                and all(c == W for c in self._cend)):
            return None
        memo = None
        if mask is None and L == 1 and a == 0:
            # Every layer of a decode step has the same layout: one mask for all.
            memo = (tuple(lo), tuple(self._cend))
            if _MASK_MEMO.get("key") == memo:
                return _MASK_MEMO["mask"]
        cols = mx.arange(a, W)[None, :]
        keep = (cols >= mx.array(lo)[:, None]) & (cols < mx.array(self._cend)[:, None])
        keep = keep[:, None, None, :]
        if L > 1:
            keep = keep & (cols[:, None, None, :]
                           <= mx.arange(self._idx - L, self._idx)[None, None, :, None])
        if mask is not None:
            keep = keep & mask[..., a:W]
        if memo is not None:
            _MASK_MEMO.update(key=memo, mask=keep)
        return keep

    def _attend_one_call(self, queries, scale):
        """A decode step where every row holds its full sinks and window: one op call
        with them as the tail (None where a row does not)."""
        S, R = self.fp16_sink_tokens, self.fp16_recent_tokens
        W, idx, d0 = self._W, self._idx, self._d0
        if (W == 0 or self._kc is None or any(n < S for n in self._ns)
                or any(c != idx - R for c in self._cend) or S + R > ops.MAX_TAIL_TOKENS):
            return None
        ks, vs = [], []
        if S:
            ks.append(self._sk)
            vs.append(self._sv)
        if R:
            ks.append(self._dk[:, :, W - d0 : idx - d0])
            vs.append(self._dv[:, :, W - d0 : idx - d0])
        tail = (None, None)
        if ks:
            tail = (ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2),
                    vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2))
        lo = [p + S for p in self._pad]
        return self._op(queries, scale, self._comp_mask(1, lo), tail, final=True)[0]

    def _compressed_part(self, queries, scale, mask):
        """``(out, lse)`` over the rows' compressed columns, or None (none visible)."""
        lo = self._comp_lo()
        W = self._W
        seen = [b for b in range(len(lo)) if self._cend[b] > lo[b]]
        if self._kc is None or not seen:
            return None
        L = queries.shape[2]
        if L <= self.decode_max_queries:
            return self._op(queries, scale, self._comp_mask(L, lo, mask))
        # A prompt block over compressed history: the op takes at most 8 queries, so
        # the visible columns are decoded once (this layer's temporary, as the single
        # cache's prefill does) and attended densely.
        a = min(lo[b] for b in seen)
        n = W - a
        yk = ops.dequantize(self._kc, self._ks, self._k_centroids, self.key_bits, a, n)
        yv = ops.dequantize(self._vc, self._vs, self._v_centroids, self.value_bits, a, n)
        k = self._rotation.inverse(yk)
        v = self._rotation.inverse(yv) if self.rotate_values else yv
        if self.center:
            k = k + self._mu_k
            v = v + self._mu_v
        return dense_attention(queries, k, v, scale, self._comp_mask(L, lo, mask, a))

    def _dense_part(self, queries, scale, mask):
        """``(out, lse)`` over the sinks and the fp16 columns each row sees."""
        S = self.fp16_sink_tokens
        L = queries.shape[2]
        idx, d0 = self._idx, self._d0
        lo = self._dense_lo()
        a = max(d0, min(lo))
        cols = mx.arange(a, idx)
        q_cols = mx.arange(idx - L, idx)
        keep = (cols[None, None, :] >= mx.array(lo)[:, None, None]) & (
            cols[None, None, :] <= q_cols[None, :, None])  # (B, L, n)
        keep = keep[:, None]
        if mask is not None:
            keep = keep & mask[..., a:idx]
        k = self._dk[:, :, a - d0 : idx - d0]
        v = self._dv[:, :, a - d0 : idx - d0]
        if S and max(self._ns) > 0:
            s_cols = mx.array(self._pad)[:, None] + mx.arange(S)[None, :]  # (B, S)
            s_keep = (mx.arange(S)[None, :] < mx.array(self._ns)[:, None])[:, None, :] & (
                s_cols[:, None, :] <= q_cols[None, :, None])  # (B, L, S): causal
            s_keep = s_keep[:, None]
            if mask is not None:
                scols = mx.array(self._pad)[:, None] + mx.arange(S)[None, :]
                scols = mx.minimum(scols, idx - 1)[:, None, None, :]
                m = mx.broadcast_to(mask, mask.shape[:-2] + (L, idx))
                m = mx.broadcast_to(m, (len(self._pad),) + m.shape[1:])
                scols = mx.broadcast_to(scols, m.shape[:-1] + (S,))
                s_keep = s_keep & mx.take_along_axis(m, scols, axis=-1)
            k = mx.concatenate([self._sk, k], axis=2)
            v = mx.concatenate([self._sv, v], axis=2)
            keep = mx.concatenate([s_keep, mx.broadcast_to(keep, s_keep.shape[:3]
                                                           + keep.shape[3:])], axis=-1)
        return dense_attention(queries, k, v, scale, keep)

    # -- batch operations -------------------------------------------------------------

    @classmethod
    def merge(cls, caches) -> "BatchTurboQuantKVCache":
        """One batch from single caches (left-padded to the longest), all of one class
        (:class:`~turboquant_mlx.cache.TurboQuantKVCache`, whose ``merge`` calls this;
        :meth:`extract` gives caches of that class back)."""
        caches = list(caches)
        if not caches:
            raise ValueError(f"{_PREFIX} merge of no caches.")
        single = type(caches[0])
        for c in caches:
            if type(c) is not single or not hasattr(c, "_state_arrays"):
                raise ValueError(
                    f"{_PREFIX} merge takes TurboQuantKVCache of one class, got "
                    f"{type(c).__name__}.")
        settings = _settings_of(caches[0])
        for c in caches[1:]:
            if _settings_of(c) != settings:
                raise ValueError(
                    f"{_PREFIX} merge of caches with different settings: {settings} and "
                    f"{_settings_of(c)}."
                )
        full = [c for c in caches if not c.empty()]
        dtypes = {c.window_dtype for c in full}
        if len(dtypes) > 1:
            raise ValueError(
                f"{_PREFIX} merge of caches with different window dtypes {dtypes}.")
        lengths = [c.size() for c in caches]
        n = max(lengths)
        batch = cls(settings, [n - m for m in lengths],
                    window_dtype=next(iter(dtypes)) if dtypes else caches[0].window_dtype)
        batch._single = single
        if not full:
            return batch
        ref = full[0]
        if ref.padded:
            raise ValueError(
                f"{_PREFIX} head dim {ref.head_dim} (stored padded) is not supported in a "
                "batch."
            )
        H = ref._batch_heads[1]
        for c in full:
            if c._batch_heads != (1, H) or c.head_dim != ref.head_dim:
                raise ValueError(
                    f"{_PREFIX} merge takes caches of one sequence each with the same heads; "
                    f"got (B, H_kv) = {c._batch_heads}, head dim {c.head_dim}."
                )
        B, D = len(caches), ref.head_dim
        batch._idx = n
        batch._init_storage(B, H, D, ref.window_dtype)
        S, R = batch.fp16_sink_tokens, batch.fp16_recent_tokens
        rows = {}  # row -> its single cache's content
        for b, c in enumerate(caches):
            if c.empty():
                continue
            names = ("kc", "ks", "vc", "vs", "sk", "sv", "wk", "wv", "mk", "mv")
            r = dict(zip(names, c._state_arrays()))
            r.update(nc=c._n_comp, ws=c._win_start, calibrated=c.calibrated)
            held = c.offset
            if r["calibrated"] and held > S and S + r["nc"] != max(S, held - R):
                raise ValueError(
                    f"{_PREFIX} cache {b} holds {r['nc']} compressed tokens of {held} (a trim "
                    "beyond its rollback window): it cannot join a batch."
                )
            rows[b] = r
        pads = batch._pad
        starts = [pads[b] + r["ws"] for b, r in rows.items() if r["wk"].size]
        lo = min(starts) if starts else n
        cap = -(-(n - lo + batch.step) // batch.step) * batch.step
        dk = mx.zeros((B, H, cap, D), batch.window_dtype)
        dv = mx.zeros((B, H, cap, D), batch.window_dtype)
        batch._d0 = lo
        if any(r["nc"] for r in rows.values()):
            batch._ensure_codes(n)
        for b, r in rows.items():
            p, nc = pads[b], r["nc"]
            if r["wk"].size:
                dk[b : b + 1, :, p + r["ws"] - lo : n - lo] = r["wk"]
                dv[b : b + 1, :, p + r["ws"] - lo : n - lo] = r["wv"]
            if r["sk"].size:
                ns = r["sk"].shape[2]
                batch._sk[b : b + 1, :, :ns] = r["sk"]
                batch._sv[b : b + 1, :, :ns] = r["sv"]
                batch._ns[b] = ns
            if nc:
                a = p + S
                for name in ("kc", "ks", "vc", "vs"):
                    getattr(batch, "_" + name)[b : b + 1, :, a : a + nc] = r[name]
            batch._cal[b] = bool(r["calibrated"])
            batch._cend[b] = p + S + nc
            if r["mk"].size:
                batch._mu_k[b : b + 1] = r["mk"]
                batch._mu_v[b : b + 1] = r["mv"]
        for b in range(B):
            if b not in rows:
                batch._cal[b] = not batch.center  # (an empty row calibrates on its own)
        batch._dk, batch._dv = dk, dv
        batch._dlo = lo
        batch._floor = n  # (fp16 tokens before the merge are not all at hand)
        batch._dirty = True
        batch._settle()
        return batch

    def extract(self, idx: int):
        """Row ``idx`` as a :class:`~turboquant_mlx.cache.TurboQuantKVCache`."""
        self._settle()
        single = self._single(**self._settings)
        b = int(idx)
        if self._dk is None or self._real(b) == 0:
            single.window_dtype = self.window_dtype
            return single
        S, R = self.fp16_sink_tokens, self.fp16_recent_tokens
        p, held, d0 = self._pad[b], self._real(b), self._d0
        ns = self._ns[b]
        cal = self._cal[b]
        nc = self._cend[b] - (p + S) if cal and ns == S else 0

        def rows(a, lo, hi):
            return mx.contiguous(a[b : b + 1, :, lo:hi])

        empty16 = mx.zeros((0,), mx.float16)
        comp = [empty16.astype(mx.uint32), empty16, empty16.astype(mx.uint32), empty16]
        if nc:
            comp = [rows(a, p + S, p + S + nc)
                    for a in (self._kc, self._ks, self._vc, self._vs)]
        sinks = [empty16, empty16]
        if ns:
            sinks = [rows(self._sk, 0, ns), rows(self._sv, 0, ns)]
        if held <= S:
            ws = S
        elif cal and R == 0:
            ws = held
        elif cal:
            ws = max(S, held - R - self.rollback_tokens, d0 - p, self._dlo - p)
            ws = min(ws, S + nc)
        else:
            ws = S
        window = [empty16, empty16]
        if ws < held:
            window = [rows(self._dk, p + ws - d0, self._idx - d0),
                      rows(self._dv, p + ws - d0, self._idx - d0)]
        levers = [mx.zeros((0,), mx.float32)] * 4
        if cal and self.center:
            levers[0] = mx.array(self._mu_k[b : b + 1])
            levers[1] = mx.array(self._mu_v[b : b + 1])
        # The single cache's configuration for this row (format of its state).
        single.offset = held
        single._n_comp = nc
        single._win_start = ws
        single._calibrated = cal
        config = single._config_values()
        single.state = comp + sinks + window + levers + config
        single.rotate_values = self.rotate_values
        return single

    def filter(self, batch_indices):
        """Keeps the rows ``batch_indices`` (in that order)."""
        self._settle()
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array)
                                 else batch_indices)]
        sel = mx.array(keep, dtype=mx.int32)
        self._pad = [self._pad[i] for i in keep]
        self._ns = [self._ns[i] for i in keep]
        self._cal = [self._cal[i] for i in keep]
        self._cend = [self._cend[i] for i in keep]
        if self._rpad is not None:
            self._rpad = [self._rpad[i] for i in keep]
        names = ("_dk", "_dv", "_sk", "_sv", "_kc", "_ks", "_vc", "_vs", "_mu_k", "_mu_v")
        for name in names:
            a = getattr(self, name)
            if a is not None:
                setattr(self, name, a[sel])
        self._private = self._dpriv = True
        self._changed()
        # Columns that are padding in every remaining row go.
        m = min(self._pad) if self._pad else 0
        if m > 0 and self._rpad is None:
            self._shift_left(m)

    def _shift_left(self, m: int):
        self._pad = [p - m for p in self._pad]
        self._cend = [c - m for c in self._cend]
        self._idx -= m
        if self._dk is not None:
            cut = max(0, m - self._d0)
            if cut:
                self._dk = self._dk[:, :, cut:]
                self._dv = self._dv[:, :, cut:]
            self._d0 = max(0, self._d0 - m)
            self._dlo = max(self._d0, self._dlo - m)
            if self._kc is not None:
                self._kc, self._ks, self._vc, self._vs = (
                    a[:, :, m:] for a in (self._kc, self._ks, self._vc, self._vs))
            self._floor = max(0, self._floor - m)
            self._private = self._dpriv = False
        self._changed()

    def extend(self, other: "BatchTurboQuantKVCache"):
        """Appends the rows of ``other`` (same settings), right-aligned on the columns."""
        if not isinstance(other, BatchTurboQuantKVCache) or other._settings != self._settings:
            raise ValueError(f"{_PREFIX} extend takes a batch of the same settings.")
        self._settle()
        other._settle()
        self._single = self._single or other._single
        if self._rpad is not None or other._rpad is not None:
            raise ValueError(f"{_PREFIX} extend during a right-padded prompt block.")
        idx = max(self._idx, other._idx)
        ref = self if self._dk is not None else other
        if ref._dk is None:  # both empty
            self._pad = [p + idx - self._idx for p in self._pad] + [
                p + idx - other._idx for p in other._pad]
            self._ns += other._ns
            self._cal += other._cal
            self._idx = idx
            self._cend = [p + self.fp16_sink_tokens for p in self._pad]
            self._changed()
            return
        B1, B2 = len(self._pad), len(other._pad)
        H, D, dtype = ref._H, ref._head_dim, ref._dk.dtype
        parts = [self, other]
        d0 = min((c._d0 + idx - c._idx) for c in parts if c._dk is not None)
        dlo = min((c._dlo + idx - c._idx) for c in parts if c._dk is not None)
        any_codes = any(c._kc is not None for c in parts)
        wk = ops.words_per_token(D, self.key_bits)
        wv = ops.words_per_token(D, self.value_bits)
        ncap = -(-(idx - d0 + self.step) // self.step) * self.step
        ccap = -(-idx // self.step) * self.step if any_codes else 0

        def no_codes(Bc):
            return [mx.zeros((Bc, H, ccap, wk), mx.uint32), mx.zeros((Bc, H, ccap), mx.float16),
                    mx.zeros((Bc, H, ccap, wv), mx.uint32), mx.zeros((Bc, H, ccap), mx.float16)]

        def place(c, Bc):
            shift = idx - c._idx
            if c._dk is None:
                z = mx.zeros((Bc, H, ncap, D), dtype)
                dk = dv = z
                sk = sv = mx.zeros((Bc, H, self.fp16_sink_tokens, D), dtype)
                codes = no_codes(Bc)
                mu = [mx.zeros((Bc, H, 1, D), mx.float32)] * 2
                return dk, dv, sk, sv, codes, mu
            a = c._d0 + shift - d0  # where its first fp16 column lands
            n = c._idx - c._d0

            def fit(x, lead, total):
                x = x[:, :, :max(0, min(x.shape[2], total - lead))]
                widths = [(0, 0)] * x.ndim
                widths[2] = (lead, total - lead - x.shape[2])
                return mx.pad(x, widths)

            dk = fit(c._dk[:, :, :n], a, ncap)
            dv = fit(c._dv[:, :, :n], a, ncap)
            sk, sv = c._sk, c._sv
            if self.fp16_sink_tokens == 0:
                sk = sv = None
            if c._kc is not None:
                codes = [fit(x, shift, ccap) for x in (c._kc, c._ks, c._vc, c._vs)]
            else:
                codes = no_codes(Bc)
            mu = [c._mu_k, c._mu_v]
            return dk, dv, sk, sv, codes, mu

        a_, b_ = place(self, B1), place(other, B2)
        if self._dk is None:
            self._init_storage(B1, H, D, dtype)
        self._dk = mx.concatenate([a_[0], b_[0]])
        self._dv = mx.concatenate([a_[1], b_[1]])
        if self.fp16_sink_tokens:
            self._sk = mx.concatenate([a_[2], b_[2]])
            self._sv = mx.concatenate([a_[3], b_[3]])
        if any_codes:
            self._kc, self._ks, self._vc, self._vs = (
                mx.concatenate([x, y]) for x, y in zip(a_[4], b_[4]))
        if self.center:
            self._mu_k = mx.concatenate([a_[5][0], b_[5][0]])
            self._mu_v = mx.concatenate([a_[5][1], b_[5][1]])
        self._pad = [p + idx - self._idx for p in self._pad] + [
            p + idx - other._idx for p in other._pad]
        self._ns = self._ns + other._ns
        self._cal = self._cal + other._cal
        self._cend = [c + idx - self._idx for c in self._cend] + [
            c + idx - other._idx for c in other._cend]
        self._idx = idx
        self._d0 = d0
        self._dlo = max(d0, dlo)
        self._floor = max(c._floor + idx - c._idx for c in parts)
        self._private = self._dpriv = True
        self._changed()
        self._dirty = True
        self._settle()

    def trim(self, n: int) -> int:
        """Drops the last ``n`` columns of every row, at most ``rollback_tokens`` and
        never into a row's sinks or back before its calibration; returns how many."""
        self._settle()
        if self._dk is None:
            return 0
        S = self.fp16_sink_tokens
        limit = [self.rollback_tokens, self._idx - max(self._dlo, self._floor)]
        for b in range(len(self._pad)):
            held = self._real(b)
            limit.append(max(0, held - S))
        n = max(0, min([int(n)] + limit))
        if n:
            self._idx -= n
            S, R = self.fp16_sink_tokens, self.fp16_recent_tokens
            self._cend = [min(c, max(p + S, self._idx - R)) if cal else c
                          for c, p, cal in zip(self._cend, self._pad, self._cal)]
            self._private = self._dpriv = False
            self._changed()
        return n

    # -- state ------------------------------------------------------------------------

    @property
    def state(self):
        """The arrays (what ``mx.eval`` needs after a prompt block)."""
        self._settle()
        arrays = [self._dk, self._dv, self._sk, self._sv, self._kc, self._ks, self._vc,
                  self._vs, self._mu_k, self._mu_v]
        return [a for a in arrays if a is not None] + list(self._index_arrays())

    @state.setter
    def state(self, v):
        raise ValueError(
            f"{_PREFIX} a batch cache cannot be set from a state: extract its rows "
            "(TurboQuantKVCache states) and merge them."
        )

    @property
    def meta_state(self):
        return tuple(str(x) for x in [self._idx] + self._pad)

    @meta_state.setter
    def meta_state(self, v):
        raise ValueError(
            f"{_PREFIX} a batch cache cannot be set from a state: extract its rows "
            "(TurboQuantKVCache states) and merge them."
        )

    @property
    def nbytes(self) -> int:
        arrays = [self._dk, self._dv, self._sk, self._sv, self._kc, self._ks, self._vc,
                  self._vs, self._mu_k, self._mu_v]
        return sum(a.nbytes for a in arrays if a is not None)

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = (value if isinstance(value, mx.Dtype)
                                 else copy.deepcopy(value, memo))
        # A deep copy shares the arrays' buffers: neither may write them in place.
        self._private = new._private = False
        self._dpriv = new._dpriv = False
        return new

    def __repr__(self):
        return (f"BatchTurboQuantKVCache(B={len(self._pad)}, columns={self._idx}, "
                f"K{self.key_bits}V{self.value_bits}, sinks={self.fp16_sink_tokens}, "
                f"window={self.fp16_recent_tokens}, center={self.center})")


register_cache_class(BatchTurboQuantKVCache)
