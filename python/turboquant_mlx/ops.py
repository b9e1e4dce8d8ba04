"""Public ops on the compressed cache (rotated space, or model space for a Hadamard
rotation the kernels apply; see docs/ARCHITECTURE.md).

Each op runs the C++ primitive when the target device has kernels in this build (the
CPU always does; the GPU when built with Metal or CUDA) and the plain-MLX fallback
otherwise, so the package works everywhere MLX does.
"""

from typing import Optional, Sequence

import mlx.core as mx

from . import _ext, fallback, selfcheck

__all__ = [
    "words_per_token",
    "RotationSigns",
    "has_kernels",
    "quantize_append",
    "quantize_append_kv",
    "write_tokens_kv",
    "ring_append_kv",
    "has_ring_append",
    "compressed_attention",
    "dequantize",
    "MAX_TAIL_TOKENS",
]

words_per_token = _ext.words_per_token
# The ops' rotation_signs, built once (a plain sequence of floats is converted per call).
RotationSigns = _ext.RotationSigns


def _device(stream, op: str) -> mx.Device:
    """The device of an op's ``stream`` argument: None (the default device), an
    ``mx.Stream``, an ``mx.Device``, or ``mx.cpu`` / ``mx.gpu`` (an ``mx.DeviceType``),
    as MLX's own ops take it."""
    if stream is None:
        return mx.default_device()
    if isinstance(stream, mx.Stream):
        return stream.device
    if isinstance(stream, mx.Device):
        return stream
    if isinstance(stream, mx.DeviceType):
        return mx.Device(stream)
    raise TypeError(
        f"[turboquant_mlx.{op}] stream must be None, an mx.Stream, an mx.Device, mx.cpu "
        f"or mx.gpu, got {stream!r}."
    )


# What this build's kernels cover per device type (_ext.kernel_support, the one answer
# the C++ op functions use too): asked once per type, as every op call asks.
_support = {}


def _kernel_support(device: mx.Device):
    support = _support.get(device.type)
    if support is None:
        support = _support[device.type] = _ext.kernel_support(device)
    return support


def _has_kernels(stream, op: str) -> bool:
    device = _device(stream, op)  # (checks the argument whatever the build)
    support = _kernel_support(device)
    if not support.kernels:
        return False
    if not support.self_check:
        return True
    # Metal's kernels pass their self-check first (selfcheck.py: once per process, then
    # a cached bool).
    usable = selfcheck._usable
    return usable if usable is not None else selfcheck.metal_kernels_usable(device)


def has_kernels(stream=None) -> bool:
    """Whether the ops run hand-written kernels (not the fallback) on ``stream`` (a
    stream, a device, or ``mx.cpu`` / ``mx.gpu``, as every op's ``stream`` is). On a
    Metal GPU the first call runs the kernels' self-check (see
    :func:`turboquant_mlx.selfcheck.metal_kernels_usable`)."""
    return _has_kernels(stream, "has_kernels")


def quantize_append(
    codes: mx.array,
    scales: mx.array,
    x: mx.array,
    centroids: mx.array,
    offset: int,
    bits: int,
    *,
    rotation_signs: Optional[Sequence[float]] = None,
    mean: Optional[mx.array] = None,
    in_place: bool = False,
    stream=None,
):
    """Quantize tokens ``(B, H, L, D)`` into the cache at ``offset``.

    ``x`` is in rotated space, or, with ``rotation_signs`` (the signs ``s`` of the
    rotation ``R = H diag(s) / sqrt(D)`` of a power-of-two ``D``: a sequence of floats,
    or, converted once, a :class:`RotationSigns`, e.g.
    :attr:`Rotation.kernel_signs <turboquant_mlx.rotation.Rotation.kernel_signs>`), in
    model space: the kernels rotate it, so a decode step needs no rotation kernels.
    With ``mean`` ``(B, H, 1, D)`` (in ``x``'s space), ``x - mean`` is quantized: a
    mean-centered cache appends its tokens as they are.

    With ``in_place``, the kernels write into the buffers even while other arrays
    still reference them, and those arrays see the new tokens too. MLX keeps an op's
    inputs alive until the device has run it, so while the previous decode step is
    still running (``mx.async_eval`` pipelining, as mlx-lm generates) the buffers are
    never free to reuse, and each append would copy the whole cache. It is for a caller
    that owns the buffers and whose other readers look only at slots before
    ``offset``: :class:`~turboquant_mlx.TurboQuantKVCache` uses it. The plain-MLX
    fallback ignores it (it always copies).

    A token that cannot be stored (NaN/Inf, or a scale ``norm / ||c||`` beyond float16)
    is refused on the CPU: evaluating the result raises (``RuntimeError``, the message
    starting ``[turboquant_mlx.quantize_append]``) and the buffers keep every bit, also
    with ``in_place``; the fallback raises ``ValueError`` at the call. GPU kernels cannot
    refuse without making the host wait for the device: they store such a token, with a
    NaN or infinite scale. Arguments of the wrong shape, dtype or range are refused at
    the call on every device, before anything is built.

    Returns:
        tuple[array, array]: updated ``(codes, scales)``. Drop your references to the
        old arrays so the primitive can reuse their buffers (O(L) instead of a copy).
    """
    if _has_kernels(stream, "quantize_append"):
        codes, scales = _ext.quantize_append(
            codes,
            scales,
            x,
            centroids,
            offset,
            bits,
            rotation_signs=rotation_signs,
            mean=mean,
            in_place=in_place,
            stream=stream,
        )
        return codes, scales
    return _fallback_append(
        codes, scales, x, centroids, offset, bits, rotation_signs, mean, stream, "quantize_append"
    )


def _fallback_append(codes, scales, x, centroids, offset, bits, rotation_signs, mean, stream, op):
    """quantize_append with the plain-MLX fallback; its refusals name ``op``."""
    _ext.words_per_token(x.shape[-1], bits)  # same validation as the kernel path
    with mx.stream(stream) if stream is not None else _nullcontext():
        if mean is not None:
            fallback._check_finite(x, op)
            x = x.astype(mx.float32) - mean.astype(mx.float32)
        if rotation_signs is not None:
            x = fallback.rotate(x, rotation_signs)
        return fallback.quantize_append(codes, scales, x, centroids, offset, bits, op=op)


def quantize_append_kv(
    k_codes: mx.array,
    k_scales: mx.array,
    v_codes: mx.array,
    v_scales: mx.array,
    keys: mx.array,
    values: mx.array,
    k_centroids: mx.array,
    v_centroids: mx.array,
    offset: int,
    key_bits: int,
    value_bits: int,
    *,
    key_rotation_signs: Optional[Sequence[float]] = None,
    value_rotation_signs: Optional[Sequence[float]] = None,
    key_mean: Optional[mx.array] = None,
    value_mean: Optional[mx.array] = None,
    stream=None,
):
    """A layer's keys and values appended at ``offset`` as one operation:
    :func:`quantize_append` with ``in_place=True`` for each (same arguments per
    tensor), built as one graph node, so that a decode step's append costs the host
    one node instead of four (at short context a step's time is its nodes' host cost).
    Keys and values bring the same number of tokens into caches of the same capacity.

    Refusals are :func:`quantize_append`'s, named ``quantize_append_kv``; on the CPU a
    refused call writes neither tensor (the keys' buffers stay as they were when only
    the values are refused).

    Returns:
        tuple[array, array, array, array]: ``(k_codes, k_scales, v_codes, v_scales)``.
    """
    if _has_kernels(stream, "quantize_append_kv"):
        return tuple(
            _ext.quantize_append_kv(
                k_codes,
                k_scales,
                v_codes,
                v_scales,
                keys,
                values,
                k_centroids,
                v_centroids,
                offset,
                key_bits,
                value_bits,
                key_rotation_signs=key_rotation_signs,
                value_rotation_signs=value_rotation_signs,
                key_mean=key_mean,
                value_mean=value_mean,
                stream=stream,
            )
        )
    return _fallback_append_kv(
        k_codes,
        k_scales,
        v_codes,
        v_scales,
        keys,
        values,
        k_centroids,
        v_centroids,
        offset,
        key_bits,
        value_bits,
        key_rotation_signs,
        value_rotation_signs,
        key_mean,
        value_mean,
        stream,
        "quantize_append_kv",
    )


def _fallback_append_kv(
    k_codes,
    k_scales,
    v_codes,
    v_scales,
    keys,
    values,
    k_centroids,
    v_centroids,
    offset,
    key_bits,
    value_bits,
    key_rotation_signs,
    value_rotation_signs,
    key_mean,
    value_mean,
    stream,
    op,
):
    """quantize_append_kv with the plain-MLX fallback; its refusals name ``op``. Nothing
    is written in place, so a refused value leaves the key buffers as they were too."""
    if keys.shape[2:3] != values.shape[2:3]:
        raise ValueError(
            f"[turboquant_mlx.{op}] keys {tuple(keys.shape)} and values "
            f"{tuple(values.shape)} must bring the same tokens."
        )
    kc, ks = _fallback_append(
        k_codes,
        k_scales,
        keys,
        k_centroids,
        offset,
        key_bits,
        key_rotation_signs,
        key_mean,
        stream,
        op,
    )
    vc, vs = _fallback_append(
        v_codes,
        v_scales,
        values,
        v_centroids,
        offset,
        value_bits,
        value_rotation_signs,
        value_mean,
        stream,
        op,
    )
    return kc, ks, vc, vs


def _has_write_kernel(stream, op: str) -> bool:
    """Whether the in-place token write (WriteTokens) has a kernel on ``stream``."""
    return _has_kernels(stream, op) and _kernel_support(_device(stream, op)).write_tokens


def write_tokens_kv(
    k_buffer: mx.array,
    v_buffer: mx.array,
    keys: mx.array,
    values: mx.array,
    offset: int,
    *,
    after: Sequence[mx.array] = (),
    stream=None,
):
    """Writes ``keys`` / ``values`` ``(B, H, L, D)`` into a layer's dense buffers
    ``(B, H, capacity, D)`` at token ``offset``, in the buffers' memory, as one graph
    node: other arrays that share a buffer see the new tokens, so the caller must own
    them. ``after``: arrays the write must follow (earlier readers of the overwritten
    slots), which become inputs of the node. Where the build has no kernel for it (Metal
    GPU streams, GPU streams of a build without GPU kernels) the tokens go in with slice
    updates, which MLX makes in place when nothing else holds the buffer and as a copy
    otherwise.

    Tokens that share memory with the slots they are written to (a view of one of the
    buffers over those slots) are refused when the result is evaluated (``ValueError``),
    before anything is written: the copy would read tokens it had overwritten. Pass a
    copy of them.

    Returns:
        tuple[array, array]: ``(k_buffer, v_buffer)``.
    """
    if _has_write_kernel(stream, "write_tokens_kv"):
        return tuple(
            _ext.write_tokens_kv(
                k_buffer, v_buffer, keys, values, offset, after=list(after), stream=stream
            )
        )
    n = keys.shape[2]
    with mx.stream(stream) if stream is not None else _nullcontext():
        k_buffer[:, :, offset : offset + n] = keys
        v_buffer[:, :, offset : offset + n] = values
    return k_buffer, v_buffer


def has_ring_append(stream=None) -> bool:
    """Whether :func:`ring_append_kv` is one node on ``stream`` (wherever the ops have
    kernels; without them it is an append and a write)."""
    return _has_kernels(stream, "has_ring_append")


def ring_append_kv(
    k_codes: mx.array,
    k_scales: mx.array,
    v_codes: mx.array,
    v_scales: mx.array,
    k_ring: mx.array,
    v_ring: mx.array,
    keys: mx.array,
    values: mx.array,
    k_centroids: mx.array,
    v_centroids: mx.array,
    offset: int,
    slot: int,
    key_bits: int,
    value_bits: int,
    *,
    key_rotation_signs: Optional[Sequence[float]] = None,
    value_rotation_signs: Optional[Sequence[float]] = None,
    key_mean: Optional[mx.array] = None,
    value_mean: Optional[mx.array] = None,
    after: Sequence[mx.array] = (),
    stream=None,
):
    """A window ring's exchange: the tokens in slots ``[slot, slot + L)`` of the rings
    ``(B, H, slots, D)`` leave for the compressed caches at ``offset``
    (:func:`quantize_append_kv` of those tokens) and ``keys`` / ``values`` ``(B, H, L,
    D)`` take their slots (:func:`write_tokens_kv` with ``after``), as one graph node
    where :func:`has_ring_append` says so: a window preset's decode step then updates
    its window with one node, and the leaving tokens need no arrays of their own. On
    the CPU a leaving token that cannot be quantized (NaN/Inf, a scale beyond float16)
    raises as :func:`quantize_append` does (named ``ring_append_kv``, the message
    giving its ring slot), and then nothing is written: neither compressed cache, nor
    the rings. New tokens that share memory with the slots they take are refused as
    :func:`write_tokens_kv` refuses them.

    Returns:
        tuple: ``(k_codes, k_scales, v_codes, v_scales, k_ring, v_ring)``.
    """
    if _has_kernels(stream, "ring_append_kv"):
        return tuple(
            _ext.ring_append_kv(
                k_codes,
                k_scales,
                v_codes,
                v_scales,
                k_ring,
                v_ring,
                keys,
                values,
                k_centroids,
                v_centroids,
                offset,
                slot,
                key_bits,
                value_bits,
                key_rotation_signs=key_rotation_signs,
                value_rotation_signs=value_rotation_signs,
                key_mean=key_mean,
                value_mean=value_mean,
                after=list(after),
                stream=stream,
            )
        )
    n = keys.shape[2]
    leaving_k, leaving_v = k_ring[:, :, slot : slot + n], v_ring[:, :, slot : slot + n]
    codes = _fallback_append_kv(
        k_codes,
        k_scales,
        v_codes,
        v_scales,
        leaving_k,
        leaving_v,
        k_centroids,
        v_centroids,
        offset,
        key_bits,
        value_bits,
        key_rotation_signs,
        value_rotation_signs,
        key_mean,
        value_mean,
        stream,
        "ring_append_kv",
    )
    rings = write_tokens_kv(
        k_ring, v_ring, keys, values, slot, after=list(after) + list(codes), stream=stream
    )
    return tuple(codes) + tuple(rings)


# Most tail tokens compressed_attention takes (TQ_MAX_TAIL in metal/tq_params.h).
MAX_TAIL_TOKENS = _ext.MAX_TAIL_TOKENS


def compressed_attention(
    q: mx.array,
    k_codes: mx.array,
    k_scales: mx.array,
    v_codes: mx.array,
    v_scales: mx.array,
    k_centroids: mx.array,
    v_centroids: mx.array,
    kv_len: int,
    scale: float,
    key_bits: int,
    value_bits: int,
    causal: bool = True,
    mask: Optional[mx.array] = None,
    *,
    tail_k: Optional[mx.array] = None,
    tail_v: Optional[mx.array] = None,
    rotation_signs: Optional[Sequence[float]] = None,
    rotate_output: bool = True,
    key_mean: Optional[mx.array] = None,
    value_mean: Optional[mx.array] = None,
    out_dtype: Optional[mx.Dtype] = None,
    stream=None,
):
    """Attention of queries ``(B, Hq, L<=8, D)`` over the first ``kv_len`` tokens and,
    when given, the tail: up to 256 uncompressed keys and values ``(B, Hkv, T, D)`` in
    the queries' space, that every query sees, unmasked (a cache's fp16 sinks and
    recent window), all in one softmax.

    The queries are rotated, or, with ``rotation_signs`` (see :func:`quantize_append`),
    in model space: the kernels rotate them, and with ``rotate_output`` (values stored
    rotated) rotate the compressed tokens' part of the output back, so that a decode
    step's attention is this one op. The tail is in the queries' space either way
    (model space with ``rotation_signs``): it needs no transform.

    ``key_mean`` / ``value_mean`` ``(B, Hkv, 1, D)`` (in the queries' space): the
    compressed tokens were appended with those means (:func:`quantize_append`'s
    ``mean``) and the tail was not; the op adds them back.

    ``out_dtype`` (float32 when None; float16 or bfloat16): ``out`` in that dtype, as
    the kernels write it (a decode step's layer output then needs no conversion node).

    A query row that sees no key (all masked) is 0 with an lse of ``-inf``. A NaN score
    (a NaN query, mask value or tail token) is not taken for a hidden key: its row of
    ``out`` and its lse are NaN, as in plain attention (the CPU kernel and the fallback;
    the GPU kernels are not held to it).

    Returns:
        tuple[array, array]: ``out`` ``(B, Hq, L, D)`` (``out_dtype``; rotated space, or
        model space with ``rotation_signs`` and ``rotate_output``) and the float32
        log-sum-exp ``(B, Hq, L)`` of the scaled, masked scores (of the uncentered keys).
    """
    if _has_kernels(stream, "compressed_attention"):
        out, lse = _ext.compressed_attention(
            q,
            k_codes,
            k_scales,
            v_codes,
            v_scales,
            k_centroids,
            v_centroids,
            kv_len,
            scale,
            key_bits,
            value_bits,
            causal,
            mask,
            tail_k=tail_k,
            tail_v=tail_v,
            rotation_signs=rotation_signs,
            rotate_output=rotate_output,
            key_mean=key_mean,
            value_mean=value_mean,
            out_dtype=out_dtype,
            stream=stream,
        )
        return out, lse
    if (key_mean is None) != (value_mean is None):
        raise ValueError(
            "[turboquant_mlx.compressed_attention] key_mean and value_mean must be given together."
        )
    if out_dtype not in (None, mx.float32, mx.float16, mx.bfloat16):
        raise ValueError(
            "[turboquant_mlx.compressed_attention] out_dtype must be float32, float16 or "
            f"bfloat16, got {out_dtype}."
        )
    with mx.stream(stream) if stream is not None else _nullcontext():
        out, lse = fallback.compressed_attention(
            q,
            k_codes,
            k_scales,
            v_codes,
            v_scales,
            k_centroids,
            v_centroids,
            kv_len,
            scale,
            key_bits,
            value_bits,
            causal,
            mask,
            tail_k,
            tail_v,
            rotation_signs,
            rotate_output,
            key_mean,
            value_mean,
        )
        return (out if out_dtype is None else out.astype(out_dtype)), lse


def dequantize(
    codes,
    scales,
    centroids,
    bits: int,
    start: int,
    length: int,
    *,
    dtype=mx.float32,
    before: int = 0,
    after: int = 0,
    prefix=None,
    suffix=None,
    into=None,
    stream=None,
):
    """Rotated-space vectors of tokens ``[start, start+length)`` in ``dtype``.

    Returns ``(B, H, before + length + after, D)``: the decoded tokens at slots
    ``[before, before + length)``; the slots around them are the rows of ``prefix``
    ``(B, H, before, D)`` and ``suffix`` ``(B, H, after, D)`` (in ``dtype``; their token
    counts set ``before`` / ``after``), or zeros. The prefill joins its fp16 tokens to the
    decoded ones this way, in the same pass.

    ``into``: a row-contiguous ``dtype`` array of at least the result's size; the
    kernels write the result into its buffer and return a view of it, so one temporary
    serves call after call. Whatever else shares that buffer sees the write: the caller
    makes the call depend on the last reader of the previous contents. Without kernels
    it is ignored (the result is a new array).
    """
    if _has_kernels(stream, "dequantize"):
        return _ext.dequantize(
            codes,
            scales,
            centroids,
            bits,
            start,
            length,
            dtype=dtype,
            before=before,
            after=after,
            prefix=prefix,
            suffix=suffix,
            into=into,
            stream=stream,
        )
    with mx.stream(stream) if stream is not None else _nullcontext():
        return fallback.dequantize(
            codes, scales, centroids, bits, start, length, dtype, before, after, prefix, suffix
        )


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
