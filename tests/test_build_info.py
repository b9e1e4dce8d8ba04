# Copyright © 2026 turboquant_mlx contributors.

"""The mlx version check at import (python/turboquant_mlx/_mlx_version.py): the build
records the MLX it was compiled against, and another installed mlx is an ImportError
naming both versions, raised before the compiled extension is loaded."""

import importlib.metadata
import os
import subprocess
import sys

import mlx.core as mx
import pytest

import turboquant_mlx
from turboquant_mlx import _build_info, _mlx_version

# The directory the package under test was imported from (site-packages, or python/),
# so that a subprocess imports the same one.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(turboquant_mlx.__file__))


def test_build_records_the_mlx_it_was_compiled_against():
    assert _mlx_version.release(_build_info.mlx_version) == _mlx_version.release(mx.__version__)


@pytest.mark.parametrize(
    "installed, ok",
    [
        ("{built}", True),
        ("{built}.dev20260101+1a2b3c4", True),
        ("{built}+local", True),
        ("0.0.1", False),
        ("{built}.1", False),
        ("99.0.0", False),
    ],
)
def test_check_compares_release_numbers(installed, ok):
    built = _build_info.mlx_version
    installed = installed.format(built=built)
    if ok:
        _mlx_version.check_mlx_version(installed)
    else:
        with pytest.raises(ImportError) as info:
            _mlx_version.check_mlx_version(installed)
        message = str(info.value)
        assert f"compiled against mlx {built}," in message
        assert f"mlx {installed} is installed" in message
        assert f"pip install 'mlx=={built}'" in message
        assert "from source" in message


_FAKE_MLX_VERSION = """
import sys
import mlx.core as mx
mx.__version__ = {version!r}
try:
    import turboquant_mlx
except ImportError as e:
    print("ImportError:", e)
    print("extension loaded:", "turboquant_mlx._ext" in sys.modules)
    sys.exit(3)
print("imported, extension loaded:", "turboquant_mlx._ext" in sys.modules)
"""


def _import_with_mlx_version(version):
    env = dict(os.environ, PYTHONPATH=PACKAGE_PARENT)
    return subprocess.run(
        [sys.executable, "-c", _FAKE_MLX_VERSION.format(version=version)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_import_with_another_mlx_fails_before_the_extension_loads():
    built = _build_info.mlx_version
    run = _import_with_mlx_version("0.31.0")
    assert run.returncode == 3, run.stdout + run.stderr
    assert f"compiled against mlx {built}, but mlx 0.31.0 is installed" in run.stdout
    assert "extension loaded: False" in run.stdout


def test_import_with_the_build_mlx_loads_the_extension():
    run = _import_with_mlx_version(mx.__version__)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "imported, extension loaded: True" in run.stdout


def test_installed_metadata_pins_the_build_mlx():
    try:
        dist = importlib.metadata.distribution(_mlx_version.DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{_mlx_version.DISTRIBUTION} is not installed (the sources are tested)")
    pins = [r.split(";")[0].replace(" ", "") for r in dist.requires or []]
    assert f"mlx=={_build_info.mlx_version}" in pins, dist.requires
