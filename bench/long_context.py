# Copyright © 2026 turboquant_mlx contributors.

"""The long-context scenario end to end: a long prompt, then decoding and speculative
verification, fp16 cache vs compressed caches, on two model shapes.

One row per model (``--models``) and cache (``--caches``). Models, caches and the
prompt are described in bench/_long.py: ``llama8b`` is the 8B-shaped 4-bit llama of
bench/bench_decode.py (32 layers, all full attention: 32 q / 8 KV heads of head dim
128); ``qwen35moe`` is mlx-lm's qwen3_5_moe in the shape of Qwen3.5-35B-A3B (40 layers,
every 4th full attention with 16 q / 2 KV heads of head dim 256, the others gated
delta nets; MoE of 256 experts, 8 routed + 1 shared; the values used are printed at
the start). Weights are random and 4-bit; the prompt is ``--context`` random tokens.

For each model and cache, with a cache built fresh (after a warm-up of the same steps
on a short prompt, ``--warmup-tokens``, so that kernels are compiled):

1. prompt: every token but the last through the model in blocks of ``--block``
   tokens as mlx-lm's ``generate_step`` prefills (``model(tokens[None, i:i+n],
   cache=c)``, ``mx.eval([x.state for x in c])``, ``mx.clear_cache()``), then the last
   token's forward pass and its greedy token. "prompt s" is the blocks' time, "prompt
   tok/s" the tokens but the last over it, "TTFT s" the time from the first block to
   the first generated token evaluated.
2. decode: ``--decode-tokens`` greedy tokens, one forward pass each, pipelined as
   ``generate_step`` runs them (the next step's graph is built and sent with
   ``mx.async_eval`` before the current token is read with ``.item()``); "decode
   tok/s" is the tokens over the time from the first step's graph to the last token.
3. verify: ``--verify-steps`` speculative-verification steps as mlx-lm's
   ``speculative_generate_step`` runs them when every draft is rejected: the last
   token and ``--verify-tokens`` - 1 = 3 draft tokens (fixed random ids) go through
   the model in one forward pass (q_len 4), the greedy token of every position is
   evaluated (``mx.eval``, ``.tolist()``), then each cache of the prompt cache that
   ``is_trimmable()`` is trimmed by 3 (``c.trim(3)``) and the first of those tokens is
   the next step's last token: every step adds one token to the caches. mlx-lm's own
   ``trim_prompt_cache`` trims nothing when any layer's cache cannot be trimmed; here
   the trimmable ones are trimmed and the others kept, so on qwen35moe the gated
   delta nets' states (ArraysCache, not trimmable) advance by all 4 tokens every step
   (a real MTP implementation would restore them; that cost is not measured). "verify
   ms/step" is the mean step time, "verify tok/s" the query tokens (4 a step) over
   it.

"KV GiB" is what the prompt cache holds after the prompt (allocated buffers, all
layers; on qwen35moe also the gated delta nets' states); "peak GiB" MLX's peak memory
from just before the prompt to the end of the verification (weights included). The
``≤ N GiB`` columns say whether that peak fits in each ``--memory-budget-gb`` (default
64 and 128: Apple unified-memory sizes; macOS lets the GPU wire about 75% of it by
default, ``iogpu.wired_limit_mb`` raises that). A run that runs out of memory prints
its row as "does not fit"; any other failure prints the error; the other rows still
run. Rows are printed as soon as each is measured (and ``--markdown-out`` is
rewritten), so a run stopped by a timeout keeps the rows done; progress goes to
stderr.

``--fill`` skips the prompt: every attention layer's cache gets ``--context`` tokens of
random keys and values (``bench_decode.fill``: ``update_and_fetch`` in chunks of 4096,
evaluated after each) and every gated delta net random states, then the decode and
verify steps run as above (the prompt columns show "–"; "KV GiB" is after the fill,
"peak GiB" from the fill on). That is how qwen35moe's long-context decode is measured
on MLX's CUDA backend, where mlx-lm's gated delta net has no kernel (its kernels are
Metal-only) and runs its per-token op loop: on an H200 that took ~0.3 s per 2048-token
block per linear layer, ~10 s a block for the 30 of them, so a 256k prompt would take
over 20 minutes per cache there. qwen35moe's prompt numbers from CUDA say nothing
about a Mac's; run its prompt there at short contexts only.

Usage:
  python bench/long_context.py                  # both models, 256k (qwen35moe's prompt: Metal)
  python bench/long_context.py --models llama8b  # 256k: about 8 minutes on an H200
  python bench/long_context.py --models qwen35moe --fill        # CUDA: no prompt
  python bench/long_context.py --models qwen35moe --context 8192
  python bench/long_context.py --device cpu --layers 2 --hidden 256 --heads 4 \\
      --kv-heads 2 --head-dim 64 --intermediate 512 --vocab 1024 --qwen-layers 4 \\
      --qwen-hidden 128 --qwen-heads 2 --qwen-kv-heads 1 --qwen-head-dim 64 \\
      --qwen-vocab 1024 --qwen-experts 4 --qwen-experts-per-tok 2 \\
      --qwen-moe-intermediate 64 --qwen-shared-intermediate 64 --qwen-linear-k-heads 2 \\
      --qwen-linear-v-heads 4 --qwen-linear-k-dim 64 --qwen-linear-v-dim 64 \\
      --context 300 --block 128 --decode-tokens 8 --verify-steps 4
"""

import sys
import time

import mlx.core as mx

import _long
from _long import GiB, context_label, fmt, gib, log

DEFAULT_MODELS = "llama8b,qwen35moe"
DEFAULT_CACHES = "fp16,tq4,k4v3"


def parse_args(argv=None):
    p = _long.base_parser(__doc__)
    p.add_argument(
        "--models",
        default=DEFAULT_MODELS,
        help=f"comma-separated, of {', '.join(_long.MODELS)} (default {DEFAULT_MODELS})",
    )
    p.add_argument("--caches", default=DEFAULT_CACHES, help=f"default: {DEFAULT_CACHES}")
    p.add_argument(
        "--context",
        "--context-tokens",
        dest="context",
        type=int,
        default=262144,
        help="prompt tokens (default 262144)",
    )
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--verify-steps", type=int, default=16)
    p.add_argument(
        "--verify-tokens",
        type=int,
        default=4,
        help="tokens per verification step (q_len; all but one trimmed)",
    )
    p.add_argument(
        "--memory-budget-gb",
        default="64,128",
        help="memory sizes (GiB) the peak is compared with (default 64,128)",
    )
    p.add_argument(
        "--fill",
        action="store_true",
        help="no prompt: fill the caches with --context random tokens' keys and "
        "values (and random linear-attention states), then decode and verify",
    )
    _long.add_common_args(p)
    _long.add_model_args(p)
    return p.parse_args(argv)


def decode(model, cache, y, n):
    """``n`` greedy tokens after ``y``, pipelined as generate_step; returns their time
    and the last step's ``(token, logprobs)``."""
    t0 = time.perf_counter()
    nxt = _long.next_token(model, cache, y)
    mx.async_eval(*nxt)
    cur = nxt
    for i in range(n):
        cur = nxt
        if i + 1 < n:
            nxt = _long.next_token(model, cache, cur[0])
            mx.async_eval(*nxt)
        cur[0].item()
    if n == 0:
        mx.eval(*cur)
    return time.perf_counter() - t0, cur


def verify(model, cache, y, steps, q_len, drafts):
    """``steps`` verification steps of ``q_len`` tokens (the module docstring);
    returns their time and the last step's logprobs."""
    logprobs = None
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = mx.concatenate([y.astype(mx.uint32), drafts])
        logits = model(tokens[None], cache=cache)[:, -q_len:, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out = mx.argmax(logprobs, axis=-1).squeeze(0)
        mx.eval(out)
        out = out.tolist()
        for c in cache:
            if c.is_trimmable():
                c.trim(q_len - 1)
        y = mx.array(out[:1], mx.uint32)
    return time.perf_counter() - t0, logprobs


def run_filled(model, name, a, reserve, fill):
    """``--fill``: a fresh cache ``name`` filled with ``a.context`` random tokens
    (``_long.fill_cache``), MLX's peak memory reset before; returns the cache, a token
    to decode from, and the measurements (``kv_bytes``, ``fill_s``)."""
    _long.free()
    mx.synchronize()
    _long.bench_decode.reset_peak_memory()
    cache = _long.make_cache(model, name, reserve)
    t0 = time.perf_counter()
    _long.fill_cache(model, cache, a.context, *fill)
    m = dict(
        prompt_tokens=a.context,
        prompt_s=None,
        ttft_s=None,
        fill_s=time.perf_counter() - t0,
        kv_bytes=_long.kv_bytes(cache),
    )
    return cache, mx.array([1], mx.uint32), m


def main(argv=None):
    a = parse_args(argv)
    dtype = _long.setup_device(a)
    models = _long.split_names(a.models)
    names = _long.split_names(a.caches)
    budgets = [float(x) for x in _long.split_names(a.memory_budget_gb)]
    for m in models:
        if m not in _long.MODELS:
            raise SystemExit(f"--models: unknown model {m!r} (one of {', '.join(_long.MODELS)})")
    if a.verify_tokens < 1:
        raise SystemExit("--verify-tokens must be at least 1")
    label = context_label(a.context)

    print(_long.device_line(a), flush=True)
    for m in models:
        print(_long.describe_model(m, a), flush=True)
    print(
        (
            f"caches filled with {a.context} random tokens (warm-up {a.warmup_tokens}); "
            if a.fill
            else f"prompt {a.context} random tokens in blocks of {a.block} (warm-up "
            f"{a.warmup_tokens}); "
        )
        + f"decode {a.decode_tokens} tokens; verify {a.verify_steps} steps of "
        f"{a.verify_tokens} tokens, {a.verify_tokens - 1} trimmed after each",
        flush=True,
    )

    columns = [
        ("model", True),
        ("cache", True),
        ("context", False),
        ("prompt s", False),
        ("prompt tok/s", False),
        ("TTFT s", False),
        ("decode tok/s", False),
        ("verify ms/step", False),
        ("verify tok/s", False),
        ("KV GiB", False),
        ("peak GiB", False),
    ] + [(f"≤ {b:g} GiB", True) for b in budgets]
    what = "caches filled with random keys and values, no prompt" if a.fill else "prompt"
    title = (
        f"### Long context, {label} {what} ({a.weight_bits}-bit weights, {a.dtype}, "
        f"{mx.default_device()}; decode {a.decode_tokens} tokens, verify "
        f"{a.verify_steps} x q_len {a.verify_tokens})"
    )
    table = _long.Table(title, columns, a.markdown_out, a.jsonl)
    reserve = a.context + a.decode_tokens + a.verify_steps * a.verify_tokens + 16

    for model_name in models:
        model = err = None
        try:
            t0 = time.perf_counter()
            log(f"building {model_name}")
            model = _long.build_model(model_name, a, dtype)
            weights = _long.weight_bytes(model)
            log(
                f"{model_name}: weights {weights / GiB:.2f} GiB, built in "
                f"{time.perf_counter() - t0:.1f} s"
            )
        except Exception as e:
            log(f"{model_name}: {type(e).__name__}: {e}")
            err = _long.failure(e)
        if err is not None:
            model = None
            _long.free()
            for name in names:
                table.add([model_name, name, a.context, f"model: {err}"])
            continue
        vocab = _long.vocab_size(model_name, a)
        prompt = _long.random_tokens(a.context, vocab, a.seed)
        drafts = _long.random_tokens(a.verify_tokens - 1, vocab, a.seed + 2).astype(mx.uint32)
        mx.eval(prompt, drafts)

        def after_warm_prompt(cache, y):
            _, (y, _) = decode(model, cache, y, 2)
            verify(model, cache, y, 2, a.verify_tokens, drafts)

        fill = (_long.attention_shape(model_name, a), dtype) if a.fill else None
        if fill is None and a.device == "gpu":
            _long.warm_attention_shapes(model_name, a, a.context, dtype)
        for name in names:
            cache = y = logprobs = last = None
            err = None
            try:
                _long.warm_up(model, name, a, vocab, after=after_warm_prompt, fill=fill)
                if fill is None:
                    log(f"{model_name} {name}: prompt")
                    cache, y, logprobs, m = _long.run_prompt(
                        model, name, prompt, a, reserve, f"{model_name} {name} {label}"
                    )
                    log(f"{model_name} {name}: prompt {m['prompt_s']:.1f} s, decode")
                else:
                    log(f"{model_name} {name}: fill")
                    cache, y, m = run_filled(model, name, a, reserve, fill)
                    log(f"{model_name} {name}: filled in {m['fill_s']:.1f} s, decode")
                t_dec, (y, last) = decode(model, cache, y, a.decode_tokens)
                ok = _long.finite(last)
                log(f"{model_name} {name}: decode {t_dec:.2f} s, verify")
                t_ver, last = verify(model, cache, y, a.verify_steps, a.verify_tokens, drafts)
                mx.synchronize()
                peak = _long.bench_decode.peak_memory()
                ok = ok and (last is None or _long.finite(last))
            except Exception as e:  # report it, keep measuring the other rows
                log(f"{model_name} {name}: {type(e).__name__}: {e}")
                err = (_long.failure(e), str(e)[:300], _long.is_oom(e))
            del cache, y, logprobs, last
            _long.free()
            if err is not None:
                cells = [model_name, name, a.context, err[0]] + [""] * 7
                cells += ["no" if err[2] else "–"] * len(budgets)
                table.add(
                    cells,
                    dict(
                        bench="long_context",
                        model=model_name,
                        cache=name,
                        context=a.context,
                        error=err[1],
                        oom=err[2],
                    ),
                )
                continue
            tps = None if a.fill else (m["prompt_tokens"] - 1) / m["prompt_s"]
            dec = a.decode_tokens / t_dec if a.decode_tokens else None
            step = t_ver / a.verify_steps if a.verify_steps else None
            record = dict(
                bench="long_context",
                model=model_name,
                cache=name,
                context=a.context,
                block=a.block,
                dtype=a.dtype,
                device=str(mx.default_device()),
                fill=a.fill,
                prompt_s=m["prompt_s"],
                prompt_tps=tps,
                ttft_s=m["ttft_s"],
                decode_tps=dec,
                verify_step_s=step,
                verify_tokens=a.verify_tokens,
                weights_bytes=weights,
                kv_bytes=m["kv_bytes"],
                peak_bytes=peak,
                finite=ok,
            )
            cells = [
                model_name,
                name,
                a.context,
                fmt(m["prompt_s"]),
                fmt(tps),
                fmt(m["ttft_s"], 2),
                fmt(dec),
                fmt(None if step is None else 1e3 * step, 2),
                fmt(None if step is None else a.verify_tokens / step),
                f"{m['kv_bytes'] / GiB:.3f}",
                gib(peak),
            ]
            cells += ["yes" if peak <= b * GiB else "no" for b in budgets]
            if not ok:
                cells[-1] = f"{cells[-1]} (non-finite logits)"
            note = f"weights {weights / GiB:.2f} GiB"
            if a.fill:
                note += f", filled in {m['fill_s']:.1f} s"
            table.add(cells, record, note=note)
        model = prompt = drafts = after_warm_prompt = None
        _long.free()
    table.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
