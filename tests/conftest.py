# Copyright © 2026 turboquant_mlx contributors.

"""Makes the in-tree package importable when it is not installed, and picks the
device the suite runs on.

``pytest --device gpu`` runs every test with MLX's default device set to the GPU, so
the ops, the cache and the model integration take the GPU kernels (CUDA or Metal
build); ``--device cpu`` (the default) runs them on the CPU backend. Tests whose
property holds only on the CPU backend by design are marked
``@pytest.mark.cpu_only(reason)`` and skipped with that reason on the GPU.
tests/test_gpu.py compares the two backends whatever ``--device`` says.
"""

import importlib.util
import os
import sys

import pytest

# An installed package (with its compiled extension) takes precedence over the
# sources; only fall back to python/ when nothing is installed.
if importlib.util.find_spec("turboquant_mlx") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "python"))

# MLX may run float32 matmuls in reduced (TF32) precision on CUDA GPUs (environment
# variable MLX_ENABLE_TF32, default on), which is outside the float32 tolerances of the
# references built with MLX ops; the suite checks float32 arithmetic, so it turns that
# off unless the variable is set. Must happen before MLX is first used.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
# On a Metal GPU the suite tests the kernels as they are: a failed first-use self-check
# would otherwise route every GPU test to the plain-MLX fallback (selfcheck.py). The
# self-check's own tests set the variable as each needs it.
os.environ.setdefault("TURBOQUANT_METAL_KERNELS", "on")

import mlx.core as mx  # noqa: E402


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=("cpu", "gpu"),
        default="cpu",
        help="MLX default device for the tests (default: cpu).",
    )


def _device_type(config):
    return mx.gpu if config.getoption("--device") == "gpu" else mx.cpu


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cpu_only(reason): holds only on the CPU backend by design; skipped with --device gpu",
    )
    device = _device_type(config)
    if device == mx.gpu and not mx.is_available(mx.gpu):
        raise pytest.UsageError("--device gpu: this MLX build has no GPU backend.")
    mx.set_default_device(device)


def pytest_report_header(config):
    return f"mlx {mx.__version__}, default device {mx.default_device()} (--device)"


def pytest_collection_modifyitems(config, items):
    if _device_type(config) != mx.gpu:
        return
    for item in items:
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            reason = marker.kwargs.get("reason") or (marker.args[0] if marker.args else "")
            item.add_marker(pytest.mark.skip(reason=f"CPU backend only: {reason}"))


@pytest.fixture
def device(request):
    """The :class:`mlx.core.Device` chosen with ``--device``."""
    return mx.Device(_device_type(request.config))


@pytest.fixture(autouse=True)
def _default_device(request):
    """Every test starts on the ``--device`` device, whatever the previous one left."""
    mx.set_default_device(_device_type(request.config))
    yield
    mx.set_default_device(_device_type(request.config))


@pytest.fixture
def kernel_override():
    """``kernel_override(name, value)`` forces a GPU kernel choice for one test
    (``_ext._set_kernel_override``: "attention", "splits", "ctas", "min_steps"); each
    goes back to what it was when the test ends."""
    from turboquant_mlx import _ext

    saved = {}

    def set_override(name, value):
        saved.setdefault(name, _ext._kernel_overrides()[name])
        _ext._set_kernel_override(name, value)

    yield set_override
    for name, value in saved.items():
        _ext._set_kernel_override(name, value)
