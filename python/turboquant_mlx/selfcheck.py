# Copyright © 2026 turboquant_mlx contributors.

"""First-use self-check of the Metal kernels.

No Apple GPU was available to the project (README, "Backends"), so the Metal kernels
may be wrong on a user's machine without anyone having seen it. The first time the ops
would run hand-written kernels on a Metal GPU, a tiny known case runs through the
extension on that GPU and on the CPU, and the results are compared
(:func:`check_kernels`). On a mismatch, or an exception from the GPU run, a
:class:`MetalKernelWarning` is issued once and the ops take the plain-MLX fallback on
the GPU for the rest of the process (:func:`metal_kernels_usable`, which
``ops._has_kernels`` consults). ``TURBOQUANT_METAL_KERNELS`` forces either way:
``auto`` (default: the self-check), ``on`` (the kernels, no check), ``off`` (the
fallback on Metal GPUs, no check).

:func:`check_kernels` calls only the raw extension module it is given, so it runs on
any device: the tests run it on the CPU against itself and against wrapped modules
that perturb one op, and an emulator of the Metal kernels can pass its own module,
stream and evaluator. Nothing here imports :mod:`turboquant_mlx.ops` (which imports
this module).
"""

import os
import threading
import warnings
from typing import Callable, List, Optional

import mlx.core as mx
import numpy as np

from . import _ext

__all__ = ["MetalKernelWarning", "ENV_VAR", "kernel_mode", "check_kernels", "metal_kernels_usable"]

ENV_VAR = "TURBOQUANT_METAL_KERNELS"
_MODES = ("auto", "on", "off")


class MetalKernelWarning(RuntimeWarning):
    """The Metal kernels failed their first-use self-check; the ops use the plain-MLX
    fallback on the GPU for the rest of the process."""


# --------------------------------------------------------------------------------------
# The case

# Lloyd-Max centroids of a standard normal (3 and 4 bits), scaled by 1/sqrt(D) below:
# close to the codebooks of codebook.py (the marginal of a rotated unit vector), and
# free to compute. Any ascending set serves the comparison.
_GAUSS_CENTROIDS = {
    3: (0.2451, 0.7560, 1.3439, 2.1520),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0691, 2.7326),
}
_KEY_BITS, _VALUE_BITS = 4, 3
_HEAD_DIMS = (64, 128)
_KV_HEADS, _GROUP = 2, 4  # GQA 4: 8 query heads
_TOKENS = 192  # compressed tokens of each cache
_SPARE = 8  # slots past the tokens, their scales NaN: a read beyond kv_len shows
_TAIL = 8  # uncompressed tail tokens
_POISON_WORD = 0xA5A5A5A5
_POISON_SCALE = np.uint16(0x7E5A)  # a float16 NaN with a payload

# Tolerances, relative to the largest |value| of the CPU's result.
_DEQUANT_RTOL = {mx.float32: 1e-5, mx.float16: 2e-3}  # per token row
# Attention, (rtol of max |ref| for out and of max(1, |lse|) for lse, atol of out): the
# portable kernel computes in float32, the simdgroup-matrix kernel (float16 / bfloat16
# queries) takes half-precision centroids and probabilities. On an H100 (the CUDA build:
# the portable kernel, and the simdgroup-matrix kernel's body on its emulation of
# simdgroup matrices) this case's errors were at most 3e-7 (float32) and 5e-4 (half) of
# max |ref|, and 2e-4 of max(1, |lse|): the bounds leave a margin of 20x and more.
_ATTN_TOL = {mx.float32: (1e-4, 1e-5), mx.float16: (1e-2, 1e-3), mx.bfloat16: (1e-2, 1e-3)}


def _centroids(head_dim: int, bits: int) -> np.ndarray:
    half = np.asarray(_GAUSS_CENTROIDS[bits], np.float64) / np.sqrt(head_dim)
    return np.concatenate([-half[::-1], half]).astype(np.float32)


def _signs(rng, head_dim: int):
    # A plain sequence (every ext converts it): the case must not depend on this
    # package's own _ext beside the one under test.
    return [float(s) for s in rng.choice((-1.0, 1.0), head_dim)]


def _tokens(rng, n: int, head_dim: int) -> np.ndarray:
    """(1, H_kv, n, D) float32 tokens with norms spread over e^[-1, 1] and a zero vector
    (token 0: scale 0)."""
    x = rng.standard_normal((1, _KV_HEADS, n, head_dim)).astype(np.float32)
    x *= np.exp(rng.uniform(-1.0, 1.0, x.shape[:-1] + (1,))).astype(np.float32)
    x[:, :, 0] = 0.0
    return x


def _empty_cache(head_dim: int, bits: int, capacity: int):
    """NumPy (words, scales) of a cache full of poison."""
    words = np.full((1, _KV_HEADS, capacity, head_dim * bits // 32), _POISON_WORD, dtype=np.uint32)
    scales = np.full((1, _KV_HEADS, capacity), _POISON_SCALE, np.uint16).view(np.float16)
    return words, scales


def _as(a: np.ndarray, dtype) -> mx.array:
    """A CPU-evaluated MLX array of ``a`` in ``dtype``."""
    x = mx.array(a)
    if x.dtype != dtype:
        x = x.astype(dtype, stream=mx.cpu)
    mx.eval(x)
    return x


class _Layer:
    """One head dim's inputs: tokens to quantize, and a cache quantized on the CPU."""

    def __init__(self, rng, head_dim: int):
        D = head_dim
        self.D = D
        self.kc = _as(_centroids(D, _KEY_BITS), mx.float32)
        self.vc = _as(_centroids(D, _VALUE_BITS), mx.float32)
        self.signs = _signs(rng, D)
        # D = 128: float16 keys, bfloat16 values, both rotated by the kernel (a
        # model-space append); D = 64: float32 tokens, centered.
        rotate = D == 128
        self.k_dtype, self.v_dtype = (
            (mx.float16, mx.bfloat16) if rotate else (mx.float32, mx.float32)
        )
        self.append_kwargs = {}
        if rotate:
            self.append_kwargs.update(
                key_rotation_signs=self.signs, value_rotation_signs=self.signs
            )
        else:
            mu = 0.3 * rng.standard_normal((2, 1, _KV_HEADS, 1, D)).astype(np.float32)
            self.append_kwargs.update(
                key_mean=_as(mu[0], mx.float32), value_mean=_as(mu[1], mx.float32)
            )
        self.keys = _as(_tokens(rng, _TOKENS, D), self.k_dtype)
        self.values = _as(_tokens(rng, _TOKENS, D), self.v_dtype)
        self.capacity = _TOKENS + _SPARE
        self.k_empty = _empty_cache(D, _KEY_BITS, self.capacity)
        self.v_empty = _empty_cache(D, _VALUE_BITS, self.capacity)
        # The cache the attention and dequantize cases read: this append on the CPU.
        self.cache = self.append(_ext, mx.cpu)
        mx.eval(self.cache)
        self.tail_k = _tokens(rng, _TAIL, D)
        self.tail_v = _tokens(rng, _TAIL, D)
        mu = 0.3 * rng.standard_normal((2, 1, _KV_HEADS, 1, D)).astype(np.float32)
        self.key_mean, self.value_mean = _as(mu[0], mx.float32), _as(mu[1], mx.float32)

    def append(self, ext, stream) -> List[mx.array]:
        """quantize_append_kv of the tokens into fresh poisoned buffers (in place)."""
        k_words, k_scales = (mx.array(a) for a in self.k_empty)
        v_words, v_scales = (mx.array(a) for a in self.v_empty)
        mx.eval(k_words, k_scales, v_words, v_scales)
        return list(
            ext.quantize_append_kv(
                k_words,
                k_scales,
                v_words,
                v_scales,
                self.keys,
                self.values,
                self.kc,
                self.vc,
                0,
                _KEY_BITS,
                _VALUE_BITS,
                **self.append_kwargs,
                stream=stream,
            )
        )


def _check_append(layer: _Layer, ext, stream, evaluate) -> Optional[str]:
    what = (
        f"quantize_append_kv (head dim {layer.D}, {_name(layer.k_dtype)} keys, "
        f"{_name(layer.v_dtype)} values, {_KEY_BITS}/{_VALUE_BITS} bits"
        f"{', rotated' if layer.D == 128 else ', centered'})"
    )
    got = _run_on(what, lambda: layer.append(ext, stream), evaluate)
    if isinstance(got, str):
        return got
    names = ("key codes", "key scales", "value codes", "value scales")
    for name, g, r in zip(names, got, layer.cache):
        g, r = np.array(g), np.array(r)
        if g.shape != r.shape or g.dtype != r.dtype:
            return f"{what}: {name} of shape {g.shape} {g.dtype}, want {r.shape} {r.dtype}"
        if g.dtype == np.uint32:
            differ = int(np.count_nonzero(g != r))
            if differ:
                return f"{what}: {differ} of {g.size} words of {name} differ (must be equal)"
        else:
            gb = g.view(np.uint16).astype(np.int32)
            rb = r.view(np.uint16).astype(np.int32)
            ulps = np.abs(gb - rb)  # positive scales and equal poison: ulps apart
            if ulps.max() > 1:
                return (
                    f"{what}: {name} differ by up to {int(ulps.max())} float16 ulp "
                    f"({int(np.count_nonzero(ulps > 1))} of {g.size}; 1 allowed)"
                )
    return None


def _check_dequantize(layer: _Layer, ext, stream, evaluate, keys: bool) -> List[str]:
    """Keys: tokens [5, 5 + 150) in float16 between a prefix of 2 rows and a suffix of
    3 (the prefill's form); values: tokens [0, 192) in float32."""
    k_words, k_scales, v_words, v_scales = layer.cache
    if keys:
        dtype, start, length = mx.float16, 5, 150
        rows = np.random.default_rng(layer.D).standard_normal((2, 1, _KV_HEADS, 3, layer.D))
        rows = rows.astype(np.float32)
        extra = dict(
            before=2,
            after=3,
            prefix=_as(rows[0][:, :, :2], dtype),
            suffix=_as(rows[1], dtype),
        )
        args = (k_words, k_scales, layer.kc, _KEY_BITS, start, length)
    else:
        dtype, start, length, extra = mx.float32, 0, _TOKENS, {}
        args = (v_words, v_scales, layer.vc, _VALUE_BITS, start, length)
    what = (
        f"dequantize (head dim {layer.D}, {args[3]}-bit {'keys' if keys else 'values'}, "
        f"{_name(dtype)}{', prefix and suffix' if extra else ''})"
    )

    def run(s):
        return [ext.dequantize(*args, dtype=dtype, **extra, stream=s)]

    want = run(mx.cpu)
    mx.eval(want)
    got = _run_on(what, lambda: run(stream), evaluate)
    if isinstance(got, str):
        return [got]
    g, r = _np(got[0]), _np(want[0])
    if g.shape != r.shape:
        return [f"{what}: shape {g.shape}, want {r.shape}"]
    err = _error(g, r)
    bound = _DEQUANT_RTOL[dtype] * np.max(np.abs(r), axis=-1, keepdims=True)
    bad = ~(err <= bound)  # (NaN fails)
    if bad.any():
        return [f"{what}: max error {_max(err):.3g} ({int(bad.sum())} of {g.size} values off)"]
    return []


def _check_attention(layer: _Layer, ext, stream, evaluate, q_dtype, q_len, kv_len, extras):
    """compressed_attention of 8 query heads (GQA 4) over the CPU's cache; ``extras``:
    a tail, model-space queries (the kernel's rotation), means and, for float16
    queries, float16 output: the cache's decode step."""
    D = layer.D
    rng = np.random.default_rng(1000 * D + 10 * q_len + kv_len)
    q = _as(rng.standard_normal((1, _KV_HEADS * _GROUP, q_len, D)).astype(np.float32), q_dtype)
    kwargs = {}
    if extras:
        kwargs = dict(
            tail_k=_as(layer.tail_k, q_dtype),
            tail_v=_as(layer.tail_v, q_dtype),
            rotation_signs=layer.signs,
            key_mean=layer.key_mean,
            value_mean=layer.value_mean,
        )
        if q_dtype == mx.float16:
            kwargs["out_dtype"] = mx.float16
    what = (
        f"compressed_attention ({_name(q_dtype)} queries, head dim {D}, q_len {q_len} "
        f"causal, kv_len {kv_len}, GQA {_GROUP}, {_KEY_BITS}/{_VALUE_BITS} bits"
        f"{f', tail {_TAIL}, rotation, means' if extras else ''})"
    )

    def run(s):
        return list(
            ext.compressed_attention(
                q,
                *layer.cache,
                layer.kc,
                layer.vc,
                kv_len,
                D**-0.5,
                _KEY_BITS,
                _VALUE_BITS,
                True,
                None,
                **kwargs,
                stream=s,
            )
        )

    want = run(mx.cpu)
    mx.eval(want)
    got = _run_on(what, lambda: run(stream), evaluate)
    if isinstance(got, str):
        return [got]
    rtol, atol = _ATTN_TOL[q_dtype]
    problems = []
    for name, g, r in zip(("out", "lse"), got, want):
        g, r = _np(g), _np(r)
        if g.shape != r.shape:
            problems.append(f"{what}: {name} of shape {g.shape}, want {r.shape}")
            continue
        err = _error(g, r)
        if name == "out":
            size = _max(np.abs(r))
            bound = rtol * size + atol
            ok = np.all(err <= bound)  # (NaN fails)
            text = (
                f"out max error {_max(err):.3g} (tolerance {bound:.3g} = {rtol:g} x max |ref| "
                f"{size:.3g} + {atol:g})"
            )
        else:  # a log: its error relative to max(1, |lse|)
            rel = err / np.maximum(1.0, np.abs(r))
            ok = np.all(rel <= rtol)
            text = f"lse max error {_max(rel):.3g} of max(1, |lse|) (tolerance {rtol:g})"
        if not ok:
            problems.append(f"{what}: {text}")
    return problems


# The attention cases: (head dim, query dtype, q_len, kv_len, extras). Half queries at
# head dims 64 / 128 take the simdgroup-matrix kernel, float32 ones the portable kernel;
# kv_len 40 is a single split written by the attention kernel itself, 192 several
# splits and the merge kernel (also whenever there is a tail, rotation or mean).
_ATTENTION_CASES = (
    (128, mx.float16, 1, _TOKENS, True),
    (64, mx.float16, 3, _TOKENS, False),
    (64, mx.bfloat16, 1, 40, False),
    (128, mx.float32, 3, _TOKENS, True),
    (64, mx.float32, 1, 40, False),
)


def _name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _np(a: mx.array) -> np.ndarray:
    """float64 NumPy copy of an evaluated result (float32 / float16 on the stream
    side: no op runs on those arrays)."""
    if a.dtype == mx.bfloat16:
        a = a.astype(mx.float32, stream=mx.cpu)
    return np.array(a).astype(np.float64)


def _error(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want|, 0 where they are equal (infinities too), NaN where got is NaN."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(got == want, 0.0, np.abs(got - want))


def _max(a: np.ndarray) -> float:
    """The largest element, NaN where one is NaN."""
    return float(np.max(a)) if a.size else 0.0


def _run_on(what: str, build: Callable[[], List[mx.array]], evaluate):
    """The stream side of a case: the graph built and evaluated (``evaluate``), or the
    message of the exception that either raised."""
    try:
        arrays = build()
        evaluate(arrays)
        return arrays
    except Exception as e:  # noqa: BLE001 (any failure of the kernels counts)
        return f"{what} raised {type(e).__name__}: {e}"


def check_kernels(ext, stream, evaluate: Callable = mx.eval) -> Optional[str]:
    """Runs the self-check's case through the extension module ``ext`` on ``stream``
    and on the CPU and compares the results.

    Every array of the ``stream`` run comes from an ``ext`` function called with
    ``stream=stream`` on CPU-evaluated inputs and is evaluated only by
    ``evaluate(list_of_arrays)`` (one call per op) before it is read. The cases:
    ``quantize_append_kv`` (codes equal bit for bit, scales within 1 float16 ulp),
    ``dequantize`` and ``compressed_attention`` (decode and 3 causal queries, GQA 4,
    head dims 64 and 128, float16 / bfloat16 / float32 queries, a tail, rotation and
    means), 4-bit keys and 3-bit values, 192 tokens per cache.

    Returns:
        None when every result agrees within its tolerance, else a message naming each
        op that failed (up to three) and its error.
    """
    rng = np.random.default_rng(20261212)
    layers = {D: _Layer(rng, D) for D in _HEAD_DIMS}
    problems: List[str] = []
    for layer in layers.values():
        p = _check_append(layer, ext, stream, evaluate)
        if p:
            problems.append(p)
    for layer in layers.values():
        for keys in (True, False):
            problems += _check_dequantize(layer, ext, stream, evaluate, keys)
    for D, q_dtype, q_len, kv_len, extras in _ATTENTION_CASES:
        problems += _check_attention(
            layers[D], ext, stream, evaluate, q_dtype, q_len, kv_len, extras
        )
    if not problems:
        return None
    more = len(problems) - 3
    return "; ".join(problems[:3]) + (f"; and {more} more" if more > 0 else "")


# --------------------------------------------------------------------------------------
# The process-wide decision

_usable: Optional[bool] = None  # the decision for Metal GPUs, once made (ops reads it)
_lock = threading.Lock()


def kernel_mode() -> str:
    """``TURBOQUANT_METAL_KERNELS``: ``auto`` (unset or empty too), ``on`` or ``off``
    (any case); another value raises ValueError."""
    raw = os.environ.get(ENV_VAR, "")
    mode = raw.strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(
            f"[turboquant_mlx] {ENV_VAR} must be auto, on or off (unset: auto), got {raw!r}."
        )
    return mode


def _warning_text(problem: str) -> str:
    return (
        "[turboquant_mlx] The Metal kernels failed their first-use self-check on this GPU: "
        f"{problem}. For the rest of this process the ops run the plain-MLX fallback on the "
        "GPU instead (correct, slower). Please report it: run `bash tools/mac_check.sh` in a "
        "clone of turboquant_mlx and attach its report (.mac-check/report-<date>.md) and this "
        f"message to an issue on the project's tracker. {ENV_VAR}=on uses the kernels anyway "
        f"(no check); {ENV_VAR}=off always uses the fallback on Metal GPUs (no check, no "
        "warning)."
    )


def _decide(device: mx.Device) -> bool:
    mode = kernel_mode()
    if mode != "auto":
        return mode == "on"
    try:
        problem = check_kernels(_ext, device)
    except Exception as e:  # noqa: BLE001 (a case that cannot run is a failure too)
        problem = f"the check itself raised {type(e).__name__}: {e}"
    if problem is None:
        return True
    warnings.warn(MetalKernelWarning(_warning_text(problem)), stacklevel=5)
    return False


def metal_kernels_usable(device=None) -> bool:
    """Whether the ops may run this build's kernels on ``device`` (an ``mx.Device`` or
    ``mx.cpu`` / ``mx.gpu``; None: the default device).

    True for the CPU and for builds whose GPU backend is not Metal. On a Metal GPU the
    answer is decided once per process, at the first call: by ``TURBOQUANT_METAL_KERNELS``
    (``on`` / ``off``), or with ``auto`` (the default) by :func:`check_kernels` on that
    GPU, which on failure warns (:class:`MetalKernelWarning`) and makes it False. A bad
    value of the variable raises ValueError (and nothing is decided).
    """
    if device is None:
        device = mx.default_device()
    elif isinstance(device, mx.DeviceType):
        device = mx.Device(device)
    if device.type != mx.gpu:
        return True
    global _usable
    usable = _usable
    if usable is not None:
        return usable
    if not _ext.kernel_support(device).self_check:  # (CUDA, builds without GPU kernels)
        return True
    with _lock:
        if _usable is None:
            _usable = _decide(device)
        return _usable
