# Copyright © 2026 turboquant_mlx contributors.

"""Prompt processing speed and peak memory, fp16 cache vs compressed caches.

For each context length (``--contexts``) and each cache (``--caches``), a random prompt
of that many tokens goes through the model as mlx-lm's ``generate_step`` prefills it
(every token but the last in blocks of ``--block`` tokens: ``model(tokens[None,
i:i+n], cache=c)``, ``mx.eval([x.state for x in c])``, ``mx.clear_cache()``), then the
last token's forward pass gives the first generated token. Models, caches and the
prompt are described in bench/_long.py (``--model llama8b``: the 8B-shaped 4-bit
llama of bench/bench_decode.py; ``--model qwen35moe``: the Qwen3.5-35B-A3B-shaped
hybrid MoE). Each cache is first warmed up once on a short prompt
(``--warmup-tokens``, default two blocks and a token: MLX's CUDA backend compiles
kernels on first use), and on a GPU MLX's fused attention is first run once at every
shape the prompt meets (it builds a cuDNN graph per new shape: otherwise the first
cache timed pays for graphs the others reuse); a cache is built fresh for every
measurement and everything is freed between caches.

Columns:
  prompt tok/s   prompt tokens but the last, over the time of their blocks
  × fp16         that over the fp16 cache's at the same context
  TTFT s         time to first token: from the first block to the first generated
                 token evaluated
  weights GiB    the model's parameters
  KV GiB         what the cache holds after the prompt (allocated buffers, all layers;
                 on qwen35moe also the linear-attention states)
  peak GiB       peak memory from just before the cache's prompt to its first token:
                 MLX's peak plus the peak of what the extension's CUDA backend
                 allocates outside MLX's allocator (bench_decode.peak_memory)
  temp GiB       peak - weights - KV: the prompt's temporaries
  goal margin    for a compressed cache, (fp16 peak - 0.7 * (fp16 KV - KV)) - peak in
                 GiB: the goal is that a compressed cache's peak is below the fp16
                 cache's by at least 70% of the KV bytes it saves ("goal met": margin
                 >= 0)
  cache time     (``--cache-time`` only) the fraction of the blocks' wall time spent in
                 the caches' own work: each call of the cache class's
                 ``update_and_fetch`` (and, for TurboQuantKVCache, its
                 ``_prefill_operands`` where the class has one) evaluates its inputs
                 first, then its outputs and the cache's arrays, and is timed
                 (``_long.CacheTimer``, patched in this process only). This mode
                 synchronises once per layer and call, so its prompt tok/s is slower
                 than the normal run's and is not the headline number.

The fp16 cache must come first in ``--caches`` (it is the baseline of × fp16 and of
the memory goal). To split a long run over several invocations, give ``--jsonl
FILE`` to each: every measured row is appended there, and a run whose ``--caches``
leave out fp16 takes the last fp16 row of the same model, context, block and dtype
from that file as its baseline. Rows are printed as soon as each is measured (and
``--markdown-out`` is rewritten), so a run stopped by a timeout keeps the rows done;
progress goes to stderr. A cache that fails prints its row with the error ("does not
fit" for out-of-memory) and the others still run.

On MLX's CUDA backend, qwen35moe's prompt runs mlx-lm's gated delta net as a per-token
op loop (its kernels are Metal-only): ~10 s per 2048-token block on an H200, so keep
its contexts short there (bench/long_context.py's docstring).

Usage:
  python bench/bench_prefill.py                                   # GPU, 32k/128k/256k
  # the same in three calls of under 10 minutes each on an H200, one baseline:
  python bench/bench_prefill.py --contexts 32768,131072 --jsonl prefill.jsonl
  python bench/bench_prefill.py --contexts 262144 --caches fp16,tq4,tq3 --jsonl prefill.jsonl
  python bench/bench_prefill.py --contexts 262144 --caches k4v3,tq4-plain --jsonl prefill.jsonl
  python bench/bench_prefill.py --model qwen35moe --contexts 32768
  python bench/bench_prefill.py --cache-time --contexts 32768
  python bench/bench_prefill.py --device cpu --layers 2 --hidden 256 --heads 4 \\
      --kv-heads 2 --head-dim 64 --intermediate 512 --vocab 1024 --contexts 300 --block 128
"""

import sys
import time

import mlx.core as mx

import _long
from _long import GiB, context_label, fmt, gib, log

DEFAULT_CONTEXTS = "32768,131072,262144"
DEFAULT_CACHES = "fp16,tq4,tq3,k4v3,tq4-plain"


def parse_args(argv=None):
    p = _long.base_parser(__doc__)
    p.add_argument("--model", choices=_long.MODELS, default="llama8b")
    p.add_argument(
        "--contexts",
        default=DEFAULT_CONTEXTS,
        help=f"comma-separated prompt lengths (default {DEFAULT_CONTEXTS})",
    )
    p.add_argument(
        "--caches",
        default=DEFAULT_CACHES,
        help=f"comma-separated, fp16 first (default {DEFAULT_CACHES})",
    )
    p.add_argument(
        "--goal-fraction",
        type=float,
        default=0.7,
        help="share of the saved KV bytes that the peak must drop by (0.7)",
    )
    p.add_argument(
        "--cache-time",
        action="store_true",
        help="report the share of the prompt's time in the caches' own work "
        "(synchronising: slower prompt)",
    )
    p.add_argument(
        "--check-finite",
        choices=("auto", "always", "never"),
        default=None,
        help="TurboQuantKVCache.check_finite for this run (default: the class's, "
        "auto: each prompt block's new tokens read on the host per layer)",
    )
    _long.add_common_args(p)
    _long.add_model_args(p)
    return p.parse_args(argv)


def _baseline_from(records, a, ctx):
    for r in reversed(records):
        if (
            r.get("bench") == "prefill"
            and r.get("cache") == "fp16"
            and r.get("model") == a.model
            and r.get("context") == ctx
            and r.get("block") == a.block
            and r.get("dtype") == a.dtype
            and r.get("cache_time") == a.cache_time
            and "peak_bytes" in r
        ):
            return r
    return None


def main(argv=None):
    a = parse_args(argv)
    if a.check_finite is not None:
        from turboquant_mlx.cache import TurboQuantKVCache

        TurboQuantKVCache.check_finite = a.check_finite
    dtype = _long.setup_device(a)
    contexts = [int(x) for x in _long.split_names(a.contexts)]
    names = _long.split_names(a.caches)
    if "fp16" in names and names[0] != "fp16":
        raise SystemExit("--caches: fp16 must come first (it is the baseline)")
    earlier = _long.load_jsonl(a.jsonl)
    vocab = _long.vocab_size(a.model, a)

    print(_long.device_line(a), flush=True)
    print(_long.describe_model(a.model, a), flush=True)
    t0 = time.perf_counter()
    log(f"building {a.model}")
    model = _long.build_model(a.model, a, dtype)
    weights = _long.weight_bytes(model)
    print(
        f"weights {weights / GiB:.2f} GiB (built in {time.perf_counter() - t0:.1f} s); "
        f"prompt blocks of {a.block}, warm-up {a.warmup_tokens} tokens; "
        f"contexts {a.contexts}; caches {', '.join(names)}",
        flush=True,
    )

    columns = [
        ("context", True),
        ("cache", True),
        ("prompt tok/s", False),
        ("× fp16", False),
        ("TTFT s", False),
        ("weights GiB", False),
        ("KV GiB", False),
        ("peak GiB", False),
        ("temp GiB", False),
        ("goal margin GiB", False),
        ("goal met", True),
    ]
    if a.cache_time:
        columns.append(("cache time", False))
    title = (
        f"### Prompt processing, {a.model} ({a.weight_bits}-bit weights, {a.dtype}, "
        f"{mx.default_device()}, blocks of {a.block}"
        + (", --cache-time: synchronised per layer" if a.cache_time else "")
        + ")"
    )
    table = _long.Table(title, columns, a.markdown_out, a.jsonl)

    warmed = set()
    for ctx in contexts:
        label = context_label(ctx)
        prompt = _long.random_tokens(ctx, vocab, a.seed)
        mx.eval(prompt)
        if a.device == "gpu":
            _long.warm_attention_shapes(a.model, a, ctx, dtype)
        base = None if "fp16" in names else _baseline_from(earlier, a, ctx)
        if base is not None:
            log(
                f"{label}: fp16 baseline from {a.jsonl}: {base['prompt_tps']:.1f} tok/s, peak "
                f"{base['peak_bytes'] / GiB:.2f} GiB"
            )
        for name in names:
            cache = y = logprobs = None
            err = None
            try:
                if name not in warmed:
                    _long.warm_up(model, name, a, vocab)
                    warmed.add(name)
                timer = _long.CacheTimer() if a.cache_time else None
                log(f"{label} {name}: prompt")
                cache, y, logprobs, m = _long.run_prompt(
                    model, name, prompt, a, ctx + 16, f"{label} {name}", timer
                )
                mx.synchronize()
                peak = _long.bench_decode.peak_memory()
                ok = _long.finite(logprobs)
            except Exception as e:  # report it, keep measuring the other caches
                log(f"{label} {name}: {type(e).__name__}: {e}")
                err = (_long.failure(e), str(e)[:300], _long.is_oom(e))
            if err is not None:  # (the exception and its frames are gone: free them)
                del cache, y, logprobs
                _long.free()
                table.add(
                    [label, name, err[0]],
                    dict(
                        bench="prefill",
                        model=a.model,
                        context=ctx,
                        cache=name,
                        block=a.block,
                        dtype=a.dtype,
                        error=err[1],
                        oom=err[2],
                    ),
                )
                continue
            del cache, y, logprobs
            _long.free()
            tps = (m["prompt_tokens"] - 1) / m["prompt_s"]
            kv, temp = m["kv_bytes"], peak - weights - m["kv_bytes"]
            record = dict(
                bench="prefill",
                model=a.model,
                context=ctx,
                cache=name,
                block=a.block,
                dtype=a.dtype,
                device=str(mx.default_device()),
                cache_time=a.cache_time,
                prompt_tps=tps,
                prompt_s=m["prompt_s"],
                ttft_s=m["ttft_s"],
                weights_bytes=weights,
                kv_bytes=kv,
                peak_bytes=peak,
                finite=ok,
            )
            if name == "fp16":
                base = record
            ratio = margin = met = None
            if base is not None and name != "fp16":
                ratio = tps / base["prompt_tps"]
                margin = (base["peak_bytes"] - a.goal_fraction * (base["kv_bytes"] - kv)) - peak
                met = "yes" if margin >= 0 else "no"
                record.update(ratio_fp16=ratio, goal_margin_bytes=margin)
            cells = [
                label,
                name,
                fmt(tps),
                fmt(ratio, 2),
                fmt(m["ttft_s"], 2),
                gib(weights),
                f"{kv / GiB:.3f}",
                gib(peak),
                gib(temp),
                "–" if margin is None else f"{margin / GiB:+.2f}",
                met or "–",
            ]
            if a.cache_time:
                frac = m["cache_s"] / m["prompt_s"]
                record["cache_fraction"] = frac
                cells.append(f"{100 * frac:.1f}%")
            if not ok:
                cells[-1] = f"{cells[-1]} (non-finite logits)"
            table.add(cells, record, note=f"prompt {m['prompt_s']:.1f} s")
        del prompt
        _long.free()
    table.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
