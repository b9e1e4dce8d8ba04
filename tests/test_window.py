# Copyright © 2026 turboquant_mlx contributors.

"""The fp16 window's ring (turboquant_mlx.window): the ring-slot formula and the ring
order agree with each other, and a cache's decode steps keep each window token at its
ring slot, in the model's space (ops that apply the rotation) and in code space."""

import mlx.core as mx
import numpy as np
import pytest

from turboquant_mlx.codespace import _to_code_space
from turboquant_mlx.kv_cache import TurboQuantKVCache
from turboquant_mlx.window import CodeTail, Ring, WindowBuffer, ring_order, ring_roll, ring_slot

# (fp16_sink_tokens S, sink slots ns, window R)
RINGS = [(0, 0, 1), (0, 0, 8), (4, 4, 8), (3, 3, 5), (4, 2, 7)]


@pytest.mark.parametrize("S,ns,R", RINGS)
def test_ring_slots_permute_the_window_and_a_new_token_takes_the_leaving_ones_slot(S, ns, R):
    for wpos in range(S, S + 2 * R + 3):
        slots = [ring_slot(ns, p, S, R) for p in range(wpos, wpos + R)]
        assert sorted(slots) == list(range(ns, ns + R))
        # The token that enters at wpos + R overwrites the one that leaves (wpos).
        assert ring_slot(ns, wpos + R, S, R) == ring_slot(ns, wpos, S, R)


def _labels(first, n):
    """``(1, 1, n, 1)`` float32 holding the positions ``first .. first + n - 1``."""
    return mx.arange(first, first + n, dtype=mx.float32).reshape(1, 1, n, 1)


@pytest.mark.parametrize("S,ns,R", RINGS)
def test_ring_order_puts_each_window_position_at_its_ring_slot(S, ns, R):
    sinks = -1 - _labels(0, ns)  # (negative: told apart from positions)
    for wpos in range(S, S + 2 * R + 3):
        window = _labels(wpos, R)
        roll = ring_roll(wpos, S, R, R)
        tail = np.array(mx.concatenate(ring_order([sinks, window], R, roll), axis=2))[0, 0, :, 0]
        assert tail.shape == (ns + R,)
        np.testing.assert_array_equal(tail[:ns], np.array(sinks)[0, 0, :, 0])
        for p in range(wpos, wpos + R):
            assert tail[ring_slot(ns, p, S, R)] == p
        # A window that is not full goes in in position order.
        assert ring_roll(wpos, S, R, R - 1) == 0
        parts = [sinks, _labels(wpos, R - 1)]
        assert ring_order(parts, R, 0) is parts


@pytest.mark.parametrize(
    "levers",
    [dict(center=True), dict(center=True, query_aware_keys=True)],
    ids=["model-space-ring", "code-space-ring"],
)
def test_decode_steps_keep_each_window_token_at_its_ring_slot(levers):
    # Query-aware keys take the code-space path (the ops do not apply their scale):
    # the ring then holds the window as the codec would quantize it.
    S, R, B, H, D = 3, 8, 1, 2, 64
    cache = TurboQuantKVCache(
        fp16_sink_tokens=S,
        fp16_recent_tokens=R,
        calibration_tokens=16,
        rollback_tokens=4,
        seed=5,
        **levers,
    )
    rng = np.random.default_rng(7)

    def rand(shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    cache.update_and_fetch(rand((B, H, 40, D)) + 1.0, rand((B, H, 40, D)))
    cache.attention(rand((B, 2 * H, 40, D)), 0.125, "causal")
    code_space = cache._op_signs() is None
    assert code_space == bool(levers.get("query_aware_keys"))
    rings = 0
    for _ in range(3 * R + 2):
        cache.update_and_fetch(rand((B, H, 1, D)) + 1.0, rand((B, H, 1, D)))
        cache.attention(rand((B, 2 * H, 1, D)), 0.125, None)
        ring = cache._ring
        if ring is None:
            continue
        rings += 1
        assert isinstance(ring, Ring) and ring.position == cache.offset
        K, V = cache.dequantized_keys_values(mx.float32)  # (the window as stored)
        sink_k, sink_v = K[:, :, :S], V[:, :, :S]
        win_k, win_v = K[:, :, -R:], V[:, :, -R:]
        if code_space:
            params = cache.rotation.params()
            mu_k, mu_v, a = cache._mu_k, cache._mu_v, cache._key_scale
            sink_k, sink_v = _to_code_space(sink_k, sink_v, mu_k, mu_v, a, *params, True)
            win_k, win_v = _to_code_space(win_k, win_v, mu_k, mu_v, a, *params, True)
            tail = cache._code_tail
            assert tail is None or isinstance(tail, CodeTail)
        tol = dict(rtol=1e-5, atol=1e-5) if code_space else dict(rtol=0, atol=0)
        got_k, got_v = ring.keys.astype(mx.float32), ring.values.astype(mx.float32)
        np.testing.assert_allclose(np.array(got_k[:, :, :S]), np.array(sink_k), **tol)
        np.testing.assert_allclose(np.array(got_v[:, :, :S]), np.array(sink_v), **tol)
        for i, p in enumerate(range(cache.offset - R, cache.offset)):
            slot = ring_slot(S, p, S, R)
            np.testing.assert_allclose(np.array(got_k[:, :, slot]), np.array(win_k[:, :, i]), **tol)
            np.testing.assert_allclose(np.array(got_v[:, :, slot]), np.array(win_v[:, :, i]), **tol)
        buf = cache._win_buf
        if buf is not None and buf.view is cache._win_k:
            assert isinstance(buf, WindowBuffer)
            n = cache._win_k.shape[2]
            np.testing.assert_array_equal(
                np.array(buf.keys[:, :, buf.lo : buf.lo + n]), np.array(cache._win_k)
            )
    assert rings >= 2 * R  # the ring is in sync from the first full-window step on
