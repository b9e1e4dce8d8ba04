# Copyright © 2026 turboquant_mlx contributors.

"""The batch cache's attention: one op call over every row, masked per row, merged with
the fp16 part (see :mod:`turboquant_mlx.batch`)."""

from typing import List

import mlx.core as mx

from . import ops
from .attention import dense_attention, merge_attention
from ._batch_common import _MASK_MEMO, _PREFIX


class _BatchAttention:
    """Part of :class:`~turboquant_mlx.batch.BatchTurboQuantKVCache`: works on its attributes."""

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
        if self._codec is None or self._idx == 0:
            raise ValueError(f"{_PREFIX} attention on an empty cache.")
        B, n_q, L, D = queries.shape
        if B != len(self._pad) or D != self._codec.head_dim or n_q % self._H:
            raise ValueError(
                f"{_PREFIX} queries {tuple(queries.shape)} do not match the cache "
                f"(B, H_kv, D) = {(len(self._pad), self._H, self._codec.head_dim)}."
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
        dense = self._dense_part(queries, scale, mask)
        if dense is not None:
            parts.append(dense)
        if sinks is not None:
            lse = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, -1, 1), (B, n_q, L))
            parts.append((mx.zeros((B, n_q, L, D), mx.float32), lse))
        return merge_attention(parts)[0].astype(queries.dtype)

    def _op(self, queries, scale, op_mask, tail=(None, None), final=False):
        return self._kv.attention(
            queries,
            self._W,
            scale,
            False,
            op_mask,
            tail=tail,
            rotation_signs=self._signs,
            rotate_output=self.rotate_values,
            means=(self._mu_k, self._mu_v),
            out_dtype=queries.dtype if final else None,
        )

    def _comp_mask(self, L: int, lo: List[int], mask=None, a: int = 0):
        """Bool ``(B, 1, 1|L, W - a)``: row b's compressed columns ``[lo_b, cend_b)``
        from column ``a`` (causal for a block: a row's block may be compressed), or
        None when every row sees all ``W``."""
        W = self._W
        if mask is None and L == 1 and all(x == 0 for x in lo) and all(c == W for c in self._cend):
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
            keep = keep & (
                cols[:, None, None, :] <= mx.arange(self._idx - L, self._idx)[None, None, :, None]
            )
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
        if (
            W == 0
            or self._kv.k_codes is None
            or any(n < S for n in self._ns)
            or any(c != idx - R for c in self._cend)
            or S + R > ops.MAX_TAIL_TOKENS
        ):
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
            tail = (
                ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2),
                vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2),
            )
        lo = [p + S for p in self._pad]
        return self._op(queries, scale, self._comp_mask(1, lo), tail, final=True)[0]

    def _compressed_part(self, queries, scale, mask):
        """``(out, lse)`` over the rows' compressed columns, or None (none visible)."""
        lo = self._comp_lo()
        W = self._W
        seen = [b for b in range(len(lo)) if self._cend[b] > lo[b]]
        if self._kv.k_codes is None or not seen:
            return None
        L = queries.shape[2]
        if L <= min(self.decode_max_queries, W):
            return self._op(queries, scale, self._comp_mask(L, lo, mask))
        # A prompt block over compressed history (the op takes at most 8 queries), or a
        # short block over fewer compressed columns than queries (the op needs at least
        # as many): the visible columns are decoded once (this layer's temporary, as the
        # single cache's prefill does) and attended densely.
        a = min(lo[b] for b in seen)
        n = W - a
        yk, yv = self._kv.decoded(a, n)
        rotation = self._codec.rotation
        k = rotation.inverse(yk)
        v = rotation.inverse(yv) if self.rotate_values else yv
        if self.center:
            k = k + self._mu_k
            v = v + self._mu_v
        return dense_attention(
            queries,
            k,
            v,
            scale,
            self._comp_mask(L, lo, mask, a),
            max_score_bytes=self.prefill_budget_bytes,
        )

    def _dense_part(self, queries, scale, mask):
        """``(out, lse)`` over the sinks and the fp16 columns each row sees, or None
        where there are none (a block without a window reads itself compressed)."""
        S = self.fp16_sink_tokens
        L = queries.shape[2]
        idx, d0 = self._idx, self._d0
        lo = self._dense_lo()
        a = max(d0, min(lo))
        sinks_held = S and max(self._ns) > 0
        if a >= idx and not sinks_held:
            return None
        cols = mx.arange(a, idx)
        q_cols = mx.arange(idx - L, idx)
        keep = (cols[None, None, :] >= mx.array(lo)[:, None, None]) & (
            cols[None, None, :] <= q_cols[None, :, None]
        )  # (B, L, n)
        keep = keep[:, None]
        if mask is not None:
            keep = keep & mask[..., a:idx]
        k = self._dk[:, :, a - d0 : idx - d0]
        v = self._dv[:, :, a - d0 : idx - d0]
        if sinks_held:
            s_cols = mx.array(self._pad)[:, None] + mx.arange(S)[None, :]  # (B, S)
            s_keep = (mx.arange(S)[None, :] < mx.array(self._ns)[:, None])[:, None, :] & (
                s_cols[:, None, :] <= q_cols[None, :, None]
            )  # (B, L, S): causal
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
            keep = mx.concatenate(
                [s_keep, mx.broadcast_to(keep, s_keep.shape[:3] + keep.shape[3:])], axis=-1
            )
        return dense_attention(
            queries, k, v, scale, keep, max_score_bytes=self.prefill_budget_bytes
        )
