#!/usr/bin/env bash
# Same-session A/B of two versions of the tensor-core kernel header on the lent NVIDIA
# machine, after `bash tools/h200_run.sh build`: device time per call
# (bench/kernel_time.py) of B, then A, then B again (so that drift between calls shows),
# each after an incremental rebuild with that header in place. The header of the
# working tree is restored at the end. A and B are files in the working tree, e.g.
#   git show main:csrc/cuda/attention_mma.cuh > ab/main.cuh     (here, before the call)
#   bash tools/mma_ab.sh ab/main.cuh csrc/cuda/attention_mma.cuh  (on the machine)
# TQ_AB_TESTS=1: run the half-precision query tests of tests/test_gpu.py on B first.
# TQ_AB_ARGS: kernel_time.py arguments (default: K4V4 at 4k, 128k, 256k).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/tq_out}"
export PYTHONPATH=/tmp/site
A=$1
B=$2
HDR=csrc/cuda/attention_mma.cuh
saved=$(mktemp)
cp "$HDR" "$saved"
cp "$A" "$OUT/ab_A.cuh"
cp "$B" "$OUT/ab_B.cuh"

build_with() { # HEADER TAG
  cp "$1" "$HDR"
  local t0=$SECONDS
  cmake --build /tmp/tq_build -j "$(nproc)" >"$OUT/ab_build_$2.log" 2>&1 ||
    { echo "== $2: build failed"; tail -20 "$OUT/ab_build_$2.log"; return 1; }
  grep -i "spill" "$OUT/ab_build_$2.log" | grep -v " 0 bytes spill" | head -3
  cp /tmp/tq_build/_ext*.so /tmp/site/turboquant_mlx/
  echo "== $2 built in $((SECONDS - t0)) s"
}

time_it() { # TAG [extra kernel_time args]
  local tag=$1
  shift
  timeout 200 python3 bench/kernel_time.py ${TQ_AB_ARGS:---lengths 4096,131072,262144 --bits 4v4} \
    "$@" 2>"$OUT/ab_time_$tag.err" | grep "^|" | tee "$OUT/ab_time_$tag.md"
  grep -E "K4V4|K3V3" "$OUT/ab_time_$tag.err" | tail -6
}

if build_with "$OUT/ab_B.cuh" B1; then
  if [ "${TQ_AB_TESTS:-0}" = 1 ]; then
    (cd tests && timeout 200 python3 -m pytest -q -p no:cacheprovider test_gpu.py \
      -k "half_queries or with_tail" 2>&1 | tail -2)
  fi
  time_it B1
fi
build_with "$OUT/ab_A.cuh" A && time_it A --no-sdpa
build_with "$OUT/ab_B.cuh" B2 && time_it B2
cp "$saved" "$HDR"
rm -f "$saved"
