# Copyright © 2026 turboquant_mlx contributors.

"""The Metal kernels' first-use self-check (selfcheck.py), on any machine.

``check_kernels`` runs on the CPU against itself (the case is valid) and against
extension modules that perturb one op on the "device" stream (a second CPU stream here),
which it must name. The process-wide decision runs with the build's backend faked as
Metal (``_ext.kernel_support`` of the GPU, ``ops._support``) and MLX's GPU device type, which a CPU-only MLX can name but not run: it must warn once, route the ops
to the fallback from then on, and obey TURBOQUANT_METAL_KERNELS.
"""

import contextlib
import warnings

import mlx.core as mx
import numpy as np
import pytest

from turboquant_mlx import _ext, fallback, ops, selfcheck
from turboquant_mlx.selfcheck import ENV_VAR, MetalKernelWarning, check_kernels

STREAM_OPS = ("quantize_append_kv", "dequantize", "compressed_attention")


class Wrapped:
    """``_ext`` whose ``ops`` are replaced by ``fn(original, *args, **kwargs)`` where
    the call's stream is not ``mx.cpu`` (the "device" side of the check); records the
    arrays that the device side's calls return."""

    def __init__(self, **ops_):
        self.ops = ops_
        self.device_arrays = []
        self.device_streams = set()

    def __getattr__(self, name):
        original = getattr(_ext, name)
        if name not in STREAM_OPS:
            return original

        def call(*args, stream=None, **kwargs):
            if stream is mx.cpu:
                return original(*args, stream=stream, **kwargs)
            self.device_streams.add(stream)
            fn = self.ops.get(name)
            out = (
                original(*args, stream=stream, **kwargs)
                if fn is None
                else fn(original, *args, stream=stream, **kwargs)
            )
            self.device_arrays += [out] if isinstance(out, mx.array) else list(out)
            return out

        return call


@pytest.fixture
def device_stream():
    return mx.new_stream(mx.cpu)


def test_the_case_agrees_with_itself_on_the_cpu():
    assert check_kernels(_ext, mx.cpu) is None


def test_the_device_side_goes_through_ext_and_evaluate(device_stream):
    # What an emulator's module, stream and evaluator rely on: every array of the
    # device run comes from an ext call on that stream and is handed to evaluate.
    ext = Wrapped()
    evaluated = []

    def evaluate(arrays):
        evaluated.extend(arrays)
        mx.eval(arrays)

    assert check_kernels(ext, device_stream, evaluate=evaluate) is None
    assert ext.device_streams == {device_stream}
    assert len(ext.device_arrays) == 2 * 4 + 4 + 5 * 2  # appends, dequantizes, attentions
    assert sorted(map(id, evaluated)) == sorted(map(id, ext.device_arrays))


def scaled(factor, index=0):
    """An op whose output ``index`` is multiplied by ``factor``."""

    def op(original, *args, **kwargs):
        out = original(*args, **kwargs)
        if isinstance(out, mx.array):
            return out * factor
        out = list(out)
        out[index] = out[index] * factor
        return out

    return op


def scales_off_by(ulps):
    """quantize_append_kv whose value scales are ``ulps`` float16 ulps larger."""

    def op(original, *args, **kwargs):
        out = list(original(*args, **kwargs))
        out[3] = mx.view(mx.view(out[3], mx.uint16) + ulps, mx.float16)
        return out

    return op


def flip_one_code_bit(original, *args, **kwargs):
    out = list(original(*args, **kwargs))
    flip = np.zeros(out[0].shape, np.uint32)
    flip[0, 1, 17, 2] = 1 << 9
    out[0] = mx.bitwise_xor(out[0], mx.array(flip))
    return out


def one_nan(original, *args, **kwargs):
    out, lse = original(*args, **kwargs)
    nan = np.zeros(out.shape, np.float32)
    nan[0, 3, -1, 5] = np.nan
    return [out + mx.array(nan).astype(out.dtype), lse]


def fewer_keys(original, q, kc, ks, vc, vs, kcent, vcent, kv_len, *args, **kwargs):
    return original(q, kc, ks, vc, vs, kcent, vcent, kv_len - 1, *args, **kwargs)


def raises(original, *args, **kwargs):
    raise RuntimeError("no such kernel: tq_attention_simd_float16_d128_k4_v3")


@pytest.mark.parametrize(
    "op,fn,needle",
    (
        ("quantize_append_kv", flip_one_code_bit, "words of key codes differ"),
        ("quantize_append_kv", scales_off_by(2), "value scales differ by up to 2 float16 ulp"),
        ("dequantize", scaled(1.001), "max error"),
        ("compressed_attention", scaled(1.01), "out max error"),
        ("compressed_attention", scaled(1.01, index=1), "lse max error"),
        ("compressed_attention", one_nan, "out max error nan"),
        ("compressed_attention", fewer_keys, "out max error"),
        ("compressed_attention", raises, "raised RuntimeError: no such kernel"),
    ),
    ids=(
        "code-bit",
        "scales-2ulp",
        "dequantize",
        "attention-out",
        "attention-lse",
        "attention-nan",
        "attention-kv_len",
        "attention-raises",
    ),
)
def test_a_wrong_op_is_named(device_stream, op, fn, needle):
    problem = check_kernels(Wrapped(**{op: fn}), device_stream)
    assert problem is not None and needle in problem, problem
    # Every failure listed is of that op.
    others = [o for o in STREAM_OPS if o != op]
    assert problem.startswith(op + " (") and not any(o in problem for o in others), problem


def test_scales_one_ulp_apart_pass(device_stream):
    assert check_kernels(Wrapped(quantize_append_kv=scales_off_by(1)), device_stream) is None


# ---------------------------------------------------------------------------
# The decision


def fake_gpu_support(monkeypatch, self_check):
    """``_ext.kernel_support`` with the GPU's answer faked as a build whose GPU kernels
    run after the self-check (Metal's) or without it (``self_check`` False: CUDA's); the
    CPU's stays the build's."""
    real = _ext.kernel_support

    class Fake:
        kernels = write_tokens = True
        out_in_query_dtype = out_in_any_dtype = False

    Fake.self_check = self_check
    Fake.write_tokens = not self_check

    def kernel_support(device):
        return real(device) if device.type == mx.cpu else Fake()

    monkeypatch.setattr(_ext, "kernel_support", kernel_support)
    monkeypatch.setattr(ops, "_support", {})


@pytest.fixture
def metal(monkeypatch):
    """The build's backend faked as Metal with GPU kernels, nothing decided yet, the
    switch unset; ``metal.checks`` records the (ext, stream) of each check, which
    returns ``metal.result`` (or raises it, an exception)."""
    fake_gpu_support(monkeypatch, self_check=True)
    monkeypatch.setattr(selfcheck, "_usable", None)
    monkeypatch.delenv(ENV_VAR, raising=False)

    class Fake:
        checks = []
        result = None

    def fake_check(ext, stream, evaluate=mx.eval):
        Fake.checks.append((ext, stream))
        if isinstance(Fake.result, Exception):
            raise Fake.result
        return Fake.result

    monkeypatch.setattr(selfcheck, "check_kernels", fake_check)
    return Fake


@contextlib.contextmanager
def no_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not caught, [str(w.message) for w in caught]


PROBLEM = "compressed_attention (float16 queries, head dim 128, q_len 1): out max error 0.5"


def test_a_failed_check_warns_once_and_routes_to_the_fallback(metal, monkeypatch):
    metal.result = PROBLEM
    with pytest.warns(MetalKernelWarning) as caught:
        assert not ops.has_kernels(mx.gpu)
    assert len(caught) == 1
    message = str(caught[0].message)
    for needle in (PROBLEM, "fallback", "tools/mac_check.sh", f"{ENV_VAR}=on", f"{ENV_VAR}=off"):
        assert needle in message, message
    assert len(metal.checks) == 1
    ext, stream = metal.checks[0]
    assert ext is _ext and stream == mx.Device(mx.gpu)

    # Decided: no second check, no second warning, the CPU keeps its kernels, and the
    # hot path reads the cached bool without calling into selfcheck.
    monkeypatch.setattr(selfcheck, "metal_kernels_usable", None)
    with no_warnings():
        for stream in (mx.gpu, mx.Device(mx.gpu)):
            assert not ops._has_kernels(stream, "compressed_attention")
        assert ops.has_kernels(mx.cpu)
    assert len(metal.checks) == 1

    # The ops take the fallback on the GPU: the extension's ops are not called (the
    # fallback runs on the CPU here: MLX's CPU build has no GPU stream to enter).
    def not_called(*args, **kwargs):
        raise AssertionError("the kernel path ran")

    monkeypatch.setattr(_ext, "compressed_attention", not_called)
    monkeypatch.setattr(_ext, "quantize_append_kv", not_called)
    monkeypatch.setattr(mx, "stream", lambda stream: contextlib.nullcontext())
    rng = np.random.default_rng(0)
    D, bits, n = 64, 4, 6
    c = mx.array(np.linspace(-0.3, 0.3, 1 << bits, dtype=np.float32))
    codes = mx.zeros((1, 2, n, D * bits // 32), mx.uint32)
    scales = mx.zeros((1, 2, n), mx.float16)
    x = mx.array(rng.standard_normal((1, 2, n, D)).astype(np.float32))
    kc, ks, vc, vs = ops.quantize_append_kv(
        codes, scales, codes, scales, x, x, c, c, 0, bits, bits, stream=mx.gpu
    )
    want = fallback.quantize_append(codes, scales, x, c, 0, bits)
    np.testing.assert_array_equal(np.array(kc), np.array(want[0]))
    q = mx.array(rng.standard_normal((1, 8, 1, D)).astype(np.float32))
    out, lse = ops.compressed_attention(
        q, kc, ks, vc, vs, c, c, n, 0.125, bits, bits, True, stream=mx.gpu
    )
    ref, ref_lse = fallback.compressed_attention(
        q, kc, ks, vc, vs, c, c, n, 0.125, bits, bits, True
    )
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-6, atol=1e-7)


def test_a_check_that_raises_counts_as_failed(metal):
    metal.result = RuntimeError("Metal library not found")
    with pytest.warns(MetalKernelWarning, match="raised RuntimeError: Metal library not found"):
        assert not selfcheck.metal_kernels_usable(mx.Device(mx.gpu))
    with no_warnings():
        assert not selfcheck.metal_kernels_usable(mx.gpu)
    assert len(metal.checks) == 1


def test_a_passed_check_keeps_the_kernels(metal):
    with no_warnings():
        assert ops.has_kernels(mx.gpu)
        assert ops.has_kernels(mx.gpu)
        assert selfcheck.metal_kernels_usable(mx.gpu)
    assert len(metal.checks) == 1


def test_the_real_check_on_a_device_that_cannot_run(monkeypatch):
    # The real check with this build's extension on MLX's GPU device, which the CPU
    # build cannot run: the device run raises, which is a failure, named by its op.
    fake_gpu_support(monkeypatch, self_check=True)
    monkeypatch.setattr(selfcheck, "_usable", None)
    monkeypatch.delenv(ENV_VAR, raising=False)
    if mx.is_available(mx.gpu):
        pytest.skip("MLX has a GPU here: the device run would not raise")
    with pytest.warns(MetalKernelWarning, match=r"quantize_append_kv \(.*\) raised"):
        assert not selfcheck.metal_kernels_usable(mx.gpu)


def test_only_metal_gpus_are_checked(metal, monkeypatch):
    metal.result = PROBLEM
    with no_warnings():
        assert selfcheck.metal_kernels_usable(mx.cpu)
        assert selfcheck.metal_kernels_usable(mx.Device(mx.cpu))
        fake_gpu_support(monkeypatch, self_check=False)
        assert selfcheck.metal_kernels_usable(mx.gpu)
    assert metal.checks == [] and selfcheck._usable is None


@pytest.mark.parametrize("value,usable", (("on", True), ("off", False), (" OFF ", False)))
def test_the_switch_decides_without_a_check(metal, monkeypatch, value, usable):
    metal.result = PROBLEM
    monkeypatch.setenv(ENV_VAR, value)
    with no_warnings():
        assert ops.has_kernels(mx.gpu) is usable
        assert ops.has_kernels(mx.gpu) is usable
        assert ops.has_kernels(mx.cpu)
    assert metal.checks == []


@pytest.mark.parametrize("value", ("auto", ""))
def test_auto_and_unset_run_the_check(metal, monkeypatch, value):
    monkeypatch.setenv(ENV_VAR, value)
    assert ops.has_kernels(mx.gpu)
    assert len(metal.checks) == 1


def test_a_bad_switch_value_is_refused(metal, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "yes")
    with pytest.raises(ValueError, match=f"{ENV_VAR} must be auto, on or off.*'yes'"):
        ops.has_kernels(mx.gpu)
    assert selfcheck._usable is None and metal.checks == []  # nothing decided
    monkeypatch.setenv(ENV_VAR, "off")
    assert not ops.has_kernels(mx.gpu)
