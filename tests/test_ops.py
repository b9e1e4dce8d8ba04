# Copyright © 2026 turboquant_mlx contributors.

"""Tests of the three compressed-cache ops on the device chosen with ``pytest --device``
(the CPU backend's C++ kernels by default; ``--device gpu`` runs the GPU kernels).

Expected values come from the NumPy reference (reference.py): codes and scales of
``quantize_append`` bit-exact (up to boundary ties that summation order may flip),
``dequantize`` exact, ``compressed_attention`` against float64 attention on the cache
that the reference dequantizes from the very same codes. Caches are poisoned beyond
the valid tokens so that any read or write outside the contract shows. The axes of
the attention tests are each covered in full, not as one cartesian product, to keep
the file fast on two cores.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from helpers import (
    POISON_SCALE_BITS,
    attention_rtol,
    assert_codes_and_scales,
    assert_op_error,
    assert_scales_close,
    centroids_np,
    graph_nodes,
    near_boundary,
    poisoned_cache,
    random_tokens,
    reference_cache,
    to_np,
)
from turboquant_mlx import codebook, fallback, ops, reference
from turboquant_mlx.rotation import Rotation

HEAD_DIMS = (64, 96, 128, 256)
BITS = (2, 3, 4)
BIT_PAIRS = ((2, 2), (3, 3), (4, 4), (4, 2), (3, 4), (2, 4), (4, 3))
FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def mx_cache(words, scales):
    return mx.array(words), mx.array(scales)


# ---------------------------------------------------------------------------
# quantize_append


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_quantize_append_matches_reference(head_dim, bits):
    rng = np.random.default_rng(1000 * head_dim + bits)
    case = HEAD_DIMS.index(head_dim) * len(BITS) + BITS.index(bits)
    length = (1, 7, 33, 65)[case % 4]  # odd token counts, one a single token
    dtype = FLOAT_DTYPES[case % 3]
    batch, heads, offset, capacity = 2, 3, 3, length + 8
    x = mx.array(random_tokens(rng, (batch, heads, length, head_dim))).astype(dtype)
    x_used = to_np(x)  # what the op sees after its cast to float32
    words, scales = poisoned_cache(rng, batch, heads, capacity, head_dim, bits)
    c = mx.array(centroids_np(head_dim, bits))

    new_words, new_scales = ops.quantize_append(*mx_cache(words, scales), x, c, offset, bits)
    assert new_words.dtype == mx.uint32 and new_words.shape == words.shape
    assert new_scales.dtype == mx.float16 and new_scales.shape == scales.shape
    new_words, new_scales = np.array(new_words), np.array(new_scales)

    written = slice(offset, offset + length)
    assert_codes_and_scales(new_words[:, :, written], new_scales[:, :, written], x_used, bits)
    # The zero vector: every coordinate gets the code above the negative boundaries.
    zero_codes = reference.unpack(new_words[:, :, offset], bits, head_dim)
    assert (zero_codes == (1 << (bits - 1)) - 1).all()
    assert (new_scales[:, :, offset] == 0).all()
    # Slots outside [offset, offset + length) keep their poison bit for bit.
    untouched = np.ones(capacity, bool)
    untouched[written] = False
    np.testing.assert_array_equal(new_words[:, :, untouched], words[:, :, untouched])
    np.testing.assert_array_equal(
        new_scales[:, :, untouched].view(np.uint16), scales[:, :, untouched].view(np.uint16)
    )


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", (96, 256))
def test_quantize_append_at_several_offsets_touches_only_its_slots(head_dim, bits):
    rng = np.random.default_rng(7 * head_dim + bits)
    batch, heads, capacity = 2, 2, 29
    words, scales = poisoned_cache(rng, batch, heads, capacity, head_dim, bits)
    c = mx.array(centroids_np(head_dim, bits))
    # Out of order, with gaps, ending at the last slot and starting at slot 0; one
    # append of zero tokens.
    appends = [(5, 3), (0, 1), (capacity - 2, 2), (11, 9), (3, 0), (8, 1)]
    expected_tokens = {}
    codes_mx, scales_mx = mx_cache(words, scales)
    for offset, length in appends:
        x = random_tokens(rng, (batch, heads, length, head_dim), spread=False)
        codes_mx, scales_mx = ops.quantize_append(codes_mx, scales_mx, mx.array(x), c, offset, bits)
        for t in range(length):
            expected_tokens[offset + t] = x[:, :, t]
    got_words, got_scales = np.array(codes_mx), np.array(scales_mx)

    slots = sorted(expected_tokens)
    x_all = np.stack([expected_tokens[s] for s in slots], axis=2)
    assert_codes_and_scales(got_words[:, :, slots], got_scales[:, :, slots], x_all, bits)
    untouched = [s for s in range(capacity) if s not in expected_tokens]
    assert untouched, "the test must leave some slots unwritten"
    np.testing.assert_array_equal(got_words[:, :, untouched], words[:, :, untouched])
    assert (got_scales[:, :, untouched].view(np.uint16) == POISON_SCALE_BITS).all()


@pytest.mark.parametrize("bits", BITS)
def test_sequential_appends_equal_one_append(bits):
    rng = np.random.default_rng(bits)
    batch, heads, head_dim, capacity = 2, 3, 128, 24
    chunks = (1, 5, 1, 9, 3)
    x = mx.array(random_tokens(rng, (batch, heads, sum(chunks), head_dim)))
    c = mx.array(centroids_np(head_dim, bits))
    words, scales = poisoned_cache(rng, batch, heads, capacity, head_dim, bits)

    once_codes, once_scales = ops.quantize_append(*mx_cache(words, scales), x, c, 2, bits)
    codes_mx, scales_mx = mx_cache(words, scales)
    offset = 2
    for n in chunks:
        codes_mx, scales_mx = ops.quantize_append(
            codes_mx, scales_mx, x[:, :, offset - 2 : offset - 2 + n], c, offset, bits
        )
        mx.eval(codes_mx, scales_mx)  # separate evaluations, not one fused graph
        offset += n
    np.testing.assert_array_equal(np.array(codes_mx), np.array(once_codes))
    np.testing.assert_array_equal(
        np.array(scales_mx).view(np.uint16), np.array(once_scales).view(np.uint16)
    )


@pytest.mark.parametrize("buffer_kind", ("evaluated", "lazy", "broadcast", "strided"))
def test_quantize_append_leaves_referenced_buffer_unchanged(buffer_kind):
    rng = np.random.default_rng(3)
    batch, heads, capacity, head_dim, bits = 2, 2, 10, 64, 3
    words, scales = poisoned_cache(rng, batch, heads, capacity, head_dim, bits)
    if buffer_kind == "evaluated":
        old_codes, old_scales = mx_cache(words, scales)
        mx.eval(old_codes, old_scales)
    elif buffer_kind == "lazy":  # still a graph node when the append is built
        old_codes = mx.array(words) + mx.array(np.uint32(0))
        old_scales = (mx.array(scales.view(np.uint16)) | 0).view(mx.float16)
    elif buffer_kind == "broadcast":  # e.g. a cache created with broadcast_to
        words = np.broadcast_to(words[:1, :1, :1], words.shape).copy()
        scales = np.broadcast_to(scales[:1, :1, :1], scales.shape).copy()
        old_codes = mx.broadcast_to(mx.array(words[:1, :1, :1]), words.shape)
        old_scales = mx.broadcast_to(mx.array(scales[:1, :1, :1]), scales.shape)
    else:  # every other slot of a larger buffer
        old_codes = mx.array(np.repeat(words, 2, axis=2))[:, :, ::2]
        old_scales = mx.array(np.repeat(scales, 2, axis=2))[:, :, ::2]
    x = random_tokens(rng, (batch, heads, 4, head_dim), spread=False)
    c = mx.array(centroids_np(head_dim, bits))

    new_codes, new_scales = ops.quantize_append(old_codes, old_scales, mx.array(x), c, 5, bits)
    mx.eval(new_codes, new_scales)
    # The old arrays are still referenced here, so the op had to copy them.
    np.testing.assert_array_equal(np.array(old_codes), words)
    np.testing.assert_array_equal(np.array(old_scales).view(np.uint16), scales.view(np.uint16))
    got_words, got_scales = np.array(new_codes), np.array(new_scales)
    assert_codes_and_scales(got_words[:, :, 5:9], got_scales[:, :, 5:9], x, bits)
    keep = [0, 1, 2, 3, 4, 9]
    np.testing.assert_array_equal(got_words[:, :, keep], words[:, :, keep])
    np.testing.assert_array_equal(
        got_scales[:, :, keep].view(np.uint16), scales[:, :, keep].view(np.uint16)
    )


def test_quantize_append_reuses_an_unreferenced_buffer():
    # O(new tokens), not O(capacity): appending one token to a large cache must not
    # allocate a second copy of it.
    head_dim, bits, capacity = 128, 4, 16384
    codes = mx.zeros((1, 8, capacity, head_dim * bits // 32), mx.uint32)
    scales = mx.zeros((1, 8, capacity), mx.float16)
    x = mx.array(np.random.default_rng(0).standard_normal((1, 8, 1, head_dim)), mx.float32)
    c = mx.array(centroids_np(head_dim, bits))
    mx.eval(codes, scales, x, c)
    cache_bytes = codes.nbytes + scales.nbytes
    for step in range(3):
        # The GPU backends release their references to a kernel's buffers after it
        # completes, asynchronously; a buffer still referenced there is copied.
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        codes, scales = ops.quantize_append(codes, scales, x, c, step, bits)
        mx.eval(codes, scales)
        extra = mx.get_peak_memory() - before
        assert extra < 0.1 * cache_bytes, f"append {step} allocated {extra} bytes"


@pytest.mark.parametrize("buffer_kind", ("evaluated", "strided"))
def test_quantize_append_in_place_writes_a_referenced_buffer(buffer_kind):
    # in_place: the buffer is written even though another array (here old_*; under
    # pipelined decoding, the previous step's kernels) still references it, and only
    # its slots [offset, offset + L) change. A buffer that is not row-contiguous is
    # still copied.
    from turboquant_mlx import _ext

    if not ops.has_kernels():
        pytest.skip("the plain-MLX fallback always copies")
    rng = np.random.default_rng(4)
    batch, heads, capacity, head_dim, bits = 2, 2, 10, 64, 4
    words, scales = poisoned_cache(rng, batch, heads, capacity, head_dim, bits)
    if buffer_kind == "evaluated":
        old_codes, old_scales = mx_cache(words, scales)
    else:  # every other slot of a larger buffer
        old_codes = mx.array(np.repeat(words, 2, axis=2))[:, :, ::2]
        old_scales = mx.array(np.repeat(scales, 2, axis=2))[:, :, ::2]
    mx.eval(old_codes, old_scales)
    x = random_tokens(rng, (batch, heads, 3, head_dim), spread=False)
    c = mx.array(centroids_np(head_dim, bits))

    copies = _ext.buffer_copies()
    new_codes, new_scales = ops.quantize_append(
        old_codes, old_scales, mx.array(x), c, 6, bits, in_place=True
    )
    mx.eval(new_codes, new_scales)
    got_words, got_scales = np.array(new_codes), np.array(new_scales)
    assert_codes_and_scales(got_words[:, :, 6:9], got_scales[:, :, 6:9], x, bits)
    keep = [0, 1, 2, 3, 4, 5, 9]
    np.testing.assert_array_equal(got_words[:, :, keep], words[:, :, keep])
    np.testing.assert_array_equal(
        got_scales[:, :, keep].view(np.uint16), scales[:, :, keep].view(np.uint16)
    )
    if buffer_kind == "evaluated":
        assert _ext.buffer_copies() == copies
        # One buffer: the referenced arrays see the new tokens.
        np.testing.assert_array_equal(np.array(old_codes), got_words)
        np.testing.assert_array_equal(
            np.array(old_scales).view(np.uint16), got_scales.view(np.uint16)
        )
    else:
        assert _ext.buffer_copies() == copies + 2  # codes and scales
        np.testing.assert_array_equal(np.array(old_codes), words)


def test_quantize_append_in_place_is_one_node(tmp_path):
    # An in-place append needs no donation, so one node writes codes and scales (a
    # decode step's host cost is per node); otherwise one node per buffer, each able to
    # donate its buffer. Same codes and scales either way, with rotation and mean.
    if not ops.has_kernels():
        pytest.skip("the plain-MLX fallback builds no primitives")
    rng = np.random.default_rng(6)
    head_dim, bits = 64, 3
    words, scales = poisoned_cache(rng, 1, 2, 12, head_dim, bits)
    x = mx.array(random_tokens(rng, (1, 2, 3, head_dim)))
    mean = mx.array(rng.standard_normal((1, 2, 1, head_dim)).astype(np.float32))
    c = mx.array(centroids_np(head_dim, bits))
    signs = Rotation(head_dim, seed=2).kernel_signs
    results = {}
    for in_place, nodes in (
        (True, ["QuantizeAppend"]),
        (False, ["QuantizeAppendCodes", "QuantizeAppendScales"]),
    ):
        codes_in, scales_in = mx_cache(words, scales)
        mx.eval(codes_in, scales_in)
        out = ops.quantize_append(
            codes_in, scales_in, x, c, 4, bits, rotation_signs=signs, mean=mean, in_place=in_place
        )
        got = [n for n in graph_nodes(tmp_path / "g.dot", *out) if n.startswith("QuantizeAppend")]
        assert sorted(got) == nodes
        mx.eval(*out)
        results[in_place] = [
            np.array(o).view(np.uint32 if o.dtype == mx.uint32 else np.uint16) for o in out
        ]
    for a, b in zip(results[True], results[False]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(results[True][0], words)  # something was written


def _kv_inputs(rng, head_dim=64, key_bits=4, value_bits=3, capacity=12, length=3):
    kw, ksc = poisoned_cache(rng, 1, 2, capacity, head_dim, key_bits)
    vw, vsc = poisoned_cache(rng, 1, 2, capacity, head_dim, value_bits)
    keys = mx.array(random_tokens(rng, (1, 2, length, head_dim)))
    values = mx.array(random_tokens(rng, (1, 2, length, head_dim)))
    means = [
        mx.array(rng.standard_normal((1, 2, 1, head_dim)).astype(np.float32)) for _ in range(2)
    ]
    cents = [mx.array(centroids_np(head_dim, b)) for b in (key_bits, value_bits)]
    return (kw, ksc, vw, vsc), keys, values, means, cents


def _bits_of(a):
    return np.array(a).view(np.uint32 if a.dtype == mx.uint32 else np.uint16)


def test_quantize_append_kv_matches_two_appends(tmp_path):
    # A layer's keys and values in one op (4-bit keys rotated and centered, 3-bit values
    # centered, unrotated): the same codes and scales as two quantize_append calls
    # (one node per buffer each), written into the referenced input buffers, as one
    # graph node.
    rng = np.random.default_rng(8)
    (kw, ksc, vw, vsc), keys, values, (mk, mv), (ck, cv) = _kv_inputs(rng)
    signs = Rotation(64, seed=3).kernel_signs
    want = []
    for w, sc, x, c, bits, sg, m in (
        (kw, ksc, keys, ck, 4, signs, mk),
        (vw, vsc, values, cv, 3, None, mv),
    ):
        want += ops.quantize_append(
            mx.array(w), mx.array(sc), x, c, 5, bits, rotation_signs=sg, mean=m
        )
    held = [mx.array(a) for a in (kw, ksc, vw, vsc)]
    mx.eval(held)
    got = ops.quantize_append_kv(
        *held, keys, values, ck, cv, 5, 4, 3, key_rotation_signs=signs, key_mean=mk, value_mean=mv
    )
    if ops.has_kernels():
        labels = [
            n for n in graph_nodes(tmp_path / "g.dot", *got) if n.startswith("QuantizeAppend")
        ]
        assert labels == ["QuantizeAppendKV"]
    mx.eval(*got, *want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits_of(g), _bits_of(w))
    assert not np.array_equal(_bits_of(got[2]), vw)  # the values were written
    if ops.has_kernels():  # in place: the held arrays see the new tokens
        for h, g in zip(held, got):
            np.testing.assert_array_equal(_bits_of(h), _bits_of(g))


def test_quantize_append_kv_errors():
    rng = np.random.default_rng(9)
    (kw, ksc, vw, vsc), keys, values, _, (ck, cv) = _kv_inputs(rng)
    bufs = [mx.array(a) for a in (kw, ksc, vw, vsc)]
    with pytest.raises(ValueError) as e:  # values bring fewer tokens than keys
        ops.quantize_append_kv(*bufs, keys, values[:, :, :2], ck, cv, 0, 4, 3)
    assert_op_error(e, "quantize_append_kv", "same tokens")
    with pytest.raises(ValueError) as e:  # past the capacity of 12
        ops.quantize_append_kv(*bufs, keys, values, ck, cv, 10, 4, 3)
    assert_op_error(e, "quantize_append_kv", "capacity overflow")
    with pytest.raises(ValueError) as e:
        ops.quantize_append_kv(*bufs, keys, values, ck, cv, 0, 4, 5)
    assert_op_error(e, "quantize_append_kv", "value cache", "5")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_write_tokens_in_place(dtype):
    # _ext.write_tokens (the benchmarks' fp16 cache that does not copy): x lands at
    # [offset, offset + L) in the buffer's own memory although `held` references it;
    # the other slots keep their values; x may be strided.
    from turboquant_mlx import _ext

    if not _ext.kernel_support(mx.default_device()).write_tokens:
        pytest.skip("write_tokens has CPU and CUDA kernels")
    rng = np.random.default_rng(5)
    base = rng.standard_normal((2, 3, 12, 64)).astype(np.float32)
    buffer = mx.array(base).astype(dtype)
    mx.eval(buffer)
    want = np.array(buffer.astype(mx.float32))
    held = buffer
    x_np = rng.standard_normal((2, 3, 64, 4)).astype(np.float32)
    x = mx.array(x_np).astype(dtype).transpose(0, 1, 3, 2)  # (2, 3, 4, 64), strided
    copies = _ext.buffer_copies()
    out = _ext.write_tokens(buffer, x, 7)
    mx.eval(out)
    want[:, :, 7:11] = np.array(x.astype(mx.float32))
    np.testing.assert_array_equal(np.array(out.astype(mx.float32)), want)
    np.testing.assert_array_equal(np.array(held.astype(mx.float32)), want)  # one buffer
    assert _ext.buffer_copies() == copies
    # A buffer that is not row-contiguous is copied first (and counted).
    strided = mx.array(np.repeat(base, 2, axis=2)).astype(dtype)[:, :, ::2]
    kept = np.array(strided.astype(mx.float32))
    out = _ext.write_tokens(strided, x, 0)
    mx.eval(out)
    assert _ext.buffer_copies() == copies + 1
    np.testing.assert_array_equal(np.array(strided.astype(mx.float32)), kept)
    np.testing.assert_array_equal(np.array(out.astype(mx.float32))[:, :, :4], want[:, :, 7:11])


def test_write_tokens_refuses_bad_input():
    from turboquant_mlx import _ext

    buffer = mx.zeros((1, 2, 8, 64), mx.float16)
    x = mx.zeros((1, 2, 3, 64), mx.float16)
    cases = [
        (buffer, x.astype(mx.float32), 0, "dtype float32 but the buffer float16"),
        (buffer, mx.zeros((1, 3, 3, 64), mx.float16), 0, "do not match the buffer"),
        (buffer, x, 6, "capacity overflow"),
        (buffer, x, -1, "offset must be >= 0"),
        (mx.zeros((1, 2, 8, 64), mx.int32), x, 0, "buffer must be float32, float16 or bfloat16"),
        (buffer[0], x, 0, "must be (B, H, capacity, D)"),
    ]
    for buf, xx, offset, message in cases:
        with pytest.raises(ValueError) as excinfo:
            _ext.write_tokens(buf, xx, offset)
        assert "[turboquant_mlx.write_tokens]" in str(excinfo.value)
        assert message in str(excinfo.value)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_write_tokens_kv_in_place_after_its_readers(dtype, tmp_path):
    # ops.write_tokens_kv: keys and values land at [offset, offset + L) of their own
    # buffers, as one WriteTokensKV node. A ring of 4 slots written 8 times, each write
    # after the previous write's reader (`after`), all built before one evaluation: every
    # reader sees the ring as it was after its own write (without `after`, MLX runs
    # the writes first and every reader sees the last state).
    from turboquant_mlx import _ext

    if mx.default_device() == mx.gpu and _ext.gpu_backend() == "metal":
        pytest.skip("Metal writes with slice updates (MLX's ordering)")
    rng = np.random.default_rng(17)
    shape = (1, 2, 4, 64)
    kb = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    vb = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    mx.eval(kb, vb)
    held_k, held_v = kb, vb
    want_k, want_v = np.array(kb.astype(mx.float32)), np.array(vb.astype(mx.float32))
    tokens = [
        mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32)).astype(dtype)
        for _ in range(16)
    ]
    mx.eval(tokens)
    readers, wants, reader = [], [], None
    for i in range(8):
        keys, values = tokens[2 * i], tokens[2 * i + 1]
        kb, vb = ops.write_tokens_kv(
            kb, vb, keys, values, i % 4, after=[] if reader is None else [reader]
        )
        if i == 0:
            assert graph_nodes(tmp_path / "g.dot", kb).count("WriteTokensKV") == 1
        reader = mx.concatenate([kb, vb], axis=3).astype(mx.float32) * 1.0
        readers.append(reader)
        want_k[:, :, i % 4] = np.array(keys.astype(mx.float32))[:, :, 0]
        want_v[:, :, i % 4] = np.array(values.astype(mx.float32))[:, :, 0]
        wants.append(np.concatenate([want_k, want_v], axis=3))
    mx.eval(readers)
    for i, (got, want) in enumerate(zip(readers, wants)):
        np.testing.assert_array_equal(np.array(got), want, err_msg=f"write {i}")
    # in the buffers' own memory
    np.testing.assert_array_equal(np.array(held_k.astype(mx.float32)), want_k)
    np.testing.assert_array_equal(np.array(held_v.astype(mx.float32)), want_v)


def test_write_tokens_kv_refuses_bad_input():
    from turboquant_mlx import _ext

    kb = mx.zeros((1, 2, 8, 64), mx.float16)
    x = mx.zeros((1, 2, 3, 64), mx.float16)
    cases = [
        ((kb, kb, x, x.astype(mx.float32), 0), "dtype float32 but the value buffer float16"),
        ((kb, mx.zeros((1, 3, 8, 64), mx.float16), x, x, 0), "do not match the value buffer"),
        ((kb, kb, x, x, 6), "capacity overflow"),
        ((kb, kb, x, x, -2), "offset must be >= 0"),
        ((kb.astype(mx.int32), kb, x, x, 0), "key buffer must be float32, float16 or bfloat16"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError) as excinfo:
            _ext.write_tokens_kv(*args)
        assert_op_error(excinfo, "write_tokens_kv", message)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_ring_append_kv_exchanges_slots_in_order(dtype, tmp_path):
    # ops.ring_append_kv on a ring of 4 slots, 8 exchanges built before one evaluation,
    # each after the previous exchange's reader (`after`): the tokens that left (the
    # ring's first 4, then the first 4 new ones) are quantized at offsets 0..7 as the
    # reference codec quantizes them, and every reader sees the ring as it was after its
    # own exchange.
    rng = np.random.default_rng(23)
    B, H, D, slots, bits = 1, 2, 64, 4, 4
    ring0 = [random_tokens(rng, (B, H, slots, D), spread=False) for _ in range(2)]
    kr, vr = (mx.array(r).astype(dtype) for r in ring0)
    new = [
        mx.array(random_tokens(rng, (B, H, 1, D), spread=False)).astype(dtype) for _ in range(16)
    ]
    kw, ks = (mx.array(a) for a in poisoned_cache(rng, B, H, 12, D, bits))
    vw, vs = (mx.array(a) for a in poisoned_cache(rng, B, H, 12, D, bits))
    c = mx.array(centroids_np(D, bits))
    mx.eval(kr, vr, new, kw, ks, vw, vs)
    ring = [to_np(kr.astype(mx.float32)), to_np(vr.astype(mx.float32))]
    left_k, left_v, readers, wants, reader = [], [], [], [], None
    for i in range(8):
        slot = i % slots
        left_k.append(ring[0][:, :, slot].copy())
        left_v.append(ring[1][:, :, slot].copy())
        kw, ks, vw, vs, kr, vr = ops.ring_append_kv(
            kw,
            ks,
            vw,
            vs,
            kr,
            vr,
            new[2 * i],
            new[2 * i + 1],
            c,
            c,
            i,
            slot,
            bits,
            bits,
            after=[] if reader is None else [reader],
        )
        if i == 0 and ops.has_ring_append():
            labels = graph_nodes(tmp_path / "g.dot", kw, kr)
            assert labels.count("RingAppendKV") == 1 and "WriteTokensKV" not in labels
        reader = mx.concatenate([kr, vr], axis=3).astype(mx.float32) * 1.0
        readers.append(reader)
        ring[0][:, :, slot] = to_np(new[2 * i].astype(mx.float32))[:, :, 0]
        ring[1][:, :, slot] = to_np(new[2 * i + 1].astype(mx.float32))[:, :, 0]
        wants.append(np.concatenate(ring, axis=3))
    mx.eval(readers, kw, ks, vw, vs)
    for i, (got, want) in enumerate(zip(readers, wants)):
        np.testing.assert_array_equal(to_np(got), want, err_msg=f"exchange {i}")
    assert_codes_and_scales(
        np.array(kw)[:, :, :8], np.array(ks)[:, :, :8], np.stack(left_k, axis=2), bits
    )
    assert_codes_and_scales(
        np.array(vw)[:, :, :8], np.array(vs)[:, :, :8], np.stack(left_v, axis=2), bits
    )


@pytest.mark.cpu_only(
    reason="the CPU kernel refuses NaN/Inf tokens with an error; a GPU kernel cannot raise"
)
@pytest.mark.parametrize("bad", ("nan", "huge"))
def test_ring_append_kv_refuses_a_bad_leaving_token_without_writing(bad):
    # A token leaving the ring that cannot be quantized raises as quantize_append does,
    # and the exchange then writes nothing: the rings keep every token, the new ones
    # are not written.
    rng = np.random.default_rng(31)
    B, H, D, bits = 1, 2, 64, 4
    x = random_tokens(rng, (B, H, 4, D), spread=False)
    x[0, 1, 2, 5] = np.nan if bad == "nan" else 60000.0  # (slot 2: the one leaving)
    k_ring = mx.array(x)
    v_ring = mx.array(random_tokens(rng, (B, H, 4, D), spread=False))
    new = mx.ones((B, H, 1, D), mx.float32)
    kw, ks = (mx.array(a) for a in poisoned_cache(rng, B, H, 8, D, bits))
    vw, vs = (mx.array(a) for a in poisoned_cache(rng, B, H, 8, D, bits))
    c = mx.array(centroids_np(D, bits))
    mx.eval(k_ring, v_ring, new, kw, ks, vw, vs)
    before = [np.array(a) for a in (k_ring, v_ring, kw, ks, vw, vs)]
    out = ops.ring_append_kv(kw, ks, vw, vs, k_ring, v_ring, new, new, c, c, 3, 2, bits, bits)
    with pytest.raises(ValueError) as excinfo:
        mx.eval(*out)
    assert_op_error(
        excinfo,
        "ring_append_kv",
        "key ring slot 2 of head 1",
        *(("non-finite",) if bad == "nan" else ("norm",)),
    )
    for a, b in zip((k_ring, v_ring), before):
        np.testing.assert_array_equal(np.array(a), b)  # (NaN compares equal here)
    # the keys' part, whose token is bad, wrote nothing
    np.testing.assert_array_equal(np.array(kw), before[2])
    np.testing.assert_array_equal(np.array(ks).view(np.uint16), before[3].view(np.uint16))


def test_ring_append_kv_refuses_bad_input():
    from turboquant_mlx import _ext

    rng = np.random.default_rng(29)
    kw, ks = (mx.array(a) for a in poisoned_cache(rng, 1, 2, 8, 64, 4))
    ring = mx.zeros((1, 2, 6, 64), mx.float16)
    x = mx.zeros((1, 2, 1, 64), mx.float16)
    c = mx.array(centroids_np(64, 4))
    good = dict(
        k_codes=kw,
        k_scales=ks,
        v_codes=kw,
        v_scales=ks,
        k_ring=ring,
        v_ring=ring,
        keys=x,
        values=x,
        k_centroids=c,
        v_centroids=c,
        offset=0,
        slot=0,
        key_bits=4,
        value_bits=4,
    )
    cases = [
        (dict(slot=6), "capacity overflow"),
        (dict(offset=8), "capacity overflow"),
        (dict(values=x.astype(mx.float32)), "dtype float32 but the value ring float16"),
        (dict(k_ring=mx.zeros((1, 3, 6, 64), mx.float16)), "do not match the key ring"),
        (dict(value_bits=3), "value cache"),
        (dict(keys=mx.zeros((1, 2, 1, 32), mx.float16)), "key ring"),
    ]
    for change, message in cases:
        with pytest.raises(ValueError) as excinfo:
            _ext.ring_append_kv(**{**good, **change})
        assert_op_error(excinfo, "ring_append_kv", message)


def test_quantize_append_reads_strided_tokens():
    # Models hand over (B, L, H, D) projections transposed to (B, H, L, D).
    rng = np.random.default_rng(11)
    batch, heads, length, head_dim, bits = 2, 4, 5, 96, 3
    x_blhd = random_tokens(rng, (batch, length, heads, head_dim), spread=False)
    x = mx.array(x_blhd).transpose(0, 2, 1, 3)
    words, scales = poisoned_cache(rng, batch, heads, 8, head_dim, bits)
    c = mx.array(centroids_np(head_dim, bits))
    got_words, got_scales = ops.quantize_append(*mx_cache(words, scales), x, c, 1, bits)
    assert_codes_and_scales(
        np.array(got_words)[:, :, 1:6],
        np.array(got_scales)[:, :, 1:6],
        x_blhd.transpose(0, 2, 1, 3),
        bits,
    )


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_fallback_quantize_append_matches_kernel(head_dim, bits):
    rng = np.random.default_rng(head_dim + 17 * bits)
    batch, heads, length, capacity = 2, 2, 9, 12
    x_np = random_tokens(rng, (batch, heads, length, head_dim))
    x = mx.array(x_np)
    words, scales = poisoned_cache(rng, batch, heads, capacity, head_dim, bits)
    c = mx.array(centroids_np(head_dim, bits))
    k_codes, k_scales = ops.quantize_append(*mx_cache(words, scales), x, c, 2, bits)
    old_codes, old_scales = mx_cache(words, scales)
    f_codes, f_scales = fallback.quantize_append(old_codes, old_scales, x, c, 2, bits)
    mx.eval(f_codes, f_scales)
    np.testing.assert_array_equal(np.array(old_codes), words)  # copied, not modified
    np.testing.assert_array_equal(np.array(old_scales).view(np.uint16), scales.view(np.uint16))
    k_codes, k_scales = np.array(k_codes), np.array(k_scales)
    f_codes, f_scales = np.array(f_codes), np.array(f_scales)
    # Both follow the contract; they may differ only where a boundary tie can flip.
    ambiguous = near_boundary(x_np, centroids_np(head_dim, bits))
    k_unpacked = reference.unpack(k_codes[:, :, 2:11], bits, head_dim)
    f_unpacked = reference.unpack(f_codes[:, :, 2:11], bits, head_dim)
    np.testing.assert_array_equal(k_unpacked[~ambiguous], f_unpacked[~ambiguous])
    assert_scales_close(f_scales[:, :, 2:11], k_scales[:, :, 2:11], skip=ambiguous.any(-1))
    outside = [0, 1, 11]
    np.testing.assert_array_equal(f_codes[:, :, outside], k_codes[:, :, outside])
    np.testing.assert_array_equal(
        f_scales[:, :, outside].view(np.uint16), k_scales[:, :, outside].view(np.uint16)
    )


# ---------------------------------------------------------------------------
# dequantize


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_dequantize_matches_reference(head_dim, bits):
    rng = np.random.default_rng(head_dim * bits)
    batch, heads, capacity = 2, 3, 19
    levels = 1 << bits
    codes = rng.integers(0, levels, (batch, heads, capacity, head_dim))
    codes[0, 0, 0] = np.arange(head_dim) % levels  # every code in every bit position
    words = reference.pack(codes, bits)
    scales = (rng.uniform(0.0, 40.0, (batch, heads, capacity))).astype(np.float16)
    scales[1, 2, 3] = 0
    c = centroids_np(head_dim, bits)
    expected = reference.dequantize(codes, scales, c)
    codes_mx, scales_mx = mx_cache(words, scales)
    for start, length in ((0, capacity), (5, 7), (capacity - 1, 1), (4, 0)):
        got = ops.dequantize(codes_mx, scales_mx, mx.array(c), bits, start, length)
        assert got.dtype == mx.float32
        assert got.shape == (batch, heads, length, head_dim)
        np.testing.assert_array_equal(np.array(got), expected[:, :, start : start + length])
        fb = fallback.dequantize(codes_mx, scales_mx, mx.array(c), bits, start, length)
        np.testing.assert_array_equal(np.array(fb), expected[:, :, start : start + length])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_into_half_precision_slots(bits, dtype):
    # The prefill's form: decoded tokens in the model's dtype at slots [before,
    # before + length) of a larger buffer, zeros around them; the values are the
    # reference's float32 ones rounded once to dtype (as MLX's astype rounds).
    rng = np.random.default_rng(bits)
    batch, heads, capacity, head_dim = 2, 3, 21, 64
    codes = rng.integers(0, 1 << bits, (batch, heads, capacity, head_dim))
    scales = rng.uniform(0.0, 40.0, (batch, heads, capacity)).astype(np.float16)
    c = centroids_np(head_dim, bits)
    expected = mx.array(reference.dequantize(codes, scales, c)).astype(dtype)
    codes_mx, scales_mx = mx_cache(reference.pack(codes, bits), scales)
    for start, length, before, after in ((0, capacity, 0, 0), (5, 7, 3, 11), (2, 0, 4, 1)):
        for fn in (ops.dequantize, fallback.dequantize):
            got = fn(
                codes_mx,
                scales_mx,
                mx.array(c),
                bits,
                start,
                length,
                dtype=dtype,
                before=before,
                after=after,
            )
            assert got.dtype == dtype
            assert got.shape == (batch, heads, before + length + after, head_dim)
            got = np.array(got.astype(mx.float32))
            np.testing.assert_array_equal(
                got[:, :, before : before + length],
                np.array(expected[:, :, start : start + length].astype(mx.float32)),
            )
            assert not got[:, :, :before].any() and not got[:, :, before + length :].any()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_copies_rows_around_the_tokens_into_a_reused_buffer(bits, dtype):
    # The prefill's form: the fp16 rows before and after the decoded tokens copied in by
    # the same call, written into a reused flat buffer ("into") that the result views;
    # against NumPy's concatenation of the reference decode and the rows.
    rng = np.random.default_rng(10 + bits)
    batch, heads, capacity, head_dim = 2, 3, 21, 64
    codes = rng.integers(0, 1 << bits, (batch, heads, capacity, head_dim))
    scales = rng.uniform(0.0, 40.0, (batch, heads, capacity)).astype(np.float16)
    c = centroids_np(head_dim, bits)
    decoded = np.array(
        mx.array(reference.dequantize(codes, scales, c)).astype(dtype).astype(mx.float32)
    )
    codes_mx, scales_mx = mx_cache(reference.pack(codes, bits), scales)
    into = mx.full((batch * heads * 40 * head_dim + 7,), 3.0, dtype)
    mx.eval(into)
    for start, length, nb, na in ((0, capacity, 4, 9), (5, 7, 0, 3), (2, 6, 5, 0), (1, 0, 2, 2)):
        prefix = mx.array(rng.standard_normal((batch, heads, nb, head_dim))).astype(dtype)
        suffix = mx.array(rng.standard_normal((batch, heads, na, head_dim))).astype(dtype)
        want = np.concatenate(
            [
                np.array(prefix.astype(mx.float32)),
                decoded[:, :, start : start + length],
                np.array(suffix.astype(mx.float32)),
            ],
            axis=2,
        )
        rows = dict(prefix=prefix if nb else None, suffix=suffix if na else None)
        for got in (
            ops.dequantize(
                codes_mx,
                scales_mx,
                mx.array(c),
                bits,
                start,
                length,
                dtype=dtype,
                before=nb,
                after=na,
                into=into,
                **rows,
            ),
            fallback.dequantize(
                codes_mx, scales_mx, mx.array(c), bits, start, length, dtype, nb, na, **rows
            ),
        ):
            assert got.dtype == dtype and got.shape == want.shape
            np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)
    # The result is a view of the buffer: the buffer holds it at its start.
    got = ops.dequantize(
        codes_mx, scales_mx, mx.array(c), bits, 0, capacity, dtype=dtype, into=into
    )
    mx.eval(got)
    np.testing.assert_array_equal(
        np.array(into[: got.size].astype(mx.float32)), np.array(got.astype(mx.float32)).reshape(-1)
    )


def test_dequantize_refuses_bad_output_arguments():
    rng = np.random.default_rng(0)
    words, scales, _ = reference_cache(rng, 1, 2, 8, 8, 64, 4)
    c = mx.array(centroids_np(64, 4))
    args = (mx.array(words), mx.array(scales), c, 4, 0, 8)
    with pytest.raises(ValueError, match=r"\[turboquant_mlx.dequantize\].*dtype.*int32"):
        ops.dequantize(*args, dtype=mx.int32)
    with pytest.raises(ValueError, match=r"\[turboquant_mlx.dequantize\].*before -1"):
        ops.dequantize(*args, before=-1)
    with pytest.raises(ValueError, match=r"\[turboquant_mlx.dequantize\].*after -2"):
        ops.dequantize(*args, after=-2)
    rows = mx.zeros((1, 2, 3, 64), mx.float32)
    with pytest.raises(ValueError, match=r"\[turboquant_mlx.dequantize\] prefix must have shape"):
        ops.dequantize(*args, prefix=mx.zeros((1, 2, 3, 32)))
    with pytest.raises(
        ValueError, match=r"\[turboquant_mlx.dequantize\] suffix must have the output"
    ):
        ops.dequantize(*args, dtype=mx.float16, suffix=rows)
    with pytest.raises(
        ValueError, match=r"\[turboquant_mlx.dequantize\] prefix has 3 tokens but 2"
    ):
        ops.dequantize(*args, before=2, prefix=rows)
    with pytest.raises(ValueError, match=r"\[turboquant_mlx.dequantize\] into must be a float32"):
        ops.dequantize(*args, into=mx.zeros((2 * 8 * 64 - 1,)))
    with pytest.raises(ValueError, match=r"\[turboquant_mlx.dequantize\] into must be a float32"):
        ops.dequantize(*args, into=mx.zeros((2 * 8 * 64,), mx.float16))


def test_dequantize_window_ignores_poison_and_strided_buffers():
    rng = np.random.default_rng(5)
    batch, heads, capacity, length, head_dim, bits = 2, 4, 40, 23, 128, 3
    words, scales, expected = reference_cache(rng, batch, heads, capacity, length, head_dim, bits)
    c = mx.array(centroids_np(head_dim, bits))
    # Heads 0 and 2 of a 4-head buffer: a non-contiguous view.
    codes_mx, scales_mx = mx_cache(words, scales)
    got = ops.dequantize(codes_mx[:, ::2], scales_mx[:, ::2], c, bits, 3, length - 3)
    np.testing.assert_array_equal(np.array(got), expected[:, ::2, 3:])


# ---------------------------------------------------------------------------
# compressed_attention


def make_mask(kind, rng, batch, q_heads, q_len, kv_len):
    """An MLX mask of the given kind (None for "none"; "hide-all" masks every key)."""
    if kind == "none":
        return None
    if kind == "hide-all":
        return mx.zeros((kv_len,), dtype=mx.bool_)
    family, shape_kind = kind.split(":")
    shapes = {
        "kv": (kv_len,),
        "L,kv": (q_len, kv_len),
        "1,1,L,kv": (1, 1, q_len, kv_len),
        "B,1,1,kv": (batch, 1, 1, kv_len),
        "1,Hq,L,1": (1, q_heads, q_len, 1),
        "B,Hq,L,kv": (batch, q_heads, q_len, kv_len),
    }
    if family == "bool":
        m = rng.random(shapes.get(shape_kind, (q_len, kv_len))) < 0.7
        if shape_kind == "transposed":  # a strided view of a (kv, L) array
            return mx.array(np.ascontiguousarray(m.T)).T
        return mx.array(m)
    values = 2.0 * rng.standard_normal(shapes.get(shape_kind, (q_len, kv_len)))
    values[rng.random(values.shape) < 0.2] = -np.inf
    if shape_kind == "strided":  # every other column of a wider array
        wide = np.repeat(values, 2, axis=-1)
        return mx.array(wide.astype(np.float32))[..., ::2]
    if shape_kind == "float16":
        return mx.array(values.astype(np.float16))
    if shape_kind == "bfloat16":
        return mx.array(values.astype(np.float32)).astype(mx.bfloat16)
    return mx.array(values.astype(np.float32))


def run_attention(
    rng,
    *,
    batch=2,
    kv_heads=2,
    group=1,
    q_len=1,
    kv_len=17,
    capacity=None,
    head_dim=64,
    key_bits=4,
    value_bits=4,
    causal=True,
    mask="none",
    q_dtype=mx.float32,
    scale=None,
    q_gain=1.0,
    zero_tokens=False,
    impl="kernel",
    tail=0,
):
    """Runs one attention op and returns (out, lse, ref_out, ref_lse, v_hat) as NumPy.

    With ``zero_tokens`` the cached keys and values have norms spread over a factor
    e^2 and every third one is the zero vector (code of 0, scale 0). ``tail`` adds that
    many float keys/values every query sees (the op's ``tail_k`` / ``tail_v``).
    """
    capacity = capacity or kv_len
    q_heads = kv_heads * group
    kv = [None, None]
    if zero_tokens:
        for i in range(2):
            x = rng.standard_normal((batch, kv_heads, kv_len, head_dim)).astype(np.float32)
            x *= np.exp(rng.uniform(-1, 1, (batch, kv_heads, kv_len, 1))).astype(np.float32)
            x[:, :, ::3] = 0
            kv[i] = x
    k_words, k_scales, k_hat = reference_cache(
        rng, batch, kv_heads, capacity, kv_len, head_dim, key_bits, x=kv[0]
    )
    v_words, v_scales, v_hat = reference_cache(
        rng, batch, kv_heads, capacity, kv_len, head_dim, value_bits, x=kv[1]
    )
    q = mx.array(q_gain * rng.standard_normal((batch, q_heads, q_len, head_dim))).astype(q_dtype)
    m = make_mask(mask, rng, batch, q_heads, q_len, kv_len)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    args = (
        q,
        *mx_cache(k_words, k_scales),
        *mx_cache(v_words, v_scales),
        mx.array(centroids_np(head_dim, key_bits)),
        mx.array(centroids_np(head_dim, value_bits)),
        kv_len,
        scale,
        key_bits,
        value_bits,
        causal,
        m,
    )
    tail_k = tail_v = None
    if tail:
        tail_k, tail_v = (
            (rng.standard_normal((batch, kv_heads, tail, head_dim)) * g).astype(np.float32)
            for g in (q_gain, 1.0)
        )
    tails = dict(
        tail_k=None if tail_k is None else mx.array(tail_k),
        tail_v=None if tail_v is None else mx.array(tail_v),
    )
    out, lse = (ops.compressed_attention if impl == "kernel" else fallback.compressed_attention)(
        *args, **tails
    )
    assert out.dtype == mx.float32 and out.shape == (batch, q_heads, q_len, head_dim)
    assert lse.dtype == mx.float32 and lse.shape == (batch, q_heads, q_len)
    # The reference sees exactly the values the op sees: queries and masks after
    # their (exact) conversion to float32, keys and values dequantized from the codes.
    ref_out, ref_lse = reference.attention(
        to_np(q),
        k_hat,
        v_hat,
        scale,
        kv_len,
        causal,
        None if m is None else to_np(m),
        tail_k,
        tail_v,
    )
    if tail:
        v_hat = np.concatenate([v_hat[:, :, :kv_len], tail_v], axis=2)
    return np.array(out), np.array(lse), ref_out, ref_lse, v_hat


def assert_attention_close(out, lse, ref_out, ref_lse, v_hat, rtol=1e-5):
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    hidden = ref_lse == -np.inf
    np.testing.assert_array_equal(lse == -np.inf, hidden)
    assert (out[hidden] == 0).all()
    # out is a convex combination of value rows: measure its error against their size.
    v_size = max(float(np.abs(v_hat).max()), 1e-30)
    err = np.abs(out - ref_out).max() / v_size
    assert err <= rtol, f"out: max error {err:.3g} of max |v|"
    lse_err = np.abs(lse[~hidden] - ref_lse[~hidden]) / np.maximum(1.0, np.abs(ref_lse[~hidden]))
    assert lse_err.size == 0 or lse_err.max() <= rtol, f"lse: error {lse_err.max():.3g}"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("key_bits,value_bits", BIT_PAIRS)
def test_attention_every_bit_width_and_head_dim(key_bits, value_bits, head_dim):
    case = BIT_PAIRS.index((key_bits, value_bits)) * len(HEAD_DIMS) + HEAD_DIMS.index(head_dim)
    rng = np.random.default_rng(case)
    result = run_attention(
        rng,
        group=(1, 4, 8)[case % 3],
        q_len=1 + case % 8,
        kv_len=127,
        capacity=131,
        head_dim=head_dim,
        key_bits=key_bits,
        value_bits=value_bits,
        causal=case % 2 == 0,
        q_gain=2.0,
    )
    assert_attention_close(*result)


@pytest.mark.parametrize("group", (1, 4, 8))
@pytest.mark.parametrize(
    "kv_len,q_len", ((1, 1), (17, 1), (17, 8), (127, 3), (127, 8), (4097, 1), (4097, 8))
)
def test_attention_lengths_and_gqa(kv_len, q_len, group):
    rng = np.random.default_rng(kv_len * 31 + group * 7 + q_len)
    bits = ((4, 4), (3, 3), (2, 4), (4, 2))[(kv_len + group) % 4]
    result = run_attention(
        rng,
        group=group,
        q_len=q_len,
        kv_len=kv_len,
        capacity=kv_len + (0 if group == 4 else 9),  # poisoned slots beyond kv_len
        head_dim=128 if kv_len > 1000 else (64, 96, 256)[group % 3],
        key_bits=bits[0],
        value_bits=bits[1],
        causal=group != 8,
        q_gain=3.0,  # peaked softmax
        zero_tokens=group == 1,
    )
    assert_attention_close(*result)


MASK_KINDS = (
    "none",
    "bool:L,kv",
    "bool:1,1,L,kv",
    "bool:B,Hq,L,kv",
    "bool:kv",
    "bool:B,1,1,kv",
    "bool:1,Hq,L,1",
    "bool:transposed",
    "add:L,kv",
    "add:1,1,L,kv",
    "add:B,Hq,L,kv",
    "add:B,1,1,kv",
    "add:float16",
    "add:bfloat16",
    "add:strided",
)


@pytest.mark.parametrize("q_len", (1, 3, 8))
@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("mask", MASK_KINDS)
def test_attention_masks(mask, causal, q_len):
    rng = np.random.default_rng(MASK_KINDS.index(mask) * 100 + q_len * 2 + causal)
    result = run_attention(
        rng,
        group=4,
        q_len=q_len,
        kv_len=45,
        capacity=50,
        head_dim=64,
        key_bits=3,
        value_bits=4,
        causal=causal,
        mask=mask,
    )
    assert_attention_close(*result)


@pytest.mark.parametrize("q_len", range(1, 9))
@pytest.mark.parametrize("q_dtype", FLOAT_DTYPES)
def test_attention_query_dtypes(q_dtype, q_len):
    rng = np.random.default_rng(q_len + 10 * FLOAT_DTYPES.index(q_dtype))
    result = run_attention(
        rng,
        group=2,
        q_len=q_len,
        kv_len=33,
        capacity=40,
        head_dim=128,
        key_bits=4,
        value_bits=3,
        causal=True,
        q_dtype=q_dtype,
        q_gain=2.0,
    )
    assert_attention_close(*result, rtol=attention_rtol(q_dtype, 128, 4, 3))


@pytest.mark.parametrize("scale", (1e-3, 0.37, 4.0))
def test_attention_scale(scale):
    rng = np.random.default_rng(int(scale * 1000))
    result = run_attention(
        rng, group=2, q_len=2, kv_len=70, scale=scale, key_bits=2, value_bits=2, zero_tokens=True
    )
    assert_attention_close(*result)


def test_attention_causal_with_kv_len_equal_to_q_len():
    # Query i sees exactly keys 0..i; query 0 sees one key, so its output is that value.
    rng = np.random.default_rng(8)
    out, lse, ref_out, ref_lse, v_hat = run_attention(rng, group=4, q_len=8, kv_len=8)
    assert_attention_close(out, lse, ref_out, ref_lse, v_hat)
    np.testing.assert_allclose(out[:, :4, 0], np.repeat(v_hat[:, :1, 0], 4, axis=1), rtol=1e-6)


@pytest.mark.parametrize("variant", ("bool_rows", "additive_rows", "chunk_edges"))
def test_attention_fully_masked_rows(variant):
    rng = np.random.default_rng(len(variant))
    batch, kv_heads, group, q_len, head_dim = 2, 2, 4, 3, 64
    q_heads = kv_heads * group
    kv_len = 2500 if variant == "chunk_edges" else 40
    if variant == "bool_rows":
        keep = rng.random((batch, q_heads, q_len, kv_len)) < 0.5
        keep[0, 1, :] = False  # all rows of one head
        keep[1, 5, 2] = False  # one row
        mask = mx.array(keep)
    elif variant == "additive_rows":
        add = rng.standard_normal((batch, q_heads, q_len, kv_len)).astype(np.float32)
        add[1, :, 0] = -np.inf
        mask = mx.array(add)
    else:
        # Keys only in the last, partial chunk for some rows and only key 0 for
        # others, so that most key chunks see nothing for a row.
        keep = np.zeros((batch, q_heads, q_len, kv_len), bool)
        keep[:, :, 0, 0] = True
        keep[:, :, 1, -3:] = True
        mask = mx.array(keep)
    cache_shape = (batch, kv_heads, kv_len + 5, kv_len, head_dim)
    k_words, k_scales, k_hat = reference_cache(rng, *cache_shape, 4)
    v_words, v_scales, v_hat = reference_cache(rng, *cache_shape, 2)
    q = mx.array(rng.standard_normal((batch, q_heads, q_len, head_dim)).astype(np.float32))
    args = (
        q,
        *mx_cache(k_words, k_scales),
        *mx_cache(v_words, v_scales),
        mx.array(centroids_np(head_dim, 4)),
        mx.array(centroids_np(head_dim, 2)),
        kv_len,
        0.125,
        4,
        2,
        False,
        mask,
    )
    ref_out, ref_lse = reference.attention(
        np.array(q), k_hat, v_hat, 0.125, kv_len, False, to_np(mask)
    )
    assert (ref_lse == -np.inf).any(), "the test must produce fully masked rows"
    out, lse = ops.compressed_attention(*args)
    assert_attention_close(np.array(out), np.array(lse), ref_out, ref_lse, v_hat)
    f_out, f_lse = fallback.compressed_attention(*args)
    assert_attention_close(np.array(f_out), np.array(f_lse), ref_out, ref_lse, v_hat)


@pytest.mark.parametrize(
    "impl",
    (
        pytest.param(
            "kernel",
            marks=pytest.mark.cpu_only(reason="the GPU kernels are not held to NaN propagation"),
        ),
        "fallback",
    ),
)
@pytest.mark.parametrize("bad", ("query", "tail"))
def test_attention_propagates_nan(bad, impl):
    # A NaN score is not a hidden key: a query with one NaN coordinate makes its row of
    # out and its lse NaN (a NaN tail key: every row of its KV head), as plain attention
    # does. Every other row is what it is without the NaN, and a row that sees no key
    # (fully masked, no tail) stays 0 with lse -inf.
    rng = np.random.default_rng(41)
    batch, kv_heads, group, q_len, head_dim, kv_len = 1, 2, 2, 2, 64, 12
    k_words, k_scales, _ = reference_cache(rng, batch, kv_heads, 16, kv_len, head_dim, 4)
    v_words, v_scales, _ = reference_cache(rng, batch, kv_heads, 16, kv_len, head_dim, 3)
    q = rng.standard_normal((batch, kv_heads * group, q_len, head_dim)).astype(np.float32)
    tail = rng.standard_normal((2, batch, kv_heads, 3, head_dim)).astype(np.float32)
    keep = np.ones((batch, kv_heads * group, q_len, kv_len), bool)
    keep[0, 3, 0] = False

    def attend(q, tail):
        args = (
            mx.array(q),
            *mx_cache(k_words, k_scales),
            *mx_cache(v_words, v_scales),
            mx.array(centroids_np(head_dim, 4)),
            mx.array(centroids_np(head_dim, 3)),
            kv_len,
            0.125,
            4,
            3,
            True,
            mx.array(keep),
        )
        tail_k, tail_v = (None, None) if tail is None else (mx.array(t) for t in tail)
        if impl == "kernel":
            out, lse = ops.compressed_attention(*args, tail_k=tail_k, tail_v=tail_v)
        else:
            out, lse = fallback.compressed_attention(*args, tail_k, tail_v)
        return np.array(out), np.array(lse)

    nan_rows = np.zeros((batch, kv_heads * group, q_len), bool)
    if bad == "query":
        tail = None
        clean_out, clean_lse = attend(q, tail)
        q = q.copy()
        q[0, 1, 1, 9] = np.nan
        nan_rows[0, 1, 1] = True
    else:
        clean_out, clean_lse = attend(q, tail)
        tail = tail.copy()
        tail[0, 0, 1, 2, 9] = np.nan  # a key of KV head 1: query heads 2 and 3
        nan_rows[0, 2:4] = True
    out, lse = attend(q, tail)
    assert np.isnan(out[nan_rows]).all() and np.isnan(lse[nan_rows]).all()
    np.testing.assert_allclose(out[~nan_rows], clean_out[~nan_rows], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse[~nan_rows], clean_lse[~nan_rows], rtol=1e-5)
    if bad == "query":
        assert (out[0, 3, 0] == 0).all() and lse[0, 3, 0] == -np.inf


@pytest.mark.parametrize("impl", ("kernel", "fallback"))
@pytest.mark.parametrize(
    "kwargs",
    (
        dict(tail=1),
        dict(tail=5, q_len=3, group=4, causal=False),
        dict(tail=52, q_len=8, group=8, causal=True, key_bits=3, value_bits=2),
        dict(tail=36, kv_len=4097, q_len=1, group=4, head_dim=128),  # several key chunks
        dict(tail=256, kv_len=300, q_len=2, group=2, head_dim=256, mask="bool:B,Hq,L,kv"),
        dict(tail=7, kv_len=45, q_len=3, group=4, mask="add:L,kv", q_dtype=mx.bfloat16),
        dict(tail=3, kv_len=8, q_len=8, group=1, causal=True, q_dtype=mx.float16),
    ),
)
def test_attention_with_tail(kwargs, impl):
    # The tail (fp16 sinks and recent window of a cache) joins the compressed tokens'
    # softmax: every query sees all of it, whatever the causal flag and the mask say
    # about the compressed tokens.
    rng = np.random.default_rng(kwargs["tail"] * 7 + kwargs.get("q_len", 1))
    result = run_attention(rng, impl=impl, q_gain=2.0, **kwargs)
    rtol = attention_rtol(
        kwargs.get("q_dtype", mx.float32),
        kwargs.get("head_dim", 64),
        kwargs.get("key_bits", 4),
        kwargs.get("value_bits", 4),
    )
    assert_attention_close(*result, rtol=max(rtol, 1e-5))


@pytest.mark.parametrize("dtype", (mx.float16, mx.bfloat16))
@pytest.mark.parametrize("model_space", (True, False))
def test_attention_out_dtype_is_the_float32_out_rounded(dtype, model_space, tmp_path):
    # out_dtype: the kernels write `out` in that dtype, and it is the float32 out of the
    # same call rounded to it (the decode step's output without a conversion node).
    # With the rotation, tail and means (the merge writes out, as for float32) it is
    # bit-identical; without them a GPU may take another path for float32 (one split
    # written by the attention kernel), so there it is compared within the dtype's
    # precision.
    from turboquant_mlx import _ext

    rng = np.random.default_rng(3 if model_space else 4)
    B, Hkv, group, L, kv_len, D = 1, 2, 4, 1, 300, 128
    k_words, k_scales, _ = reference_cache(rng, B, Hkv, 320, kv_len, D, 4)
    v_words, v_scales, _ = reference_cache(rng, B, Hkv, 320, kv_len, D, 4)
    q = mx.array(rng.standard_normal((B, Hkv * group, L, D)).astype(np.float32)).astype(dtype)
    args = (
        q,
        mx.array(k_words),
        mx.array(k_scales),
        mx.array(v_words),
        mx.array(v_scales),
        mx.array(centroids_np(D, 4)),
        mx.array(centroids_np(D, 4)),
        kv_len,
        0.09,
        4,
        4,
        False,
    )
    kw = {}
    if model_space:
        tail = mx.array(rng.standard_normal((B, Hkv, 5, D)).astype(np.float32)).astype(dtype)
        mean = mx.array(0.1 * rng.standard_normal((B, Hkv, 1, D)).astype(np.float32))
        kw = dict(
            tail_k=tail,
            tail_v=tail * 0.5,
            rotation_signs=Rotation(D, seed=1).kernel_signs,
            key_mean=mean,
            value_mean=-mean,
        )
    out32, lse32 = ops.compressed_attention(*args, **kw)
    out, lse = ops.compressed_attention(*args, out_dtype=dtype, **kw)
    assert out.dtype == dtype and lse.dtype == mx.float32
    support = _ext.kernel_support(mx.default_device())
    if support.out_in_any_dtype or (support.out_in_query_dtype and q.dtype == dtype):
        # written by the op's own node, no conversion after it
        assert graph_nodes(tmp_path / "g.dot", out)[-1] == "CompressedAttention"
    want = np.array(out32.astype(dtype).astype(mx.float32))
    got = np.array(out.astype(mx.float32))
    if model_space or mx.default_device() == mx.cpu:
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.array(lse), np.array(lse32))
    else:
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
    with pytest.raises(ValueError) as excinfo:
        ops.compressed_attention(*args, out_dtype=mx.int32, **kw)
    assert_op_error(excinfo, "compressed_attention", "out_dtype", "int32")


def test_attention_tail_rescues_fully_masked_rows():
    # Rows whose compressed keys are all masked still see the tail: finite lse, and
    # the output is the tail's attention alone.
    rng = np.random.default_rng(5)
    out, lse, ref_out, ref_lse, v_hat = run_attention(
        rng, q_len=2, kv_len=4097, group=2, mask="hide-all", causal=False, tail=4
    )
    assert np.isfinite(lse).all() and np.isfinite(ref_lse).all()
    assert_attention_close(out, lse, ref_out, ref_lse, v_hat)


def test_attention_reads_strided_inputs():
    # Queries transposed from (B, L, H, D) and caches that are views into larger buffers.
    rng = np.random.default_rng(21)
    batch, kv_heads, group, q_len, kv_len, head_dim = 2, 2, 2, 4, 30, 96
    q_heads = kv_heads * group
    cache_shape = (batch, 2 * kv_heads, kv_len, kv_len, head_dim)
    k_words, k_scales, k_hat = reference_cache(rng, *cache_shape, 3)
    v_words, v_scales, v_hat = reference_cache(rng, *cache_shape, 4)
    q_blhd = rng.standard_normal((batch, q_len, q_heads, head_dim)).astype(np.float32)
    q = mx.array(q_blhd).transpose(0, 2, 1, 3)
    out, lse = ops.compressed_attention(
        q,
        mx.array(k_words)[:, 1::2],
        mx.array(k_scales)[:, 1::2],
        mx.array(v_words)[:, ::2],
        mx.array(v_scales)[:, ::2],
        mx.array(centroids_np(head_dim, 3)),
        mx.array(centroids_np(head_dim, 4)),
        kv_len,
        0.1,
        3,
        4,
        True,
    )
    ref_out, ref_lse = reference.attention(
        q_blhd.transpose(0, 2, 1, 3), k_hat[:, 1::2], v_hat[:, ::2], 0.1, kv_len, True
    )
    assert_attention_close(np.array(out), np.array(lse), ref_out, ref_lse, v_hat)


@pytest.mark.parametrize(
    "kwargs",
    (
        dict(group=1, q_len=1, kv_len=1, head_dim=64, key_bits=2, value_bits=2),
        dict(group=4, q_len=5, kv_len=127, capacity=140, head_dim=96, key_bits=3, value_bits=4),
        dict(
            group=8,
            q_len=8,
            kv_len=300,
            head_dim=256,
            key_bits=4,
            value_bits=2,
            causal=False,
            mask="bool:B,Hq,L,kv",
        ),
        dict(group=2, q_len=3, kv_len=2049, head_dim=128, mask="add:L,kv", q_dtype=mx.bfloat16),
        dict(
            group=4,
            q_len=2,
            kv_len=50,
            head_dim=128,
            key_bits=4,
            value_bits=3,
            mask="bool:1,Hq,L,1",
            q_dtype=mx.float16,
        ),
    ),
)
def test_fallback_attention_matches_kernel(kwargs):
    # The same cache and queries (same seed) through the kernel and the fallback; both
    # must match the reference, and each other.
    kernel = run_attention(np.random.default_rng(99), **kwargs)
    fb = run_attention(np.random.default_rng(99), impl="fallback", **kwargs)
    np.testing.assert_array_equal(kernel[2], fb[2])  # same inputs indeed
    rtol = attention_rtol(
        kwargs.get("q_dtype", mx.float32),
        kwargs.get("head_dim", 64),
        kwargs.get("key_bits", 4),
        kwargs.get("value_bits", 4),
    )
    assert_attention_close(*kernel, rtol=rtol)
    assert_attention_close(*fb)
    np.testing.assert_allclose(
        fb[0], kernel[0], rtol=0, atol=2 * max(rtol, 1e-5) * np.abs(kernel[4]).max()
    )
    np.testing.assert_allclose(fb[1], kernel[1], rtol=max(rtol, 1e-5))


# ---------------------------------------------------------------------------
# The codec end to end: Rotation -> quantize_append -> dequantize -> Rotation.inverse


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS + (160,))  # 160: dense rotation
def test_codec_round_trip_mse_matches_lloyd_max(head_dim, bits):
    rng = np.random.default_rng(head_dim + bits)
    batch, heads, length = 2, 4, 96
    # Anisotropic keys with a mean: the rotation must make any input look like a
    # random direction for the codebook to reach its design distortion.
    channel_scale = np.exp(rng.uniform(-0.7, 0.7, head_dim))
    x = rng.standard_normal((batch, heads, length, head_dim)) * channel_scale + 0.3
    x *= np.exp(rng.uniform(-2, 2, (batch, heads, length, 1)))
    x = mx.array(x.astype(np.float32))
    rotation = Rotation(head_dim, seed=head_dim * 10 + bits)
    assert rotation.uses_hadamard == (head_dim != 160)
    c = codebook.centroids(head_dim, bits)
    words, scales = poisoned_cache(rng, batch, heads, length, head_dim, bits)
    codes_mx, scales_mx = ops.quantize_append(
        *mx_cache(words, scales), rotation.forward(x), c, 0, bits
    )
    x_hat = rotation.inverse(ops.dequantize(codes_mx, scales_mx, c, bits, 0, length))
    x_np, x_hat_np = np.array(x, np.float64), np.array(x_hat, np.float64)
    # Squared error of each vector relative to its squared norm, i.e. per unit vector.
    err = np.sum((x_np - x_hat_np) ** 2, -1) / np.sum(x_np**2, -1)
    expected = head_dim * codebook.lloyd_max_distortion(head_dim, bits)
    assert abs(err.mean() / expected - 1) <= 0.10, (err.mean(), expected)


# ---------------------------------------------------------------------------
# Invalid input: every op refuses it with "[turboquant_mlx.<op>] ... <bad value>"


def qa_args(**override):
    """Valid quantize_append arguments (B=2, H=2, capacity 8, D=64, 4 bits), overridden."""
    head_dim, bits = override.pop("head_dim", 64), override.get("bits", 4)
    args = dict(
        codes=mx.zeros((2, 2, 8, head_dim * bits // 32), mx.uint32),
        scales=mx.zeros((2, 2, 8), mx.float16),
        x=mx.ones((2, 2, 3, head_dim)),
        centroids=mx.array(centroids_np(64, 4)),
        offset=0,
        bits=bits,
    )
    args.update(override)
    return args


def attn_args(**override):
    """Valid compressed_attention arguments (B=2, Hq=4, Hkv=2, L=2, cap 16, D=64)."""
    args = dict(
        q=mx.ones((2, 4, 2, 64)),
        k_codes=mx.zeros((2, 2, 16, 8), mx.uint32),
        k_scales=mx.zeros((2, 2, 16), mx.float16),
        v_codes=mx.zeros((2, 2, 16, 6), mx.uint32),
        v_scales=mx.zeros((2, 2, 16), mx.float16),
        k_centroids=mx.array(centroids_np(64, 4)),
        v_centroids=mx.array(centroids_np(64, 3)),
        kv_len=10,
        scale=0.125,
        key_bits=4,
        value_bits=3,
        causal=True,
        mask=None,
    )
    args.update(override)
    return args


def dq_args(**override):
    """Valid dequantize arguments (B=2, H=2, capacity 8, D=64, 2 bits)."""
    args = dict(
        codes=mx.zeros((2, 2, 8, 4), mx.uint32),
        scales=mx.zeros((2, 2, 8), mx.float16),
        centroids=mx.array(centroids_np(64, 2)),
        bits=2,
        start=0,
        length=8,
    )
    args.update(override)
    return args


def case(op, kwargs, needles, id, marks=()):
    return pytest.param(op, kwargs, needles, id=id, marks=marks)


QA, ATTN, DQ = "quantize_append", "compressed_attention", "dequantize"

BAD_INPUT = [
    # quantize_append
    *(case(QA, qa_args(bits=b), ("bits", f"got {b}"), f"qa-bits{b}") for b in (1, 5, 8)),
    *(case(QA, qa_args(head_dim=d), (f"got {d}",), f"qa-head_dim{d}") for d in (48, 80, 512)),
    case(QA, qa_args(x=mx.ones((2, 2, 3, 64), mx.int32)), ("x", "int32"), "qa-x-int32"),
    case(QA, qa_args(codes=mx.zeros((2, 2, 8, 8), mx.uint8)), ("codes", "uint8"), "qa-codes-uint8"),
    case(
        QA,
        qa_args(scales=mx.zeros((2, 2, 8), mx.float32)),
        ("scales", "float32"),
        "qa-scales-float32",
    ),
    case(
        QA,
        qa_args(centroids=mx.arange(16, dtype=mx.int32)),
        ("centroids", "int32"),
        "qa-centroids-int32",
    ),
    case(QA, qa_args(x=mx.ones((3, 2, 3, 64))), ("(3, 2, 3, 64)", "(2, 2, 8, 8)"), "qa-batch"),
    case(QA, qa_args(x=mx.ones((2, 5, 3, 64))), ("(2, 5, 3, 64)",), "qa-heads"),
    case(QA, qa_args(x=mx.ones((2, 2, 3, 128))), ("head dim 128", "64"), "qa-words-vs-head_dim"),
    case(QA, qa_args(x=mx.ones((2, 3, 64))), ("(2, 3, 64)",), "qa-x-3d"),
    case(QA, qa_args(scales=mx.zeros((2, 2, 9), mx.float16)), ("(2, 2, 9)",), "qa-scales-shape"),
    case(QA, qa_args(centroids=mx.zeros((8,))), ("(8,)", "16"), "qa-centroid-count"),
    case(QA, qa_args(offset=-1), ("got -1",), "qa-offset-negative"),
    case(QA, qa_args(offset=6), ("3 tokens at offset 6", "capacity 8"), "qa-capacity-overflow"),
    # compressed_attention
    *(
        case(ATTN, attn_args(key_bits=b), ("bits", f"got {b}"), f"attn-key_bits{b}")
        for b in (1, 5, 8)
    ),
    case(ATTN, attn_args(value_bits=5), ("bits", "got 5"), "attn-value_bits5"),
    *(
        case(
            ATTN,
            attn_args(
                q=mx.ones((2, 4, 2, d)),
                k_codes=mx.zeros((2, 2, 16, d // 8), mx.uint32),
                v_codes=mx.zeros((2, 2, 16, d // 8), mx.uint32),
                v_centroids=mx.array(centroids_np(64, 4)),
                value_bits=4,
            ),
            (f"got {d}",),
            f"attn-head_dim{d}",
        )
        for d in (48, 80, 512)
    ),
    case(ATTN, attn_args(q=mx.ones((2, 4, 2, 64), mx.int32)), ("queries", "int32"), "attn-q-int32"),
    case(
        ATTN,
        attn_args(k_codes=mx.zeros((2, 2, 16, 8), mx.uint8)),
        ("key codes", "uint8"),
        "attn-codes-uint8",
    ),
    case(
        ATTN,
        attn_args(v_scales=mx.zeros((2, 2, 16), mx.float32)),
        ("value scales", "float32"),
        "attn-scales-float32",
    ),
    case(ATTN, attn_args(mask=mx.ones((2, 10), mx.int32)), ("mask", "int32"), "attn-mask-int32"),
    case(ATTN, attn_args(q=mx.ones((3, 4, 2, 64))), ("batch 3", "2"), "attn-batch"),
    case(
        ATTN,
        attn_args(
            v_codes=mx.zeros((2, 4, 16, 6), mx.uint32), v_scales=mx.zeros((2, 4, 16), mx.float16)
        ),
        ("2 vs 4",),
        "attn-kv-heads",
    ),
    case(
        ATTN,
        attn_args(
            q=mx.ones((2, 6, 2, 64)),
            k_codes=mx.zeros((2, 4, 16, 8), mx.uint32),
            k_scales=mx.zeros((2, 4, 16), mx.float16),
            v_codes=mx.zeros((2, 4, 16, 6), mx.uint32),
            v_scales=mx.zeros((2, 4, 16), mx.float16),
        ),
        ("(6)", "(4)"),
        "attn-gqa-ratio",
    ),
    case(
        ATTN,
        attn_args(q=mx.ones((2, 4, 2, 128))),
        ("head dim 128", "64/64"),
        "attn-words-vs-head_dim",
    ),
    case(
        ATTN,
        attn_args(k_scales=mx.zeros((2, 2, 15), mx.float16)),
        ("(2, 2, 15)",),
        "attn-scales-shape",
    ),
    case(ATTN, attn_args(v_centroids=mx.zeros((16,))), ("(16,)", "(8,)"), "attn-centroid-count"),
    case(ATTN, attn_args(kv_len=17), ("got 17", "capacity 16"), "attn-kv_len-over-capacity"),
    case(ATTN, attn_args(kv_len=1), ("got 1", "query length 2"), "attn-kv_len-below-q_len"),
    case(ATTN, attn_args(q=mx.ones((2, 4, 0, 64))), ("got 0",), "attn-q_len0"),
    case(ATTN, attn_args(q=mx.ones((2, 4, 9, 64))), ("got 9",), "attn-q_len9"),
    case(
        ATTN,
        attn_args(mask=mx.ones((2, 11), mx.bool_)),
        ("(2, 11)", "(2, 4, 2, 10)"),
        "attn-mask-kv",
    ),
    case(
        ATTN,
        attn_args(mask=mx.ones((3, 4, 2, 10), mx.bool_)),
        ("(3, 4, 2, 10)",),
        "attn-mask-batch",
    ),
    case(
        ATTN,
        attn_args(mask=mx.ones((1, 2, 4, 2, 10), mx.bool_)),
        ("(1, 2, 4, 2, 10)",),
        "attn-mask-5d",
    ),
    *(
        case(ATTN, attn_args(scale=s), (f"got {text}",), f"attn-scale{text}")
        for s, text in ((0.0, "0"), (-0.5, "-0.5"), (float("nan"), "nan"), (float("inf"), "inf"))
    ),
    case(
        ATTN, attn_args(tail_k=mx.ones((2, 2, 3, 64))), ("tail_k and tail_v",), "attn-tail-k-only"
    ),
    case(
        ATTN,
        attn_args(tail_k=mx.ones((2, 2, 3, 64)), tail_v=mx.ones((2, 2, 4, 64))),
        ("(2, 2, 3, 64)", "(2, 2, 4, 64)"),
        "attn-tail-length-mismatch",
    ),
    case(
        ATTN,
        attn_args(tail_k=mx.ones((2, 4, 3, 64)), tail_v=mx.ones((2, 4, 3, 64))),
        ("(2, 4, 3, 64)", "(2, 2, 3, 64)"),
        "attn-tail-heads",
    ),
    case(
        ATTN,
        attn_args(tail_k=mx.ones((2, 2, 3, 32)), tail_v=mx.ones((2, 2, 3, 32))),
        ("(2, 2, 3, 32)",),
        "attn-tail-head-dim",
    ),
    case(
        ATTN,
        attn_args(tail_k=mx.ones((2, 2, 257, 64)), tail_v=mx.ones((2, 2, 257, 64))),
        ("at most 256", "got 257"),
        "attn-tail-too-long",
    ),
    case(
        ATTN,
        attn_args(tail_k=mx.ones((2, 2, 3, 64), mx.int32), tail_v=mx.ones((2, 2, 3, 64), mx.int32)),
        ("tail", "int32"),
        "attn-tail-int32",
    ),
    # dequantize
    *(
        case(
            DQ,
            dq_args(bits=b, codes=mx.zeros((2, 2, 8, 2 * b), mx.uint32)),
            ("bits", f"got {b}"),
            f"dq-bits{b}",
        )
        for b in (1, 5, 8)
    ),
    *(
        case(
            DQ,
            dq_args(codes=mx.zeros((2, 2, 8, d // 16), mx.uint32)),
            (f"got {d}",),
            f"dq-head_dim{d}",
        )
        for d in (48, 80, 512)
    ),
    case(DQ, dq_args(codes=mx.zeros((2, 2, 8, 4), mx.uint8)), ("codes", "uint8"), "dq-codes-uint8"),
    case(
        DQ,
        dq_args(scales=mx.zeros((2, 2, 8), mx.float32)),
        ("scales", "float32"),
        "dq-scales-float32",
    ),
    case(DQ, dq_args(scales=mx.zeros((1, 2, 8), mx.float16)), ("(1, 2, 8)",), "dq-scales-batch"),
    case(
        DQ,
        dq_args(
            bits=3, codes=mx.zeros((2, 2, 8, 4), mx.uint32), centroids=mx.array(centroids_np(64, 3))
        ),
        ("4 words",),
        "dq-words-vs-bits",
    ),
    case(DQ, dq_args(centroids=mx.zeros((8,))), ("(8,)", "(4,)"), "dq-centroid-count"),
    case(DQ, dq_args(start=-1, length=2), ("[-1, 1)",), "dq-start-negative"),
    case(DQ, dq_args(start=5, length=4), ("[5, 9)", "capacity 8"), "dq-past-capacity"),
    case(DQ, dq_args(start=2, length=-1), ("[2, 1)",), "dq-length-negative"),
]


@pytest.mark.parametrize("op,kwargs,needles", BAD_INPUT)
def test_invalid_input_is_refused(op, kwargs, needles):
    with pytest.raises(ValueError) as excinfo:
        getattr(ops, op)(**kwargs)
    assert_op_error(excinfo, op, *needles)


@pytest.mark.cpu_only(
    reason="the CPU kernel refuses NaN/Inf tokens and overflowing "
    "scales with an error; a GPU kernel cannot raise"
)
@pytest.mark.parametrize("bad", ("nan", "inf", "-inf", "huge"))
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_append_refuses_bad_tokens_without_writing(dtype, bad):
    # NaN/Inf anywhere, or a token whose norm (hence its scale) would not fit float16.
    rng = np.random.default_rng(4)
    batch, heads, length, head_dim, bits = 2, 3, 5, 128, 4
    words, scales = poisoned_cache(rng, batch, heads, 12, head_dim, bits)
    old_codes, old_scales = mx_cache(words, scales)
    mx.eval(old_codes, old_scales)
    c = mx.array(centroids_np(head_dim, bits))
    x = random_tokens(rng, (batch, heads, length, head_dim), spread=False)
    token = (1, 2, length - 1) if dtype == mx.float32 else (0, 0, 0)
    if bad == "huge":
        x[token] = 8000.0  # finite in every dtype; the scale is not
        needles = ("norm", "90509.7")
    else:
        x[token + (head_dim - 1,)] = float(bad)
        needles = ("non-finite", bad)
    new_codes, new_scales = ops.quantize_append(
        old_codes, old_scales, mx.array(x).astype(dtype), c, 4, bits
    )  # lazy: the check runs with the kernel
    for result in (new_codes, new_scales):
        with pytest.raises(ValueError) as excinfo:
            mx.eval(result)
        assert_op_error(excinfo, "quantize_append", *needles)
    # The cache still referenced keeps its content.
    np.testing.assert_array_equal(np.array(old_codes), words)
    np.testing.assert_array_equal(np.array(old_scales).view(np.uint16), scales.view(np.uint16))
    # And it still works: a clean append on it succeeds.
    x[token] = 0.5
    codes2, scales2 = ops.quantize_append(old_codes, old_scales, mx.array(x), c, 4, bits)
    got_codes, got_scales = np.array(codes2), np.array(scales2)
    assert_codes_and_scales(got_codes[:, :, 4:9], got_scales[:, :, 4:9], x, bits)


@pytest.mark.parametrize("bits", BITS)
def test_quantize_append_accepts_large_norms(bits):
    # Scales up to norm / min ||c|| ~ 40000 / 0.75 still fit float16.
    rng = np.random.default_rng(bits)
    head_dim = 64
    x = rng.standard_normal((1, 2, 3, head_dim)).astype(np.float32)
    x *= 40000.0 / np.linalg.norm(x, axis=-1, keepdims=True)
    words, scales = poisoned_cache(rng, 1, 2, 3, head_dim, bits)
    c = mx.array(centroids_np(head_dim, bits))
    got_codes, got_scales = ops.quantize_append(*mx_cache(words, scales), mx.array(x), c, 0, bits)
    assert np.isfinite(np.array(got_scales)).all()
    assert_codes_and_scales(np.array(got_codes), np.array(got_scales), x, bits)


def tokens_with_overflowing_scales(kind):
    """2-bit, D = 64 tokens of norm < 60000 whose scale norm / ||c|| exceeds 65504."""
    head_dim, bits = 64, 2
    c = centroids_np(head_dim, bits)
    if kind == "crafted":
        # 63 coordinates just inside the inner cells, one carrying the remaining
        # mass: ||c|| ~ 0.46, so a norm of 50000 gives a scale of ~110000.
        u = np.full(head_dim, 0.999 * (c[2] + c[3]) / 2)
        u[0] = np.sqrt(1 - (head_dim - 1) * u[1] ** 2)
        x = (50000.0 * u).reshape(1, 1, 1, head_dim)
    else:
        # Random directions: ||c|| is below 0.90 for about a quarter of them.
        x = np.random.default_rng(0).standard_normal((1, 2, 32, head_dim))
        x *= 59500.0 / np.linalg.norm(x, axis=-1, keepdims=True)
    return x.astype(np.float32), c, bits


@pytest.mark.cpu_only(
    reason="the CPU kernel refuses a scale that overflows float16; a GPU "
    "kernel cannot raise and stores its float16 rounding"
)
@pytest.mark.parametrize("kind", ("crafted", "random"))
def test_quantize_append_never_stores_an_infinite_scale(kind):
    x, c, bits = tokens_with_overflowing_scales(kind)
    words, scales = poisoned_cache(np.random.default_rng(0), *x.shape[:3], x.shape[3], bits)
    try:
        _, got_scales = ops.quantize_append(
            *mx_cache(words, scales), mx.array(x), mx.array(c), 0, bits
        )
        mx.eval(got_scales)
    except ValueError as e:  # refusing them is right too
        assert_op_error(pytest.ExceptionInfo.from_exception(e), "quantize_append", "norm")
        return
    assert np.isfinite(np.array(got_scales)).all()


@pytest.mark.parametrize("kind", ("crafted", "random"))
def test_fallback_quantize_append_never_stores_an_infinite_scale(kind):
    x, c, bits = tokens_with_overflowing_scales(kind)
    words, scales = poisoned_cache(np.random.default_rng(0), *x.shape[:3], x.shape[3], bits)
    with pytest.raises(ValueError) as excinfo:
        fallback.quantize_append(*mx_cache(words, scales), mx.array(x), mx.array(c), 0, bits)
    assert_op_error(excinfo, "quantize_append", "norm")


@pytest.mark.parametrize("bad", ("nan", "huge"))
def test_fallback_quantize_append_refuses_bad_tokens(bad):
    words, scales = poisoned_cache(np.random.default_rng(0), 1, 1, 4, 64, 2)
    old_codes, old_scales = mx_cache(words, scales)
    x = np.ones((1, 1, 2, 64), np.float32)
    if bad == "nan":
        x[0, 0, 1, 3] = np.nan
    else:
        x[0, 0, 1] = 30000.0  # norm 240000, scale 160000
    with pytest.raises(ValueError) as excinfo:
        fallback.quantize_append(
            old_codes, old_scales, mx.array(x), mx.array(centroids_np(64, 2)), 0, 2
        )
    needles = ("non-finite",) if bad == "nan" else ("norm", "240000")
    assert_op_error(excinfo, "quantize_append", *needles)
    np.testing.assert_array_equal(np.array(old_codes), words)


# ---------------------------------------------------------------------------
# stream: every op takes it as MLX's own ops do


STREAM_FORMS = {
    "DeviceType": lambda: mx.cpu,
    "Device": lambda: mx.Device(mx.cpu),
    "Stream": lambda: mx.default_stream(mx.Device(mx.cpu)),
    "new Stream": lambda: mx.new_stream(mx.Device(mx.cpu)),
}


def every_op_on(stream):
    """Each op once on small valid inputs (B=1, H=2, D=64, K4V3), on ``stream``:
    {name: its outputs}."""
    rng = np.random.default_rng(12)
    kc, vc = mx.array(centroids_np(64, 4)), mx.array(centroids_np(64, 3))

    def cache():  # fresh buffers for each op: the in-place appends write into them
        return [
            *mx_cache(*poisoned_cache(rng, 1, 2, 8, 64, 4)),
            *mx_cache(*poisoned_cache(rng, 1, 2, 8, 64, 3)),
        ]

    x = mx.array(random_tokens(rng, (1, 2, 2, 64), spread=False))
    dense = np.zeros((1, 2, 8, 64), np.float32)
    return {
        "has_kernels": [mx.array(ops.has_kernels(stream))],
        "has_ring_append": [mx.array(ops.has_ring_append(stream))],
        "quantize_append": ops.quantize_append(*cache()[:2], x, kc, 0, 4, stream=stream),
        "quantize_append_kv": ops.quantize_append_kv(
            *cache(), x, x, kc, vc, 0, 4, 3, stream=stream
        ),
        "write_tokens_kv": ops.write_tokens_kv(
            mx.array(dense), mx.array(dense), x, x, 1, stream=stream
        ),
        "ring_append_kv": ops.ring_append_kv(
            *cache(), mx.array(dense), mx.array(dense), x, x, kc, vc, 2, 3, 4, 3, stream=stream
        ),
        "compressed_attention": ops.compressed_attention(
            mx.concatenate([x, x], axis=1), *cache(), kc, vc, 4, 0.125, 4, 3, stream=stream
        ),
        "dequantize": [ops.dequantize(*cache()[:2], kc, 4, 0, 4, stream=stream)],
    }


@pytest.mark.parametrize("form", STREAM_FORMS)
def test_ops_take_every_stream_form(form):
    # mx.cpu (a DeviceType), a Device, a Stream: the same results as the CPU's default
    # stream gives, bit for bit.
    want = every_op_on(mx.default_stream(mx.Device(mx.cpu)))
    got = every_op_on(STREAM_FORMS[form]())
    uint = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}
    for name in want:
        for a, b in zip(got[name], want[name]):
            np.testing.assert_array_equal(
                np.array(a.view(uint[a.itemsize])), np.array(b.view(uint[b.itemsize])), err_msg=name
            )


@pytest.mark.parametrize("op", ("quantize_append", "compressed_attention", "has_kernels"))
def test_ops_refuse_a_stream_of_another_type(op):
    words, scales = mx_cache(*poisoned_cache(np.random.default_rng(13), 1, 2, 8, 64, 4))
    c = mx.array(centroids_np(64, 4))
    x = mx.zeros((1, 2, 2, 64))
    calls = {
        "quantize_append": lambda: ops.quantize_append(words, scales, x, c, 0, 4, stream="cpu"),
        "compressed_attention": lambda: ops.compressed_attention(
            x, words, scales, words, scales, c, c, 2, 0.125, 4, 4, stream="cpu"
        ),
        "has_kernels": lambda: ops.has_kernels("cpu"),
    }
    with pytest.raises(TypeError) as excinfo:
        calls[op]()
    assert_op_error(excinfo, op, "stream must be", "'cpu'")


def test_kernel_support_is_the_answer_the_ops_take():
    # Which kernels run where is answered once per backend (_ext.kernel_support), and
    # the ops route by it: the CPU has every kernel; a GPU has the build's.
    from turboquant_mlx import _ext

    cpu = _ext.kernel_support(mx.Device(mx.cpu))
    assert cpu.kernels and cpu.write_tokens and cpu.out_in_any_dtype and cpu.out_in_query_dtype
    assert not cpu.self_check
    assert ops.has_kernels(mx.cpu) and ops.has_ring_append(mx.cpu)
    gpu = _ext.kernel_support(mx.Device(mx.gpu))
    backend = _ext.gpu_backend()
    assert gpu.kernels == _ext.gpu_available()
    assert gpu.kernels or backend != "metal"
    assert not gpu.kernels or backend != "none"
    assert gpu.self_check == (backend == "metal")
    assert gpu.write_tokens == gpu.out_in_query_dtype == (backend == "cuda" and gpu.kernels)
    assert not gpu.out_in_any_dtype
    if not gpu.self_check:
        assert ops.has_kernels(mx.gpu) == gpu.kernels


def test_kernel_overrides_are_read_back_and_refuse_bad_values(kernel_override):
    from turboquant_mlx import _ext

    kernel_override("attention", "portable")
    kernel_override("splits", 3)
    kernel_override("ctas", "64")
    want = {"attention": "portable", "splits": 3, "ctas": 64, "min_steps": None}
    assert _ext._kernel_overrides() == want
    for name, value in (
        ("splits", 0),
        ("splits", "3x"),
        ("min_steps", -1),
        ("attention", "simt"),
        ("tiles", 2),
    ):
        with pytest.raises(ValueError, match=r"^\[turboquant_mlx\._set_kernel_override\] "):
            _ext._set_kernel_override(name, value)
    assert _ext._kernel_overrides() == want  # a refused value changes nothing
