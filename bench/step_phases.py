# Copyright © 2026 turboquant_mlx contributors.

"""Where the host's time of one decode step goes: building the graph (Python, the
caches' bookkeeping, MLX's graph nodes), evaluating it (MLX encodes and launches every
node: each primitive's ``eval_gpu`` runs on the host here) and waiting for the device.

The 8B-shaped model of ``bench_decode.py``; each step is built, then ``mx.async_eval``
is called on it (host: encode and launch), then its token is waited for
(``.item()``), one step at a time, so the three phases do not overlap. Medians over
``--steps`` steps per cache and context; caches are timed in interleaved rounds.

Usage:
  python bench/step_phases.py --contexts 4096,131072 --caches fp16,k4v4
"""

import statistics
import sys
import time

import mlx.core as mx

import bench_decode as bd


def phases(model, caches, steps):
    tok = mx.array([1], dtype=mx.int32)
    out = {"build": [], "launch": [], "wait": []}
    for i in range(steps):
        t0 = time.perf_counter()
        logits = model(tok[:, None], cache=caches)[:, -1]
        y = mx.argmax(logits, axis=-1).astype(mx.int32)
        t1 = time.perf_counter()
        mx.async_eval(y)
        t2 = time.perf_counter()
        y.item()
        t3 = time.perf_counter()
        if i >= 2:  # warm-up
            out["build"].append(t1 - t0)
            out["launch"].append(t2 - t1)
            out["wait"].append(t3 - t2)
    return out


def main(argv=None):
    a = bd.parse_args(argv)
    mx.set_default_device(mx.gpu if mx.is_available(mx.gpu) else mx.cpu)
    dtype = getattr(mx, a.dtype or ("float16" if mx.default_device() == mx.gpu else "float32"))
    model = bd.build_model(a, dtype)
    names = [x.strip() for x in a.caches.split(",") if x.strip()]
    print(f"mlx {mx.__version__}, {mx.default_device()}: ms per step (median), one step at a "
          "time\n")
    print("| context | cache | build | launch (encode) | wait (device) | total |")
    print("|---:|---|---:|---:|---:|---:|")
    for ctx in (int(x) for x in a.contexts.split(",")):
        held = {}
        for name in names:
            caches = bd.make_caches(model, name, ctx + a.rounds * (a.steps + 2) + 1)
            with bd.variant(name):
                bd.fill(caches, ctx, a, dtype)
            held[name] = caches
        times = {n: {"build": [], "launch": [], "wait": []} for n in names}
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                with bd.variant(name):
                    got = phases(model, held[name], a.steps + 2)
                for k, v in got.items():
                    times[name][k] += v
        for name in names:
            med = {k: statistics.median(v) * 1e3 for k, v in times[name].items()}
            print(f"| {ctx // 1024}k | {name} | {med['build']:.2f} | {med['launch']:.2f} | "
                  f"{med['wait']:.2f} | {sum(med.values()):.2f} |", flush=True)
        del held
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
