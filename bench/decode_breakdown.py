# Copyright © 2026 turboquant_mlx contributors.

"""Where a compressed cache's decode step goes: the 8B-shaped model of
``bench_decode.py`` at one context, timed with the fp16 cache, with a compressed
cache, and with that cache's parts left out one at a time.

Variants (same filled caches, timed in ``--rounds`` interleaved rounds whose order
rotates, median step time over all rounds):
  fp16           mlx-lm's KVCache
  <cache>        the compressed cache, as in bench_decode.py
  no-attention   ``ops.compressed_attention`` replaced by zeros of its output shapes
                 (the attention kernels, split-K merge and their launches left out;
                 the query rotation and the output's inverse rotation still run)
  no-append      ``ops.quantize_append`` returns the cache buffers unchanged (the
                 key/value rotations still run; the new token is not stored)
  neither        both left out

The differences between rows attribute the step time: <cache> - no-attention is what
attention over the compressed cache costs inside the model (to set against the
kernel-only figures of bench_gpu.py), <cache> - no-append what storing a token costs.
A left-out variant computes wrong logits: these rows are timings only.

Usage:
  python bench/decode_breakdown.py --context 131072 --cache k4v4
"""

import argparse
import statistics
import sys

import mlx.core as mx

import bench_decode as bd
from turboquant_mlx import _ext, ops


def _zeros_attention(q, *args, **kwargs):
    B, n_q, L, D = q.shape
    return mx.zeros((B, n_q, L, D), mx.float32), mx.zeros((B, n_q, L), mx.float32)


def _keep_buffers(codes, scales, *args, **kwargs):
    return codes, scales


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--cache", default="k4v4", help="a bench_decode.py cache name")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    own, rest = p.parse_known_args(argv)
    a = bd.parse_args(
        rest + ["--steps", str(own.steps), "--warmup", str(own.warmup), "--rounds", str(own.rounds)]
    )
    mx.set_default_device(mx.gpu if mx.is_available(mx.gpu) else mx.cpu)
    dtype = getattr(mx, a.dtype or ("float16" if mx.default_device() == mx.gpu else "float32"))
    print(
        f"mlx {mx.__version__}, {mx.default_device()}, kernels {_ext.gpu_backend()}, "
        f"context {own.context}, cache {own.cache}",
        flush=True,
    )
    model = bd.build_model(a, dtype)
    total = own.context + a.rounds * 4 * (a.warmup + a.steps) + 1

    fp16 = bd.make_caches(model, "fp16", total)
    bd.fill(fp16, own.context, a, dtype)
    caches = bd.make_caches(model, own.cache, total)
    bd.fill(caches, own.context, a, dtype)
    real_attention, real_append = ops.compressed_attention, ops.quantize_append
    variants = [
        ("fp16", fp16, real_attention, real_append),
        (own.cache, caches, real_attention, real_append),
        ("no-attention", caches, _zeros_attention, real_append),
        ("no-append", caches, real_attention, _keep_buffers),
        ("neither", caches, _zeros_attention, _keep_buffers),
    ]
    times = {name: [] for name, *_ in variants}
    try:
        for r in range(a.rounds):
            for name, cache, attention, append in variants[r % 5 :] + variants[: r % 5]:
                ops.compressed_attention, ops.quantize_append = attention, append
                times[name] += bd.time_decode(model, cache, a)[0]
    finally:
        ops.compressed_attention, ops.quantize_append = real_attention, real_append
    rows = [(name, statistics.median(t)) for name, t in times.items()]

    layers = len(model.layers)
    print(
        f"\n### Decode step breakdown, {own.context} tokens, {layers} layers, "
        f"{mx.default_device()}\n"
    )
    print("| variant | ms/token | µs/layer vs fp16 |\n|---|---:|---:|")
    base = rows[0][1]
    for name, med in rows:
        print(f"| {name} | {med * 1e3:.2f} | {(med - base) / layers * 1e6:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
