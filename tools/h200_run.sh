#!/usr/bin/env bash
# Builds the CUDA extension on a lent NVIDIA machine and runs the GPU tests and the
# GPU benchmark there, writing logs to $OUT. Needs MLX's CUDA wheel carried in two
# halves (run `bash ../shared/tools/mlx-cuda-carry.sh` from the repository root first)
# and nanobind 3.1.0 as a wheel in .whl/. Two calls, back to back:
#   1) carry [".carry/mlx-a"]           bash tools/h200_run.sh stage
#   2) carry [".carry/mlx-b", ".whl"]   bash tools/h200_run.sh all   (or: build, test, bench)
# Steps after `stage` can be combined: `bash tools/h200_run.sh build test bench`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/tq_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

step_stage() {
  mkdir -p /opt/mlx-carry && cp .carry/mlx-a/part-00 /opt/mlx-carry/
  {
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
    python3 --version
    python3 -c 'import sysconfig, os; p = sysconfig.get_paths()["include"]; print(p, os.path.exists(os.path.join(p, "Python.h")))'
    python3 -c 'import nanobind; print("nanobind", nanobind.__version__)' 2>&1
    nvcc --version | tail -1
    cmake --version | head -1
  } 2>&1 | tee "$OUT/env.log"
}

setup_env() {
  # shellcheck disable=SC1091
  source .carry/mlx-b/setup.sh || return 1
  set +e # setup.sh turns on errexit; a failing test must not stop the benchmark
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site
  python3 -c 'import nanobind; print("nanobind", nanobind.__version__)'
}

step_build() {
  local t0=$SECONDS
  cmake -S . -B /tmp/tq_build -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DTURBOQUANT_BUILD_CUDA=ON -DMLX_DIR=/tmp/site/mlx/share/cmake/MLX \
    -DPython_EXECUTABLE="$(command -v python3)" \
    -DTURBOQUANT_CUDA_ARCHITECTURES="${TQ_CUDA_ARCHS:-90-real}" >"$OUT/build.log" 2>&1 &&
    cmake --build /tmp/tq_build -j "$(nproc)" >>"$OUT/build.log" 2>&1
  local rc=$?
  echo "build rc=$rc in $((SECONDS - t0)) s"
  if [ $rc -ne 0 ]; then
    grep -E "error|Error" "$OUT/build.log" | head -40
    return $rc
  fi
  # Install next to mlx so that the module's rpath ($ORIGIN/../mlx/lib) finds libmlx.so.
  rm -rf /tmp/site/turboquant_mlx && mkdir -p /tmp/site/turboquant_mlx
  cp -r python/turboquant_mlx/. /tmp/site/turboquant_mlx/
  cp /tmp/tq_build/_ext*.so /tmp/site/turboquant_mlx/
  python3 -c 'import mlx.core as mx, turboquant_mlx._ext as e; print("gpu kernels:", e.gpu_backend(), e.gpu_available(), mx.default_device())'
}

step_test() {
  local t0=$SECONDS
  (cd tests && timeout "${TQ_TEST_TIMEOUT:-300}" python3 -m pytest -q -ra -p no:cacheprovider \
    test_gpu.py ${TQ_TEST_ARGS:-}) 2>&1 | tee "$OUT/test.log" | tail -40
  echo "tests done in $((SECONDS - t0)) s"
}

step_bench() {
  local t0=$SECONDS
  timeout "${TQ_BENCH_TIMEOUT:-300}" python3 bench/bench_gpu.py ${TQ_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  echo "bench done in $((SECONDS - t0)) s"
}

if [ $# -eq 0 ]; then
  set -- all
fi
for step in "$@"; do
  case "$step" in
    stage) step_stage ;;
    all) setup_env && step_build && { step_test; step_bench; } ;;
    build) setup_env && step_build ;;
    test) export PYTHONPATH=/tmp/site; step_test ;;
    bench) export PYTHONPATH=/tmp/site; step_bench ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
