# Copyright © 2026 turboquant_mlx contributors.

"""Where the host's time of one decode step goes: building the graph (Python, the
caches' bookkeeping, MLX's graph nodes), evaluating it (MLX encodes and launches every
node: each primitive's ``eval_gpu`` runs on the host here) and waiting for the device.

The 8B-shaped model of ``bench_decode.py``; each step is built, then ``mx.async_eval``
is called on it (host: encode and launch), then its token is waited for
(``.item()``), one step at a time, so the three phases do not overlap. Medians over
``--steps`` steps per cache and context after ``--warmup`` untimed ones in each of the
interleaved rounds. (A window preset's first ``fp16_recent_tokens`` steps after the
prefill differ from the later ones: ``--warmup 40`` times the steady state.)

``TQ_PROFILE=N`` also profiles the build and launch phases with cProfile and prints each
cache's N functions with the most time of their own (a C++ call counts to its Python
caller; ``_launch`` is the launch). ``TQ_PROFILER_RANGE=1`` brackets the timed rounds with
cuProfilerStart/Stop, for ``nsys profile --capture-range=cudaProfilerApi``.

Usage:
  python bench/step_phases.py --contexts 4096,131072 --caches fp16,k4v4
  TQ_PROFILE=25 python bench/step_phases.py --contexts 4096 --caches k4v4,tq4
"""

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import mlx.core as mx

import bench_decode as bd


def _profiler_range(start):
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    (lib.cuProfilerStart if start else lib.cuProfilerStop)()


def _launch(y):
    """(a function of its own, so that a profile lists the launch apart)"""
    mx.async_eval(y)


def phases(model, caches, steps, warmup, profile=None):
    tok = mx.array([1], dtype=mx.int32)
    out = {"build": [], "launch": [], "wait": []}
    for i in range(steps):
        if profile is not None and i >= warmup:
            profile.enable()
        t0 = time.perf_counter()
        logits = model(tok[:, None], cache=caches)[:, -1]
        y = mx.argmax(logits, axis=-1).astype(mx.int32)
        t1 = time.perf_counter()
        _launch(y)
        t2 = time.perf_counter()
        if profile is not None and i >= warmup:
            profile.disable()
        y.item()
        t3 = time.perf_counter()
        if i >= warmup:
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
    print(
        f"mlx {mx.__version__}, {mx.default_device()}: ms per step (median), one step at a time\n"
    )
    print("| context | cache | build | launch (encode) | wait (device) | total |")
    print("|---:|---|---:|---:|---:|---:|")
    for ctx in (int(x) for x in a.contexts.split(",")):
        held = {}
        for name in names:
            caches = bd.make_caches(model, name, ctx + a.rounds * (a.warmup + a.steps) + 1)
            bd.fill(caches, ctx, a, dtype)
            held[name] = caches
        times = {n: {"build": [], "launch": [], "wait": []} for n in names}
        top = int(os.environ.get("TQ_PROFILE", "0"))
        profiles = {n: cProfile.Profile() for n in names} if top else {}
        if os.environ.get("TQ_PROFILER_RANGE") == "1":
            _profiler_range(True)
        for r in range(a.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                got = phases(model, held[name], a.warmup + a.steps, a.warmup, profiles.get(name))
                for k, v in got.items():
                    times[name][k] += v
        if os.environ.get("TQ_PROFILER_RANGE") == "1":
            _profiler_range(False)
        for name in names:
            med = {k: statistics.median(v) * 1e3 for k, v in times[name].items()}
            print(
                f"| {ctx // 1024}k | {name} | {med['build']:.2f} | {med['launch']:.2f} | "
                f"{med['wait']:.2f} | {sum(med.values()):.2f} |",
                flush=True,
            )
        for name, prof in profiles.items():
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
            print(
                f"\n#### {ctx // 1024}k {name}: build + launch, "
                f"{len(times[name]['build'])} steps\n{text.getvalue()}",
                flush=True,
            )
        del held
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
