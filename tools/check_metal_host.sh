#!/usr/bin/env bash
# Compiles the Metal backend's host code (csrc/metal/eval_metal.cpp, the only source
# metal.cmake adds) for arm64 macOS on Linux, against the headers of MLX's macOS wheel,
# and checks its symbols against that wheel's libmlx.dylib.
#
# Checked:
#  - the file compiles as C++20 with clang++-19 -target arm64-apple-macos14 against
#    MLX's headers with the Metal build's include dirs and defines (MLXConfig.cmake:
#    -D_METAL_ -DACCELERATE_NEW_LAPACK, include/metal_cpp, include,
#    kernels/metal_3_1), -Wall -Wextra -Werror: every call into MLX's Metal backend and
#    metal-cpp (types, overloads, templates) is type-checked;
#  - every mlx::core / MTL / NS symbol the object file needs is exported by the
#    wheel's libmlx.dylib (a header declaration without MLX_API fails here, as it
#    would when linking on macOS);
#  - it defines every turboquant_mlx::gpu entry point that csrc/gpu_none.cpp defines,
#    with the same signature.
# Not checked:
#  - anything at run time (no Metal device here), nor the kernels (tools/check_metal.sh
#    type-checks metal/*.metal);
#  - the C and C++ libraries: the macOS SDK and libc++ are not available on Linux, so
#    the file is compiled against the host's libstdc++ and glibc headers, plus minimal
#    stubs for the Apple headers metal-cpp includes (tools/metal_host_stubs/apple/:
#    only the names metal-cpp uses), two glibc shims for the arm64 Darwin target
#    (tools/metal_host_stubs/glibc/) and a copy of glibc's bits/types.h that makes
#    int64_t long long as on macOS. A standard #include that only libc++ would miss,
#    or a libc++-only difference in the standard library, is not caught.
#
# Usage: bash tools/check_metal_host.sh [--self-test]
#   --self-test: also checks that copies of eval_metal.cpp with deliberate mistakes
#   (a wrong argument type, a misspelled encoder method, int64_t mixed with long, a
#   call to a function libmlx does not export, a changed entry-point signature) fail.
# Needs clang++-19, llvm-nm-19 and llvm-cxxfilt-19 (Debian: clang-19, llvm-19), and
# pip with access to PyPI the first time: the mlx-metal wheel (MLX's headers and
# libmlx.dylib for macOS, version from pyproject.toml, or $MLX_VERSION) is unpacked
# into build/metal-sdk/ and reused from there.
set -euo pipefail
export LC_ALL=C
root="$(cd "$(dirname "$0")/.." && pwd)"
cxx="${CLANGXX:-clang++-19}"
nm="${LLVM_NM:-llvm-nm-19}"
cxxfilt="${LLVM_CXXFILT:-llvm-cxxfilt-19}"
python="${PYTHON:-python3}"
self_test=0
case "${1:-}" in
  --self-test) self_test=1 ;;
  "") ;;
  *) echo "usage: $0 [--self-test]" >&2; exit 2 ;;
esac
for tool in "$cxx" "$nm" "$cxxfilt"; do
  command -v "$tool" >/dev/null || { echo "check_metal_host: $tool not found" >&2; exit 2; }
done

# ---- MLX's macOS headers and library (the mlx wheel itself carries neither) ----
version="${MLX_VERSION:-$(grep -o 'mlx==[0-9][0-9.]*' "$root/pyproject.toml" | head -1 | cut -d= -f3)}"
sdk="$root/build/metal-sdk/mlx-metal-$version"
if [ ! -f "$sdk/.complete" ]; then
  echo "-- fetching mlx-metal==$version (macOS arm64 wheel) into ${sdk#$root/}"
  rm -rf "$sdk"
  mkdir -p "$sdk"
  "$python" -m pip download -q --no-deps --only-binary=:all: --platform macosx_14_0_arm64 \
    --python-version 3.12 -d "$sdk/wheel" "mlx-metal==$version"
  "$python" - "$sdk" <<'EOF'
import glob, sys, zipfile
sdk = sys.argv[1]
(wheel,) = glob.glob(f"{sdk}/wheel/mlx_metal-*.whl")
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith(("mlx/include/", "mlx/share/cmake/")) or name == "mlx/lib/libmlx.dylib":
            z.extract(name, sdk)
EOF
  rm -rf "$sdk/wheel"
  touch "$sdk/.complete"
fi
inc="$sdk/mlx/include"
for f in "$inc/mlx/backend/metal/device.h" "$inc/metal_cpp/Metal/Metal.hpp" "$sdk/mlx/lib/libmlx.dylib"; do
  [ -f "$f" ] || { echo "check_metal_host: $f missing (remove ${sdk#$root/} to fetch again)" >&2; exit 2; }
done
# The defines MLX's CMake package gives the Metal build (see its MLXConfig.cmake).
grep -q -- '-D_METAL_' "$sdk/mlx/share/cmake/MLX/MLXConfig.cmake" || {
  echo "check_metal_host: MLXConfig.cmake no longer sets -D_METAL_: update this script" >&2
  exit 2
}

# ---- compiler flags ----
# The host's libstdc++ and glibc include dirs, as clang finds them for the host.
sys_inc=()
while read -r d; do
  [ "$d" = /usr/local/include ] || sys_inc+=(-isystem "$d")
done < <("$cxx" -std=c++20 -x c++ -E -v /dev/null 2>&1 |
  sed -n '/<\.\.\.> search starts here/,/End of search list/p' | sed '1d;$d;s/^ *//')
stubs="$root/tools/metal_host_stubs"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# int64_t is long long on macOS, long in LP64 glibc: compile against a copy of glibc's
# bits/types.h that makes it long long, so that code mixing int64_t with long fails
# here as it would there, and the symbols' mangling matches libmlx.dylib's.
types_h=""
for ((i = 1; i < ${#sys_inc[@]}; i += 2)); do
  if [ -f "${sys_inc[i]}/bits/types.h" ]; then types_h="${sys_inc[i]}/bits/types.h"; break; fi
done
[ -n "$types_h" ] || { echo "check_metal_host: glibc's bits/types.h not found" >&2; exit 2; }
mkdir -p "$work/int64/bits"
sed -e 's/^typedef signed long int __int64_t;/__extension__ typedef signed long long int __int64_t;/' \
  -e 's/^typedef unsigned long int __uint64_t;/__extension__ typedef unsigned long long int __uint64_t;/' \
  "$types_h" >"$work/int64/bits/types.h"
if grep -q '^typedef \(un\)\{0,1\}signed long int __u\{0,1\}int64_t;' "$work/int64/bits/types.h" ||
  ! grep -q 'long long int __int64_t;' "$work/int64/bits/types.h"; then
  echo "check_metal_host: cannot make int64_t long long in $types_h" >&2
  exit 2
fi
flags=(
  -target arm64-apple-macos14 -std=c++20 -Wall -Wextra -Werror
  # glibc under a Darwin target: its headers need _GNU_SOURCE (a Linux target predefines
  # it) and define __nonnull(params), which Darwin predefines as _Nonnull.
  -nostdinc -D_GNU_SOURCE -U__nonnull
  -isystem "$stubs/apple" -isystem "$stubs/glibc" -isystem "$work/int64" "${sys_inc[@]}"
  -D_METAL_ -DACCELERATE_NEW_LAPACK
  -isystem "$inc/metal_cpp" -isystem "$inc" -isystem "$inc/mlx/backend/metal/kernels/metal_3_1"
  -I"$root/csrc" -I"$root" -I"$root/metal"
)

# Demangled names, libc++'s and libstdc++'s inline namespaces dropped.
demangle() {
  "$cxxfilt" -_ | sed -E 's/std::__1::/std::/g; s/std::__cxx11::/std::/g' | sort -u
}
"$nm" -gU --format=just-symbols "$sdk/mlx/lib/libmlx.dylib" | demangle >"$work/mlx_exports"
"$cxx" "${flags[@]}" -c "$root/csrc/gpu_none.cpp" -o "$work/gpu_none.o"
"$nm" -gU --format=just-symbols "$work/gpu_none.o" | demangle |
  grep '^turboquant_mlx::gpu::' >"$work/entry_points"

# Checks one copy of eval_metal.cpp; prints what fails, returns non-zero then.
check() {
  local src="$1" obj="$work/eval_metal.o"
  rm -f "$obj"
  if ! "$cxx" "${flags[@]}" -c "$src" -o "$obj"; then
    echo "FAIL: does not compile"
    return 1
  fi
  local status=0 missing
  missing="$("$nm" -u --format=just-symbols "$obj" | demangle |
    grep -E '^(mlx::core|MTL|NS|CA)::' | comm -23 - "$work/mlx_exports" || true)"
  if [ -n "$missing" ]; then
    echo "FAIL: needs symbols libmlx.dylib does not export:"
    echo "$missing" | sed 's/^/  /'
    status=1
  fi
  missing="$("$nm" -gU --format=just-symbols "$obj" | demangle | comm -13 - "$work/entry_points" || true)"
  if [ -n "$missing" ]; then
    echo "FAIL: does not define these GPU entry points (see csrc/gpu.h):"
    echo "$missing" | sed 's/^/  /'
    status=1
  fi
  return $status
}

echo "-- compile csrc/metal/eval_metal.cpp for arm64-apple-macos14 against mlx-metal $version"
check "$root/csrc/metal/eval_metal.cpp" || exit 1
echo "ok   csrc/metal/eval_metal.cpp"
[ $self_test = 1 ] || exit 0

# ---- self-test: each broken copy must fail ----
mutant() { # name, sed expression, then the text the edit must produce
  local name="$1" expr="$2" expect="$3" src="$work/eval_metal_$1.cpp"
  sed -e "$expr" "$root/csrc/metal/eval_metal.cpp" >"$src"
  if ! grep -qF -- "$expect" "$src"; then
    echo "self-test: the edit for '$name' no longer applies to eval_metal.cpp" >&2
    exit 1
  fi
  if check "$src" >"$work/$name.log" 2>&1; then
    echo "self-test FAILED: the check accepts eval_metal.cpp with $name"
    exit 1
  fi
  echo "ok   rejects $name:"
  grep -m1 -A1 -E 'error:|FAIL' "$work/$name.log" | sed 's/^.*error: //; s/^ */       /'
}
mutant "a pointer passed to set_input_array" \
  's/enc\.set_input_array(x, 0);/enc.set_input_array(\&x, 0);/' 'enc.set_input_array(&x, 0);'
mutant "a misspelled encoder method" \
  's/enc\.dispatch_threadgroups(/enc.dispatch_thread_groups(/' 'enc.dispatch_thread_groups('
mutant "int64_t and long in one std::max" \
  's|(codes\.offset() / 4) % na|(std::max(codes.offset(), 0L) / 4) % na|' 'std::max(codes.offset(), 0L)'
mutant "a call libmlx does not export" \
  's/^bool available() {$/bool available() {\n  (void)mx::metal::is_nax_available();/' \
  'mx::metal::is_nax_available();'
mutant "a changed entry-point signature" \
  's/^    const Dequantize& prim,$/    Dequantize\& prim,/' '    Dequantize& prim,'
echo "self-test passed"
