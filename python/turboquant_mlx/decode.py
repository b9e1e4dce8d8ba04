# Copyright © 2026 turboquant_mlx contributors.

"""Attention of decode and verification blocks (``L <= decode_max_queries`` queries)
on :class:`~turboquant_mlx.cache.TurboQuantKVCache`: which segments (fp16 sinks,
compressed tokens, fp16 window) each query sees, and how they go to the attention op.

Which kernel calls a step makes is decided in one place, :func:`turboquant_mlx.plan.
plan_step` (its docstring has the table of routes); this module carries each route
out (:attr:`DecodeMixin._ROUTES`). The usual step is one op call over the compressed
tokens with the fp16 segments as the op's tail; where the tail is longer than the op
takes, or masks differ per segment, the segments are attended to apart and merged by
their log-sum-exp (:meth:`DecodeMixin._attend_segments`, one route for both kinds of
op: :meth:`DecodeMixin._compressed_part` puts the rotation on the op's side or around
it). The ops either apply the layer's rotation themselves (model-space queries, tails
and output) or take code-space queries and tails (see
:meth:`~turboquant_mlx.storage.StorageMixin._op_signs`). Their one-call routes differ
in more than the rotation's place (the ring is written by an op in model space, by a
compiled transform in code space; code space keeps the last tail), and stay apart. A
verification block's queries each see the cache as a single-token step at their
position would (:meth:`DecodeMixin._attend_block`).
"""

import mlx.core as mx
import numpy as np

from . import ops
from .attention import dense_attention, merge_attention
from .codespace import (
    _codes_to_model,
    _fused_decode_inputs,
    _fused_decode_output,
    _fused_queries_to_codes,
    _fused_tail_decode_output,
    _half_queries_on_gpu,
    _queries_to_codes,
)
from .ops import MAX_TAIL_TOKENS
from .plan import plan_step
from .window import CodeTail, Ring, ring_order, ring_roll, ring_slot


def _block_mask(mask, visible: np.ndarray, spans, qpos: np.ndarray):
    """``visible`` ``(L, n)`` (which of the keys at the positions of ``spans``, a list of
    ``(first position, count)``, each query sees) combined with the caller's mask
    (None, ``"causal"`` for queries at positions ``qpos``, or a bool or additive array
    over every position)."""
    if mask is None:
        return mx.array(visible)
    if isinstance(mask, str):
        kpos = np.concatenate([np.arange(p0, p0 + n) for p0, n in spans])
        return mx.array(visible & (kpos[None, :] <= qpos[:, None]))
    parts = [mask[..., p0 : p0 + n] for p0, n in spans]
    sel = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    vis = mx.array(visible)
    if sel.dtype == mx.bool_:
        return mx.logical_and(sel, vis)
    return mx.where(vis, sel, mx.array(float("-inf"), dtype=sel.dtype))


class DecodeMixin:
    """Decode and verification attention (module docstring). A part of
    :class:`TurboQuantKVCache`, on its attributes."""

    def _attend_step(self, queries, scale, mask, sinks):
        """A decode or verification block (the last ``L <= decode_max_queries``
        positions): the route :func:`~turboquant_mlx.plan.plan_step` picks, carried
        out by the method of that name in :attr:`_ROUTES`."""
        plan = plan_step(self, queries.shape[2], mask, sinks)
        return self._ROUTES[plan.route](self, queries, scale, mask, sinks, plan)

    @staticmethod
    def _segment_mask(mask, p0: int, n: int, q0: int, L: int):
        """Mask of keys at positions ``[p0, p0+n)`` for queries at ``[q0, q0+L)``."""
        if mask is None:
            return None
        if isinstance(mask, str):
            if p0 + n - 1 <= q0:
                return None  # every query sees every key of the segment
            return (p0 + mx.arange(n))[None, :] <= (q0 + mx.arange(L))[:, None]
        return mask[..., p0 : p0 + n]

    def _exact_from(self) -> int:
        """First position read from the fresh prefill block (``offset`` without one)."""
        if self._fresh is None:
            return self.offset
        ns = 0 if self._sink_k is None else self._sink_k.shape[2]
        return max(self._fresh[2], ns)

    def _dense_segments(self, key_end):
        """``(k, v, p0, n)`` of the fp16 segments (sinks, window, fresh block) before
        ``key_end``."""
        ns, _, wpos = self._layout()
        e = self._exact_from()
        segments = []
        n = min(ns, key_end)
        if n > 0:
            k, v = self._sink_k, self._sink_v
            if n < ns:
                k, v = k[:, :, :n], v[:, :, :n]
            segments.append((k, v, 0, n))
        n = min(e, key_end) - wpos
        if n > 0:
            i0 = wpos - self._win_start
            segments.append(
                (self._win_k[:, :, i0 : i0 + n], self._win_v[:, :, i0 : i0 + n], wpos, n)
            )
        n = key_end - e
        if n > 0:
            fk, fv, f0 = self._fresh
            i0 = e - f0
            segments.append((fk[:, :, i0 : i0 + n], fv[:, :, i0 : i0 + n], e, n))
        return segments

    def _dense_parts(self, q, scale, mask, q0, key_end, combine=False):
        """(out, lse) of the fp16 segments; ``combine`` attends to all of them at once."""
        L = q.shape[2]
        segments = self._dense_segments(key_end)
        if combine and len(segments) > 1:
            masks = [self._segment_mask(mask, p0, n, q0, L) for _, _, p0, n in segments]
            if all(m is None for m in masks):
                m = None
            else:
                masks = [
                    mx.ones((L, n), dtype=mx.bool_) if m is None else m
                    for m, (_, _, _, n) in zip(masks, segments)
                ]
                if len({m.ndim for m in masks}) > 1:
                    masks = [m.reshape((1,) * (4 - m.ndim) + m.shape) for m in masks]
                    shape = np.broadcast_shapes(*[m.shape[:-1] for m in masks])
                    masks = [mx.broadcast_to(m, shape + m.shape[-1:]) for m in masks]
                m = mx.concatenate(masks, axis=-1)
            k = mx.concatenate([seg[0] for seg in segments], axis=2)
            v = mx.concatenate([seg[1] for seg in segments], axis=2)
            return [dense_attention(q, k, v, scale, m)]
        return [
            dense_attention(q, k, v, scale, self._segment_mask(mask, p0, n, q0, L))
            for k, v, p0, n in segments
        ]

    @staticmethod
    def _sink_part(sinks, q):
        B, n_q, L, D = q.shape
        lse = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, -1, 1), (B, n_q, L))
        return mx.zeros((B, n_q, L, D), dtype=mx.float32), lse

    def _compressed_queries(self, q: mx.array, fused: bool = False) -> mx.array:
        """Rotated queries for the compressed segment (divided by ``a`` first)."""
        # A half-precision model's queries stay half precision on the GPU, where the
        # CUDA build's tensor-core kernel takes them (float32 selects its exact kernel);
        # the CPU kernel gets float32.
        fn = _fused_queries_to_codes if fused else _queries_to_codes
        signs, matrix, rot_scale = self._codec.rotation.params()
        return fn(q, self._key_scale, signs, matrix, rot_scale, _half_queries_on_gpu(q.dtype))

    def _compressed_result(self, out: mx.array, lse: mx.array, q: mx.array, scale: float):
        """``(out, lse)`` of the compressed segment in the model's space (see
        :func:`_codes_to_model`) from the op's on code-space queries."""
        return _codes_to_model(out, lse, q, *self._model_space_args(), scale)

    def _model_space_args(self):
        signs, matrix, rot_scale = self._codec.rotation.params()
        if not self.rotate_values:
            signs = matrix = None
        return signs, matrix, rot_scale, self._mu_k, self._mu_v

    # -- the routes (see turboquant_mlx.plan): each (queries, scale, mask, sinks, plan)

    def _route_block(self, queries, scale, mask, sinks, plan):
        return self._attend_block(queries, self.offset - queries.shape[2], scale, mask, sinks)

    def _route_segments(self, queries, scale, mask, sinks, plan):
        return self._attend_segments(queries, scale, mask, sinks, plan.c, plan.wpos)

    def _route_ring(self, queries, scale, mask, sinks, plan):
        return self._ring_step(queries, scale, plan.ns, plan.c)

    def _route_code_space_tail(self, queries, scale, mask, sinks, plan):
        L = queries.shape[2]
        return self._attend_decode_with_tail(
            queries,
            scale,
            *self._op_mask(mask, plan.c, plan.wpos, self.offset - L, L),
            plan.ns,
            plan.c,
            plan.wpos,
            [k for k, _, _, _ in plan.segments],
            [v for _, v, _, _ in plan.segments],
        )

    def _route_fused_apart(self, queries, scale, mask, sinks, plan):
        L = queries.shape[2]
        causal, op_mask = self._op_mask(mask, plan.c, plan.wpos, self.offset - L, L)
        queries_in_codes = self._compressed_queries(queries, fused=True)
        out, lse = self._kv.attention(queries_in_codes, plan.c, scale, causal, op_mask)
        return _fused_decode_output(
            out,
            lse,
            queries,
            *self._model_space_args(),
            scale,
            [k for k, _, _, _ in plan.segments],
            [v for _, v, _, _ in plan.segments],
        )

    def _route_all_compressed(self, queries, scale, mask, sinks, plan):
        # (The plain codec: the step's Python time is most of its cost.)
        return self._model_space_op(queries, plan.c, scale, final=True)[0]

    def _route_sinks_tail(self, queries, scale, mask, sinks, plan):
        tail = (self._sink_k, self._sink_v)
        return self._model_space_op(queries, plan.c, scale, tail=tail, final=True)[0]

    def _route_ring_model_space(self, queries, scale, mask, sinks, plan):
        tail = self._ring_write_new_token(plan.ns)
        out = self._model_space_op(queries, plan.c, scale, tail=tail, final=True)[0]
        self._ring_readers.append(out)
        return out

    def _route_model_space_tail(self, queries, scale, mask, sinks, plan):
        L = queries.shape[2]
        tail = self._model_space_tail(plan.segments, plan.ns, plan.wpos, L)
        op_mask = self._op_mask(mask, plan.c, plan.wpos, self.offset - L, L)
        out = self._model_space_op(queries, plan.c, scale, *op_mask, tail=tail, final=True)[0]
        if self._ring is not None and self._ring.keys is tail[0]:
            self._ring_readers.append(out)
        return out

    # -- the parts the routes are made of

    def _attend_segments(self, queries, scale, mask, sinks, c: int, wpos: int):
        """A decode step's general plan, whichever side of the op the rotation is on: the
        fp16 segments attended to apart, the ``c`` compressed tokens (before the window
        at ``wpos``) in one op call (:meth:`_compressed_part`; dequantized when fewer
        than the queries), merged by their log-sum-exp. Returns float32."""
        L = queries.shape[2]
        q0 = self.offset - L
        parts = self._dense_parts(queries, scale, mask, q0, self.offset, combine=True)
        if 0 < c < L:
            parts.append(self._dequantized_part(queries, scale, mask, c, q0))
        elif c > 0:
            parts.append(
                self._compressed_part(queries, c, scale, *self._op_mask(mask, c, wpos, q0, L))
            )
        if sinks is not None:
            parts.append(self._sink_part(sinks, queries))
        return merge_attention(parts)[0]

    def _compressed_part(self, queries, c: int, scale: float, causal: bool = False, op_mask=None):
        """``(out, lse)`` of the ``c`` compressed tokens alone, float32, in the model's
        space. The rotation's place is the one difference between the two kinds of op:
        ops that apply it themselves (:meth:`_op_signs`) take the model's queries
        (:meth:`_model_space_op`); the others take code-space queries, and their output
        comes back to the model's space here (:meth:`_compressed_result`)."""
        if self._op_signs() is not None:
            return self._model_space_op(queries, c, scale, causal, op_mask)
        out, lse = self._kv.attention(self._compressed_queries(queries), c, scale, causal, op_mask)
        return self._compressed_result(out, lse, queries, scale)

    def _dequantized_part(self, queries, scale, mask, c: int, q0: int):
        """``(out, lse)`` of fewer compressed tokens than queries (the op needs
        ``kv_len >= L``): a few tokens only, attended to dequantized."""
        L = queries.shape[2]
        k, v = self._kv.decoded(0, c)
        out, lse = dense_attention(
            self._compressed_queries(queries),
            k,
            v,
            scale,
            self._segment_mask(mask, self.fp16_sink_tokens, c, q0, L),
        )
        return self._compressed_result(out, lse, queries, scale)

    def _attend_block(self, queries, q0: int, scale: float, mask, sinks):
        """Attention of decode-sized queries at positions ``[q0, q0 + L)``, each seeing
        the cache as a single-token step at its position sees it: the query at ``p``
        sees the non-sink tokens before ``p + 1 - fp16_recent_tokens`` through their
        codes and every later one (and the sinks) in fp16. A verification block's
        first queries so read tokens that its later ones pushed out of the window; the
        window buffer keeps ``rollback_tokens`` of those (tokens that only exist
        quantized, after a trim beyond that, are read quantized). Returns
        ``(B, H_q, L, D)`` float32."""
        L = queries.shape[2]
        S, R = self.fp16_sink_tokens, self.fp16_recent_tokens
        ns, c, wpos = self._layout()
        qpos = np.arange(q0, q0 + L)
        if R and self._calibrated:
            # First non-sink position each query sees in fp16.
            exact = np.clip(np.maximum(qpos + 1 - R, self._win_start), S, wpos)
        else:
            exact = np.full(L, wpos)
        lo = int(exact.min())
        parts = []
        spans = ([(0, ns)] if ns else []) + ([(lo, self.offset - lo)] if self.offset > lo else [])
        if spans:
            ks, vs = [], []
            if ns:
                ks.append(self._sink_k)
                vs.append(self._sink_v)
            if self.offset > lo:
                i0 = lo - self._win_start
                ks.append(self._win_k[:, :, i0:])
                vs.append(self._win_v[:, :, i0:])
            kpos = np.concatenate([np.arange(p0, p0 + n) for p0, n in spans])
            visible = (kpos[None, :] < S) | (kpos[None, :] >= exact[:, None])
            k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
            v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
            parts.append(
                dense_attention(queries, k, v, scale, _block_mask(mask, visible, spans, qpos))
            )
        if c:
            visible = (S + np.arange(c))[None, :] < exact[:, None]
            if (
                c >= L
                and not isinstance(mask, mx.array)
                and np.array_equal(exact - S, c - L + 1 + np.arange(L))
            ):
                # Query i sees the first c - L + 1 + i compressed tokens: the op's causal
                # mode (a causal mask holds for them too).
                causal, op_mask = True, None
            else:
                causal, op_mask = False, _block_mask(mask, visible, [(S, c)], qpos)
            if c < L:
                # (The op needs at least as many tokens as queries.)
                kd, vd = self._kv.decoded(0, c)
                out, lse = dense_attention(
                    self._compressed_queries(queries), kd, vd, scale, op_mask
                )
                parts.append(self._compressed_result(out, lse, queries, scale))
            else:
                parts.append(self._compressed_part(queries, c, scale, causal, op_mask))
        if sinks is not None:
            parts.append(self._sink_part(sinks, queries))
        return merge_attention(parts)[0]

    def _model_space_op(
        self,
        queries,
        c: int,
        scale: float,
        causal: bool = False,
        op_mask=None,
        tail=(None, None),
        final: bool = False,
    ):
        """``(out, lse)`` of the op over the ``c`` compressed tokens and a model-space
        ``tail`` (keys, values), from the model's queries, in the model's space.
        ``final``: ``out`` is the layer's output, written in the queries' dtype (else
        float32, for merging with other parts)."""
        return self._kv.attention(
            queries,
            c,
            scale,
            causal,
            op_mask,
            tail=tail,
            rotation_signs=self._op_signs(),
            rotate_output=self.rotate_values,
            means=(self._mu_k, self._mu_v),
            out_dtype=queries.dtype if final else None,
        )

    def _model_space_tail(self, segments, ns: int, wpos: int, L: int):
        """The fp16 segments (sinks, window; model space) as one tail. A full window
        goes in in ring order (position p at slot ns + (p - sinks) % R), whatever the
        step, so that a ring step and this one give the same tail, summed in the same
        order; a single-token step starts the ring from it."""
        R = self.fp16_recent_tokens
        ks = [k for k, _, _, _ in segments]
        vs = [v for _, v, _, _ in segments]
        n_win = sum(k.shape[2] for k in ks) - ns
        roll = ring_roll(wpos, self.fp16_sink_tokens, R, n_win)
        ks, vs = ring_order(ks, R, roll), ring_order(vs, R, roll)
        starts_ring = L == 1 and R and n_win == R
        if starts_ring and len(ks) == 1:
            # The ring is written in place: a buffer of its own, not the window's
            # (a concatenation always makes one).
            ks = [ks[0][:, :, :1], ks[0][:, :, 1:]]
            vs = [vs[0][:, :, :1], vs[0][:, :, 1:]]
        tail_k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        tail_v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        if starts_ring:
            self._ring = Ring(tail_k, tail_v, self.offset)
            self._ring_readers = []
        return tail_k, tail_v

    def _ring_write_new_token(self, ns: int):
        """The ring with the new token in the slot of the one that just left the
        window (a model-space ring step); returns the ring's keys and values."""
        ring, new = self._ring, self._new_token
        P = self.offset - 1
        tail_k, tail_v = ring.keys, ring.values
        if ring.position == P:  # (at P + 1 the leaving token's append wrote it: _ring_append)
            self._ring = ring = None  # only the ring may hold it, or MLX copies it
            slot = ring_slot(ns, P, self.fp16_sink_tokens, self.fp16_recent_tokens)
            # The ring's buffers are this cache's own (see _model_space_tail); the
            # slot's last reader was the previous step's attention.
            after, self._ring_readers = self._ring_readers, []
            tail_k, tail_v = ops.write_tokens_kv(tail_k, tail_v, new[0], new[1], slot, after=after)
            self._ring = Ring(tail_k, tail_v, P + 1)
        if len(self._win_pending) == self.fp16_recent_tokens:
            self._sync_window()  # (from the ring: see _sync_window)
        return tail_k, tail_v

    def _op_mask(self, mask, c: int, wpos: int, q0: int, L: int):
        """``(causal, mask)`` for the op over the ``c`` compressed tokens, queries at
        positions ``[q0, q0 + L)``."""
        if isinstance(mask, str) and wpos == self.offset:
            return True, None  # the queries are the last tokens of the compressed segment
        return False, self._segment_mask(mask, self.fp16_sink_tokens, c, q0, L)

    def _attend_decode_with_tail(
        self, queries, scale, causal, op_mask, ns, c, wpos, dense_k, dense_v
    ):
        """A decode step as one attention call: the fp16 segments (possibly none; sinks
        first, ``ns`` of them, then the window from ``wpos``), which every query sees
        whole, join the ``c`` compressed tokens as the op's tail."""
        signs, matrix, rot_scale = self._codec.rotation.params()
        n_win = sum(k.shape[2] for k in dense_k) - ns
        ct = self._code_tail
        R = self.fp16_recent_tokens
        # (A single-token step whose ring holds the sinks and full window never gets
        # here: the plan takes it to the ring route first.)
        if (
            dense_k
            and ct is not None
            and ct.sinks == ns
            and ct.keys.shape[2] - ns == n_win
            and (n_win == 0 or (ct.window_start == wpos and ct.roll == 0))
        ):
            # The same tokens as the last step's tail (sinks only, as without a window):
            # only the queries need the transform.
            tail_k, tail_v = ct.keys, ct.values
            q_codes = self._compressed_queries(queries, fused=True)
        else:
            # A full window goes in in ring order (position p at slot
            # ns + (p - sinks) % R), whatever the step: the tail is then the same
            # array, and its sums are added in the same order, whether a ring step
            # or this one produced it (e.g. after a trim).
            roll = ring_roll(wpos, self.fp16_sink_tokens, R, n_win)
            dense_k, dense_v = ring_order(dense_k, R, roll), ring_order(dense_v, R, roll)
            # Concatenated before the compiled transform, which then fuses the same way
            # as for a ring step's single token: the same token gets the same bits.
            if len(dense_k) > 1:
                dense_k = [mx.concatenate(dense_k, axis=2)]
                dense_v = [mx.concatenate(dense_v, axis=2)]
            q_codes, tail_k, tail_v = _fused_decode_inputs(
                queries,
                self._key_scale,
                signs,
                matrix,
                rot_scale,
                _half_queries_on_gpu(queries.dtype),
                self._mu_k,
                self._mu_v,
                self.rotate_values,
                dense_k,
                dense_v,
            )
            if tail_k is not None:
                self._code_tail = CodeTail(tail_k, tail_v, ns, wpos, roll)
                if R and n_win == R:
                    # Start a ring from this tail; it is in sync while the cache holds
                    # `offset` tokens.
                    # (Handles of their own: a ring step's in-place write must not
                    # change what _code_tail holds.)
                    self._ring = Ring(tail_k[...], tail_v[...], self.offset)
                    self._ring_tokens.clear()
        return self._tail_attention(queries, q_codes, scale, causal, op_mask, c, tail_k, tail_v)

    def _ring_step_layout(self):
        """``(ns, c)`` when this single-token step can take the ring path (the ring
        holds the sinks and the full window before the new token), else None."""
        ring, new = self._ring, self._new_token
        P = self.offset - 1
        # (a ring at P + 1 holds the new token already: see _ring_append)
        if (
            ring is None
            or new is None
            or new[2] != P
            or ring.position not in (P, P + 1)
            or self._fresh is not None
        ):
            return None
        ns, c, wpos = self._layout()
        R = self.fp16_recent_tokens
        if c < 1 or self.offset - wpos != R or ns + R > MAX_TAIL_TOKENS:
            return None
        return ns, c

    def _ring_step(self, queries, scale, ns, c):
        """A single-token step on the ring: the new token takes the slot of the one
        that just left the window (quantized by update_and_fetch from its code-space
        copy), then one attention call over the compressed tokens and the ring, which
        the query sees whole (no causal limit, no mask)."""
        signs, matrix, rot_scale = self._codec.rotation.params()
        ring, new = self._ring, self._new_token
        P = self.offset - 1
        tail_k, tail_v = ring.keys, ring.values
        self._ring = ring = None  # only the ring may hold it, or MLX copies it
        q_codes, k_new, v_new = _fused_decode_inputs(
            queries,
            self._key_scale,
            signs,
            matrix,
            rot_scale,
            _half_queries_on_gpu(queries.dtype),
            self._mu_k,
            self._mu_v,
            self.rotate_values,
            [new[0]],
            [new[1]],
        )
        slot = ring_slot(ns, P, self.fp16_sink_tokens, self.fp16_recent_tokens)
        tail_k[:, :, slot : slot + 1] = k_new
        tail_v[:, :, slot : slot + 1] = v_new
        self._ring = Ring(tail_k, tail_v, P + 1)
        self._ring_tokens.append((P, k_new, v_new))
        return self._tail_attention(queries, q_codes, scale, False, None, c, tail_k, tail_v)

    def _tail_attention(self, queries, q_codes, scale, causal, op_mask, c, tail_k, tail_v):
        """The op over the ``c`` compressed tokens and a code-space tail, to the layer's
        output (``q_codes``: the queries in code space)."""
        out, _ = self._kv.attention(q_codes, c, scale, causal, op_mask, tail=(tail_k, tail_v))
        signs, matrix, rot_scale, _, mu_v = self._model_space_args()
        return _fused_tail_decode_output(out, signs, matrix, rot_scale, mu_v, queries)

    _ROUTES = {
        "block": _route_block,
        "all_compressed": _route_all_compressed,
        "sinks_tail": _route_sinks_tail,
        "ring_model_space": _route_ring_model_space,
        "ring": _route_ring,
        "model_space_tail": _route_model_space_tail,
        "code_space_tail": _route_code_space_tail,
        "fused_apart": _route_fused_apart,
        "segments": _route_segments,
    }
