# Copyright © 2026 turboquant_mlx contributors.

"""Attention of a prefill block (more than ``decode_max_queries`` queries: prompt
processing) on :class:`~turboquant_mlx.cache.TurboQuantKVCache`: MLX's fused
attention over every cached token, in code space, with the compressed tokens decoded
once per layer (:meth:`PrefillMixin._attend_prefill`).
"""

import mlx.core as mx

from . import codespace
from .codespace import (
    _fused_queries_to_codes,
    _fused_tail_decode_output,
    _fused_to_code_space,
    _queries_to_codes,
    _tail_decode_output,
    _to_code_space,
)


# The prefill's key and value temporaries, one pair per dtype for the whole process:
# every layer's keys and values are decoded into the same two buffers (ops.dequantize's
# ``into``), so the temporary stays one layer's worth however many layers the GPU has in
# flight. Reuse is safe because a layer's decode reads the block's new tokens, which
# come from the previous layer's attention output: it runs after that attention has
# read the buffers. Released by the first decode step (release_scratch).
_scratch = {}
_SCRATCH_GROWTH = 1.25  # grow ahead of the prompt: one allocation per ~25% of context


def scratch_buffers(dtype, size):
    """The reused ``(keys, values)`` buffers of ``dtype``, each of at least ``size``
    elements (flat, evaluated, row-contiguous)."""
    bufs = _scratch.get(dtype)
    if bufs is None or bufs[0].size < size:
        n = max(int(_SCRATCH_GROWTH * size), 0 if bufs is None else bufs[0].size)
        bufs = None  # (the old pair goes before the new one is made)
        _scratch.pop(dtype, None)
        bufs = (mx.zeros((n,), dtype), mx.zeros((n,), dtype))
        mx.eval(bufs)
        _scratch[dtype] = bufs
    return bufs


def release_scratch():
    """Frees the prefill's temporaries (the prompt is read; a decode step follows)."""
    _scratch.clear()


class PrefillMixin:
    """Prefill attention (module docstring). A part of :class:`TurboQuantKVCache`, on
    its attributes."""

    def _attend_prefill(self, queries, scale, mask, sinks):
        """Attention of a block of more than ``decode_max_queries`` queries (prompt
        processing): MLX's fused attention over every cached token, in code space.

        The compressed tokens are decoded once, straight into the model's dtype, into
        one buffer of the layer's keys and one of its values that also holds the fp16
        tokens (sinks, window, the block as it arrived) transformed as the codec
        transforms what it quantizes (centered, scaled, rotated: see
        :meth:`_prefill_operands`); the queries go to code space as a decode step's do.
        Centering shifts every score of a query by the same amount, so one softmax
        covers every segment, and the output comes back with the value rotation undone
        and the mean added. Per layer, the temporary is that one buffer pair: never a
        full-precision copy of the whole cache.

        Where MLX's attention has no fused kernel for the shapes (the CPU always, head
        dims or dtypes a GPU kernel does not take), it materializes the scores, and the
        queries go in chunks whose scores stay within ``prefill_budget_bytes``.
        """
        B, n_q, L, _ = queries.shape
        q, k, v, centered = self._prefill_operands(queries, uncentered=sinks is not None)
        N = k.shape[2]
        first = self.offset - L  # position of the first query
        causal = isinstance(mask, str)
        if sinks is not None:
            sinks = sinks.astype(q.dtype)  # MLX's attention takes them in the output's type

        def attend(a, b, force_fused=False):
            # Keys before the chunk's last query suffice for a causal chunk; MLX's causal
            # mask is aligned at the last key, the chunk's last position.
            n = first + b if causal else N
            m = mask
            if isinstance(mask, mx.array):
                m = mask[..., a:b, :n] if mask.ndim >= 2 and mask.shape[-2] == L else mask[..., :n]
            qa = q if (a, b) == (0, L) else q[:, :, a:b]
            ka, va = (k, v) if n == N else (k[:, :, :n], v[:, :, :n])
            return mx.fast.scaled_dot_product_attention(
                qa, ka, va, scale=scale, mask=m, sinks=sinks, force_fused=force_fused
            )

        try:
            out = attend(0, L, force_fused=True)
        except ValueError:  # no fused kernel: scores are materialized, chunk the queries
            per_query = B * n_q * N * 4 * 3  # float32 scores, exponentials, probabilities
            chunk = max(1, min(L, self.prefill_budget_bytes // per_query))
            outs = [attend(a, min(a + chunk, L)) for a in range(0, L, chunk)]
            out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
        signs, matrix, rot_scale, _, mu_v = self._model_space_args()
        to_model = _fused_tail_decode_output if codespace._COMPILE else _tail_decode_output
        return to_model(out, signs, matrix, rot_scale, mu_v if centered else None, queries)

    def _prefill_operands(self, queries, uncentered=False):
        """``(q, k, v, centered)`` of a prefill attention call, in the queries' dtype.

        ``q``: the queries in code space (divided by ``a``, rotated). ``k``/``v``
        ``(B, H_kv, offset, D)``: every cached token in position order, the compressed
        ones decoded as stored and the fp16 segments transformed as the codec would
        transform them before quantizing. ``centered``: whether the values are centered
        (the output then needs ``+ mu_v``). With ``uncentered`` the means are added
        back to ``k``/``v`` and ``centered`` is False: with attention-sink logits the
        softmax is not invariant to the centering's score shift (the sink's logit does
        not shift).
        """
        dtype = queries.dtype
        S = self.fp16_sink_tokens
        _, c, _ = self._layout()
        n_comp = max(0, min(c, self._exact_from() - S))
        segments = self._dense_segments(self.offset)
        signs, matrix, rot_scale = self._codec.rotation.params()
        # A prompt's blocks have the same shapes (but its last): compiled, each of these
        # transforms is a kernel or two instead of about ten (see codespace._COMPILE).
        to_codes = _fused_to_code_space if codespace._COMPILE else _to_code_space
        queries_to_codes = _fused_queries_to_codes if codespace._COMPILE else _queries_to_codes
        q = queries_to_codes(queries, self._key_scale, signs, matrix, rot_scale, True)

        def code_space(segs):
            if not segs:
                return None, None
            k = segs[0][0] if len(segs) == 1 else mx.concatenate([s[0] for s in segs], axis=2)
            v = segs[0][1] if len(segs) == 1 else mx.concatenate([s[1] for s in segs], axis=2)
            k, v = to_codes(
                k,
                v,
                self._mu_k,
                self._mu_v,
                self._key_scale,
                signs,
                matrix,
                rot_scale,
                self.rotate_values,
            )
            return k.astype(dtype), v.astype(dtype)

        if n_comp == 0:
            k, v = code_space(segments)
        else:
            # Sinks before the compressed tokens, window and fresh block after them,
            # copied by the decoding kernel in the same pass, straight into the reused
            # temporaries: nothing of this size is allocated per layer.
            before_k, before_v = code_space([g for g in segments if g[2] < S])
            after_k, after_v = code_space([g for g in segments if g[2] >= S])
            B, H = self._batch_heads
            size = B * H * self.offset * self._codec.head_dim  # every token; keys and values alike
            k, v = self._kv.decoded(
                0,
                n_comp,
                dtype,
                (before_k, after_k),
                (before_v, after_v),
                scratch_buffers(dtype, size),
            )
        centered = self._mu_k is not None
        if centered and uncentered:
            mu_k, mu_v = _to_code_space(
                self._mu_k,
                self._mu_v,
                None,
                None,
                self._key_scale,
                signs,
                matrix,
                rot_scale,
                self.rotate_values,
            )
            k = (k + mu_k).astype(dtype)
            v = (v + mu_v).astype(dtype)
            centered = False
        return q, k, v, centered
