# Copyright © 2026 turboquant_mlx contributors.

"""One layer's decode step on one cache, without a model: the Python time to build it
(``update_and_fetch`` + the attention call, as mlx-lm's attention layers make them:
``base.scaled_dot_product_attention``, which the hook routes to our caches) and the time
to evaluate it, one step at a time (synchronous), for mlx-lm's fp16 ``KVCache`` (the
baseline), the plain codec and the default preset's variants.

A window preset's first ``fp16_recent_tokens`` steps after a prefill quantize tokens
that came with the prefill (read from the window); later ones quantize tokens that
arrived alone and defer their window writes: the two halves of the run are printed
apart. "tq4 nodefer" writes the window every step (as before deferred writes).
32 query / 8 KV heads, head dim 128, float16 (float32 on the CPU), B=1.

Usage:
  python bench/layer_step.py gpu 4096,131072
"""

import sys, time, statistics
import mlx.core as mx
from mlx_lm.models import base
from mlx_lm.models.cache import KVCache

from turboquant_mlx import TurboQuantKVCache, install_hook


def run(ctx, cfg, steps=80, dtype=mx.float16, defer=True):
    B, H, D, Hq = 1, 8, 128, 32
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
        q = mx.random.normal((B, Hq, 8, D)).astype(dtype)
        # (a short query block: the compressed caches' decode path)
        mx.eval(base.scaled_dot_product_attention(q, k, v, cache=c, scale=0.088, mask=None))
    # the steps' inputs made up front, so that a step's build time is the cache's alone
    ks = [mx.random.normal((B, H, 1, D)).astype(dtype) for _ in range(steps)]
    vs = [mx.random.normal((B, H, 1, D)).astype(dtype) for _ in range(steps)]
    qs = [mx.random.normal((B, Hq, 1, D)).astype(dtype) for _ in range(steps)]
    mx.eval(ks, vs, qs)
    tb, te = [], []
    for i in range(steps):
        t0 = time.perf_counter()
        k, v = c.update_and_fetch(ks[i], vs[i])
        o = base.scaled_dot_product_attention(qs[i], k, v, cache=c, scale=0.088, mask=None)
        t1 = time.perf_counter()
        mx.eval(o)
        t2 = time.perf_counter()
        tb.append(t1 - t0); te.append(t2 - t1)
    h = steps // 2  # (before / after the window's prefill tokens have left it)
    return (statistics.median(tb[:h]) * 1e6, statistics.median(te[:h]) * 1e6,
            statistics.median(tb[h:]) * 1e6, statistics.median(te[h:]) * 1e6)

def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else "gpu"
    mx.set_default_device(mx.gpu if dev == "gpu" else mx.cpu)
    ctxs = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4096,131072").split(",")]
    tq4 = dict(fp16_sink_tokens=4, fp16_recent_tokens=32, center=True)
    # float32 on the CPU, as models run there (its fp16 SDPA takes an unfused path whose
    # evaluation would dwarf and disturb the build times)
    dtype = mx.float16 if dev == "gpu" else mx.float32
    install_hook()  # base.scaled_dot_product_attention -> TurboQuantKVCache.attention
    print("| context | cache | first 40 steps: build / eval µs | next 40: build / eval µs "
          "| build × KVCache |\n|---:|---|---:|---:|---:|")
    for ctx in ctxs:
        base_build = None
        for name, cfg, defer in (("mlx-lm KVCache", None, True), ("k4v4", {}, True),
                                 ("tq4", tq4, True), ("tq4 nodefer", tq4, False),
                                 ("tq4-nowindow", dict(fp16_sink_tokens=4, center=True), True)):
            b1, e1, b2, e2 = run(ctx, cfg, defer=defer, dtype=dtype)
            base_build = base_build or b2
            print(f"| {ctx} | {name} | {b1:.0f} / {e1:.0f} | {b2:.0f} / {e2:.0f} "
                  f"| {b2 / base_build:.2f} |", flush=True)
            mx.clear_cache()


if __name__ == "__main__":
    main()
