# Copyright © 2026 turboquant_mlx contributors.

"""The mlx-lm cache class of one layer, :class:`TurboQuantKVCache`.

It follows mlx-lm's cache protocol (``update_and_fetch``, ``offset``,
``state``/``meta_state``/``from_state``, ``trim``, ``make_mask``, ``nbytes``,
``empty``, ``size``) and computes attention on its compressed storage
(:meth:`TurboQuantKVCache.attention`, reached through
:func:`~turboquant_mlx.attention.install_hook`). The token layout, the levers and the
attention plans are described in :mod:`turboquant_mlx.cache`. This module holds the
configuration, the protocol and the entry points; the class's other parts live in the
modules of its bases, each on the class's attributes:

* :mod:`~turboquant_mlx.state`: the state format (``state``, ``meta_state``,
  ``from_state``);
* :mod:`~turboquant_mlx.calibration`: calibration of the levers (``center``,
  ``query_aware_keys``);
* :mod:`~turboquant_mlx.window`: the fp16 window, the code tail and the ring;
* :mod:`~turboquant_mlx.storage`: the compressed segment's buffers and byte counts;
* :mod:`~turboquant_mlx.decode`: decode and verification attention;
* :mod:`~turboquant_mlx.prefill`: prefill attention.
"""

from typing import Optional, Union

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as _mlx_cache
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ._common import (
    _PREFIX,
    _ROPE_PAIRINGS,
    _cat,
    _check_bits,
    _check_int,
    _pad_last,
    deepcopy_attributes,
)
from .attention import ensure_hook, register_cache_class
from .buffer import CompressedKV
from .calibration import CalibrationMixin
from .codec import Codec
from .codespace import _fused_all_finite
from .levers import QueryEnergies
from .decode import DecodeMixin
from .prefill import PrefillMixin, release_scratch
from .rotation import Rotation
from .state import StateMixin
from .storage import StorageMixin
from .window import WindowMixin

__all__ = ["TurboQuantKVCache"]


class TurboQuantKVCache(
    StateMixin, CalibrationMixin, WindowMixin, StorageMixin, DecodeMixin, PrefillMixin, _BaseCache
):
    """One layer's KV cache stored as TurboQuant codes (see :mod:`turboquant_mlx.cache`).

    Args:
        key_bits: Bits per key coordinate (2, 3 or 4).
        value_bits: Bits per value coordinate (2, 3 or 4).
        seed: Seed of this layer's rotation (shared by keys and values). The
            factory derives it from a base seed and the layer index
            (:func:`layer_seed`).
        fp16_sink_tokens: Number of first positions kept unquantized.
        fp16_recent_tokens: Size of the window of most recent tokens kept
            unquantized (0: quantize every token on arrival).
        rollback_tokens: Extra unquantized tokens kept behind the window so that a
            ``trim`` of up to this many tokens is exact, and that each query of a
            verification block of up to this many tokens plus one sees the window of
            its own position (only used with a window).
        prefill_budget_bytes: Where MLX's attention has no fused kernel for a
            prefill (the CPU; see :meth:`_attend_prefill`), the most bytes of scores
            one chunk of queries may materialize; default 1 GiB (fewer, larger
            chunks read the layer's keys and values fewer times).
        window_dtype: Storage dtype of the unquantized tokens (sinks, window).
            Default: the keys' dtype if it is float16 or bfloat16, else float16.
            Incoming keys and values are rounded to it on arrival, so the cache
            behaves the same whichever segment a token is in when it is quantized.
        center: Store the compressed tokens centered on the calibration tokens' mean
            keys and values (:mod:`turboquant_mlx.cache`).
        query_aware_keys: Scale the compressed keys channel-wise by ``a`` from the
            calibration's query and key energies, and the queries by ``1/a``.
        rope_pairing: Channels whose energies are averaged for ``a`` (the pairs the
            model's RoPE rotates together): ``"half"`` pairs ``i`` with
            ``i + rope_dims/2`` (mlx-lm's default RoPE), ``"interleaved"`` pairs
            ``2i`` with ``2i+1`` (``traditional`` RoPE), ``"none"`` ties nothing.
        rope_dims: Number of rotated channels (partial RoPE); 0 means the head dim.
        calibration_tokens: Non-sink tokens held unquantized before the levers are
            calibrated (at least 1; only used with ``center`` or
            ``query_aware_keys``).
        rotate_values: Rotate values with the layer's rotation before quantizing
            them, and rotate the attention output's value accumulation back
            (default). ``False`` is for a model whose ``W_v``/``W_o`` carry this
            rotation already (:mod:`turboquant_mlx.fold`): values are quantized as
            they arrive and the output stays in that rotated space, for ``W_o`` to
            undo. Keys are rotated either way. Not part of the saved state (a cache
            rebuilt from a state rotates its values).

    Head dims: the kernels take multiples of 32 in [32, 256]. Any other even head dim
    ``D`` up to 256 (80, 112, 72, ...) is stored zero-padded to ``D'``, the next
    multiple of 32: a head vector ``x`` is stored as ``(x, 0)`` and the layer's
    rotation is one of ``R^D'``. A random rotation maps the direction of ``(x, 0)`` to
    a uniform point of the sphere of ``R^D'``, so the ``D'``-dim codebook is the right
    one, and with the queries padded too the dot products are those of ``x``: attention
    is exact up to quantization. The cost is ``D'/D`` times the code bits per token
    (80: 1.2x, 112: 1.14x, 72: 1.33x), and the fp16 sinks and window are stored padded
    too (counted in ``nbytes``). The queries, the attention output and
    :meth:`dequantized_keys_values` have the model's head dim (:attr:`head_dim`;
    :attr:`stored_head_dim` is ``D'``); a saved state holds the padded arrays and the
    model's head dim (format 3). The value rotation cannot be folded into ``W_v``/``W_o``
    (:mod:`turboquant_mlx.fold`) at a padded head dim.

    ``update_and_fetch`` refuses (ValueError) tokens of the wrong shape, and keys or
    values that are not finite once rounded to the fp16 storage, before it changes
    anything: a refused update leaves the cache as it was. The finiteness check reads
    the new tokens, so the host waits for them to be computed. Attribute
    ``check_finite`` (class or instance) says which updates it checks: ``"auto"``
    (default) every prompt block (more than ``decode_max_queries`` tokens) and, on the
    CPU, whose append kernels would refuse such tokens later, every update (on a GPU
    the prompt block's check does not wait: the next update reads it, and if the block
    was not finite, takes it back out of the cache and raises); ``"always"``
    decode and verify steps on a GPU too, at the price of pipelined decoding (the next
    step's graph is then built after this step's keys are known, not while they are
    computed); ``"never"``. On a GPU an unchecked non-finite token is stored as it is
    and makes the attention outputs that see it NaN, as with an fp16 cache.

    Note:
        The class has no attribute ``bits``: mlx-lm sends any cache that has one to
        its affine-quantized attention path.
    """

    rotate_values = True  # see rotate_values above; instance attribute when set
    step = 256  # capacity granularity (tokens)
    growth = 1.25  # capacity grows at least by this factor when full
    decode_max_queries = 8  # larger query blocks take the prefill path
    # Which updates are checked for non-finite tokens before anything changes (see the
    # class docstring): "auto", "always" or "never".
    check_finite = "auto"
    default_prefill_budget_bytes = 1 << 30
    # Whether "auto" defers a prompt block's check to the next update: None = on a GPU
    # (the CPU's append kernels would refuse the tokens first). Tests set it.
    _defer_prompt_check = None

    def __init__(
        self,
        key_bits: int = 4,
        value_bits: int = 4,
        seed: int = 0,
        *,
        fp16_sink_tokens: int = 0,
        fp16_recent_tokens: int = 0,
        rollback_tokens: int = 16,
        prefill_budget_bytes: Optional[int] = None,
        window_dtype: Optional[mx.Dtype] = None,
        center: bool = False,
        query_aware_keys: bool = False,
        rope_pairing: str = "half",
        rope_dims: int = 0,
        calibration_tokens: int = 32,
        rotate_values: bool = True,
    ):
        self._init_runtime(prefill_budget_bytes)
        self.window_dtype = window_dtype
        self._configure(
            key_bits,
            value_bits,
            seed,
            fp16_sink_tokens,
            fp16_recent_tokens,
            rollback_tokens,
            center,
            query_aware_keys,
            rope_pairing,
            rope_dims,
            calibration_tokens,
        )
        if not isinstance(rotate_values, (bool, np.bool_)):
            raise ValueError(f"{_PREFIX} rotate_values must be a bool, got {rotate_values!r}.")
        self.rotate_values = bool(rotate_values)
        self._config_set = True
        self._reset_storage()

    # -- configuration ----------------------------------------------------------------

    def _init_runtime(self, prefill_budget_bytes=None):
        if prefill_budget_bytes is None:
            prefill_budget_bytes = self.default_prefill_budget_bytes
        self.prefill_budget_bytes = _check_int("prefill_budget_bytes", prefill_budget_bytes, 1)
        self._reserve_tokens = 0
        self.window_dtype = None
        self._pending_arrays = None

    def _configure(
        self,
        key_bits,
        value_bits,
        seed,
        sinks,
        recent,
        rollback,
        center=False,
        query_aware_keys=False,
        rope_pairing="half",
        rope_dims=0,
        calibration_tokens=32,
    ):
        self.key_bits = _check_bits("key_bits", key_bits)
        self.value_bits = _check_bits("value_bits", value_bits)
        self.seed = _check_int("seed", seed)
        self.fp16_sink_tokens = _check_int("fp16_sink_tokens", sinks)
        self.fp16_recent_tokens = _check_int("fp16_recent_tokens", recent)
        self.rollback_tokens = _check_int("rollback_tokens", rollback)
        for name, flag in (("center", center), ("query_aware_keys", query_aware_keys)):
            if not isinstance(flag, (bool, np.bool_)) and flag not in (0, 1):
                raise ValueError(f"{_PREFIX} {name} must be a bool, got {flag!r}.")
        self.center = bool(center)
        self.query_aware_keys = bool(query_aware_keys)
        if rope_pairing not in _ROPE_PAIRINGS:
            raise ValueError(
                f"{_PREFIX} rope_pairing must be one of {', '.join(_ROPE_PAIRINGS)}, "
                f"got {rope_pairing!r}."
            )
        self.rope_pairing = rope_pairing
        self.rope_dims = _check_int("rope_dims", rope_dims)
        self.calibration_tokens = _check_int("calibration_tokens", calibration_tokens, 1)
        self._codec = None  # set at the first update (the head dim comes with it)

    def _reset_storage(self):
        self.offset = 0
        # The compressed segment: a buffer.CompressedKV (set with the codec) whose
        # slots [0, _n_comp) hold the compressed positions [S, S + _n_comp).
        self._kv = None
        self._n_comp = 0
        self._sink_k = self._sink_v = None
        self._win_k = self._win_v = None
        self._win_start = self.fp16_sink_tokens
        # The last prefill block as it arrived: (keys, values, first position), until
        # the attention call that follows it (see update_and_fetch).
        self._fresh = None
        # A GPU prompt block's finiteness check, not yet read: (all-finite flag, first
        # position, tokens, the block as given, window dtype) (see _settle_finite_check).
        self._finite_pending = None
        self._drop_code_space()
        # The window's buffer (model space), a window.WindowBuffer, or None. Decode
        # steps write their token into it in place instead of concatenating the window
        # (see _window_append).
        self._win_buf = None
        # The last single-token update as it arrived: (keys, values, position).
        self._new_token = None
        # Calibration of the levers (turboquant_mlx.cache); None means identity.
        self._calibrated = not (self.center or self.query_aware_keys)
        self._mu_k = self._mu_v = self._key_scale = None
        # The queries' energies seen before calibration (levers.QueryEnergies), with the
        # marks that let a trim of the last rollback_tokens positions take them back out.
        self._queries = QueryEnergies()
        # What a trim back before the calibration point restores (see _calibrate), and
        # whether a prompt block's attention call calibrated (then the next update
        # drops it: held for longer, it doubled a short prompt's memory).
        self._calib_undo = None
        self._calib_in_prompt = False

    def _init_codec(self, head_dim: int, batch: int, heads: int, arrays=None):
        """Sets up the codec for the model's head dim (stored padded if need be) and
        the compressed buffer (over a state's ``arrays``, or empty)."""
        self._codec = Codec(head_dim, self.key_bits, self.value_bits, self.seed)
        self._batch_heads = (batch, heads)
        self._kv = CompressedKV(self._codec)
        if arrays is not None:
            self._kv.replace(arrays, private=False)

    @property
    def head_dim(self) -> Optional[int]:
        """The model's head dim (``None`` before the first update)."""
        return None if self._codec is None else self._codec.model_dim

    @property
    def stored_head_dim(self) -> Optional[int]:
        """Head dim of the stored vectors: :attr:`head_dim`, or the next multiple of 32
        where the cache pads (``None`` before the first update)."""
        return None if self._codec is None else self._codec.head_dim

    @property
    def padded(self) -> bool:
        """Whether the cache stores zero-padded vectors (see the class docstring)."""
        return self._codec is not None and self._codec.padded

    @property
    def rotation(self) -> Optional[Rotation]:
        """The layer's rotation (``None`` before the first update)."""
        return None if self._codec is None else self._codec.rotation

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Stores new tokens ``(B, H_kv, L, D)`` and returns them unchanged.

        The returned arrays are *not* the cache contents: attention on this cache
        goes through :meth:`attention` (the hook calls it), which reads the
        compressed storage.

        Raises:
            ValueError: tokens whose shape does not match, or (with ``check_finite``)
                keys or values that are NaN or infinite in the cache's fp16 storage
                dtype; the cache is then unchanged.
        """
        # The attention that follows must be the hook's (see ensure_hook), whoever made
        # this cache: mlx-lm's own would see only the tokens returned here.
        ensure_hook()
        self._settle_finite_check()
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                f"{_PREFIX} update_and_fetch expects keys and values (B, H, L, D) with equal "
                f"B, H, L; got {tuple(keys.shape)} and {tuple(values.shape)}."
            )
        if keys.shape[-1] != values.shape[-1]:
            raise ValueError(
                f"{_PREFIX} keys and values must have the same head dim (one rotation per "
                f"layer); got {keys.shape[-1]} and {values.shape[-1]}."
            )
        if self._codec is not None and (
            keys.shape[-1] != self._codec.model_dim
            or (keys.shape[0], keys.shape[1]) != self._batch_heads
        ):
            raise ValueError(
                f"{_PREFIX} new tokens {tuple(keys.shape)} do not match the cache "
                f"(B, H_kv, D) = {self._batch_heads + (self._codec.model_dim,)}."
            )
        given = keys, values
        window_dtype = self.window_dtype
        if window_dtype is None:
            half = (mx.float16, mx.bfloat16)
            window_dtype = keys.dtype if keys.dtype in half else mx.float16
        keys = keys.astype(window_dtype)
        values = values.astype(window_dtype)
        check = self.check_finite
        if check not in ("auto", "always", "never"):
            raise ValueError(
                f"{_PREFIX} check_finite must be 'auto', 'always' or 'never', got {check!r}."
            )
        prompt_block = keys.shape[2] > self.decode_max_queries
        on_cpu = mx.default_device() == mx.cpu
        checked = check == "always" or check == "auto" and (prompt_block or on_cpu)
        # A GPU prompt block under "auto" is checked without waiting: reading the flag
        # now would stall the GPU once per layer and block, about a tenth of a long
        # prompt's time. The next update reads it (see _settle_finite_check).
        deferred = (
            checked
            and check == "auto"
            and prompt_block
            and (not on_cpu if self._defer_prompt_check is None else self._defer_prompt_check)
        )
        if checked and not deferred and not _fused_all_finite(keys, values).item():
            raise ValueError(self._not_finite_message(given, window_dtype))
        # Everything checked (a refused update changes nothing): store.
        if self._codec is None:
            # (refuses an unsupported head dim first)
            self._init_codec(keys.shape[-1], keys.shape[0], keys.shape[1])
        if self._codec.padded:  # zero-padded from here on
            keys = _pad_last(keys, self._codec.head_dim)
            values = _pad_last(values, self._codec.head_dim)
        self.window_dtype = window_dtype
        if self._calib_undo is not None and self._calib_in_prompt:
            # Calibrated at a prompt block's attention: the steps that follow trim only
            # their own tokens, never back before the block's end.
            self._calib_undo = None
        if not self._calibrated and self._held_tokens() >= self.calibration_tokens:
            self._calibrate()  # no attention call came since those tokens arrived
        L = keys.shape[2]
        P = self.offset
        S = self.fp16_sink_tokens
        t = 0
        if P < S:
            t = min(S - P, L)
            self._sink_k = _cat(self._sink_k, keys[:, :, :t])
            self._sink_v = _cat(self._sink_v, values[:, :, :t])
        if t < L:
            self._store(keys[:, :, t:] if t else keys, values[:, :, t:] if t else values, P + t)
        self.offset = P + L
        undo = self._calib_undo
        if undo is not None and self.offset - undo[0] >= self.rollback_tokens:
            self._calib_undo = None  # no trim of up to rollback_tokens reaches back there
        # A prefill block's queries attend to the block's own keys and values as they
        # arrived, not as stored: the block is in memory anyway for the attention
        # call, and its queries then see every token closer than the block start
        # exactly, as a decode step sees its fp16 window. Decode and verify steps
        # (<= decode_max_queries tokens) see the cache as stored. The reference is
        # dropped by the next update or trim.
        self._fresh = (keys, values, P) if L > self.decode_max_queries else None
        if deferred:
            self._finite_pending = (_fused_all_finite(keys, values), P, L, given, window_dtype)
        self._new_token = (keys, values, P) if L == 1 else None
        return given

    def _settle_finite_check(self):
        """Reads a deferred prompt-block finiteness check (see update_and_fetch). A
        block that was not finite is taken back out of the cache (``trim``), and the
        call that found it raises."""
        pending = self._finite_pending
        if pending is None:
            return
        self._finite_pending = None
        flag, start, n, given, window_dtype = pending
        if flag.item():
            return
        self.trim(self.offset - start)
        raise ValueError(
            self._not_finite_message(given, window_dtype).replace(
                "the cache is unchanged.",
                f"the prompt block at positions [{start}, {start + n}) (checked when the "
                "next call came, as GPU prompt blocks are) was taken back out of the cache.",
            )
        )

    @staticmethod
    def _not_finite_message(given, window_dtype) -> str:
        k, v = given
        names = [
            name for name, x in (("keys", k), ("values", v)) if not mx.all(mx.isfinite(x)).item()
        ]
        if names:
            what = f"the new {' and '.join(names)} are not finite (NaN or Inf)"
        else:
            what = f"the new keys or values exceed the range of the cache's {window_dtype} storage"
        return f"{_PREFIX} update_and_fetch refused: {what}; the cache is unchanged."

    # -- attention --------------------------------------------------------------------

    def attention(
        self,
        queries: mx.array,
        scale: float,
        mask: Union[None, str, mx.array] = None,
        sinks: Optional[mx.array] = None,
    ) -> mx.array:
        """Attention of ``queries`` ``(B, H_q, L, D)`` over everything the cache holds.

        The queries are the last ``L`` positions (mlx-lm calls this right after
        ``update_and_fetch``). ``mask`` follows mlx-lm: ``None`` (no mask),
        ``"causal"``, or a bool/additive array whose last axis spans all
        ``offset`` positions. ``sinks`` are optional per-head attention-sink logits.

        Returns:
            ``(B, H_q, L, D)`` in the queries' dtype.
        """
        if self.offset == 0 or self._codec is None:
            raise ValueError(f"{_PREFIX} attention on an empty cache.")
        B, n_q, L, D = queries.shape
        codec = self._codec
        if D != codec.model_dim or B != self._batch_heads[0] or n_q % self._batch_heads[1]:
            raise ValueError(
                f"{_PREFIX} queries {tuple(queries.shape)} do not match the cache "
                f"(B, H_kv, D) = {self._batch_heads + (self._codec.model_dim,)}."
            )
        if L > self.offset:
            raise ValueError(f"{_PREFIX} {L} queries but only {self.offset} cached tokens.")
        if isinstance(mask, str):
            if mask != "causal":
                raise ValueError(f"{_PREFIX} unknown mask mode {mask!r}.")
        elif mask is not None and mask.shape[-1] != self.offset:
            raise ValueError(
                f"{_PREFIX} mask covers {mask.shape[-1]} keys but the cache holds "
                f"{self.offset} tokens."
            )
        elif mask is not None and mask.ndim >= 2 and mask.shape[-2] not in (1, L):
            raise ValueError(
                f"{_PREFIX} mask {tuple(mask.shape)} has {mask.shape[-2]} queries for a "
                f"block of {L} queries."
            )
        if self._fresh is not None and self._fresh[0].shape[2] != L:
            self._fresh = None  # these queries are not the block that just arrived
        if D != codec.head_dim:  # padded queries: dot products unchanged
            queries = _pad_last(queries, codec.head_dim)
        if L <= self.decode_max_queries:
            release_scratch()  # the prompt is read: its temporaries go
            if not self._calibrated:
                out = self._attend_calibrating(queries, scale, mask, sinks)
            else:
                out = self._attend_step(queries, scale, mask, sinks)
        else:
            if not self._calibrated:
                self._observe_queries(queries, self.offset - L)
                if self._held_tokens() >= self.calibration_tokens:
                    self._calibrate()
            out = self._attend_prefill(queries, scale, mask, sinks)
        if D != codec.head_dim:
            out = out[..., :D]
        return out.astype(queries.dtype)

    # -- protocol ---------------------------------------------------------------------

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        """Same masks as mlx-lm's ``KVCache.make_mask`` (the cache holds every position)."""
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self._codec is None

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drops the last ``n`` tokens; returns how many were dropped.

        Exact (the cache equals one that never saw the dropped tokens) when no
        fp16 window is used, or when ``n <= rollback_tokens`` since the last time
        the window lost tokens to a trim; beyond that, tokens that should be back
        in the fp16 window are only available quantized and are used as such.
        With the levers (``center``/``query_aware_keys``), the query energies of
        the trimmed positions are taken back out (those of a prefill block trimmed
        in part stay), and a trim back before the position that calibrated the
        levers returns the cache to the uncalibrated one that never saw the trimmed
        tokens, while fewer than ``rollback_tokens`` tokens have arrived since, or, where
        a prompt block's attention call calibrated them, until the next update (after
        that, ``mu`` and ``a`` stay).
        """
        n = max(0, min(int(n), self.offset))
        if n == 0:
            return 0
        self._fresh = None
        self._new_token = None
        self._drop_code_space()
        new = self.offset - n
        if self._finite_pending is not None and new <= self._finite_pending[1]:
            self._finite_pending = None  # the unchecked block is gone
        S = self.fp16_sink_tokens
        if self._sink_k is not None and new < self._sink_k.shape[2]:
            if new == 0:
                self._sink_k = self._sink_v = None
            else:
                self._sink_k = self._sink_k[:, :, :new]
                self._sink_v = self._sink_v[:, :, :new]
        self._n_comp = min(self._n_comp, max(0, new - S))
        # The dropped slots are written again by the next appends, while arrays taken
        # before the trim (state, dequantized tokens, pending graphs) may still read them.
        self._kv.private = False
        if self._calib_undo is not None and new < self._calib_undo[0]:
            self._uncalibrate(new)
        elif (self.fp16_recent_tokens == 0 and self._calibrated) or new <= self._win_start:
            self._win_k = self._win_v = None
            self._win_start = max(S, new)
        else:
            self._win_k = self._win_k[:, :, : new - self._win_start]
            self._win_v = self._win_v[:, :, : new - self._win_start]
        self._queries.trim(new)
        self.offset = new
        return n

    def __deepcopy__(self, memo):
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        deepcopy_attributes(self, new, memo)
        # A deep copy of an mx.array shares its buffer: neither cache may append to the
        # shared buffers in place, nor write the shared ring in place (both start a ring
        # of their own at their next decode step).
        for c in (self, new):
            if c._kv is not None:
                c._kv.private = False
            c._ring, c._ring_readers = None, []
        return new

    def __copy__(self):
        # As a deep copy: mx.arrays are shared either way, and a copy that shared this
        # cache's lists of pending window tokens would corrupt both.
        return self.__deepcopy__({})

    @classmethod
    def merge(cls, caches):
        """One :class:`~turboquant_mlx.batch.BatchTurboQuantKVCache` of single-sequence
        caches (mlx-lm's batched generation merges a layer's caches this way)."""
        from .batch import BatchTurboQuantKVCache

        return BatchTurboQuantKVCache.merge(caches)

    def __repr__(self):
        return (
            f"TurboQuantKVCache(key_bits={self.key_bits}, value_bits={self.value_bits}, "
            f"seed={self.seed}, fp16_sink_tokens={self.fp16_sink_tokens}, "
            f"fp16_recent_tokens={self.fp16_recent_tokens}, center={self.center}, "
            f"query_aware_keys={self.query_aware_keys}, offset={self.offset})"
        )


# mlx-lm's load_prompt_cache (and CacheList) rebuild caches by class name from the
# globals of mlx_lm.models.cache.
setattr(_mlx_cache, "TurboQuantKVCache", TurboQuantKVCache)
# The attention hook sends its attention to TurboQuantKVCache.attention.
register_cache_class(TurboQuantKVCache)
