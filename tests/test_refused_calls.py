# Copyright © 2026 turboquant_mlx contributors.

"""Refused calls of the in-place ops write nothing, and the ops' ``stream`` argument.

A call of quantize_append, quantize_append_kv, write_tokens_kv or ring_append_kv that
is refused (tokens that cannot be stored, tokens that overlap the slots they are written
to, arguments of the wrong shape) raises with a message naming the op that was called
and leaves every buffer it would have written bit for bit as it was; the same buffers
then take a valid call. The CPU backend refuses the tokens' values (NaN/Inf, a scale
beyond float16) when the graph is evaluated; GPU kernels cannot (see ops.py), so those
tests are CPU-only.
"""

import mlx.core as mx
import numpy as np
import pytest

from helpers import (
    assert_codes_and_scales,
    assert_op_error,
    centroids_np,
    poisoned_cache,
    random_tokens,
)
from turboquant_mlx import ops

B, H, D, CAP = 1, 2, 64, 8
KEY_BITS, VALUE_BITS = 4, 3
CPU_REFUSES = pytest.mark.cpu_only(
    reason="the CPU kernels refuse tokens that cannot be stored; GPU kernels cannot raise"
)

_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}


def bits_of(arrays):
    """The arrays' bits (NaN-safe to compare)."""
    return [np.array(a.view(_UINT[a.itemsize])) for a in arrays]


def assert_unchanged(arrays, snapshot):
    for i, (got, want) in enumerate(zip(bits_of(arrays), snapshot)):
        np.testing.assert_array_equal(got, want, err_msg=f"buffer {i} was written")


def refused(call, op, *needles, error=ValueError):
    """Runs ``call`` and evaluates what it returns; it must raise ``error`` naming op."""
    with pytest.raises(error) as excinfo:
        mx.eval(call())
    assert_op_error(excinfo, op, *needles)


def caches(rng):
    """Key and value caches (codes, scales) full of poison, evaluated."""
    arrays = [
        mx.array(a)
        for bits in (KEY_BITS, VALUE_BITS)
        for a in poisoned_cache(rng, B, H, CAP, D, bits)
    ]
    mx.eval(arrays)
    return arrays


def with_bad(x, bad, token=(0, 1, 1), coordinate=5):
    """float32 tokens with ``bad`` at one coordinate of one token."""
    x = x.copy()
    x[token + (coordinate,)] = bad
    return x


# Bad token values: (value, message needles). "huge" has a finite norm whose scale is
# beyond float16; 1e30 overflows the norm itself (float32).
BAD = {
    "nan": (np.nan, ("non-finite", "nan")),
    "inf": (np.inf, ("non-finite", "inf")),
    "-inf": (-np.inf, ("non-finite", "-inf")),
    "huge": (60000.0, ("norm", "float16 range")),
    "1e30": (1e30, ("norm", "float16 range")),
}


# ---------------------------------------------------------------------------
# quantize_append / quantize_append_kv


@CPU_REFUSES
@pytest.mark.parametrize("in_place", (False, True))
@pytest.mark.parametrize("bad", BAD)
def test_quantize_append_refused_call_writes_nothing(bad, in_place):
    rng = np.random.default_rng(1)
    codes, scales = caches(rng)[:2]
    before = bits_of([codes, scales])
    c = mx.array(centroids_np(D, KEY_BITS))
    x = random_tokens(rng, (B, H, 3, D), spread=False)
    value, needles = BAD[bad]
    refused(
        lambda: ops.quantize_append(
            codes, scales, mx.array(with_bad(x, value)), c, 2, KEY_BITS, in_place=in_place
        ),
        "quantize_append",
        "token 1 of head 1 (batch 0)",
        *needles,
    )
    assert_unchanged([codes, scales], before)
    # The same buffers take a valid call.
    got = ops.quantize_append(codes, scales, mx.array(x), c, 2, KEY_BITS, in_place=in_place)
    assert_codes_and_scales(np.array(got[0])[:, :, 2:5], np.array(got[1])[:, :, 2:5], x, KEY_BITS)


@CPU_REFUSES
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("part", ("key", "value"))
def test_quantize_append_kv_refused_call_writes_neither_tensor(part, bad):
    # The other tensor's tokens are fine: its buffers must not be written either.
    rng = np.random.default_rng(2)
    buffers = caches(rng)
    before = bits_of(buffers)
    kc, vc = mx.array(centroids_np(D, KEY_BITS)), mx.array(centroids_np(D, VALUE_BITS))
    keys, values = (random_tokens(rng, (B, H, 2, D), spread=False) for _ in range(2))
    value, needles = BAD[bad]
    bad_keys = with_bad(keys, value) if part == "key" else keys
    bad_values = with_bad(values, value) if part == "value" else values
    refused(
        lambda: ops.quantize_append_kv(
            *buffers, mx.array(bad_keys), mx.array(bad_values), kc, vc, 3, KEY_BITS, VALUE_BITS
        ),
        "quantize_append_kv",
        f"{part} token 1 of head 1 (batch 0)",
        *needles,
    )
    assert_unchanged(buffers, before)
    got = [
        np.array(a)
        for a in ops.quantize_append_kv(
            *buffers, mx.array(keys), mx.array(values), kc, vc, 3, KEY_BITS, VALUE_BITS
        )
    ]
    assert_codes_and_scales(got[0][:, :, 3:5], got[1][:, :, 3:5], keys, KEY_BITS)
    assert_codes_and_scales(got[2][:, :, 3:5], got[3][:, :, 3:5], values, VALUE_BITS)


@CPU_REFUSES
def test_quantize_append_kv_refuses_a_bad_mean_without_writing():
    rng = np.random.default_rng(3)
    buffers = caches(rng)
    before = bits_of(buffers)
    kc, vc = mx.array(centroids_np(D, KEY_BITS)), mx.array(centroids_np(D, VALUE_BITS))
    keys, values = (mx.array(random_tokens(rng, (B, H, 2, D), spread=False)) for _ in range(2))
    mean = np.zeros((B, H, 1, D), np.float32)
    bad_mean = with_bad(mean, np.nan, token=(0, 0, 0), coordinate=7)
    refused(
        lambda: ops.quantize_append_kv(
            *buffers,
            keys,
            values,
            kc,
            vc,
            0,
            KEY_BITS,
            VALUE_BITS,
            key_mean=mx.array(mean),
            value_mean=mx.array(bad_mean),
        ),
        "quantize_append_kv",
        "value mean has a non-finite value nan at coordinate 7",
    )
    assert_unchanged(buffers, before)


@pytest.mark.parametrize(
    "change,needles",
    [
        (dict(values=mx.zeros((B, H + 1, 2, D))), ("(1, 3, 2, 64)",)),
        (dict(values=mx.zeros((B, H, 3, D))), ("same tokens",)),
        (dict(offset=CAP - 1), ("capacity overflow",)),
        (dict(value_bits=5), ("bits", "got 5")),
    ],
)
def test_quantize_append_kv_refuses_bad_arguments_without_writing(change, needles):
    rng = np.random.default_rng(4)
    buffers = caches(rng)
    before = bits_of(buffers)
    args = dict(
        k_codes=buffers[0],
        k_scales=buffers[1],
        v_codes=buffers[2],
        v_scales=buffers[3],
        keys=mx.zeros((B, H, 2, D)),
        values=mx.zeros((B, H, 2, D)),
        k_centroids=mx.array(centroids_np(D, KEY_BITS)),
        v_centroids=mx.array(centroids_np(D, VALUE_BITS)),
        offset=0,
        key_bits=KEY_BITS,
        value_bits=VALUE_BITS,
    )
    refused(lambda: ops.quantize_append_kv(**{**args, **change}), "quantize_append_kv", *needles)
    assert_unchanged(buffers, before)


@pytest.mark.parametrize("op", ("quantize_append_kv", "ring_append_kv"))
def test_fallback_refusals_name_the_op(op, monkeypatch):
    # Where the build has no kernels for the stream, the plain-MLX fallback refuses at
    # the call, naming the op called, and writes nothing (it never writes in place).
    monkeypatch.setattr(ops, "_has_kernels", lambda stream, op: False)
    rng = np.random.default_rng(14)
    buffers = caches(rng)
    before = bits_of(buffers)
    kc, vc = mx.array(centroids_np(D, KEY_BITS)), mx.array(centroids_np(D, VALUE_BITS))
    keys = random_tokens(rng, (B, H, 1, D), spread=False)
    values = with_bad(keys, np.nan, token=(0, 1, 0))
    if op == "quantize_append_kv":

        def call():
            return ops.quantize_append_kv(
                *buffers, mx.array(keys), mx.array(values), kc, vc, 0, KEY_BITS, VALUE_BITS
            )
    else:
        rings = [mx.array(keys), mx.array(values)]

        def call():
            return ops.ring_append_kv(
                *buffers,
                *rings,
                mx.zeros((B, H, 1, D)),
                mx.zeros((B, H, 1, D)),
                kc,
                vc,
                0,
                0,
                KEY_BITS,
                VALUE_BITS,
            )

    refused(call, op, "non-finite")
    assert_unchanged(buffers, before)


# ---------------------------------------------------------------------------
# write_tokens_kv


def dense_buffers(rng, dtype=mx.float16):
    arrays = [
        mx.array(rng.standard_normal((B, H, CAP, D)).astype(np.float32)).astype(dtype)
        for _ in range(2)
    ]
    mx.eval(arrays)
    return arrays


def test_write_tokens_kv_refuses_tokens_that_overlap_their_slots():
    # A view of a buffer over the slots being written would be read after (part of) it
    # was overwritten: refused before anything is written, whichever buffer it views.
    rng = np.random.default_rng(5)
    kb, vb = dense_buffers(rng)
    before = bits_of([kb, vb])
    fresh = mx.array(rng.standard_normal((B, H, 2, D)).astype(np.float32)).astype(mx.float16)
    cases = [
        (kb[:, :, 1:3], fresh, "keys share memory with the slots [2, 4) of the key buffer"),
        (fresh, vb[:, :, 3:5], "values share memory with the slots [2, 4) of the value buffer"),
        (vb[:, :, 2:4], fresh, "keys share memory with the slots [2, 4) of the value buffer"),
        (kb[:, :, 2:4], fresh, "of the key buffer"),  # (even onto themselves)
    ]
    for keys, values, needle in cases:
        refused(lambda: ops.write_tokens_kv(kb, vb, keys, values, 2), "write_tokens_kv", needle)
        assert_unchanged([kb, vb], before)
    # Views of slots the write leaves alone are fine, and so is a copy.
    want_k, want_v = (np.array(a.astype(mx.float32)) for a in (kb, vb))
    want_k[:, :, 5:7] = want_k[:, :, 0:2]
    want_v[:, :, 5:7] = want_k[:, :, 2:4]
    out = ops.write_tokens_kv(kb, vb, kb[:, :, 0:2], kb[:, :, 2:4], 5)
    for got, want in zip(out, (want_k, want_v)):
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)


def test_write_tokens_refuses_tokens_that_overlap_their_slots():
    from turboquant_mlx import _ext

    rng = np.random.default_rng(6)
    buffer = dense_buffers(rng, mx.float32)[0]
    before = bits_of([buffer])
    refused(
        lambda: _ext.write_tokens(buffer, buffer[:, :, 0:3], 1),
        "write_tokens",
        "tokens share memory with the slots [1, 4) of the buffer",
    )
    assert_unchanged([buffer], before)


def test_write_tokens_kv_refuses_bad_arguments_without_writing():
    rng = np.random.default_rng(7)
    kb, vb = dense_buffers(rng)
    before = bits_of([kb, vb])
    x = mx.zeros((B, H, 2, D), mx.float16)
    for args, needle in [
        ((x, x.astype(mx.float32), 0), "the value buffer float16"),
        ((x, mx.zeros((B, H, 2, 32), mx.float16), 0), "value buffer"),
        ((x, x, CAP - 1), "capacity overflow"),
    ]:
        refused(lambda: ops.write_tokens_kv(kb, vb, *args), "write_tokens_kv", needle)
        assert_unchanged([kb, vb], before)


# ---------------------------------------------------------------------------
# ring_append_kv


def ring_setup(rng, dtype=mx.float32):
    """Caches, rings of 4 slots (float32 tokens as NumPy too), new tokens, centroids."""
    buffers = caches(rng)
    rings_np = [random_tokens(rng, (B, H, 4, D), spread=False) for _ in range(2)]
    new = [mx.array(random_tokens(rng, (B, H, 1, D), spread=False)).astype(dtype) for _ in range(2)]
    cents = [mx.array(centroids_np(D, b)) for b in (KEY_BITS, VALUE_BITS)]
    mx.eval(new)
    return buffers, rings_np, new, cents


@CPU_REFUSES
@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("part", ("key", "value"))
def test_ring_append_kv_refused_call_writes_nothing(part, bad):
    # The token leaving slot 2 of one ring cannot be stored: neither compressed cache is
    # written, nor either ring.
    rng = np.random.default_rng(8)
    buffers, rings_np, new, cents = ring_setup(rng)
    value, needles = BAD[bad]
    i = 0 if part == "key" else 1
    good_ring = rings_np[i].copy()
    rings_np[i] = with_bad(rings_np[i], value, token=(0, 1, 2))
    rings = [mx.array(r) for r in rings_np]
    mx.eval(rings)
    everything = buffers + rings
    before = bits_of(everything)

    def call():
        return ops.ring_append_kv(*buffers, *rings, *new, *cents, 5, 2, KEY_BITS, VALUE_BITS)

    refused(call, "ring_append_kv", f"{part} ring slot 2 of head 1 (batch 0)", *needles)
    assert_unchanged(everything, before)
    # With the token repaired, the same buffers take the exchange.
    rings[i][:, :, 2] = mx.array(good_ring[:, :, 2])
    rings_np[i] = good_ring
    out = [np.array(a) for a in call()]
    assert_codes_and_scales(out[0][:, :, 5:6], out[1][:, :, 5:6], rings_np[0][:, :, 2:3], KEY_BITS)
    assert_codes_and_scales(
        out[2][:, :, 5:6], out[3][:, :, 5:6], rings_np[1][:, :, 2:3], VALUE_BITS
    )
    for got, ring, tokens in zip(out[4:], rings_np, new):
        want = ring.copy()
        want[:, :, 2:3] = np.array(tokens)
        np.testing.assert_array_equal(got, want)


def test_ring_append_kv_refuses_new_tokens_that_overlap_their_slots():
    rng = np.random.default_rng(9)
    buffers, rings_np, new, cents = ring_setup(rng)
    rings = [mx.array(r) for r in rings_np]
    mx.eval(rings)
    everything = buffers + rings
    before = bits_of(everything)
    for keys, values, needle in [
        (rings[0][:, :, 1:2], new[1], "keys share memory with the slots [1, 2) of the key ring"),
        (new[0], rings[0][:, :, 1:2], "values share memory with the slots [1, 2) of the key ring"),
    ]:
        refused(
            lambda: ops.ring_append_kv(
                *buffers, *rings, keys, values, *cents, 0, 1, KEY_BITS, VALUE_BITS
            ),
            "ring_append_kv",
            needle,
        )
        assert_unchanged(everything, before)
    # A slot the exchange does not write may be a new token.
    out = ops.ring_append_kv(
        *buffers, *rings, rings[0][:, :, 3:4], new[1], *cents, 0, 1, KEY_BITS, VALUE_BITS
    )
    want = rings_np[0].copy()
    want[:, :, 1] = rings_np[0][:, :, 3]
    np.testing.assert_array_equal(np.array(out[4]), want)


def test_ring_append_kv_refuses_bad_arguments_without_writing():
    rng = np.random.default_rng(10)
    buffers, rings_np, new, cents = ring_setup(rng)
    rings = [mx.array(r) for r in rings_np]
    mx.eval(rings)
    everything = buffers + rings
    before = bits_of(everything)
    for change, needle in [
        ((new[0], new[1].astype(mx.float16)), "value ring float32"),
        ((new[0], mx.zeros((B, H, 1, 32))), "value ring"),
        ((new[0], mx.zeros((B, H, 2, D))), "same tokens"),
    ]:
        refused(
            lambda: ops.ring_append_kv(
                *buffers, *rings, *change, *cents, 0, 1, KEY_BITS, VALUE_BITS
            ),
            "ring_append_kv",
            needle,
        )
        assert_unchanged(everything, before)
