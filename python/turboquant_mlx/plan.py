# Copyright © 2026 turboquant_mlx contributors.

"""The attention plan of a decode or verification step: which kernel calls a step of
``L <= decode_max_queries`` queries makes, decided once, here, from the query length,
the mask and sink logits, the window, the ring, the levers and where the ops apply
the rotation. :mod:`turboquant_mlx.decode` carries the plan out.

======================  =======================================================
route                   when / what it runs
======================  =======================================================
``block``               ``L > 1`` with a window on a calibrated cache: each query
                        sees the cache as a single-token step at its position
                        (compressed tokens with the op's causal mode, sinks and
                        window with a band mask, merged)
``all_compressed``      rotation in the op, one token, every token compressed (the
                        plain codec): one op call, no tail
``sinks_tail``          rotation in the op, one token, no window, sinks and
                        compressed tokens only: one op call, the sinks its tail
``ring_model_space``    rotation in the op, one token, the ring in sync with a full
                        window: the new token written into the ring's slot, one op
                        call with the ring as tail
``ring``                rotation around the op (code space), one token, the ring in
                        sync: the new token transformed alone into the ring, one op
                        call
``model_space_tail``    rotation in the op, every fp16 token visible to every query,
                        at most ``MAX_TAIL_TOKENS`` of them: one op call with the
                        sinks and window as tail (a full window in ring order,
                        starting the ring)
``code_space_tail``     rotation around the op, the same condition (or no fp16 token
                        and no value mean): the tail transformed to code space (or
                        the last step's, kept), one op call
``fused_apart``         rotation around the op, fp16 tokens visible whole but more
                        than the op's tail takes: the op on the compressed tokens,
                        the fp16 segments attended to densely, one compiled merge
``segments``            anything else (masks that differ per segment, sink logits,
                        fewer compressed tokens than queries): every segment apart,
                        merged by log-sum-exp
======================  =======================================================
"""

from typing import NamedTuple, Tuple

import mlx.core as mx

from . import codespace
from .ops import MAX_TAIL_TOKENS

__all__ = ["StepPlan", "plan_step"]


class StepPlan(NamedTuple):
    """A step's route (module docstring) and the layout it was decided on: sink count
    ``ns``, compressed tokens ``c``, window start ``wpos`` and the fp16 segments
    ``(keys, values, first position, tokens)`` where the route reads them."""

    route: str
    ns: int = 0
    c: int = 0
    wpos: int = 0
    segments: Tuple = ()


def plan_step(cache, L: int, mask, sinks) -> StepPlan:
    """The plan of a step of ``L`` queries (the last ``L`` positions) on ``cache``."""
    if L > 1 and cache.fp16_recent_tokens and cache._calibrated:
        return StepPlan("block")
    model_space = cache._op_signs() is not None
    one_token = L == 1 and sinks is None and not isinstance(mask, mx.array)
    n = cache._n_comp
    if model_space and one_token:
        if n == cache.offset:
            return StepPlan("all_compressed", c=n)
        sinks_k = cache._sink_k
        if (
            cache.fp16_recent_tokens == 0
            and n > 0
            and sinks_k is not None
            and sinks_k.shape[2] + n == cache.offset
        ):
            return StepPlan("sinks_tail", c=n)
    if one_token and (model_space or codespace._COMPILE):
        ring = cache._ring_step_layout()
        if ring is not None:
            route = "ring_model_space" if model_space else "ring"
            return StepPlan(route, ns=ring[0], c=ring[1])
    q0 = cache.offset - L
    ns, c, wpos = cache._layout()
    # (Reading the segments writes the window's pending tokens: only from here on.)
    segments = tuple(cache._dense_segments(cache.offset))
    n_tail = sum(s[3] for s in segments)

    def seen_whole():
        return all(cache._segment_mask(mask, p0, k, q0, L) is None for _, _, p0, k in segments)

    if model_space:
        if sinks is None and c >= L and 0 < n_tail <= MAX_TAIL_TOKENS and seen_whole():
            return StepPlan("model_space_tail", ns, c, wpos, segments)
        return StepPlan("segments", ns, c, wpos)
    if not (codespace._COMPILE and sinks is None and c >= L and seen_whole()):
        return StepPlan("segments", ns, c, wpos)
    # Without a tail, a row whose keys are all masked must stay 0: the value mean is
    # only added where a row saw a key (the segments route checks).
    if n_tail <= MAX_TAIL_TOKENS and (n_tail > 0 or cache._mu_v is None):
        return StepPlan("code_space_tail", ns, c, wpos, segments)
    return StepPlan("fused_apart", ns, c, wpos, segments)
