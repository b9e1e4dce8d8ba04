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
# The shim declares simdgroup_matrix::thread_elements() as returning the lane's two
# elements by value; Metal returns a reference to them (MLX's steel kernels assign
# through it, as tq_attention_simd.h does). The check runs on a copy of msl-check whose
# shim says so; every other declaration is the shim's own.
shim_decl='vec<T, 2> thread_elements() const;'
if grep -qF "$shim_decl" "$(dirname "$checker")/msl_shim.h"; then
  patched="$(mktemp -d)"
  trap 'rm -rf "$patched"' EXIT
  cp -r "$(dirname "$checker")/." "$patched/"
  python3 - "$patched/msl_shim.h" "$shim_decl" <<'PY'
import sys
path, old = sys.argv[1], sys.argv[2]
text = open(path).read()
new = "thread vec<T, 2>& thread_elements(); thread const vec<T, 2>& thread_elements() const;"
open(path, "w").write(text.replace(old, new))
PY
  checker="$patched/$(basename "$checker")"
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
