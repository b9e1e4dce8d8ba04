#!/usr/bin/env bash
# Compiles every CUDA source in csrc/cuda/ with nvcc for sm_90 and sm_80 against the
# installed mlx wheel's headers (C++20), without linking: a syntax and code-generation
# check (ptxas runs, so register spills are reported) for machines with nvcc but no GPU.
# Usage: bash tools/check_cuda_compile.sh [-j N]   (python3 must import mlx)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
jobs="$(nproc 2>/dev/null || echo 2)"
if [ "${1:-}" = "-j" ]; then jobs="$2"; fi
nvcc="${NVCC:-nvcc}"
command -v "$nvcc" >/dev/null || { echo "check_cuda_compile: nvcc not found" >&2; exit 2; }
mlx_inc="$(python3 -c 'import mlx.core, os; print(os.path.join(os.path.dirname(mlx.core.__file__), "include"))')"
[ -f "$mlx_inc/mlx/backend/cuda/device.h" ] || {
  echo "check_cuda_compile: MLX CUDA headers not found under $mlx_inc (install mlx[cpu])" >&2
  exit 2
}
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
export nvcc root mlx_inc out
compile() {
  f="$1"
  name="$(basename "$f" .cu)"
  log="$out/$name.log"
  if "$nvcc" -std=c++20 -O3 --expt-relaxed-constexpr -diag-suppress=997,20012 \
      -gencode arch=compute_90,code=sm_90 -gencode arch=compute_80,code=sm_80 \
      -Xptxas -warn-spills -I"$root" -I"$root/csrc" -I"$root/csrc/cuda" -I"$root/csrc/cuda/compat" \
      -I"$root/metal" -I"$mlx_inc" -c "$f" -o "$out/$name.o" >"$log" 2>&1; then
    if grep -q "spill" "$log"; then
      echo "FAIL (spills) csrc/cuda/$name.cu"; cat "$log"; return 1
    fi
    echo "ok   csrc/cuda/$name.cu"
  else
    echo "FAIL csrc/cuda/$name.cu"; cat "$log"; return 1
  fi
}
export -f compile
ls "$root"/csrc/cuda/*.cu | xargs -P "$jobs" -I{} bash -c 'compile "$@"' _ {}
