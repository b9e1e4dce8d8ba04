# Copyright © 2026 turboquant_mlx contributors.

"""The batch cache's batch operations: merge of single caches, extract, filter, extend,
trim (see :mod:`turboquant_mlx.batch`)."""

import mlx.core as mx

from ._batch_common import _PREFIX, _settings_of


class _BatchOperations:
    """Part of :class:`~turboquant_mlx.batch.BatchTurboQuantKVCache`: works on its attributes."""

    # -- batch operations -------------------------------------------------------------

    @classmethod
    def merge(cls, caches):
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
                    f"{_PREFIX} merge takes TurboQuantKVCache of one class, got {type(c).__name__}."
                )
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
            raise ValueError(f"{_PREFIX} merge of caches with different window dtypes {dtypes}.")
        lengths = [c.size() for c in caches]
        n = max(lengths)
        batch = cls(
            settings,
            [n - m for m in lengths],
            window_dtype=next(iter(dtypes)) if dtypes else caches[0].window_dtype,
        )
        batch._single = single
        if not full:
            return batch
        ref = full[0]
        if ref.padded:
            raise ValueError(
                f"{_PREFIX} head dim {ref.head_dim} (stored padded) is not supported in a batch."
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
            target = max(S, held - R)  # where a calibrated row's compressed tokens end
            if r["calibrated"] and held > S and S + r["nc"] > target:
                # A trim beyond the rollback window left compressed tokens where the
                # window should be, and the single cache reads them as stored: the row
                # reads them so too, decoded into its fp16 columns.
                keep = target - S
                if r["ws"] > target:
                    k, v = c._dequantized(keep, r["ws"] - target, batch.window_dtype)
                    r["wk"] = k if not r["wk"].size else mx.concatenate([k, r["wk"]], axis=2)
                    r["wv"] = v if not r["wv"].size else mx.concatenate([v, r["wv"]], axis=2)
                    r["ws"] = target
                for name in ("kc", "ks", "vc", "vs"):
                    r[name] = r[name][:, :, :keep]
                r["nc"] = keep
            if r["calibrated"] and held > S and S + r["nc"] != target:
                raise ValueError(
                    f"{_PREFIX} cache {b} holds {r['nc']} compressed tokens of {held} where "
                    f"{target - S} are expected: it cannot join a batch."
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
                for buf, name in zip(batch._kv.arrays, ("kc", "ks", "vc", "vs")):
                    buf[b : b + 1, :, a : a + nc] = r[name]
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
            comp = [rows(a, p + S, p + S + nc) for a in self._kv.arrays]
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
            window = [
                rows(self._dk, p + ws - d0, self._idx - d0),
                rows(self._dv, p + ws - d0, self._idx - d0),
            ]
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
        keep = [
            int(i)
            for i in (
                batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices
            )
        ]
        sel = mx.array(keep, dtype=mx.int32)
        self._pad = [self._pad[i] for i in keep]
        self._ns = [self._ns[i] for i in keep]
        self._cal = [self._cal[i] for i in keep]
        self._cend = [self._cend[i] for i in keep]
        if self._rpad is not None:
            self._rpad = [self._rpad[i] for i in keep]
        for name in ("_dk", "_dv", "_sk", "_sv", "_mu_k", "_mu_v"):
            a = getattr(self, name)
            if a is not None:
                setattr(self, name, a[sel])
        self._dpriv = True
        if self._kv is not None and self._kv.k_codes is not None:
            self._kv.replace([a[sel] for a in self._kv.arrays], private=True)
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
            # (views of the old arrays: not private)
            self._kv.replace(
                [None if a is None else a[:, :, m:] for a in self._kv.arrays], private=False
            )
            self._floor = max(0, self._floor - m)
            self._dpriv = False
        self._changed()

    def extend(self, other):
        """Appends the rows of ``other`` (same settings), right-aligned on the columns."""
        if not isinstance(other, type(self)) or other._settings != self._settings:
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
                p + idx - other._idx for p in other._pad
            ]
            self._ns += other._ns
            self._cal += other._cal
            self._idx = idx
            self._cend = [p + self.fp16_sink_tokens for p in self._pad]
            self._changed()
            return
        B1, B2 = len(self._pad), len(other._pad)
        H, D, dtype = ref._H, ref._codec.head_dim, ref._dk.dtype
        parts = [self, other]
        d0 = min((c._d0 + idx - c._idx) for c in parts if c._dk is not None)
        dlo = min((c._dlo + idx - c._idx) for c in parts if c._dk is not None)
        any_codes = any(c._kv is not None and c._kv.k_codes is not None for c in parts)
        wk, wv = ref._codec.key_words, ref._codec.value_words
        ncap = -(-(idx - d0 + self.step) // self.step) * self.step
        ccap = -(-idx // self.step) * self.step if any_codes else 0

        def no_codes(Bc):
            return [
                mx.zeros((Bc, H, ccap, wk), mx.uint32),
                mx.zeros((Bc, H, ccap), mx.float16),
                mx.zeros((Bc, H, ccap, wv), mx.uint32),
                mx.zeros((Bc, H, ccap), mx.float16),
            ]

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
                x = x[:, :, : max(0, min(x.shape[2], total - lead))]
                widths = [(0, 0)] * x.ndim
                widths[2] = (lead, total - lead - x.shape[2])
                return mx.pad(x, widths)

            dk = fit(c._dk[:, :, :n], a, ncap)
            dv = fit(c._dv[:, :, :n], a, ncap)
            sk, sv = c._sk, c._sv
            if self.fp16_sink_tokens == 0:
                sk = sv = None
            if c._kv.k_codes is not None:
                codes = [fit(x, shift, ccap) for x in c._kv.arrays]
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
            self._kv.replace([mx.concatenate([x, y]) for x, y in zip(a_[4], b_[4])], private=True)
        if self.center:
            self._mu_k = mx.concatenate([a_[5][0], b_[5][0]])
            self._mu_v = mx.concatenate([a_[5][1], b_[5][1]])
        self._pad = [p + idx - self._idx for p in self._pad] + [
            p + idx - other._idx for p in other._pad
        ]
        self._ns = self._ns + other._ns
        self._cal = self._cal + other._cal
        self._cend = [c + idx - self._idx for c in self._cend] + [
            c + idx - other._idx for c in other._cend
        ]
        self._idx = idx
        self._d0 = d0
        self._dlo = max(d0, dlo)
        self._floor = max(c._floor + idx - c._idx for c in parts)
        self._dpriv = True
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
            self._cend = [
                min(c, max(p + S, self._idx - R)) if cal else c
                for c, p, cal in zip(self._cend, self._pad, self._cal)
            ]
            self._kv.private = self._dpriv = False
            self._changed()
        return n
