#!/usr/bin/env python3
"""Builds the Metal emulator and runs the cases; with --self-test, also plants known bugs.

The sources (metal/, csrc/, tools/metal_emu/, the codebook) are synced into
build/metal-emu/src (only changed files are written) and built in build/metal-emu/build,
so that a planted bug rebuilds only what it touches. See tools/run_metal_emulated.sh.
"""

import argparse
import os
import shutil
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
WORK = os.path.join(ROOT, "build", "metal-emu")
SRC, BUILD = os.path.join(WORK, "src"), os.path.join(WORK, "build")
TREES = ["metal", "csrc", "tools/metal_emu", "python/turboquant_mlx/codebook.py"]

# (name, file, text, replacement): each a bug in code that only Metal runs, or in the
# host code that dispatches it.
BUGS = [
    (
        "two buffer indices swapped (eval_metal.cpp: key / value scales)",
        "csrc/metal/eval_metal.cpp",
        "  enc.set_input_array(inputs[2], 2);\n  enc.set_input_array(vc, 3);\n  enc.set_input_array(inputs[4], 4);",
        "  enc.set_input_array(inputs[4], 2);\n  enc.set_input_array(vc, 3);\n  enc.set_input_array(inputs[2], 4);",
    ),
    (
        "wrong shuffle mask (tq_portable.h, Metal branch)",
        "metal/tq_portable.h",
        "return simd_shuffle_xor(x, ushort(mask));",
        "return simd_shuffle_xor(x, ushort(mask ^ 1));",
    ),
    (
        "threadgroup barrier removed (tq_kernels.h, quantize: codebook ready)",
        "metal/tq_kernels.h",
        "    bnd[th.tid] = tq_mul_rn(tq_add_rn(cent[th.tid], cent[th.tid + 1]), 0.5f);\n  }\n  tq_threadgroup_barrier();",
        "    bnd[th.tid] = tq_mul_rn(tq_add_rn(cent[th.tid], cent[th.tid + 1]), 0.5f);\n  }",
    ),
    (
        "threadgroup memory one element short (eval_metal.cpp: merge)",
        "csrc/metal/eval_metal.cpp",
        "set_threadgroup_floats(enc, TQ_MERGE_SMEM);",
        "set_threadgroup_floats(enc, TQ_MERGE_SMEM - 1);",
    ),
    (
        "threadgroup memory 16 bytes short (eval_metal.cpp: quantize)",
        "csrc/metal/eval_metal.cpp",
        "set_threadgroup_floats(enc, TQ_QUANT_SMEM(head_dim));",
        "set_threadgroup_floats(enc, TQ_QUANT_SMEM(head_dim) - 4);",
    ),
    (
        "grid one threadgroup short (eval_metal.cpp: quantize)",
        "csrc/metal/eval_metal.cpp",
        "MTL::Size((n + TQ_QUANT_SIMDGROUPS - 1) / TQ_QUANT_SIMDGROUPS, 1, 1),",
        "MTL::Size(n / TQ_QUANT_SIMDGROUPS, 1, 1),",
    ),
]


def sync(plant=None):
    """The copy of the sources, with `plant` (a BUGS entry) applied."""
    wanted = {}
    for t in TREES:
        p = os.path.join(ROOT, t)
        files = (
            [p]
            if os.path.isfile(p)
            else [
                os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs if "__pycache__" not in d
            ]
        )
        for f in files:
            with open(f, "rb") as fh:
                wanted[os.path.relpath(f, ROOT)] = fh.read()
    if plant:
        _, path, old, new = plant
        text = wanted[path].decode()
        assert text.count(old) == 1, f"the planted bug's text is not (once) in {path}"
        wanted[path] = text.replace(old, new).encode()
    for rel, data in wanted.items():
        dst = os.path.join(SRC, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.exists(dst) or open(dst, "rb").read() != data:
            with open(dst, "wb") as fh:
                fh.write(data)


def build(cxx, quiet=False):
    log = os.path.join(WORK, "build.log")
    with open(log, "w") as fh:
        for cmd in (
            [
                "cmake",
                "-S",
                os.path.join(SRC, "tools", "metal_emu"),
                "-B",
                BUILD,
                "-G",
                "Ninja",
                f"-DCMAKE_CXX_COMPILER={cxx}",
                f"-DPython_EXECUTABLE={sys.executable}",
            ],
            ["ninja", "-C", BUILD],
        ):
            if subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode != 0:
                if not quiet:
                    print(open(log).read()[-6000:])
                return False
    return True


def run_cases(args, capture=False):
    cmd = [sys.executable, os.path.join(SRC, "tools", "metal_emu", "run_cases.py"), BUILD] + args
    if capture:
        return subprocess.run(cmd, capture_output=True, text=True).stdout
    return subprocess.run(cmd).returncode


def self_test(cxx):
    rows, ok = [], True
    for bug in BUGS:
        sync(bug)
        if not build(cxx, quiet=True):
            rows.append((bug[0], "does not build", ""))
            ok = False
            continue
        out = run_cases(["--quick"], capture=True)
        fails = [line for line in out.splitlines() if line.startswith("FAIL  ")]
        first = ""
        if fails:
            first = fails[0][6:].split("  [", 1)[0] + ": " + fails[0].split("]: ", 1)[-1]
        rows.append((bug[0], f"{len(fails)} cases fail", first[:220]))
        ok &= bool(fails)
        print(f"{'caught' if fails else 'MISSED'}: {bug[0]}: {len(fails)} cases fail", flush=True)
    sync(None)
    print()
    print("| planted bug | result | first failing case |")
    print("|---|---|---|")
    for name, res, first in rows:
        print(f"| {name} | {res} | {first.replace('|', '/')} |")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("-k", dest="select")
    ap.add_argument("--cxx", default=os.environ.get("CLANGXX", "clang++-19"))
    args = ap.parse_args()
    for tool in (args.cxx, "cmake", "ninja"):
        if shutil.which(tool) is None:
            sys.exit(f"run_metal_emulated: {tool} not found")
    os.makedirs(WORK, exist_ok=True)
    print("== building the Metal emulator (build/metal-emu)", flush=True)
    sync(None)
    if not build(args.cxx):
        return 1
    print("== Metal primitives on the CPU executor vs the CPU op", flush=True)
    case_args = (["--quick"] if args.quick else []) + (["-k", args.select] if args.select else [])
    status = run_cases(case_args)
    if args.self_test:
        print("\n== self-test: each planted bug must make cases fail", flush=True)
        status |= 0 if self_test(args.cxx) else 1
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
