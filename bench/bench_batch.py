# Copyright © 2026 turboquant_mlx contributors.

"""Batched decode: total tokens/s at several batch sizes, and how many sequences fit in
a memory budget, fp16 cache vs compressed caches.

The model is the 8B-shaped 4-bit llama of bench/bench_decode.py (``build_model``:
mlx-lm's llama with random weights, 32 layers, hidden 4096, 32 query / 8 KV heads of
head dim 128, intermediate 14336, vocab 128256, linear layers and embedding at 4 bits,
group size 64; float16 activations on the GPU, float32 on the CPU).

For each context (``--contexts``), batch size (``--batches``) and cache (``--caches``):

1. ``B`` single-sequence prompt caches are made (``fp16``: mlx-lm's KVCache; a preset
   name such as ``tq4`` or ``k4v3``: ``turboquant_mlx.cache.make_prompt_cache``, each
   TurboQuantKVCache ``reserve``d for the run; see ``bench_decode.make_caches``) and
   every one is filled with ``context`` tokens of random keys and values of the
   model's dtype (``bench_decode.fill``: ``update_and_fetch`` in chunks of ``--chunk``,
   at most half the context, evaluated after each) instead of a prompt pass. A
   compressed cache calibrates and compresses a chunk when the next one arrives, so
   with two chunks or more every single cache holds its context compressed (but its
   fp16 sinks and window), as the prompt cache of an earlier request would.
2. The ``B`` caches of each layer are merged into one batch cache by mlx-lm's own merge
   path (``mlx_lm.generate._merge_caches``, which ``BatchGenerator`` and
   ``batch_generate`` call for caches with history: ``type(c).merge(caches)``), giving
   mlx-lm's BatchKVCache for fp16 and BatchTurboQuantKVCache
   (``TurboQuantKVCache.merge``) for the compressed caches. This is done one layer at a
   time (fill that layer's ``B`` caches, merge, evaluate, drop the single caches), so
   that the single caches and the batch never both hold the whole context.
3. The model decodes ``--warmup`` untimed then ``--steps`` timed steps as
   ``BatchGenerator._step`` runs them: the ``(B, 1)`` tokens through the model, the
   last position's logits normalised to log-probabilities, the greedy token of each
   row; the next step's graph is built and started (``mx.async_eval``) before the
   current tokens are read (``.tolist()``). All rows are the same length (no left
   padding).

   The warm-up (default 160 steps) is long enough for the caches to reach the layout
   they keep while decoding goes on: mlx-lm's BatchKVCache grows its buffers by 256
   columns at the first step, and a BatchTurboQuantKVCache merged from caches of a
   context that is a multiple of 256 grows its code buffers by a quarter (to the next
   256) when the first token leaves its fp16 window, after ``fp16_recent_tokens`` + 1
   steps (tq4: 33, k4v3: 129). The memory columns are measured after that growth, as
   a server would see it; with a shorter warm-up they miss it.

Table 1 (per context, batch size and cache):
  KV            what the batch cache holds after the timed steps (allocated buffers,
                all layers) and "KV / fp16" its ratio to the fp16 cache's
  tok/s         total decode tokens/s: ``B`` over the median step time
  ms/step       the median step time
  × fp16        tok/s over the fp16 cache's at the same context and batch size,
                measured in the same run (fp16 must come first in ``--caches``)
  peak          MLX's peak memory over the timed steps, plus the peak of what the
                extension's CUDA backend allocates outside MLX's allocator
                (``bench_decode.peak_memory``): weights + caches + the steps'
                temporaries (nothing else is held then)
  temp          peak - weights - KV

Table 2 (per context and cache): how many sequences of that context fit in
``--budget-gib`` of memory during decode. Method: the peak of a batch of ``B`` is taken
as ``fixed + B * per_sequence``, with
  KV/seq        KV bytes of the largest batch measured, over its ``B``;
  temp/seq      the growth of the temporaries (temp) per sequence between the
                smallest and the largest batch measured (0 with one batch size or if
                they shrink);
  fixed         weights + the temporaries of the smallest batch less its ``B`` times
                temp/seq: what a batch costs whatever its size;
  fit           floor((budget - fixed) / (KV/seq + temp/seq)), and "× fp16" that over
                the fp16 cache's.
It counts decode only: the memory of a prompt pass for a new request, and of a
BatchKVCache growing (mlx-lm concatenates a layer's buffer with 256 new columns, so
that layer exists twice for a moment), is not in it except where it happened during
the timed steps.

Memory is in GiB (``--memory-unit MiB`` for small models).

A cache that fails is reported in its row ("does not fit" for out-of-memory) and the
others still run. Rows are printed as they are measured (and ``--markdown-out`` is
rewritten with both tables), each measured row is appended to ``--jsonl``; progress
goes to stderr.

Usage:
  python bench/bench_batch.py                               # GPU, 32k, batches 1, 4, 16
  python bench/bench_batch.py --contexts 8192,32768 --budget-gib 128
  python bench/bench_batch.py --device cpu --layers 2 --hidden 576 --heads 9 \\
      --kv-heads 3 --head-dim 64 --intermediate 1536 --vocab 1024 \\
      --contexts 4096 --budget-gib 1 --memory-unit MiB
"""

import argparse
import math
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm.generate import _merge_caches

import _long
import bench_decode
from _long import GiB, context_label, fmt, log

DEFAULT_CACHES = "fp16,tq4,k4v3"
MiB = 2**20


def parse_args(argv=None):
    p = _long.base_parser(__doc__)
    p.add_argument(
        "--contexts",
        default="32768",
        help="comma-separated tokens held by every sequence (default 32768)",
    )
    p.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    p.add_argument(
        "--caches",
        default=DEFAULT_CACHES,
        help=f"comma-separated, fp16 first (default {DEFAULT_CACHES})",
    )
    p.add_argument("--steps", type=int, default=20, help="timed decode steps")
    p.add_argument(
        "--warmup",
        type=int,
        default=160,
        help="untimed decode steps first (default 160: past the compressed "
        "caches' first code-buffer growth, see above)",
    )
    p.add_argument("--chunk", type=int, default=4096, help="tokens per cache fill call")
    p.add_argument(
        "--budget-gib",
        type=float,
        default=64.0,
        help="memory budget of the second table, GiB (default 64)",
    )
    _long.add_device_args(p)
    p.add_argument(
        "--memory-unit",
        choices=("GiB", "MiB"),
        default="GiB",
        help="unit of the memory columns (MiB for small models)",
    )
    g = p.add_argument_group("model (bench_decode.build_model; Llama-3-8B shape)")
    g.add_argument("--layers", type=int, default=32)
    g.add_argument("--hidden", type=int, default=4096)
    g.add_argument("--heads", type=int, default=32)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--intermediate", type=int, default=14336)
    g.add_argument("--vocab", type=int, default=128256)
    g.add_argument("--weight-bits", type=int, default=4)
    g.add_argument("--group-size", type=int, default=64)
    a = p.parse_args(argv)
    for name in ("steps", "warmup", "chunk"):
        if getattr(a, name) < (1 if name != "warmup" else 0):
            p.error(f"--{name} must be positive, got {getattr(a, name)}")
    if a.budget_gib <= 0:
        p.error(f"--budget-gib must be positive, got {a.budget_gib}")
    return a


def batch_cache(model, name, batch, context, a, dtype):
    """The merged batch cache of ``batch`` sequences of ``context`` random tokens
    (module docstring, steps 1 and 2), one layer at a time."""
    reserve = context + a.warmup + a.steps + 16
    singles = [_long.make_cache(model, name, reserve) for _ in range(batch)]
    # Two chunks at least: a compressed cache holds a lone first chunk uncompressed
    # (it calibrates at the next append), and a merge of such caches keeps an fp16
    # copy of the whole context until its buffer is next rebuilt.
    chunk = min(a.chunk, -(-context // 2))
    shape = argparse.Namespace(chunk=chunk, kv_heads=a.kv_heads, head_dim=a.head_dim)
    merged = []
    for i in range(len(model.layers)):
        bench_decode.fill([s[i] for s in singles], context, shape, dtype)
        layer = _merge_caches([[s[i]] for s in singles])[0]
        mx.eval(layer.state)
        merged.append(layer)
        for s in singles:
            s[i] = None
        _long.free()
    return merged


def time_decode(model, cache, batch, a):
    """Step times of ``a.warmup`` untimed then ``a.steps`` timed batched decode steps
    (module docstring, step 3), the peak memory over the timed ones, and whether the
    last log-probabilities are finite."""

    def step(tokens):
        logits = model(tokens[:, None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(logprobs, axis=-1), logprobs

    state = {"y": mx.ones((batch,), mx.uint32)}
    state["y"], state["logprobs"] = step(state["y"])
    mx.async_eval(state["y"], state["logprobs"])

    def run(n):
        times = []
        t0 = time.perf_counter()
        for _ in range(n):
            next_y, next_logprobs = step(state["y"])
            mx.async_eval(next_y, next_logprobs)
            mx.eval(state["y"], state["logprobs"])
            state["y"].tolist()  # as BatchGenerator hands out each step's tokens
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0 = t1
            state["y"], state["logprobs"] = next_y, next_logprobs
        return times

    run(a.warmup)
    mx.synchronize()
    bench_decode.reset_peak_memory()
    times = run(a.steps)
    mx.eval(state["y"], state["logprobs"])
    mx.synchronize()
    peak = bench_decode.peak_memory()
    return times, peak, _long.finite(state["logprobs"])


def fit_budget(rows, weights, budget):
    """Table 2's numbers (module docstring) from the measured rows of one context and
    cache (``{batch: record}``): ``(kv_seq, temp_seq, fixed, fit)`` in bytes and
    sequences."""
    sizes = sorted(rows)
    lo, hi = rows[sizes[0]], rows[sizes[-1]]
    kv_seq = hi["kv_bytes"] / hi["batch"]
    temp_seq = 0.0
    if hi["batch"] > lo["batch"]:
        temp_seq = max(0.0, (hi["temp_bytes"] - lo["temp_bytes"]) / (hi["batch"] - lo["batch"]))
    fixed = weights + max(0.0, lo["temp_bytes"] - lo["batch"] * temp_seq)
    fit = max(0, math.floor((budget - fixed) / (kv_seq + temp_seq)))
    return kv_seq, temp_seq, fixed, fit


def main(argv=None):
    a = parse_args(argv)
    dtype = _long.setup_device(a)
    contexts = [int(x) for x in _long.split_names(a.contexts)]
    batches = [int(x) for x in _long.split_names(a.batches)]
    names = _long.split_names(a.caches)
    if "fp16" in names and names[0] != "fp16":
        raise SystemExit("--caches: fp16 must come first (it is the baseline)")
    if not contexts or not batches or min(contexts + batches) < 1:
        raise SystemExit(
            f"--contexts and --batches must be positive integers, got "
            f"{a.contexts!r} and {a.batches!r}"
        )

    print(_long.device_line(a), flush=True)
    print(_long.describe_model("llama8b", a), flush=True)
    t0 = time.perf_counter()
    log("building llama8b")
    model = _long.build_model("llama8b", a, dtype)
    weights = _long.weight_bytes(model)
    print(
        f"weights {weights / GiB:.2f} GiB (built in {time.perf_counter() - t0:.1f} s); "
        f"{a.warmup} warm-up + {a.steps} timed steps per row, median; contexts "
        f"{a.contexts}; batches {a.batches}; caches {', '.join(names)}",
        flush=True,
    )

    shape = (
        "8B-shaped llama"
        if (a.layers, a.hidden) == (32, 4096)
        else f"llama {a.layers} layers, hidden {a.hidden}, {a.kv_heads} KV heads x {a.head_dim}"
    )
    u = a.memory_unit
    unit = GiB if u == "GiB" else MiB

    def mem(x, digits=2):
        return f"{x / unit:.{digits}f}"

    where = f"{a.weight_bits}-bit weights, {a.dtype}, {mx.default_device()}"
    decode = _long.Table(
        f"### Batched decode, {shape} ({where})",
        [
            ("context", True),
            ("batch", False),
            ("cache", True),
            (f"KV {u}", False),
            ("KV / fp16", False),
            ("tok/s", False),
            ("ms/step", False),
            ("× fp16", False),
            (f"peak {u}", False),
            (f"temp {u}", False),
        ],
        None,
        a.jsonl,
    )
    budget = a.budget_gib * GiB
    fits = None

    def write_markdown():
        if a.markdown_out:
            with open(a.markdown_out, "w") as f:
                f.write(decode.markdown() + ("\n" + fits.markdown() if fits else ""))

    measured = {}  # (context, cache) -> {batch: record}
    for ctx in contexts:
        label = context_label(ctx)
        for batch in batches:
            base = None
            for name in names:
                cache = None
                err = None
                try:
                    _long.free()
                    mx.synchronize()
                    t1 = time.perf_counter()
                    log(f"{label} B={batch} {name}: fill and merge")
                    cache = batch_cache(model, name, batch, ctx, a, dtype)
                    t_fill = time.perf_counter() - t1
                    log(f"{label} B={batch} {name}: decode ({t_fill:.1f} s to fill)")
                    times, peak, ok = time_decode(model, cache, batch, a)
                    kv = bench_decode.kv_bytes(cache)
                    kind = type(cache[0]).__name__
                except Exception as e:  # report it, keep measuring the other caches
                    log(f"{label} B={batch} {name}: {type(e).__name__}: {e}")
                    err = (_long.failure(e), str(e)[:300], _long.is_oom(e))
                del cache
                _long.free()
                record = dict(
                    bench="batch",
                    context=ctx,
                    batch=batch,
                    cache=name,
                    dtype=a.dtype,
                    device=str(mx.default_device()),
                )
                if err is not None:
                    decode.add([label, batch, name, err[0]], dict(record, error=err[1], oom=err[2]))
                    write_markdown()
                    continue
                step_s = statistics.median(times)
                tps = batch / step_s
                record.update(
                    batch_cache=kind,
                    kv_bytes=kv,
                    tokens_per_s=tps,
                    step_s=step_s,
                    peak_bytes=peak,
                    weights_bytes=weights,
                    temp_bytes=peak - weights - kv,
                    finite=ok,
                    fill_s=t_fill,
                )
                if name == "fp16":
                    base = record
                ratio = kv_ratio = None
                if base is not None and name != "fp16":
                    ratio = tps / base["tokens_per_s"]
                    kv_ratio = kv / base["kv_bytes"]
                    record.update(ratio_fp16=ratio, kv_ratio_fp16=kv_ratio)
                cells = [
                    label,
                    batch,
                    name,
                    mem(kv, 3),
                    fmt(kv_ratio, 3),
                    fmt(tps),
                    fmt(step_s * 1e3, 2),
                    fmt(ratio, 2),
                    mem(peak),
                    mem(record["temp_bytes"]),
                ]
                if not ok:
                    cells[-1] += " (non-finite logits)"
                decode.add(
                    cells,
                    record,
                    note=f"{kind}, fill {t_fill:.1f} s, best {min(times) * 1e3:.2f} ms",
                )
                measured.setdefault((ctx, name), {})[batch] = record
                write_markdown()

    fits = _long.Table(
        f"### Sequences in {a.budget_gib:g} GiB during decode, {shape} ({where}; "
        f"fixed + B x (KV/seq + temp/seq) from batches {a.batches}, bench/bench_batch.py's "
        "docstring)",
        [
            ("context", True),
            ("cache", True),
            ("KV MiB/seq", False),
            ("temp MiB/seq", False),
            (f"fixed {u}", False),
            (f"sequences in {a.budget_gib:g} GiB", False),
            ("× fp16", False),
        ],
        None,
        a.jsonl,
    )
    for ctx in contexts:
        base_fit = None
        for name in names:
            rows = measured.get((ctx, name))
            if not rows:
                fits.add([context_label(ctx), name, "no measured row"])
                continue
            kv_seq, temp_seq, fixed, fit = fit_budget(rows, weights, budget)
            if name == "fp16":
                base_fit = fit
            ratio = fit / base_fit if base_fit and name != "fp16" else None
            fits.add(
                [
                    context_label(ctx),
                    name,
                    fmt(kv_seq / MiB, 2),
                    fmt(temp_seq / MiB, 2),
                    mem(fixed),
                    fit,
                    fmt(ratio, 2),
                ],
                dict(
                    bench="batch_budget",
                    context=ctx,
                    cache=name,
                    dtype=a.dtype,
                    device=str(mx.default_device()),
                    budget_bytes=budget,
                    kv_bytes_per_seq=kv_seq,
                    temp_bytes_per_seq=temp_seq,
                    fixed_bytes=fixed,
                    sequences=fit,
                    ratio_fp16=ratio,
                    batches=sorted(rows),
                ),
            )
    write_markdown()
    decode.finish()
    fits.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
