#!/usr/bin/env bash
# Tuning run on the lent NVIDIA machine, after `bash tools/h200_run.sh build`: rebuilds
# the extension for each tensor-core kernel shape given (CMake TURBOQUANT_MMA_TUNE
# values, see csrc/cuda/attention_mma.cuh), checks it against the references
# (tests/test_gpu.py, half-precision query tests) and times it with bench/kernel_time.py.
#   bash tools/mma_variants.sh "TQ_MMA_TILES=1;TQ_MMA_WARPS_4BIT=12" "TQ_MMA_TILES=2;TQ_MMA_WARPS_4BIT=8"
# TQ_VARIANT_ARGS: kernel_time.py arguments (default: K4V4 at 4k, 128k, 256k).
# TQ_VARIANT_TESTS=0: no tests.
# Knobs: TQ_MMA_TILES, TQ_MMA_WARPS_4BIT, TQ_MMA_CHAINS_4BIT, TQ_MMA_STAGES,
# TQ_MMA_PIPELINE (attention_mma.cuh).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/tq_out}"
export PYTHONPATH=/tmp/site
first=1
for v in "$@"; do
  tag=$(echo "$v" | tr -c 'A-Za-z0-9\n' '_') # letters, digits and _ only
  t0=$SECONDS
  cmake -S . -B /tmp/tq_build -DTURBOQUANT_MMA_TUNE="$v" >"$OUT/variant_$tag.log" 2>&1 &&
    cmake --build /tmp/tq_build -j "$(nproc)" >>"$OUT/variant_$tag.log" 2>&1 ||
    { echo "== $v: build failed"; tail -20 "$OUT/variant_$tag.log"; continue; }
  grep -i "spill" "$OUT/variant_$tag.log" | grep -v " 0 bytes spill" | head -3
  cp /tmp/tq_build/_ext*.so /tmp/site/turboquant_mlx/
  echo "== $v (built in $((SECONDS - t0)) s)"
  if [ "${TQ_VARIANT_TESTS:-1}" = 1 ]; then
    (cd tests && timeout 150 python3 -m pytest -q -p no:cacheprovider test_gpu.py \
      -k "half_queries or with_tail" 2>&1 | tail -2)
  fi
  sdpa=--no-sdpa
  [ $first = 1 ] && sdpa=
  first=0
  timeout 200 python3 bench/kernel_time.py ${TQ_VARIANT_ARGS:---lengths 4096,131072,262144 --bits 4v4} \
    $sdpa 2>>"$OUT/variant_$tag.log" | grep "^|"
  grep "k K4V4" "$OUT/variant_$tag.log" | tail -3
done
