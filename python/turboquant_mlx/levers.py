# Copyright © 2026 turboquant_mlx contributors.

"""The levers' statistics and maths (:mod:`turboquant_mlx.cache` gives the model):
the query energies a cache adds up before its calibration, and the query-aware key
scale ``a`` computed from them. The calibration itself (which tokens, when, its undo)
is the cache's (:mod:`turboquant_mlx.calibration`).
"""

from typing import List, Optional, Tuple

import mlx.core as mx

__all__ = ["QueryEnergies", "pair_mean", "key_scale_from"]


class QueryEnergies:
    """Per-channel sums of squared queries ``(B, H_kv, D)`` float32 over the query
    vectors seen (``count`` of them; query heads are folded onto their KV head), and
    marks that let a trim take the queries of later positions back out."""

    def __init__(self, energy: Optional[mx.array] = None, count: int = 0):
        self.energy = energy
        self.count = count
        # (position, energy, count) before the queries from that position on were added
        self.marks: List[Tuple[int, Optional[mx.array], int]] = []

    def observe(self, queries: mx.array, q0: int, first: int, kv_heads: int, keep: int):
        """Adds the queries ``(B, H_q, L, D)`` at positions ``[q0, q0 + L)`` from
        position ``first`` on (the sinks' queries do not count); marks are kept for
        trims of up to ``keep`` positions."""
        B, n_q, L, D = queries.shape
        skip = max(0, first - q0)
        if skip >= L:
            return
        marks = self.marks
        marks.append((q0 + skip, self.energy, self.count))
        while marks[0][0] < q0 - keep:
            marks.pop(0)  # no exact trim reaches back there
        q = queries[:, :, skip:] if skip else queries
        G = n_q // kv_heads
        q = q.astype(mx.float32).reshape(B, kv_heads, G * (L - skip), D)
        e = mx.sum(q * q, axis=2)
        self.energy = e if self.energy is None else self.energy + e
        self.count += G * (L - skip)

    def trim(self, new: int):
        """Takes the energies of the queries at positions ``>= new`` back out (exact where
        they came in steps or blocks that start at or after ``new``)."""
        marks = self.marks
        i = len(marks)
        while i and marks[i - 1][0] >= new:
            i -= 1
        if i < len(marks):
            _, self.energy, self.count = marks[i]
            del marks[i:]


def pair_mean(e: mx.array, pairing: str, rope_dims: int) -> mx.array:
    """Channel energies ``(..., D)`` averaged over the RoPE pairs (``pairing``:
    ``"half"``, ``"interleaved"`` or ``"none"``; the first ``rope_dims`` channels
    rotate, 0: all)."""
    D = e.shape[-1]
    d = min(rope_dims or D, D)
    if pairing == "none" or d < 2:
        return e
    h = d // 2
    if pairing == "half":
        m = (e[..., :h] + e[..., h : 2 * h]) * 0.5
        parts = [m, m]
    else:  # interleaved
        pairs = e[..., : 2 * h].reshape(e.shape[:-1] + (h, 2))
        m = mx.mean(pairs, axis=-1, keepdims=True)
        parts = [mx.broadcast_to(m, pairs.shape).reshape(e.shape[:-1] + (2 * h,))]
    if 2 * h < D:
        parts.append(e[..., 2 * h :])
    return mx.concatenate(parts, axis=-1)


def key_scale_from(
    q_energy: mx.array,
    k_energy: mx.array,
    *,
    model_dim: int,
    pairing: str,
    rope_dims: int,
    limit: float,
) -> mx.array:
    """``a`` ``(B, H, 1, D)`` from mean query and (centered) key energies ``(B, H, D)``,
    clamped to ``[1/limit, limit]``; computed on the first ``model_dim`` channels, 1 on
    the padded ones."""
    D = q_energy.shape[-1]
    if model_dim < D:
        m = model_dim
        a = key_scale_from(
            q_energy[..., :m],
            k_energy[..., :m],
            model_dim=m,
            pairing=pairing,
            rope_dims=rope_dims,
            limit=limit,
        )
        return mx.concatenate([a, mx.ones(a.shape[:-1] + (D - m,), a.dtype)], axis=-1)
    sq = pair_mean(q_energy, pairing, rope_dims)
    sk = pair_mean(k_energy, pairing, rope_dims)
    # Regularize channels without energy (a few calibration tokens) relative to the
    # head's mean energy.
    sq = sq + 1e-3 * mx.mean(sq, axis=-1, keepdims=True) + 1e-30
    sk = sk + 1e-3 * mx.mean(sk, axis=-1, keepdims=True) + 1e-30
    r = mx.sqrt(sq / sk)
    a2 = r / mx.mean(r, axis=-1, keepdims=True)
    lim = float(limit) ** 2
    a2 = mx.clip(a2, 1.0 / lim, lim)
    a2 = mx.where(mx.isfinite(a2), a2, 1.0)
    return mx.sqrt(a2)[:, :, None, :]
