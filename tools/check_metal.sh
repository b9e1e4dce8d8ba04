#!/usr/bin/env bash
# Type-checks every Metal source in metal/ with msl-check (clang++-19 through a Metal
# shim; see ../shared/tools/msl-check/README.md). This proves the kernels parse and
# type-check as Metal Shading Language, not that Apple's compiler accepts them or how
# fast they run. Usage: bash tools/check_metal.sh   (from anywhere in the checkout)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
checker="${MSL_CHECK:-}"
if [ -z "$checker" ]; then
  for c in "$root/shared/tools/msl-check/msl_check.py" "$root/../shared/tools/msl-check/msl_check.py"; do
    if [ -f "$c" ]; then checker="$c"; break; fi
  done
fi
if [ -z "$checker" ]; then
  echo "check_metal: msl_check.py not found (set MSL_CHECK=/path/to/msl_check.py)" >&2
  exit 2
fi
status=0
shopt -s nullglob
files=("$root"/metal/*.metal)
if [ ${#files[@]} -eq 0 ]; then
  echo "check_metal: no .metal files in $root/metal" >&2
  exit 2
fi
for f in "${files[@]}"; do
  echo "-- msl-check ${f#$root/}"
  python3 "$checker" -I "$root/metal" -I "$root/csrc" "$f" || status=1
done
exit $status
