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

from typing import List

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from . import ops
from ._batch_common import _PREFIX, _roll_rows
from ._common import deepcopy_attributes
from .attention import ensure_hook, register_cache_class
from .batch_attention import _BatchAttention
from .batch_ops import _BatchOperations
from .batch_rows import _RowSettling
from .buffer import CompressedKV
from .codec import Codec

__all__ = ["BatchTurboQuantKVCache"]


class BatchTurboQuantKVCache(_RowSettling, _BatchAttention, _BatchOperations, _BaseCache):
    """The compressed caches of one layer for ``B`` left-padded sequences (see the
    module docstring). Build it with ``TurboQuantKVCache.merge(caches)``.

    Attributes (mlx-lm's batch protocol):
        offset: ``(B,)`` int32, each row's position of the next token (RoPE).
        left_padding: ``(B,)`` int32.
    """

    step = 256  # capacity granularity of the buffers (tokens)
    decode_max_queries = 8  # the op's most queries per call
    # A prompt block's scores over the rows' columns are materialized in query chunks
    # within this many bytes (as the single cache's prefill_budget_bytes).
    prefill_budget_bytes = 1 << 30

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
        self._kv = None  # buffer.CompressedKV, column-indexed (set with the codec)
        # Row b's compressed columns are [pad_b + S, cend_b) (empty before its
        # calibration); its fp16 columns start at cend_b.
        self._cend = [p + self.fp16_sink_tokens for p in self._pad]
        self._floor = 0  # trim never goes below this column
        no_levers = not self.center
        self._cal = [no_levers] * len(self._pad)
        self._mu_k = self._mu_v = None  # (B, H, 1, D) float32 (zeros: not calibrated)
        self._dirty = False  # tokens arrived since the last _settle
        # Whether the fp16 buffers are this cache's alone, so that appends may write
        # them in place (a deep copy shares them until filter or a rebuild); the codes'
        # flag is the buffer's (buffer.CompressedKV.private).
        self._dpriv = True
        self._codec = None  # codec.Codec, set at the first update
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
            self._arrays = (
                mx.array(self._pad, dtype=mx.int32),
                mx.array([self._idx - p for p in self._pad], dtype=mx.int32),
            )
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
        codec = Codec(D, self.key_bits, self.value_bits, self.seed)
        if codec.padded or codec.rotation.kernel_signs is None:
            raise ValueError(
                f"{_PREFIX} head dim {D} is not supported in a batch: the kernels rotate "
                "power-of-two head dims only (32, 64, 128, 256)."
            )
        self._codec = codec
        self._H = H
        self._signs = codec.rotation.kernel_signs
        self._kv = CompressedKV(codec)
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
        self._dpriv = True

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
        cap = self._kv.capacity
        if needed <= cap:
            return
        # Grown by one step of columns, as mlx-lm's BatchKVCache grows: a quarter of
        # slack per row (the single cache's growth) costs a batch a quarter of the rows
        # a memory budget holds, and the copy every `step` decode steps is cheap.
        new_cap = -(-max(needed, cap + self.step) // self.step) * self.step
        self._kv.grow(new_cap, cap, len(self._pad), self._H)

    # -- the protocol -----------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Stores new tokens ``(B, H_kv, L, D)`` at the next ``L`` columns and returns
        them unchanged (attention reads the cache through :meth:`attention`)."""
        ensure_hook()
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
        if self._codec is not None and (keys.shape[1], keys.shape[3]) != (
            self._H,
            self._codec.head_dim,
        ):
            raise ValueError(
                f"{_PREFIX} new tokens {tuple(keys.shape)} do not match the cache "
                f"(H_kv, D) = {(self._H, self._codec.head_dim)}."
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
                cols < mx.array([self._idx + L - r for r in rp])[:, None]
            )
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
        if self._codec is None:
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
                raise ValueError(f"{_PREFIX} left padding can only be added to an empty cache.")
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
            if self._kv.k_codes is not None:
                self._kv.replace([_roll_rows(a, shifts) for a in self._kv.arrays], private=True)
            self._dpriv = True
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

    # -- state ------------------------------------------------------------------------

    @property
    def state(self):
        """The arrays (what ``mx.eval`` needs after a prompt block)."""
        self._settle()
        arrays = [
            self._dk,
            self._dv,
            self._sk,
            self._sv,
            *(self._kv.arrays if self._kv is not None else ()),
            self._mu_k,
            self._mu_v,
        ]
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
        arrays = [
            self._dk,
            self._dv,
            self._sk,
            self._sv,
            *(self._kv.arrays if self._kv is not None else ()),
            self._mu_k,
            self._mu_v,
        ]
        return sum(a.nbytes for a in arrays if a is not None)

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        deepcopy_attributes(self, new, memo)
        # A deep copy shares the arrays' buffers: neither may write them in place.
        for c in (self, new):
            if c._kv is not None:
                c._kv.private = False
            c._dpriv = False
        return new

    def __repr__(self):
        return (
            f"BatchTurboQuantKVCache(B={len(self._pad)}, columns={self._idx}, "
            f"K{self.key_bits}V{self.value_bits}, sinks={self.fp16_sink_tokens}, "
            f"window={self.fp16_recent_tokens}, center={self.center})"
        )


register_cache_class(BatchTurboQuantKVCache)
