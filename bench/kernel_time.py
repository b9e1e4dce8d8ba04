# Copyright © 2026 turboquant_mlx contributors.

"""Device time of one decode attention call, from Nsight Compute: compressed cache vs
MLX's fp16 ``scaled_dot_product_attention``, with no host time in it.

``bench_gpu.py`` times calls from Python; on MLX's CUDA backend those times include the
host's graph building and launch (tens of µs per call, the same for every method), which
at short contexts is most of what is measured. This script asks ``ncu`` for the GPU
duration of every kernel a call launches (``gpu__time_duration``, L2 flushed before each
kernel, clocks left alone) and sums them per call: the attention kernels' own time.

    python bench/kernel_time.py                      # the driver: runs ncu, prints tables
    python bench/kernel_time.py --one tq --context 131072 --kb 4 --vb 4   # (under ncu)

The timed calls sit between cuProfilerStart/Stop, so warm-up launches are not counted.
"""

import argparse
import csv
import ctypes
import io
import math
import os
import shutil
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def _profiler(start):
    lib = ctypes.CDLL("libcuda.so.1")
    rc = (lib.cuProfilerStart if start else lib.cuProfilerStop)()
    if rc != 0:
        print(f"cuProfiler{'Start' if start else 'Stop'} returned {rc}", file=sys.stderr)


def run_one(a):
    """Builds one random problem, warms it up, then profiles `a.calls` calls."""
    import mlx.core as mx
    import numpy as np

    sys.path.insert(0, HERE)
    from bench_gpu import random_cache

    from turboquant_mlx import codebook, ops
    from turboquant_mlx.rotation import Rotation

    mx.set_default_device(mx.gpu)
    if a.kernel:
        from turboquant_mlx import _ext

        _ext._set_kernel_override("attention", {"simt": "portable"}.get(a.kernel, a.kernel))
    n, d, hq, hkv = a.context, a.head_dim, a.q_heads, a.kv_heads
    scale = 1.0 / math.sqrt(d)
    q = mx.random.normal((1, hq, 1, d)).astype(mx.float16)
    if a.one == "sdpa":
        k = mx.random.normal((1, hkv, n, d)).astype(mx.float16)
        v = mx.random.normal((1, hkv, n, d)).astype(mx.float16)
        mx.eval(q, k, v)
        call = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731
    else:
        kc, ks = random_cache(1, hkv, n, d, a.kb)
        vc, vs = random_cache(1, hkv, n, d, a.vb)
        kcent = mx.array(codebook.lloyd_max_centroids(d, a.kb).astype(np.float32))
        vcent = mx.array(codebook.lloyd_max_centroids(d, a.vb).astype(np.float32))
        # the tail in the queries' dtype, as a cache's fp16 sinks and window
        tk = mx.random.normal((1, hkv, a.tail, d)).astype(q.dtype) if a.tail else None
        tv = mx.random.normal((1, hkv, a.tail, d)).astype(q.dtype) if a.tail else None
        mu_k = mx.random.normal((1, hkv, 1, d)) if a.centered else None
        mu_v = mx.random.normal((1, hkv, 1, d)) if a.centered else None
        extra = [x for x in (tk, tv, mu_k, mu_v) if x is not None]
        mx.eval(q, kc, ks, vc, vs, kcent, vcent, *extra)

        signs = Rotation(d, seed=0).kernel_signs if a.op_rotation else None

        def call():
            return ops.compressed_attention(
                q,
                kc,
                ks,
                vc,
                vs,
                kcent,
                vcent,
                n,
                scale,
                a.kb,
                a.vb,
                True,
                tail_k=tk,
                tail_v=tv,
                rotation_signs=signs,
                key_mean=mu_k,
                value_mean=mu_v,
            )[0]

    for _ in range(3):
        mx.eval(call())
    mx.synchronize()
    _profiler(True)
    for _ in range(a.calls):
        mx.eval(call())
        mx.synchronize()
    _profiler(False)


INST = "smsp__inst_executed.sum"  # warp-level instructions issued and executed


def ncu_call_time(args, calls, cache_control="all", kernel=None):
    """(µs per call, {kernel: µs per call}, warp instructions per call) of one `--one`
    configuration under ncu; `kernel` ("simt": the portable kernel, "simd": the
    simdgroup-matrix kernel on its emulation; None: the default selection, the
    tensor-core kernel where it applies) is the attention kernel override."""
    cmd = [
        "ncu",
        "--profile-from-start",
        "off",
        "--clock-control",
        "none",
        "--cache-control",
        cache_control,
        "--metrics",
        f"gpu__time_duration.sum,{INST}",
        "--csv",
        "--print-units",
        "base",
        sys.executable,
        os.path.abspath(__file__),
        "--calls",
        str(calls),
        *args,
        *(["--kernel", kernel] if kernel else []),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    rows = [ln for ln in res.stdout.splitlines() if ln.startswith('"')]
    if not rows:
        raise RuntimeError(
            f"ncu gave no kernels for {args}:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        )
    per_kernel, inst = {}, 0.0
    for r in csv.DictReader(io.StringIO("\n".join(rows))):
        value = float(r["Metric Value"].replace(",", ""))
        if r.get("Metric Name") == INST:
            inst += value / calls
            continue
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = r["Kernel Name"].split("(")[0].split("<")[0].strip()
        per_kernel.setdefault(name, []).append(value * 1e-3)
    # launches per call x median duration, per kernel name
    parts = {k: len(v) / calls * statistics.median(v) for k, v in per_kernel.items()}
    return sum(parts.values()), parts, inst


def driver(a):
    if shutil.which("ncu") is None:
        sys.exit("kernel_time: Nsight Compute (ncu) is not on the PATH")
    sys.path.insert(0, HERE)
    from bench_gpu import device_bandwidth

    mlx_bw, torch_bw = device_bandwidth()
    bw = torch_bw or mlx_bw
    print(
        f"Device copy bandwidth (read+write, {'torch' if torch_bw else 'MLX'}): {bw / 1e12:.2f} TB/s"
    )
    lengths = [int(x) for x in a.lengths.split(",")]
    pairs = [tuple(int(c) for c in p.split("v")) for p in a.bits.split(",")]
    shapes = [(32, 8, 128)]
    if a.d256:
        shapes += [(16, 4, 256), (16, 2, 256)]
    for hq, hkv, d in [] if a.kernels_only else shapes:
        shape = ["--q-heads", str(hq), "--kv-heads", str(hkv), "--head-dim", str(d)]
        l2 = "L2 flushed before each kernel" if a.cache_control == "all" else "L2 not flushed"
        print(f"\n### Device time per call (ncu, {l2}), B=1, {hq}q/{hkv}kv d{d}, one query token\n")
        head = "| context | fp16 SDPA µs |" + "".join(
            f" K{kb}V{vb} µs | × fp16 | % BW |" for kb, vb in pairs
        )
        print(head)
        print("|---:|---:|" + "---:|---:|---:|" * len(pairs))
        for n in lengths:
            # Repeats alternate the methods (SDPA, then each bit pair), so that a drift of
            # the clocks between runs moves both sides of a ratio alike.
            t_sdpa_runs, t_runs = [], {pair: [] for pair in pairs}
            details = []
            for _ in range(a.repeats):
                if a.no_sdpa:
                    t_sdpa, parts_sdpa = math.nan, {}
                else:
                    t_sdpa, parts_sdpa, _ = ncu_call_time(
                        ["--one", "sdpa", "--context", str(n), *shape], a.calls, a.cache_control
                    )
                t_sdpa_runs.append(t_sdpa)
                details.append(f"sdpa {t_sdpa:.1f} {parts_sdpa}")
                for kb, vb in pairs:
                    t, parts, _ = ncu_call_time(
                        [
                            "--one",
                            "tq",
                            "--context",
                            str(n),
                            "--kb",
                            str(kb),
                            "--vb",
                            str(vb),
                            "--tail",
                            str(a.tail),
                            *shape,
                        ]
                        + (["--op-rotation"] if a.op_rotation else [])
                        + (["--centered"] if a.centered else []),
                        a.calls,
                        a.cache_control,
                    )
                    t_runs[(kb, vb)].append(t)
                    details.append(
                        f"K{kb}V{vb} {t:.1f} ("
                        + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
                        + f"), x{t_sdpa / t:.2f}"
                    )
            t_sdpa = statistics.median(t_sdpa_runs)
            line = f"| {n // 1024}k | {t_sdpa:.1f} |"
            for kb, vb in pairs:
                ts = t_runs[(kb, vb)]
                t = statistics.median(ts)
                nbytes = hkv * n * (d * (kb + vb) // 8 + 4)
                pct = f"{100 * nbytes / (t * 1e-6) / bw:.0f}%"
                ratios = [s / x for s, x in zip(t_sdpa_runs, ts)]
                ratio = f"{statistics.median(ratios):.2f}x"
                if a.repeats > 1:  # median of the paired ratios, and their range
                    ratio += f" ({min(ratios):.2f}-{max(ratios):.2f})"
                line += f" {t:.1f} | {ratio} | {pct} |"
            print(line, flush=True)
            for x in details:
                print(f"    {n // 1024}k {x}", file=sys.stderr)
    if a.kernels:
        kernel_table(a, lengths, pairs)


def kernel_table(a, lengths, pairs):
    """Device time and instructions per compressed coordinate of each attention kernel
    of `--kernels`, against fp16 SDPA."""
    kernels = a.kernels.split(",")
    for hq, hkv, d in [(32, 8, 128)] + ([(16, 2, 256)] if a.d256 else []):
        shape = ["--q-heads", str(hq), "--kv-heads", str(hkv), "--head-dim", str(d)]
        print(
            f"\n### Attention kernels compared (ncu), B=1, {hq}q/{hkv}kv d{d}, one query "
            "token; inst/coord = warp instructions x 32 / (KV heads x context x D x 2)\n"
        )
        print("| context | bits | kernel | µs | × fp16 SDPA | warp inst | inst/coord |")
        print("|---:|---|---|---:|---:|---:|---:|")
        for n in lengths:
            t_sdpa, _, _ = ncu_call_time(
                ["--one", "sdpa", "--context", str(n), *shape], a.calls, a.cache_control
            )
            coords = hkv * n * d * 2
            for kb, vb in pairs:
                for kernel in kernels:
                    try:
                        t, parts, inst = ncu_call_time(
                            [
                                "--one",
                                "tq",
                                "--context",
                                str(n),
                                "--kb",
                                str(kb),
                                "--vb",
                                str(vb),
                                "--tail",
                                str(a.tail),
                                *shape,
                            ],
                            a.calls,
                            a.cache_control,
                            kernel=None if kernel == "default" else kernel,
                        )
                    except Exception as e:  # noqa: BLE001 (one failed kernel keeps the table)
                        print(
                            f"| {n // 1024}k | K{kb}V{vb} | {kernel} | failed: "
                            f"{str(e).splitlines()[0][:80]} | | | |",
                            flush=True,
                        )
                        continue
                    print(
                        f"| {n // 1024}k | K{kb}V{vb} | {kernel} | {t:.1f} | {t_sdpa / t:.2f} | "
                        f"{inst:.3g} | {inst * 32 / coords:.2f} |",
                        flush=True,
                    )
                    print(
                        f"    {n // 1024}k K{kb}V{vb} {kernel}: "
                        + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()),
                        file=sys.stderr,
                    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--one", choices=("sdpa", "tq"), help="run one configuration (under ncu)")
    p.add_argument(
        "--kernel",
        choices=("simt", "simd"),
        help="with --one tq: this attention kernel instead of the default selection",
    )
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--kb", type=int, default=4)
    p.add_argument("--vb", type=int, default=4)
    p.add_argument("--tail", type=int, default=0, help="uncompressed tail tokens (tq4: 36)")
    p.add_argument(
        "--op-rotation",
        action="store_true",
        help="queries in model space, rotated (and the output rotated back) by "
        "the op, as the cache calls it for power-of-two head dims",
    )
    p.add_argument(
        "--centered",
        action="store_true",
        help="key and value means, as a mean-centered cache (tq4) calls the op",
    )
    p.add_argument("--calls", type=int, default=5)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measurements of each method per context, alternating; the table "
        "gives medians, and with more than one the range of the paired ratios",
    )
    p.add_argument("--lengths", default="4096,32768,131072,262144")
    p.add_argument("--bits", default="4v4,3v3", help="key/value bit pairs")
    p.add_argument("--d256", action="store_true", help="also the head-dim-256 shapes")
    p.add_argument("--no-sdpa", action="store_true", help="skip fp16 SDPA (ratios print nan)")
    p.add_argument(
        "--kernels",
        default="",
        help="also compare these attention kernels (simt = the portable kernel, "
        "simd = the Metal simdgroup-matrix "
        "kernel through its CUDA emulation, default = the tensor-core kernel) "
        "by device time and instructions per coordinate",
    )
    p.add_argument("--kernels-only", action="store_true", help="print only the --kernels table")
    p.add_argument(
        "--cache-control",
        choices=("all", "none"),
        default="all",
        help="ncu's --cache-control: all = L2 flushed before every kernel (the "
        "default: each kernel reads everything from device memory, also the "
        "query and the split-K partials), none = caches left as the previous "
        "kernel left them",
    )
    a = p.parse_args()
    if a.one:
        run_one(a)
    else:
        driver(a)


if __name__ == "__main__":
    main()
