#!/usr/bin/env python3
"""Runs every Metal primitive's eval_gpu on the CPU executor against the CPU op.

Each case builds the same op twice with the emulator build of the extension (the
package's sources with csrc/metal/eval_metal.cpp, see CMakeLists.txt beside this file):
on the CPU stream (the reference: the CPU kernels) and on metal_stream() (the graph the
ops build for Metal, evaluated through eval_metal.cpp's dispatches into the executor),
and compares the results: codes and scales bit for bit, decoded values and attention
within the kernels' precision class. Prints one table row per case with the kernels it
dispatched; exits 1 on any mismatch or error.

usage: run_cases.py BUILD_DIR [--quick] [-k SUBSTRING]
"""

import argparse
import importlib.util
import os
import sys
import time
import traceback

import numpy as np


def load(build_dir):
    sys.path.insert(0, build_dir)
    from tq_metal_emu import _ext  # noqa: E402

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    spec = importlib.util.spec_from_file_location(
        "tq_codebook", os.path.join(root, "python", "turboquant_mlx", "codebook.py")
    )
    codebook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codebook)
    return _ext, codebook


import mlx.core as mx  # noqa: E402

ext = codebook = S = None
DTYPES = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}


def rand(shape, dtype, seed):
    a = mx.random.normal(shape, key=mx.random.key(seed)).astype(DTYPES[dtype])
    mx.eval(a)
    return a


def signs(d, seed):
    r = np.random.default_rng(seed)
    return [float(s) for s in r.choice([-1.0, 1.0], size=d)]


def on_metal(fn):
    """fn(stream) evaluated on the emulated Metal device and on the CPU."""
    ext.reset()
    got = list(fn(S))
    ext.evaluate(got)
    kernels = [
        d["kernel"]
        + (
            f" x{d['grid'][1]} splits"
            if d["kernel"].startswith("tq_attention_")
            and "merge" not in d["kernel"]
            and d["grid"][1] > 1
            else ""
        )
        for d in ext.dispatches()
        if not d["kernel"].startswith("(")
    ]
    ref = list(fn(mx.cpu))
    mx.eval(ref)
    return (
        [np.array(g.astype(mx.float32) if g.dtype == mx.bfloat16 else g) for g in got],
        [np.array(r.astype(mx.float32) if r.dtype == mx.bfloat16 else r) for r in ref],
        kernels,
    )


def exact(got, ref):
    bad = [i for i, (g, r) in enumerate(zip(got, ref)) if not np.array_equal(g, r, equal_nan=True)]
    return (f"outputs {bad} differ" if bad else None), 0.0


def close(got, ref, rtol):
    worst = 0.0
    for g, r in zip(got, ref):
        finite = np.isfinite(r)
        if not np.array_equal(np.isfinite(g), finite):
            return "non-finite values differ", float("inf")
        scale = max(1.0, float(np.abs(r[finite]).max())) if finite.any() else 1.0
        err = float(np.abs(g[finite] - r[finite]).max()) / scale if finite.any() else 0.0
        worst = max(worst, err)
    return (f"error {worst:.2e} > {rtol:.0e}" if worst > rtol else None), worst


# ------------------------------------------------------------------ the cases


def empty_cache(B, H, cap, D, bits):
    w = ext.words_per_token(D, bits)
    c, s = mx.zeros((B, H, cap, w), mx.uint32), mx.zeros((B, H, cap), mx.float16)
    mx.eval(c, s)
    return c, s


def filled_cache(B, H, N, D, bits, seed, cap=None):
    c, s = empty_cache(B, H, cap or N, D, bits)
    x = rand((B, H, N, D), "f32", seed)
    c, s = ext.quantize_append(c, s, x, codebook.centroids(D, bits), 0, bits, stream=mx.cpu)
    mx.eval(c, s)
    return c, s


def case_quantize(D, dtype, kb, vb, B=1, H=2, L=5, rotate=False, centered=False, strided=False):
    def fn(stream):
        kc, ks = empty_cache(B, H, 16, D, kb)
        vc, vs = empty_cache(B, H, 16, D, vb)
        k = rand((B, L, H, D), dtype, 1) if strided else rand((B, H, L, D), dtype, 1)
        v = rand((B, H, L, D), dtype, 2)
        if strided:
            k = k.transpose(0, 2, 1, 3)
        kw = {}
        if rotate:
            kw.update(key_rotation_signs=signs(D, 3), value_rotation_signs=signs(D, 4))
        if centered:
            kw.update(
                key_mean=rand((B, H, 1, D), "f32", 5), value_mean=rand((B, H, 1, D), "f32", 6)
            )
        return ext.quantize_append_kv(
            kc,
            ks,
            vc,
            vs,
            k,
            v,
            codebook.centroids(D, kb),
            codebook.centroids(D, vb),
            3,
            kb,
            vb,
            stream=stream,
            **kw,
        )

    return fn, exact


def case_ring(D, dtype, kb, vb, L=1, slot=2, B=1, H=2, rotate=False):
    def fn(stream):
        kc, ks = empty_cache(B, H, 16, D, kb)
        vc, vs = empty_cache(B, H, 16, D, vb)
        k_ring, v_ring = rand((B, H, 8, D), dtype, 7), rand((B, H, 8, D), dtype, 8)
        keys, values = rand((B, H, L, D), dtype, 9), rand((B, H, L, D), dtype, 10)
        kw = {}
        if rotate:
            kw.update(key_rotation_signs=signs(D, 3), value_rotation_signs=signs(D, 4))
        return ext.ring_append_kv(
            kc,
            ks,
            vc,
            vs,
            k_ring,
            v_ring,
            keys,
            values,
            codebook.centroids(D, kb),
            codebook.centroids(D, vb),
            4,
            slot,
            kb,
            vb,
            stream=stream,
            **kw,
        )

    return fn, exact


def case_dequantize(D, bits, dtype, before=0, after=0, B=1, H=2, N=12):
    codes, scales = filled_cache(B, H, N, D, bits, 11)

    def fn(stream):
        kw = {}
        if before:
            kw["prefix"] = rand((B, H, before, D), dtype, 12)
        if after:
            kw["suffix"] = rand((B, H, after, D), dtype, 13)
        return [
            ext.dequantize(
                codes,
                scales,
                codebook.centroids(D, bits),
                bits,
                2,
                N - 3,
                dtype=DTYPES[dtype],
                before=before,
                after=after,
                stream=stream,
                **kw,
            )
        ]

    return fn, (lambda g, r: close(g, r, 1e-6 if dtype == "f32" else 1e-2))


def case_attention(
    D,
    qdtype,
    kb,
    vb,
    N=96,
    L=1,
    Hq=8,
    Hkv=2,
    B=1,
    causal=True,
    mask=None,
    portable=False,
    tail=0,
    rotate=False,
    centered=False,
    out_dtype=None,
    ctas=None,
):
    kc, ks = filled_cache(B, Hkv, N + 8, D, kb, 21)
    vc, vs = filled_cache(B, Hkv, N + 8, D, vb, 22)
    q = rand((B, Hq, L, D), qdtype, 23)
    m = None
    if mask == "bool":
        m = mx.array(np.random.default_rng(24).random((B, Hq, L, N)) > 0.3)
        m[..., 0] = True
    elif mask == "float":
        m = mx.array(np.random.default_rng(25).normal(size=(B, 1, L, N)).astype(np.float32))
    kw = {}
    if tail:
        kw.update(
            tail_k=rand((B, Hkv, tail, D), qdtype, 26), tail_v=rand((B, Hkv, tail, D), qdtype, 27)
        )
    if rotate:
        kw.update(rotation_signs=signs(D, 28))
    if centered:
        kw.update(
            key_mean=rand((B, Hkv, 1, D), "f32", 29), value_mean=rand((B, Hkv, 1, D), "f32", 30)
        )
    if out_dtype:
        kw["out_dtype"] = DTYPES[out_dtype]

    def fn(stream):
        ext._set_kernel_override("attention", "portable" if portable else None)
        ext._set_kernel_override("ctas", ctas or None)
        return ext.compressed_attention(
            q,
            kc,
            ks,
            vc,
            vs,
            codebook.centroids(D, kb),
            codebook.centroids(D, vb),
            N,
            D**-0.5,
            kb,
            vb,
            causal,
            m,
            stream=stream,
            **kw,
        )

    half = qdtype != "f32" or out_dtype in ("f16", "bf16")
    return fn, (lambda g, r: close(g, r, 2e-2 if half else 1e-4))


def cases(quick):
    c = []
    # Quantize / append: every dtype and bit width, the head dims, rotation, centering,
    # strided tokens, batch rows.
    for D, dt, kb, vb in [
        (64, "f32", 4, 3),
        (96, "f16", 2, 4),
        (128, "bf16", 3, 2),
        (256, "f16", 4, 4),
    ]:
        c.append((f"quantize_append_kv D{D} {dt} k{kb}v{vb}", case_quantize(D, dt, kb, vb)))
    c.append(
        (
            "quantize_append_kv D128 f16 rotated centered B2",
            case_quantize(128, "f16", 4, 3, B=2, rotate=True, centered=True),
        )
    )
    c.append(
        ("quantize_append_kv D64 f32 strided tokens", case_quantize(64, "f32", 3, 3, strided=True))
    )
    # Ring exchange: one dispatch for a pair, two for parts of different bits.
    c.append(("ring_append_kv D64 f16 k4v4 (pair) L1", case_ring(64, "f16", 4, 4)))
    c.append(
        (
            "ring_append_kv D128 bf16 k4v3 L3 rotated",
            case_ring(128, "bf16", 4, 3, L=3, slot=5, rotate=True),
        )
    )
    c.append(("ring_append_kv D96 f32 k2v2 B2", case_ring(96, "f32", 2, 2, B=2)))
    # Dequantize.
    for D, bits, dt, before, after in [
        (64, 2, "f32", 0, 0),
        (128, 3, "f16", 3, 2),
        (256, 4, "bf16", 0, 4),
    ]:
        c.append(
            (
                f"dequantize D{D} b{bits} {dt} prefix{before} suffix{after}",
                case_dequantize(D, bits, dt, before, after),
            )
        )
    # Attention: decode, verification (causal among the new tokens), masks, both kernels,
    # the query dtypes, bit widths, head dims, GQA ratios, batch rows, the merge.
    att = [
        ("decode D64 f16 k4v4 gqa4 (simdgroup matrix)", dict(D=64, qdtype="f16", kb=4, vb=4)),
        ("decode D128 bf16 k4v3 gqa4 (simdgroup matrix)", dict(D=128, qdtype="bf16", kb=4, vb=3)),
        (
            "decode D256 f16 k3v3 gqa8 (simdgroup matrix)",
            dict(D=256, qdtype="f16", kb=3, vb=3, Hq=8, Hkv=1),
        ),
        ("decode D64 f16 k4v4 gqa4 portable", dict(D=64, qdtype="f16", kb=4, vb=4, portable=True)),
        ("decode D96 f32 k2v4 gqa1", dict(D=96, qdtype="f32", kb=2, vb=4, Hq=2, Hkv=2)),
        ("decode D128 f32 k4v2 gqa8 B2", dict(D=128, qdtype="f32", kb=4, vb=2, Hq=8, Hkv=1, B=2)),
        ("verify L4 D128 f16 k4v3 causal", dict(D=128, qdtype="f16", kb=4, vb=3, L=4)),
        ("verify L8 D64 f32 k3v3 causal", dict(D=64, qdtype="f32", kb=3, vb=3, L=8)),
        (
            "verify L2 D64 bf16 k4v4 portable",
            dict(D=64, qdtype="bf16", kb=4, vb=4, L=2, portable=True),
        ),
        (
            "verify L3 D128 f16 bool mask",
            dict(D=128, qdtype="f16", kb=4, vb=4, L=3, causal=False, mask="bool"),
        ),
        (
            "verify L3 D64 f32 additive mask",
            dict(D=64, qdtype="f32", kb=4, vb=3, L=3, causal=False, mask="float"),
        ),
        (
            "decode D128 f16 tail+rotation+means f16 out",
            dict(
                D=128,
                qdtype="f16",
                kb=4,
                vb=3,
                tail=12,
                rotate=True,
                centered=True,
                out_dtype="f16",
            ),
        ),
        (
            "decode D64 f32 tail+rotation portable",
            dict(D=64, qdtype="f32", kb=4, vb=4, tail=5, rotate=True),
        ),
        ("merge: D128 f16 N2048 split-K", dict(D=128, qdtype="f16", kb=4, vb=4, N=2048, ctas=64)),
        (
            "merge: D64 f32 N1536 split-K L2",
            dict(D=64, qdtype="f32", kb=4, vb=3, N=1536, L=2, ctas=64),
        ),
        (
            "merge: D256 bf16 N1024 split-K portable",
            dict(D=256, qdtype="bf16", kb=3, vb=4, N=1024, ctas=32, portable=True),
        ),
    ]
    # Every bit-width pair on the fast path, every head dim of the portable kernel, GQA
    # ratios 1 / 4 / 8 on both.
    for kb in (2, 3, 4):
        for vb in (2, 3, 4):
            att.append(
                (f"decode D128 f16 k{kb}v{vb} gqa4", dict(D=128, qdtype="f16", kb=kb, vb=vb))
            )
    for D in (32, 160, 192, 224):
        att.append((f"decode D{D} f32 k4v3 gqa4 portable", dict(D=D, qdtype="f32", kb=4, vb=3)))
    for Hq, Hkv in ((4, 4), (8, 2), (8, 1)):
        for qd, portable in (("f16", False), ("bf16", True)):
            att.append(
                (
                    f"verify L2 D64 {qd} gqa{Hq // Hkv}{' portable' if portable else ''}",
                    dict(D=64, qdtype=qd, kb=4, vb=4, L=2, Hq=Hq, Hkv=Hkv, portable=portable),
                )
            )
    att.append(
        (
            "merge: D64 bf16 N1024 split-K tail+means",
            dict(
                D=64, qdtype="bf16", kb=4, vb=3, N=1024, ctas=32, tail=7, centered=True, rotate=True
            ),
        )
    )
    if quick:
        att = [a for a in att if not a[0].startswith("merge") or "D64" in a[0]]
    for name, kw in att:
        c.append((f"compressed_attention {name}", case_attention(**kw)))
    return c


def main(argv=None):
    global ext, codebook, S
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build_dir")
    ap.add_argument("--quick", action="store_true", help="fewer long-context cases")
    ap.add_argument("-k", dest="select", default="", help="only cases whose name contains this")
    args = ap.parse_args(argv)
    ext, codebook = load(args.build_dir)
    S = ext.metal_stream()
    rows, failed = [], 0
    for name, (fn, compare) in cases(args.quick):
        if args.select not in name:
            continue
        t0 = time.time()
        try:
            got, ref, kernels = on_metal(fn)
            problem, err = compare(got, ref)
        except Exception as e:  # an executor or host-code error is a failed case
            problem, err, kernels = f"{type(e).__name__}: {e}", float("nan"), []
            if os.environ.get("METAL_EMU_TRACEBACK"):
                traceback.print_exc()
        failed += problem is not None
        names = sorted(set(kernels))
        rows.append((name, ", ".join(names) or "-", err, time.time() - t0, problem))
        where = f"{name}  [{', '.join(names)}]"
        if problem is None:
            print(f"  ok  {where}  {time.time() - t0:.1f}s", flush=True)
        else:
            print(f"FAIL  {where}: {problem}", flush=True)
    # The package's first-use self-check (turboquant_mlx.selfcheck), run as on a Mac but
    # through the emulated device: it must pass here, and fail where a case above fails.
    if args.select in "selfcheck.check_kernels":
        try:
            from turboquant_mlx import selfcheck
        except ImportError:
            print("  --  selfcheck: turboquant_mlx is not installed here; skipped")
        else:
            t0 = time.time()
            ext.reset()
            problem = selfcheck.check_kernels(ext, S, evaluate=ext.evaluate)
            names = sorted(
                {d["kernel"] for d in ext.dispatches() if not d["kernel"].startswith("(")}
            )
            failed += problem is not None
            rows.append(
                (
                    "selfcheck.check_kernels (first use on Metal)",
                    ", ".join(names),
                    0.0,
                    time.time() - t0,
                    problem,
                )
            )
            if problem is None:
                print(f"  ok  selfcheck.check_kernels  [{len(names)} kernels]", flush=True)
            else:
                print(f"FAIL  selfcheck.check_kernels  []: {problem}", flush=True)
    print()
    print("| case | kernels dispatched (Metal, emulated) | max rel. error | s | result |")
    print("|---|---|---:|---:|---|")
    for name, names, err, secs, problem in rows:
        print(
            f"| {name} | {names} | {err:.1e} | {secs:.1f} | {'ok' if problem is None else 'FAIL: ' + problem} |"
        )
    print(f"\n{len(rows) - failed} of {len(rows)} cases agree with the CPU op.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
