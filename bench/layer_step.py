# Copyright © 2026 turboquant_mlx contributors.

"""Layers' decode steps on their caches, without a model: the Python time to build them
(``update_and_fetch`` + the attention call, as mlx-lm's attention layers make them:
``base.scaled_dot_product_attention``, which the hook routes to our caches), the time
``mx.async_eval`` takes to encode and launch them, and the wait for the device, one step
at a time, for mlx-lm's fp16 ``KVCache`` (the baseline), the plain codec and the default
preset's variants. Times are per layer.

``--layers N`` steps N independent layers (one cache each) together, as a model's step
has them in one evaluation: what a cache costs the host can depend on how many nodes an
evaluation holds (MLX's CUDA backend commits a graph every 100 kernel nodes), which one
layer alone does not show.

The first ``fp16_recent_tokens`` steps of a window preset after a prefill quantize
tokens that came with the prefill (from the window buffer), the later ones tokens that
arrived alone: the two halves of the run are printed apart. "tq4 nodefer" writes the
window every step instead of deferring it. 32 query / 8 KV heads, head dim 128, float16
(float32 on the CPU), B=1.

Usage:
  python bench/layer_step.py gpu 4096,131072
  python bench/layer_step.py gpu 4096 --layers 32
"""

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models import base
from mlx_lm.models.cache import KVCache

from turboquant_mlx import TurboQuantKVCache, install_hook

B, H, D, HQ = 1, 8, 128, 32


def make_cache(ctx, cfg, steps, dtype, defer):
    if cfg is None:
        c = KVCache()
    else:
        c = TurboQuantKVCache(**cfg)
        if not defer:
            c._defer_window_write = lambda *a: False
        c.reserve(ctx + steps + 8)
    chunk = 4096
    for p in range(0, ctx, chunk):
        n = min(chunk, ctx - p)
        k = mx.random.normal((B, H, n, D)).astype(dtype)
        v = mx.random.normal((B, H, n, D)).astype(dtype)
        k, v = c.update_and_fetch(k, v)
        q = mx.random.normal((B, HQ, 8, D)).astype(dtype)
        # (a short query block: the compressed caches' decode path)
        mx.eval(base.scaled_dot_product_attention(q, k, v, cache=c, scale=0.088, mask=None))
    return c


def run(ctx, cfg, layers, steps=80, dtype=mx.float16, defer=True):
    caches = [make_cache(ctx, cfg, steps, dtype, defer) for _ in range(layers)]
    # the steps' inputs made up front, so that a step's build time is the caches' alone
    ks = [
        [mx.random.normal((B, H, 1, D)).astype(dtype) for _ in range(layers)] for _ in range(steps)
    ]
    vs = [
        [mx.random.normal((B, H, 1, D)).astype(dtype) for _ in range(layers)] for _ in range(steps)
    ]
    qs = [
        [mx.random.normal((B, HQ, 1, D)).astype(dtype) for _ in range(layers)] for _ in range(steps)
    ]
    mx.eval(ks, vs, qs)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        outs = []
        for c, k, v, q in zip(caches, ks[i], vs[i], qs[i]):
            k, v = c.update_and_fetch(k, v)
            outs.append(base.scaled_dot_product_attention(q, k, v, cache=c, scale=0.088, mask=None))
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        t3 = time.perf_counter()
        times.append([(t1 - t0) / layers, (t2 - t1) / layers, (t3 - t2) / layers])
    h = steps // 2  # (before / after the window's prefill tokens have left it)
    med = lambda rows: [statistics.median(r[j] for r in rows) * 1e6 for j in range(3)]  # noqa: E731
    return med(times[:h]), med(times[h:])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("device", nargs="?", default="gpu", choices=("gpu", "cpu"))
    p.add_argument("contexts", nargs="?", default="4096,131072")
    p.add_argument("--layers", type=int, default=1, help="layers stepped together")
    p.add_argument("--steps", type=int, default=80)
    a = p.parse_args()
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    tq4 = dict(fp16_sink_tokens=4, fp16_recent_tokens=32, center=True)
    # float32 on the CPU, as models run there (its fp16 SDPA takes an unfused path whose
    # evaluation would dwarf and disturb the build times)
    dtype = mx.float16 if a.device == "gpu" else mx.float32
    install_hook()  # base.scaled_dot_product_attention -> TurboQuantKVCache.attention
    print(f"{a.layers} layer(s) per step, µs per layer: build / launch / wait\n")
    print(
        "| context | cache | first half | second half | build × KVCache |\n"
        "|---:|---|---:|---:|---:|"
    )
    for ctx in (int(x) for x in a.contexts.split(",")):
        base_build = None
        for name, cfg, defer in (
            ("mlx-lm KVCache", None, True),
            ("k4v4", {}, True),
            ("tq4", tq4, True),
            ("tq4 nodefer", tq4, False),
            ("tq4-nowindow", dict(fp16_sink_tokens=4, center=True), True),
        ):
            first, second = run(ctx, cfg, a.layers, a.steps, dtype, defer)
            base_build = base_build or second[0]
            show = lambda t: " / ".join(f"{x:.0f}" for x in t)  # noqa: E731
            print(
                f"| {ctx} | {name} | {show(first)} | {show(second)} "
                f"| {second[0] / base_build:.2f} |",
                flush=True,
            )
            mx.clear_cache()


if __name__ == "__main__":
    main()
