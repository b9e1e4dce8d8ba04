# Copyright © 2026 turboquant_mlx contributors.

"""Decode attention on the GPU: compressed cache vs fp16 SDPA vs mlx-lm's affine path.

One run measures, side by side on the same device:
  * the device's memory bandwidth (a large copy);
  * turboquant_mlx attention on the compressed cache (query rotation + kernel +
    output un-rotation, as a model step runs it; and the kernel alone);
  * ``mx.fast.scaled_dot_product_attention`` on float16 K/V;
  * mlx-lm's affine 4-bit path (two ``mx.quantized_matmul`` around a softmax, as
    ``mlx_lm.models.base.quantized_scaled_dot_product_attention`` computes it);
for B = 1, one query token, over several context lengths, and prints markdown tables
with the time per call, the effective bandwidth (bytes of the cache read / time) and
its share of the measured device bandwidth.

Shapes: Llama-like (32 query heads, 8 KV heads, head dim 128) and Qwen3.5-like full
attention layers (16 query heads, head dim 256, 2 or 4 KV heads).

Times: "eval" is the median wall time of one call evaluated on its own (what one
decode step of one layer costs, launch and synchronisation included); "stream" is
the time per call when 16 calls are queued before one evaluation. On MLX's CUDA
backend a queued graph (up to 100 operations on Hopper) is built on the host before it
runs, so "stream" is host time plus GPU time per call; ``kernel_time.py`` measures the
GPU time alone. Inputs rotate among several buffers so that short contexts are not served
from L2. Usage: python bench/bench_gpu.py [--quick] [--lengths 4096,32768] [--reps 30 --rounds 5]
"""

import argparse
import math
import statistics
import time

import mlx.core as mx
import numpy as np

from turboquant_mlx import _ext, codebook, ops
from turboquant_mlx.rotation import Rotation

L2_BYTES = 60 * 2**20  # H200; rotating among enough buffers to exceed it 3x
REPS = 30  # timed calls evaluated alone (--reps)
ROUNDS = 5  # rounds of 16 queued calls (--rounds)


def wall(fn, reps):
    """Median seconds per call of fn() evaluated alone."""
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def streamed(fns, n=16, rounds=None):
    """Seconds per call when n calls are queued before one evaluation."""
    ts = []
    for _ in range(rounds or ROUNDS):
        t0 = time.perf_counter()
        outs = [fns[i % len(fns)]() for i in range(n)]
        mx.eval(outs)
        ts.append((time.perf_counter() - t0) / n)
    return statistics.median(ts)


def measure(fns, reps=None):
    for f in fns[:3]:  # warm-up: kernel load, graph capture, buffer cache
        mx.eval(f())
    mx.eval([f() for f in fns])
    cycle = iter(range(10**9))
    t_eval = wall(lambda: fns[next(cycle) % len(fns)](), reps or REPS)
    t_stream = streamed(fns)
    return t_eval, t_stream


def device_bandwidth():
    """Bytes moved per second by a 2 GiB copy (read + write), MLX and, if present, torch."""
    n = 2**29  # float32 elements: 2 GiB
    a = mx.random.uniform(shape=(n,))
    mx.eval(a)
    f = lambda: a * 1.0  # noqa: E731  read + write
    mx.eval(f())
    t = min(wall(f, 5) for _ in range(3))
    mlx_bw = 2 * 4 * n / t
    a = None  # free the 2 GiB (f holds the name)
    torch_bw = None
    try:
        import torch

        if torch.cuda.is_available():
            x = torch.empty(n, dtype=torch.float32, device="cuda").uniform_()
            y = torch.empty_like(x)
            for _ in range(3):
                y.copy_(x)
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(10):
                s.record()
                y.copy_(x)
                e.record()
                torch.cuda.synchronize()
                times.append(s.elapsed_time(e) / 1e3)
            torch_bw = 2 * 4 * n / statistics.median(times)
            del x, y
            torch.cuda.empty_cache()
    except Exception as exc:  # torch is optional
        print(f"(torch copy not measured: {exc})")
    return mlx_bw, torch_bw


def n_sets(bytes_per_set):
    return int(min(16, max(1, math.ceil(3 * L2_BYTES / max(bytes_per_set, 1)))))


def random_cache(b, h, n, d, bits):
    w = d * bits // 32
    codes = mx.random.randint(0, 2**31 - 1, (b, h, n, w), dtype=mx.int32).astype(mx.uint32)
    scales = mx.random.uniform(0.5, 2.0, (b, h, n)).astype(mx.float16)
    return codes, scales


def bench_turboquant(b, hq, hkv, d, n, kb, vb, kernel_only=False, tail=0):
    """``tail``: uncompressed tokens (float32, as the presets' sinks and window) passed
    as the op's tail, seen by the split-K merge."""
    rot = Rotation(d, seed=0)
    kc_, vc_ = (
        mx.array(codebook.lloyd_max_centroids(d, kb).astype(np.float32)),
        mx.array(codebook.lloyd_max_centroids(d, vb).astype(np.float32)),
    )
    per_set = b * hkv * n * ((d * kb // 8 + 2) + (d * vb // 8 + 2))
    sets = []
    for _ in range(n_sets(per_set)):
        kc, ks = random_cache(b, hkv, n, d, kb)
        vc, vs = random_cache(b, hkv, n, d, vb)
        q = mx.random.normal((b, hq, 1, d)).astype(mx.float16)
        tk = mx.random.normal((b, hkv, tail, d)) if tail else None
        tv = mx.random.normal((b, hkv, tail, d)) if tail else None
        mx.eval(kc, ks, vc, vs, q, *([tk, tv] if tail else []))
        sets.append((q, kc, ks, vc, vs, tk, tv))
    scale = 1.0 / math.sqrt(d)

    def make(s):
        q, kc, ks, vc, vs, tk, tv = s
        if kernel_only:
            qr = rot.forward(q).astype(q.dtype)  # half queries: the tensor-core kernel
            mx.eval(qr)
            return lambda: ops.compressed_attention(
                qr, kc, ks, vc, vs, kc_, vc_, n, scale, kb, vb, True, tail_k=tk, tail_v=tv
            )[0]

        def step():
            out, _ = ops.compressed_attention(
                rot.forward(q).astype(q.dtype), kc, ks, vc, vs, kc_, vc_, n, scale, kb, vb, True
            )
            return rot.inverse(out).astype(q.dtype)

        return step

    t = measure([make(s) for s in sets])
    return t, per_set


def bench_sdpa(b, hq, hkv, d, n):
    per_set = 2 * b * hkv * n * d * 2
    sets = []
    for _ in range(n_sets(per_set)):
        k = mx.random.normal((b, hkv, n, d)).astype(mx.float16)
        v = mx.random.normal((b, hkv, n, d)).astype(mx.float16)
        q = mx.random.normal((b, hq, 1, d)).astype(mx.float16)
        mx.eval(k, v, q)
        sets.append((q, k, v))
    scale = 1.0 / math.sqrt(d)
    fns = [
        (lambda s: lambda: mx.fast.scaled_dot_product_attention(s[0], s[1], s[2], scale=scale))(s)
        for s in sets
    ]
    return measure(fns), per_set


def affine_sdpa(queries, q_keys, q_values, scale, group_size=64, bits=4):
    """mlx-lm's quantized attention: scores and output through quantized matmuls."""
    b, hq, length, d = queries.shape
    hkv = q_keys[0].shape[-3]
    rep = hq // hkv
    queries = queries * scale
    if rep > 1:
        queries = queries.reshape(b, hkv, rep, length, d)
        q_keys = [mx.expand_dims(x, -3) for x in q_keys]
        q_values = [mx.expand_dims(x, -3) for x in q_values]
    scores = mx.quantized_matmul(queries, *q_keys, transpose=True, group_size=group_size, bits=bits)
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(scores, *q_values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(b, hq, length, d) if rep > 1 else out


def bench_affine(b, hq, hkv, d, n, bits=4, group_size=64):
    per_set = 2 * b * hkv * n * (d * bits // 8 + 2 * 2 * d // group_size)
    sets = []
    for _ in range(n_sets(per_set)):
        k = mx.random.normal((b, hkv, n, d)).astype(mx.float16)
        v = mx.random.normal((b, hkv, n, d)).astype(mx.float16)
        qk = mx.quantize(k, group_size=group_size, bits=bits)
        qv = mx.quantize(v, group_size=group_size, bits=bits)
        q = mx.random.normal((b, hq, 1, d)).astype(mx.float16)
        mx.eval(qk, qv, q)
        del k, v
        sets.append((q, qk, qv))
    scale = 1.0 / math.sqrt(d)
    fns = [
        (lambda s: lambda: affine_sdpa(s[0], s[1], s[2], scale, group_size, bits))(s) for s in sets
    ]
    return measure(fns), per_set


def main():
    global REPS, ROUNDS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,32768,131072,262144")
    parser.add_argument("--quick", action="store_true", help="D=128 shapes only")
    parser.add_argument("--no-affine", action="store_true")
    parser.add_argument("--no-sweep", action="store_true", help="skip the split-count sweep")
    parser.add_argument("--reps", type=int, default=REPS, help="calls timed alone (median)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="rounds of 16 queued calls")
    args = parser.parse_args()
    REPS, ROUNDS = args.reps, args.rounds
    lengths = [int(x) for x in args.lengths.split(",")]
    mx.set_default_device(mx.gpu)
    print(
        f"mlx {mx.__version__}, device {mx.default_device()}, turboquant backend "
        f"{_ext.gpu_backend()} (kernels: {_ext.gpu_available()})"
    )

    mlx_bw, torch_bw = device_bandwidth()
    ref_bw = torch_bw or mlx_bw
    print(
        f"\nDevice bandwidth: MLX a*1.0 on 2 GiB {mlx_bw / 1e12:.2f} TB/s (read+write)"
        + (f", torch copy {torch_bw / 1e12:.2f} TB/s" if torch_bw else "")
        + f"; reference for %: {ref_bw / 1e12:.2f} TB/s\n"
    )

    shapes = [("32q/8kv d128", 1, 32, 8, 128)]
    if not args.quick:
        shapes += [("16q/4kv d256", 1, 16, 4, 256), ("16q/2kv d256", 1, 16, 2, 256)]

    for name, b, hq, hkv, d in shapes:
        print(f"### B={b}, {name}, one query token\n")
        print(
            "| context | method | µs (eval) | µs (stream) | GB/s (stream) | % of device BW | × vs fp16 SDPA (eval) | × (stream) |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|")
        for n in lengths:
            rows = []
            (se, ss), sb = bench_sdpa(b, hq, hkv, d, n)
            rows.append(("fp16 SDPA", se, ss, sb))
            for kb, vb in ((4, 4), (3, 3)):
                (te, ts), tb = bench_turboquant(b, hq, hkv, d, n, kb, vb)
                rows.append((f"TurboQuant K{kb}V{vb} (rot+attn+unrot)", te, ts, tb))
                if (kb, vb) == (4, 4):
                    (ke, kst), _ = bench_turboquant(b, hq, hkv, d, n, kb, vb, kernel_only=True)
                    rows.append((f"TurboQuant K{kb}V{vb} kernel only", ke, kst, tb))
                    if d == 128:
                        # tq4's decode step: 4 sinks + 32 window tokens as the op's tail
                        (ke, kst), _ = bench_turboquant(
                            b, hq, hkv, d, n, kb, vb, kernel_only=True, tail=36
                        )
                        rows.append((f"TurboQuant K{kb}V{vb} kernel + 36-token tail", ke, kst, tb))
            if not args.no_affine:
                (ae, ast), ab = bench_affine(b, hq, hkv, d, n)
                rows.append(("mlx-lm affine 4-bit g64", ae, ast, ab))
            for label, te, ts, nbytes in rows:
                print(
                    f"| {n // 1024}k | {label} | {te * 1e6:.1f} | {ts * 1e6:.1f} | "
                    f"{nbytes / ts / 1e9:.0f} | {100 * nbytes / ts / ref_bw:.0f}% | "
                    f"{se / te:.2f} | {ss / ts:.2f} |"
                )
            mx.clear_cache()
        print()

    if args.no_sweep:
        return
    # Split-count sweep for the main shape (the split heuristic's target, a kernel
    # override of _ext).
    print("### Split sweep, 32q/8kv d128 K4V4, kernel only (µs, stream)\n")
    targets = (264, 528, 1056, 2112)
    print("| context | " + " | ".join(f"{t} CTAs" for t in targets) + " |")
    print("|---:|" + "---:|" * len(targets))
    for n in lengths:
        cells = []
        for t in targets:
            _ext._set_kernel_override("ctas", t)
            (_, ts), _ = bench_turboquant(1, 32, 8, 128, n, 4, 4, kernel_only=True)
            cells.append(f"{ts * 1e6:.1f}")
        _ext._set_kernel_override("ctas", None)
        print(f"| {n // 1024}k | " + " | ".join(cells) + " |")
        mx.clear_cache()


if __name__ == "__main__":
    main()
