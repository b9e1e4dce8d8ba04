# Copyright © 2026 turboquant_mlx contributors.

"""The state format of :class:`~turboquant_mlx.cache.TurboQuantKVCache`: what its
``state`` / ``meta_state`` hold, how a state is checked before anything is set, and
the older formats it still reads (docs/ARCHITECTURE.md).

A state is 12 arrays (compressed segment, sinks, window, lever statistics) and the
configuration integers of :data:`_CONFIG_FIELDS` (format 2), or of
:data:`_CONFIG_FIELDS_V3` (format 3: format 2 plus the model's head dim, written by
a cache whose head dim is padded). Format 1 had 8 arrays and the first 10 integers.
With mlx-lm versions that use ``meta_state``, ``state`` holds only the arrays and
``meta_state`` the integers as strings.
"""

import contextlib
from typing import List

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import _BaseCache

from . import ops
from ._common import _PREFIX, _ROPE_PAIRINGS, _check_int, _empty, _is_empty, padded_head_dim

_FORMAT_VERSION = 2
# Format 3 is format 2 plus the model's head dim, written only by a cache whose head
# dim is padded (see TurboQuantKVCache): its arrays hold the padded vectors.
_FORMAT_VERSION_PADDED = 3

# Older mlx-lm kept the non-array part of a cache's state in ``meta_state``
# (a tuple of strings) and could only save arrays in ``state``.
_LEGACY_META_STATE = hasattr(_BaseCache, "meta_state")

# Names of the integers that describe a cache besides its arrays, in state order
# (format version 2; version 1 had the first 10 and 8 arrays).
_CONFIG_FIELDS = (
    "format_version",
    "key_bits",
    "value_bits",
    "seed",
    "fp16_sink_tokens",
    "fp16_recent_tokens",
    "rollback_tokens",
    "offset",
    "n_compressed",
    "window_start",
    "center",
    "query_aware_keys",
    "rope_pairing",
    "rope_dims",
    "calibration_tokens",
    "calibrated",
    "query_count",
)
_CONFIG_FIELDS_V1 = _CONFIG_FIELDS[:10]
_CONFIG_FIELDS_V3 = _CONFIG_FIELDS + ("head_dim",)
# k_codes, k_scales, v_codes, v_scales, sink_k, sink_v, win_k, win_v,
# mu_k, mu_v, key_scale, query_energy
_N_ARRAYS = 12
_N_ARRAYS_V1 = 8
_ARRAY_FIELDS = (
    "k_codes",
    "k_scales",
    "v_codes",
    "v_scales",
    "sink_keys",
    "sink_values",
    "window_keys",
    "window_values",
    "key_mean",
    "value_mean",
    "key_scale",
    "query_energy",
)
_WINDOW_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
_MAX_CONFIG_VALUE = 2**62  # configuration integers (counts, seed) of a state


class StateMixin:
    """The state format of the cache (module docstring): ``state``, ``meta_state``,
    ``from_state`` and their checks. A part of :class:`TurboQuantKVCache`, on its
    attributes."""

    def _config_values(self) -> List[int]:
        values = [
            _FORMAT_VERSION,
            self.key_bits,
            self.value_bits,
            self.seed,
            self.fp16_sink_tokens,
            self.fp16_recent_tokens,
            self.rollback_tokens,
            self.offset,
            self._n_comp,
            self._win_start,
            int(self.center),
            int(self.query_aware_keys),
            _ROPE_PAIRINGS.index(self.rope_pairing),
            self.rope_dims,
            self.calibration_tokens,
            int(self._calibrated),
            self._queries.count,
        ]
        if self.padded:  # format 3: the arrays hold padded vectors of the model's dim
            values[0] = _FORMAT_VERSION_PADDED
            values.append(self._codec.model_dim)
        return values

    def _state_arrays(self) -> List[mx.array]:
        n = self._n_comp
        if self._kv is None or self._kv.k_codes is None or n == 0:
            comp = [_empty(mx.uint32), _empty(mx.float16), _empty(mx.uint32), _empty(mx.float16)]
        else:
            comp = [a[:, :, :n] for a in self._kv.arrays]
        dense = [
            a if not _is_empty(a) else _empty(mx.float16)
            for a in (self._sink_k, self._sink_v, self._win_k, self._win_v)
        ]
        levers = [a if a is not None else _empty(mx.float32) for a in self._lever_arrays()]
        return comp + dense + levers

    @property
    def state(self):
        """Arrays (compressed segment, sinks, window, lever statistics), then the
        configuration integers (docs/ARCHITECTURE.md). With mlx-lm versions that use
        ``meta_state``, only the arrays.
        """
        arrays = self._state_arrays()
        if _LEGACY_META_STATE:
            return arrays
        return arrays + self._config_values()

    @state.setter
    def state(self, v):
        # A refused state (ValueError) leaves the cache as it was.
        with self._unchanged_on_error():
            self._set_state(v)

    def _set_state(self, v):
        if not hasattr(self, "prefill_budget_bytes"):
            self._init_runtime()
        v = list(v)
        layouts = {
            _N_ARRAYS + len(_CONFIG_FIELDS): _N_ARRAYS,
            _N_ARRAYS + len(_CONFIG_FIELDS_V3): _N_ARRAYS,
            _N_ARRAYS_V1 + len(_CONFIG_FIELDS_V1): _N_ARRAYS_V1,
        }
        if len(v) in layouts:
            n = layouts[len(v)]
            self._apply_config(v[n:])
            self._set_arrays(v[:n])
        elif len(v) in (_N_ARRAYS, _N_ARRAYS_V1):
            if hasattr(self, "key_bits") and getattr(self, "_config_set", False):
                self._set_arrays(v)
            else:
                self._pending_arrays = v  # meta_state will follow
        else:
            raise ValueError(
                f"{_PREFIX} a state has {_N_ARRAYS} arrays and optionally "
                f"{len(_CONFIG_FIELDS)} integers ({len(_CONFIG_FIELDS_V3)} with a padded head "
                f"dim; format 1: {_N_ARRAYS_V1} and "
                f"{len(_CONFIG_FIELDS_V1)}); got {len(v)} entries."
            )

    @property
    def meta_state(self):
        """The configuration integers as strings (older mlx-lm convention)."""
        return tuple(str(x) for x in self._config_values())

    @meta_state.setter
    def meta_state(self, v):
        with self._unchanged_on_error():
            if not hasattr(self, "prefill_budget_bytes"):
                self._init_runtime()
            self._apply_config(v)
            if self._pending_arrays is not None:
                arrays, self._pending_arrays = self._pending_arrays, None
                self._set_arrays(arrays)

    @contextlib.contextmanager
    def _unchanged_on_error(self):
        """Restores every attribute of the cache if the block raises: setting a state
        configures the cache before its arrays are checked against that configuration.
        (The attributes are replaced, never mutated in place, by the state setters.)"""
        saved = dict(self.__dict__)
        try:
            yield
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(saved)
            raise

    def _apply_config(self, values):
        values = list(values)
        ints = []
        for i, x in enumerate(values):
            name = _CONFIG_FIELDS_V3[i] if i < len(_CONFIG_FIELDS_V3) else f"#{i}"
            shown = f"an array of shape {tuple(x.shape)}" if isinstance(x, mx.array) else repr(x)
            try:
                if isinstance(x, mx.array):
                    x = x.item()  # (a ValueError unless it has one element)
                if isinstance(x, (float, np.floating)) and not float(x).is_integer():
                    raise ValueError(shown)
                ints.append(int(x))
            except (TypeError, ValueError, OverflowError) as e:
                raise ValueError(
                    f"{_PREFIX} configuration value {name} must be an integer, got {shown[:80]}."
                ) from e
        version = ints[0] if ints else None
        fields = {
            1: _CONFIG_FIELDS_V1,
            _FORMAT_VERSION: _CONFIG_FIELDS,
            _FORMAT_VERSION_PADDED: _CONFIG_FIELDS_V3,
        }.get(version)
        if fields is None:
            raise ValueError(
                f"{_PREFIX} unsupported state format version {version} "
                f"(this build reads versions 1 to {_FORMAT_VERSION_PADDED})."
            )
        if len(ints) != len(fields):
            raise ValueError(
                f"{_PREFIX} expected {len(fields)} configuration values {fields}, got {len(ints)}."
            )
        cfg = dict(zip(fields, ints))
        for name, value in cfg.items():
            if not 0 <= value <= _MAX_CONFIG_VALUE:
                raise ValueError(
                    f"{_PREFIX} configuration value {name} = {value} is out of range "
                    f"[0, {_MAX_CONFIG_VALUE}]."
                )
        for name in ("center", "query_aware_keys", "calibrated"):
            if cfg.get(name, 0) not in (0, 1):
                raise ValueError(
                    f"{_PREFIX} configuration value {name} must be 0 or 1, got {cfg[name]}."
                )
        state_dim = cfg.get("head_dim")
        if state_dim is not None:
            try:
                stored = padded_head_dim(state_dim)
            except ValueError as e:
                raise ValueError(f"{_PREFIX} configuration value head_dim: {e}.") from None
            if stored == state_dim:
                raise ValueError(
                    f"{_PREFIX} configuration value head_dim = {state_dim} in a "
                    "padded state (format 3), but that head dim is not padded."
                )
        pairing = cfg.get("rope_pairing", 1)
        if not 0 <= pairing < len(_ROPE_PAIRINGS):
            raise ValueError(f"{_PREFIX} unknown rope_pairing code {pairing}.")
        self._configure(
            cfg["key_bits"],
            cfg["value_bits"],
            cfg["seed"],
            cfg["fp16_sink_tokens"],
            cfg["fp16_recent_tokens"],
            cfg["rollback_tokens"],
            cfg.get("center", 0),
            cfg.get("query_aware_keys", 0),
            _ROPE_PAIRINGS[pairing],
            cfg.get("rope_dims", 0),
            cfg.get("calibration_tokens", 32),
        )
        self._reset_storage()
        self.offset = _check_int("offset", cfg["offset"])
        self._n_comp = _check_int("n_compressed", cfg["n_compressed"])
        self._win_start = _check_int("window_start", cfg["window_start"])
        self._calibrated = bool(cfg.get("calibrated", 1))
        if not (self.center or self.query_aware_keys) and not self._calibrated:
            raise ValueError(f"{_PREFIX} inconsistent state: uncalibrated without levers.")
        self._queries.count = _check_int("query_count", cfg.get("query_count", 0))
        self._state_head_dim = state_dim  # the model's head dim where the arrays are padded
        self._config_set = True

    def _set_arrays(self, arrays):
        """Checks the state arrays against the configuration (set before), then stores
        them; on a ValueError nothing is stored."""
        arrays = list(arrays)
        if len(arrays) not in (_N_ARRAYS, _N_ARRAYS_V1):
            raise ValueError(
                f"{_PREFIX} a state has {_N_ARRAYS} arrays (format 1: {_N_ARRAYS_V1}); "
                f"got {len(arrays)}."
            )
        arrays += [None] * (_N_ARRAYS - len(arrays))  # format 1: no levers

        def bad(msg):
            return ValueError(f"{_PREFIX} inconsistent state: {msg}.")

        for name, a in zip(_ARRAY_FIELDS, arrays):
            if a is not None and not isinstance(a, mx.array):
                raise bad(f"{name} is a {type(a).__name__}, not an array")
        kc, ks, vc, vs, sk, sv, wk, wv, mk, mv, ka, qe = [
            None if _is_empty(a) else a for a in arrays
        ]
        named = dict(zip(_ARRAY_FIELDS, (kc, ks, vc, vs, sk, sv, wk, wv, mk, mv, ka, qe)))
        for name, a in named.items():
            ndim = 3 if name in ("k_scales", "v_scales", "query_energy") else 4
            if a is not None and a.ndim != ndim:
                raise bad(f"{name} has shape {tuple(a.shape)}, expected {ndim} dimensions")
        S, R = self.fp16_sink_tokens, self.fp16_recent_tokens
        off, n = self.offset, self._n_comp

        # Lever statistics: (B, H, 1, D) float32 means and key scale, (B, H, D) float32
        # query energies, present as the configuration and calibration say.
        q_count = self._queries.count
        if (qe is None) != (q_count == 0) or (qe is not None and self._calibrated):
            raise bad(f"query_energy does not match query_count {q_count}")
        if (mk is None) != (mv is None) or (mk is not None and not self.center):
            raise bad("key_mean and value_mean must come together, with center")
        if ka is not None and not self.query_aware_keys:
            raise bad("a key_scale without query_aware_keys")
        if not self._calibrated and (mk is not None or ka is not None):
            raise bad("lever statistics in an uncalibrated cache")
        if self._calibrated and self.center and mk is None:
            raise bad("a calibrated cache with center has no key_mean/value_mean")
        levers = [
            (name, named[name])
            for name in ("key_mean", "value_mean", "key_scale")
            if named[name] is not None
        ]
        lever_shape = levers[0][1].shape if levers else None
        for name, a in levers:
            if a.shape != lever_shape or a.shape[2] != 1 or a.dtype != mx.float32:
                raise bad(
                    f"{name} of shape {tuple(a.shape)} / {a.dtype}, expected "
                    f"(B, H, 1, D) float32 like {levers[0][0]}"
                )
        if qe is not None and qe.dtype != mx.float32:
            raise bad(f"query_energy of dtype {qe.dtype}, expected float32")

        if off == 0:
            present = [k for k, a in list(named.items())[:8] if a is not None]
            if present:
                raise bad(f"{', '.join(present)} present in an empty cache")
            bhd = [(a.shape[0], a.shape[1], a.shape[3]) for _, a in levers]
            if qe is not None:
                bhd.append(tuple(qe.shape))
            if len(set(bhd)) > 1:
                raise bad("lever statistics of different (B, H, D)")
            if bhd:
                self._check_head_dim(bhd[0][2], bad)
            # A cache trimmed to nothing keeps its calibration (or query energies).
            self._drop_code_space()
            if self._kv is not None:
                self._kv.private = False
            self._mu_k, self._mu_v, self._key_scale = mk, mv, ka
            self._queries.energy, self._queries.marks, self._calib_undo = qe, [], None
            return

        # Batch, heads and head dim from the first present array of the segments.
        ref_name, ref = next(
            (
                (k, named[k])
                for k in ("sink_keys", "window_keys", "k_codes")
                if named[k] is not None
            ),
            (None, None),
        )
        if ref is None:
            raise bad(f"offset {off} but no sink, window or compressed keys")
        B, H = ref.shape[0], ref.shape[1]
        if ref_name == "k_codes":
            head_dim = ref.shape[3] * 32 // self.key_bits
        else:
            head_dim = ref.shape[3]
        wk_words, wv_words = self._check_head_dim(head_dim, bad)
        model_dim = getattr(self, "_state_head_dim", None) or head_dim
        if padded_head_dim(model_dim) != head_dim:
            raise bad(
                f"head dim {model_dim} is stored padded to {padded_head_dim(model_dim)}, "
                f"but the arrays hold {head_dim} channels"
            )

        # fp16 segments: keys and values of one shape (B, H, tokens, D), one float dtype.
        dense = [
            (k, named[k])
            for k in ("sink_keys", "sink_values", "window_keys", "window_values")
            if named[k] is not None
        ]
        for name, a in dense:
            if (a.shape[0], a.shape[1], a.shape[3]) != (B, H, head_dim):
                raise bad(
                    f"{name} of shape {tuple(a.shape)}, expected (B, H, tokens, D) = "
                    f"({B}, {H}, tokens, {head_dim})"
                )
            if a.dtype not in _WINDOW_DTYPES:
                raise bad(f"{name} of dtype {a.dtype}, expected float16, bfloat16 or float32")
            if a.dtype != dense[0][1].dtype:
                raise bad(f"{name} of dtype {a.dtype} but {dense[0][0]} of {dense[0][1].dtype}")
        for kname, vname in (("sink_keys", "sink_values"), ("window_keys", "window_values")):
            k_, v_ = named[kname], named[vname]
            if (k_ is None) != (v_ is None) or (k_ is not None and k_.shape != v_.shape):
                raise bad(
                    f"{kname} of shape {None if k_ is None else tuple(k_.shape)} but "
                    f"{vname} of shape {None if v_ is None else tuple(v_.shape)}"
                )
        ns = min(off, S)
        if (0 if sk is None else sk.shape[2]) != ns:
            raise bad(f"expected {ns} sink tokens, got {0 if sk is None else sk.shape[2]}")

        # Compressed segment: n tokens of packed codes (uint32) and float16 scales.
        if n > max(0, off - S):
            raise bad(f"n_compressed {n} beyond offset {off} (with {S} sink tokens)")
        if n:
            if kc is None or ks is None or vc is None or vs is None:
                raise bad(f"n_compressed {n} but missing compressed arrays")
            for name, a, shape, dtype in (
                ("k_codes", kc, (B, H, n, wk_words), mx.uint32),
                ("v_codes", vc, (B, H, n, wv_words), mx.uint32),
                ("k_scales", ks, (B, H, n), mx.float16),
                ("v_scales", vs, (B, H, n), mx.float16),
            ):
                if tuple(a.shape) != shape or a.dtype != dtype:
                    raise bad(
                        f"{name} of shape {tuple(a.shape)} / {a.dtype}, expected {shape} / {dtype}"
                    )
        elif any(a is not None for a in (kc, ks, vc, vs)):
            raise bad("compressed arrays without compressed tokens")

        # Window: positions [window_start, offset), within its capacity.
        nw = 0 if wk is None else wk.shape[2]
        if not self._calibrated:
            if n or self._win_start != S or nw != max(0, off - S):
                raise bad("an uncalibrated cache holds every non-sink token in its window")
        elif R == 0:
            if nw or n != max(0, off - S):
                raise bad("window tokens or missing compressed tokens without a window")
        else:
            if (
                self._win_start < S
                or self._win_start > max(S, off)
                or nw != max(0, off - self._win_start)
                or nw > self._window_capacity
                or S + n < min(self._win_start, off)
                or n < max(0, off - R - S)
            ):
                raise bad(
                    f"window of {nw} tokens from window_start {self._win_start} does not match "
                    f"offset {off}, {n} compressed tokens and capacity {self._window_capacity}"
                )
        for name, a in levers:
            if a.shape != (B, H, 1, head_dim):
                raise bad(f"{name} of shape {tuple(a.shape)}, expected {(B, H, 1, head_dim)}")
        if qe is not None and qe.shape != (B, H, head_dim):
            raise bad(f"query_energy of shape {tuple(qe.shape)}, expected {(B, H, head_dim)}")

        # Everything checked: store.
        self._drop_code_space()
        # (a buffer over the caller's arrays: not private)
        self._init_codec(model_dim, B, H, arrays=(kc, ks, vc, vs))
        if dense:
            self.window_dtype = dense[0][1].dtype
        self._sink_k, self._sink_v, self._win_k, self._win_v = sk, sv, wk, wv
        self._mu_k, self._mu_v, self._key_scale = mk, mv, ka
        # (no history: trims keep these)
        self._queries.energy, self._queries.marks, self._calib_undo = qe, [], None
        if self._calibrated and R == 0:
            self._win_start = max(S, off)

    def _check_head_dim(self, head_dim, bad):
        """Words per token of the keys and values at ``head_dim``, or ``bad``'s error."""
        try:
            return (
                ops.words_per_token(head_dim, self.key_bits),
                ops.words_per_token(head_dim, self.value_bits),
            )
        except Exception as e:
            raise bad(f"head dim {head_dim} is not supported: {e}") from e

    @classmethod
    def from_state(cls, state, meta_state=None):
        """Rebuilds a cache from ``state`` (and ``meta_state`` for older mlx-lm)."""
        obj = cls.__new__(cls)
        obj._init_runtime()
        if meta_state is not None:
            obj.meta_state = meta_state
        obj.state = state
        if obj._pending_arrays is not None:
            raise ValueError(f"{_PREFIX} state has no configuration and no meta_state was given.")
        return obj
