#!/usr/bin/env bash
# Runs the Metal backend on the CPU: builds the extension with the unchanged
# csrc/metal/eval_metal.cpp (in the form a Mac without Apple's Metal compiler builds:
# the kernel source embedded, one kernel compiled per first use) against a fake of MLX's
# Metal API, whose dispatches run metal/'s kernels compiled as C++ by a cooperative-
# fiber executor (tools/metal_emu/), then runs every Metal primitive's eval_gpu against
# the CPU op and prints a table (tools/metal_emu/run_cases.py). Exit status 1 on any
# mismatch. Nothing here runs on Apple hardware: see tools/metal_emu/msl_exec.h for
# what the executor models and what it cannot.
#
# Usage (from anywhere in the checkout, with a Python that has mlx[cpu] and nanobind,
# e.g. the venv of tools/test.sh):
#   bash tools/run_metal_emulated.sh [--quick] [--self-test] [-k SUBSTRING]
#     --quick      fewer long-context cases
#     --self-test  then plants known bugs in copies of the Metal-only code, one at a
#                  time, and checks that each makes the cases fail (a table of how)
# Needs clang++-19 (Debian: clang-19), cmake and ninja.
# Builds in build/metal-emu/ (tools/metal_emu/run.py).
set -euo pipefail
exec "${PYTHON:-python}" "$(dirname "$0")/metal_emu/run.py" "$@"

