# Copyright © 2026 turboquant_mlx contributors.

"""What bench/bench_prefill.py and bench/long_context.py share: the two model shapes,
the prompt fed as mlx-lm's ``generate_step`` feeds it, the memory accounting, the
timing of the caches' own work, and the tables.

Models (``--model`` / ``--models``):

``llama8b``
    ``bench_decode.build_model``: mlx-lm's llama in the Llama-3-8B shape (flags
    ``--layers --hidden --heads --kv-heads --head-dim --intermediate --vocab``).
``qwen35moe``
    mlx-lm's ``qwen3_5_moe`` in the shape of Qwen3.5-35B-A3B's published config (flags
    ``--qwen-*``, defaults in ``QWEN35_A3B``): 40 layers, hidden 2048, every 4th layer
    full attention (16 query / 2 KV heads of head dim 256, output gate, partial RoPE
    over 64 of the 256 dims, theta 1e7), the other 30 gated delta nets (16 key heads
    and 32 value heads of dim 128, conv kernel 4); every layer a sparse MoE of 256
    experts (intermediate 512), 8 routed per token (top-k probabilities renormalised)
    plus 1 shared expert (intermediate 512) behind a sigmoid gate; vocab 248320,
    untied embeddings, RMSNorm eps 1e-6. ``mrope_section`` [11, 11, 10] is
    irrelevant for text (mlx-lm's text model applies plain RoPE).

Both have random weights (mx.random, as mlx-lm's modules initialise them), cast to
the activation dtype, then quantized as mlx-lm's quantizer does it for these models:
every Linear, SwitchLinear (experts) and Embedding to ``--weight-bits`` (4) with group
size ``--group-size`` (64); for qwen35moe the router (``mlp.gate``) and the shared
expert's gate at ``--gate-bits`` (8, mlx-lm's ``quant_predicate``; 0 keeps them in the
activation dtype) and ``A_log`` in float32. The weights are built lazily and evaluated
one layer (then the embedding, then the output head) at a time, so the float
weights of one layer at most exist at once (qwen35moe: ~3 GiB of float32 experts).

The prompt is random token ids. It goes through the model exactly as
``mlx_lm.generate.generate_step`` prefills: every token but the last in blocks of
``--block`` tokens, each ``model(tokens[None, i:i+n], cache=c)``, then
``mx.eval([x.state for x in c])`` and ``mx.clear_cache()``; then the last token's
forward pass gives the first generated token (greedy). Caches: ``fp16`` is mlx-lm's
own (``mlx_lm.models.cache.make_prompt_cache``: KVCache on attention layers,
ArraysCache on linear-attention layers); any other name goes through
``bench_decode.make_caches`` (a preset of ``turboquant_mlx.cache.PRESETS`` through
``turboquant_mlx.cache.make_prompt_cache``, which compresses the full-attention layers
only, each TurboQuantKVCache ``reserve``d for the whole run as
``turboquant_mlx.generate`` does).
"""

import argparse
import gc
import json
import math
import os
import sys
import time
from contextlib import contextmanager, nullcontext

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5_moe
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

import bench_decode
from bench_decode import GiB, _arrays, kv_bytes, weight_bytes  # noqa: F401

from turboquant_mlx import _ext

MODELS = ("llama8b", "qwen35moe")

# Qwen3.5-35B-A3B's text config (Hugging Face config.json, text_config): flag name
# (--qwen-NAME), value, help.
QWEN35_A3B = {
    "layers": (40, "num_hidden_layers"),
    "hidden": (2048, "hidden_size"),
    "heads": (16, "num_attention_heads (full-attention layers)"),
    "kv-heads": (2, "num_key_value_heads"),
    "head-dim": (256, "head_dim"),
    "vocab": (248320, "vocab_size"),
    "experts": (256, "num_experts"),
    "experts-per-tok": (8, "num_experts_per_tok (routed)"),
    "moe-intermediate": (512, "moe_intermediate_size (each expert)"),
    "shared-intermediate": (512, "shared_expert_intermediate_size (1 shared expert)"),
    "linear-k-heads": (16, "linear_num_key_heads (gated delta net)"),
    "linear-v-heads": (32, "linear_num_value_heads"),
    "linear-k-dim": (128, "linear_key_head_dim"),
    "linear-v-dim": (128, "linear_value_head_dim"),
    "conv-kernel": (4, "linear_conv_kernel_dim"),
    "full-attention-interval": (4, "full_attention_interval (every Nth layer attends)"),
}
QWEN_ROPE_THETA = 10_000_000.0
QWEN_PARTIAL_ROTARY = 0.25

_T0 = time.perf_counter()


def log(msg):
    """A progress line on stderr (seconds since the script started)."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


# -- arguments ------------------------------------------------------------------------


def add_common_args(p):
    p.add_argument(
        "--block",
        type=int,
        default=2048,
        help="prompt tokens per forward pass (mlx-lm's prefill_step_size)",
    )
    p.add_argument(
        "--warmup-tokens",
        type=int,
        default=None,
        help="length of each cache's warm-up prompt (default: 2 * block + 1)",
    )
    add_device_args(p)


def add_device_args(p):
    """--device, --dtype, --markdown-out, --jsonl, --seed (``setup_device`` reads the
    first two)."""
    p.add_argument(
        "--device", choices=("gpu", "cpu"), default=None, help="default: gpu if MLX has one"
    )
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        default=None,
        help="activations and fp16-cache dtype (default: float16 on the GPU, float32 on the CPU)",
    )
    p.add_argument(
        "--markdown-out",
        default=None,
        help="write the tables (markdown) to this file, rewritten after each row",
    )
    p.add_argument(
        "--jsonl", default=None, help="append each measured row to this file as one JSON object"
    )
    p.add_argument("--seed", type=int, default=0)


def add_model_args(p):
    g = p.add_argument_group("llama8b (bench_decode.build_model; Llama-3-8B shape)")
    g.add_argument("--layers", type=int, default=32)
    g.add_argument("--hidden", type=int, default=4096)
    g.add_argument("--heads", type=int, default=32)
    g.add_argument("--kv-heads", type=int, default=8)
    g.add_argument("--head-dim", type=int, default=128)
    g.add_argument("--intermediate", type=int, default=14336)
    g.add_argument("--vocab", type=int, default=128256)
    g = p.add_argument_group("qwen35moe (mlx-lm's qwen3_5_moe; Qwen3.5-35B-A3B shape)")
    for name, (value, what) in QWEN35_A3B.items():
        g.add_argument(f"--qwen-{name}", type=int, default=value, help=f"{what} (default {value})")
    g.add_argument(
        "--gate-bits",
        type=int,
        default=8,
        help="bits of the router and shared-expert gate (mlx-lm: 8; 0: unquantized)",
    )
    g = p.add_argument_group("weights (both models)")
    g.add_argument("--weight-bits", type=int, default=4)
    g.add_argument("--group-size", type=int, default=64)


def setup_device(a):
    """Sets MLX's default device and ``a.dtype``; returns the activation dtype."""
    if a.device is None:
        a.device = "gpu" if mx.is_available(mx.gpu) else "cpu"
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    if a.dtype is None:
        a.dtype = "float16" if a.device == "gpu" else "float32"
    if getattr(a, "block", None) and a.warmup_tokens is None:  # (prompt benchmarks)
        a.warmup_tokens = 2 * a.block + 1
    return getattr(mx, a.dtype)


def split_names(s):
    return [x.strip() for x in s.split(",") if x.strip()]


def context_label(n):
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


# -- models ---------------------------------------------------------------------------


def qwen_text_config(a):
    """mlx-lm ``qwen3_5_moe`` text_config of the ``--qwen-*`` flags."""
    q = lambda name: getattr(a, "qwen_" + name.replace("-", "_"))  # noqa: E731
    return dict(
        model_type="qwen3_5_moe_text",
        num_hidden_layers=q("layers"),
        hidden_size=q("hidden"),
        num_attention_heads=q("heads"),
        num_key_value_heads=q("kv-heads"),
        head_dim=q("head-dim"),
        vocab_size=q("vocab"),
        num_experts=q("experts"),
        num_experts_per_tok=q("experts-per-tok"),
        moe_intermediate_size=q("moe-intermediate"),
        shared_expert_intermediate_size=q("shared-intermediate"),
        decoder_sparse_step=1,
        norm_topk_prob=True,
        linear_num_key_heads=q("linear-k-heads"),
        linear_num_value_heads=q("linear-v-heads"),
        linear_key_head_dim=q("linear-k-dim"),
        linear_value_head_dim=q("linear-v-dim"),
        linear_conv_kernel_dim=q("conv-kernel"),
        full_attention_interval=q("full-attention-interval"),
        rms_norm_eps=1e-6,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_parameters={
            "type": "default",
            "mrope_section": [11, 11, 10],
            "rope_theta": QWEN_ROPE_THETA,
            "partial_rotary_factor": QWEN_PARTIAL_ROTARY,
        },
    )


def build_qwen35moe(a, dtype):
    """mlx-lm's qwen3_5_moe with random weights in the ``--qwen-*`` shape (module
    docstring); evaluated one layer at a time."""
    args = qwen3_5_moe.ModelArgs(model_type="qwen3_5_moe", text_config=qwen_text_config(a))
    model = qwen3_5_moe.Model(args)  # random init, lazy
    model.set_dtype(dtype)
    for layer in model.layers:
        if layer.is_linear:  # mlx-lm's cast_predicate keeps A_log in float32
            layer.linear_attn.A_log = layer.linear_attn.A_log.astype(mx.float32)
    predicate = model.quant_predicate

    def quantize_this(path, m):
        if not hasattr(m, "to_quantized") or m.weight.shape[-1] % a.group_size:
            return False
        p = predicate(path, m) if predicate is not None else True
        if isinstance(p, dict):  # the router and shared-expert gate
            return dict(p, bits=a.gate_bits) if a.gate_bits else False
        return p

    nn.quantize(model, group_size=a.group_size, bits=a.weight_bits, class_predicate=quantize_this)
    lm = model.language_model
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(lm.model.embed_tokens.parameters())
    mx.eval(lm.lm_head.parameters())
    mx.eval(model.parameters())
    return model


def build_model(name, a, dtype):
    mx.random.seed(a.seed)
    if name == "llama8b":
        return bench_decode.build_model(a, dtype)
    if name == "qwen35moe":
        return build_qwen35moe(a, dtype)
    raise ValueError(f"unknown model {name!r}: one of {', '.join(MODELS)}")


def vocab_size(name, a):
    return a.vocab if name == "llama8b" else a.qwen_vocab


def describe_model(name, a):
    """One line with every shape value the model is built with."""
    w = f"{a.weight_bits}-bit g{a.group_size} weights"
    if name == "llama8b":
        return (
            f"llama8b: mlx-lm llama, {a.layers} layers, hidden {a.hidden}, {a.heads} q / "
            f"{a.kv_heads} kv heads, head dim {a.head_dim}, intermediate {a.intermediate}, "
            f"vocab {a.vocab}, rope theta 500000, {w}"
        )
    c = qwen_text_config(a)
    n = c["num_hidden_layers"]
    full = sum(1 for i in range(n) if (i + 1) % c["full_attention_interval"] == 0)
    gates = f"{a.gate_bits}-bit" if a.gate_bits else "unquantized"
    return (
        f"qwen35moe: mlx-lm qwen3_5_moe, {n} layers ({full} full attention: "
        f"{c['num_attention_heads']} q / {c['num_key_value_heads']} kv heads, head dim "
        f"{c['head_dim']}, rope theta {QWEN_ROPE_THETA:g} on {QWEN_PARTIAL_ROTARY:g} of the "
        f"dims; {n - full} gated delta nets: {c['linear_num_key_heads']} k heads x "
        f"{c['linear_key_head_dim']}, {c['linear_num_value_heads']} v heads x "
        f"{c['linear_value_head_dim']}, conv {c['linear_conv_kernel_dim']}), hidden "
        f"{c['hidden_size']}, MoE {c['num_experts']} experts x {c['moe_intermediate_size']}, "
        f"{c['num_experts_per_tok']} routed + 1 shared x "
        f"{c['shared_expert_intermediate_size']}, vocab {c['vocab_size']}, untied, {w}, "
        f"{gates} router/shared gates"
    )


def device_line(a):
    return (
        f"mlx {mx.__version__}, device {mx.default_device()}, turboquant GPU kernels: "
        f"{_ext.gpu_backend()} ({_ext.gpu_available()}), activations {a.dtype}"
    )


# -- caches and the prompt ------------------------------------------------------------


def make_cache(model, name, total_tokens):
    """The prompt cache called ``name``: ``fp16`` is mlx-lm's own, anything else
    ``bench_decode.make_caches``."""
    if name == "fp16":
        return mlx_make_prompt_cache(model)
    return bench_decode.make_caches(model, name, total_tokens)


def random_tokens(n, vocab, seed):
    return mx.random.randint(0, vocab, (n,), key=mx.random.key(seed)).astype(mx.int32)


def feed_prompt(model, cache, prompt, block, progress=None):
    """Every prompt token but the last through the model, as mlx-lm's generate_step
    prefills; returns the tokens left (the last one)."""
    total = prompt.size
    done = 0
    while total - done > 1:
        n = min(block, total - done - 1)
        model(prompt[None, done : done + n], cache=cache)
        mx.eval([c.state for c in cache])
        done += n
        if progress is not None:
            progress(done, total)
        mx.clear_cache()
    return prompt[done:]


def next_token(model, cache, tokens):
    """One forward pass of ``tokens`` and the greedy next token (generate_step's
    ``_step``): ``(token (1,), logprobs (1, vocab))``, lazy."""
    logits = model(tokens[None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return mx.argmax(logprobs, axis=-1), logprobs


def attention_shape(name, a):
    """``(KV heads, head dim)`` of the model's attention layers."""
    return (a.kv_heads, a.head_dim) if name == "llama8b" else (a.qwen_kv_heads, a.qwen_head_dim)


def fill_cache(model, cache, n, kv_shape, dtype, chunk=4096):
    """Instead of a prompt: ``n`` tokens of random keys and values in every attention
    layer's cache (``bench_decode.fill``: ``update_and_fetch`` in chunks of ``chunk``,
    evaluated after each) and random states in the linear-attention layers' caches
    (conv state in ``dtype``, recurrent state float32, as the gated delta net keeps
    them)."""
    shape = argparse.Namespace(chunk=chunk, kv_heads=kv_shape[0], head_dim=kv_shape[1])
    bench_decode.fill([c for c in cache if not isinstance(c, ArraysCache)], n, shape, dtype)
    for c, layer in zip(cache, model.layers):
        if isinstance(c, ArraysCache):
            g = layer.linear_attn
            c[0] = (0.1 * mx.random.normal((1, g.conv_kernel_size - 1, g.conv_dim))).astype(dtype)
            c[1] = 0.01 * mx.random.normal((1, g.num_v_heads, g.head_v_dim, g.head_k_dim))
            mx.eval(c.state)


class Progress:
    """Prompt progress on stderr, at most every ``every`` seconds, and at the end."""

    def __init__(self, label, every=10.0):
        self.label, self.every = label, every
        self.start = self.last = time.perf_counter()

    def __call__(self, done, total):
        now = time.perf_counter()
        if now - self.last < self.every and done < total - 1:
            return
        self.last = now
        dt = now - self.start
        log(
            f"{self.label}: {done}/{total} prompt tokens, {done / max(dt, 1e-9):.0f} tok/s, "
            f"{dt:.1f} s"
        )


def free():
    gc.collect()
    mx.clear_cache()


def query_heads(name, a):
    return a.heads if name == "llama8b" else a.qwen_heads


def warm_attention_shapes(name, a, total, dtype):
    """MLX's fused attention once at every shape a ``total``-token prompt fed in blocks
    of ``a.block`` meets (block queries against every key length), before any cache is
    timed. MLX's CUDA backend builds a cuDNN graph the first time it meets a shape:
    without this, whichever cache runs first pays for graphs the next ones reuse (both
    caches call the same attention with the same shapes)."""
    t = time.perf_counter()
    kv_heads, head_dim = attention_shape(name, a)
    heads = query_heads(name, a)
    done, shapes = 0, 0
    while total - done > 1:
        n = min(a.block, total - done - 1)
        done += n
        q = mx.zeros((1, heads, n, head_dim), dtype)
        k = mx.zeros((1, kv_heads, done, head_dim), dtype)
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, k, scale=1.0, mask="causal"))
        shapes += 1
    del q, k
    free()
    log(f"attention warmed at {shapes} shapes in {time.perf_counter() - t:.1f} s")


def warm_up(model, name, a, vocab, after=None, fill=None):
    """One short prompt (``a.warmup_tokens``) and its first token with a fresh cache
    ``name``, so that kernels are compiled before anything is timed; ``after(cache,
    token)`` runs more steps on it. With ``fill`` (``fill_cache``'s ``kv_shape``,
    ``dtype``) the cache is filled with that many random tokens instead of a prompt."""
    t = time.perf_counter()
    cache = make_cache(model, name, a.warmup_tokens + 256)
    if fill is None:
        prompt = random_tokens(a.warmup_tokens, vocab, a.seed + 1)
        rest = feed_prompt(model, cache, prompt, a.block)
        y, logprobs = next_token(model, cache, rest)
        mx.eval(y, logprobs)
        del prompt, rest, logprobs
    else:
        fill_cache(model, cache, a.warmup_tokens, *fill)
        y = mx.array([1], mx.uint32)
    if after is not None:
        after(cache, y)
    del cache, y
    free()
    how = "filled" if fill is not None else "prompt"
    log(f"warm-up {name}: {a.warmup_tokens} tokens ({how}) in {time.perf_counter() - t:.1f} s")


def run_prompt(model, name, prompt, a, reserve, label, timer=None):
    """A fresh cache ``name``, the prompt fed through it and the first token, with MLX's
    peak memory reset before (read it after whatever follows).

    Returns ``(cache, first token, logprobs, measurements)``: ``prompt_s`` (every
    token but the last, in blocks), ``ttft_s`` (from the first block to the first
    token evaluated), ``kv_bytes`` (what the cache holds then), ``cache_s`` (with a
    ``CacheTimer``: the time of the cache's own work during the blocks)."""
    free()
    mx.synchronize()
    bench_decode.reset_peak_memory()
    cache = make_cache(model, name, reserve)
    progress = Progress(label)
    t0 = time.perf_counter()
    with timer.patched(cache) if timer is not None else nullcontext():
        rest = feed_prompt(model, cache, prompt, a.block, progress)
    t1 = time.perf_counter()
    y, logprobs = next_token(model, cache, rest)
    mx.eval(y, logprobs)
    t2 = time.perf_counter()
    m = dict(
        prompt_tokens=int(prompt.size), prompt_s=t1 - t0, ttft_s=t2 - t0, kv_bytes=kv_bytes(cache)
    )
    if timer is not None:
        m["cache_s"] = timer.seconds
    return cache, y, logprobs, m


def finite(x):
    return bool(mx.isfinite(x.astype(mx.float32)).all().item())


# -- the caches' own time -------------------------------------------------------------

TIMED_METHODS = ("update_and_fetch", "_prefill_operands")


class CacheTimer:
    """Time spent in the caches' own methods (``TIMED_METHODS`` where a cache class has
    them): while ``patched``, each call of such a method first evaluates its inputs
    (the layer's new keys and values: everything the model computed before), then
    runs, then evaluates what it returned and every array the cache holds, and adds
    the time from the call to that evaluation's end. Nested calls count once. Only
    in this process and only while patched; this synchronises the device once per
    layer, so the prompt runs slower than without it."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self._depth = 0

    def _wrap(self, f):
        timer = self

        def timed(cache, *args, **kwargs):
            if timer._depth:
                return f(cache, *args, **kwargs)
            mx.eval(_arrays(list(args) + list(kwargs.values())))
            timer._depth += 1
            t0 = time.perf_counter()
            try:
                out = f(cache, *args, **kwargs)
                mx.eval(_arrays([out]) + _arrays(list(vars(cache).values())))
            finally:
                timer._depth -= 1
            timer.seconds += time.perf_counter() - t0
            timer.calls += 1
            return out

        timed.__wrapped__ = f
        return timed

    @contextmanager
    def patched(self, cache):
        self.seconds, self.calls = 0.0, 0
        classes = {
            type(c)
            for c in cache
            if not isinstance(c, ArraysCache) and hasattr(c, "update_and_fetch")
        }
        saved = []
        try:
            for cls in classes:
                for name in TIMED_METHODS:
                    f = getattr(cls, name, None)
                    if f is None:
                        continue
                    saved.append((cls, name, cls.__dict__.get(name)))
                    setattr(cls, name, self._wrap(f))
            yield self
        finally:
            for cls, name, own in reversed(saved):
                if own is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, own)


# -- failures and tables --------------------------------------------------------------

_OOM_WORDS = (
    "out of memory",
    "outofmemory",
    "insufficient memory",
    "malloc",
    "failed to allocate",
    "allocation",
    "maximum allowed buffer size",
    "resource limit",
    "bad_alloc",
)


def is_oom(e):
    return isinstance(e, MemoryError) or any(w in str(e).lower() for w in _OOM_WORDS)


def failure(e):
    """A table cell for an exception: "does not fit" for out-of-memory."""
    text = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return ("does not fit (" + text + ")") if is_oom(e) else "error: " + text


class Table:
    """A markdown table printed row by row as rows are measured (stdout, flushed), and
    rewritten to ``path`` after each row if given."""

    def __init__(self, title, columns, path=None, jsonl=None):
        self.title, self.columns, self.path, self.jsonl = title, columns, path, jsonl
        self.rows = []
        print("\n" + self.header(), flush=True)
        self._write()

    def header(self):
        cols = "| " + " | ".join(c for c, _ in self.columns) + " |"
        align = "|" + "|".join("---" if left else "---:" for _, left in self.columns) + "|"
        return cols + "\n" + align

    def add(self, cells, record=None, note=""):
        cells = list(cells) + [""] * (len(self.columns) - len(cells))
        row = "| " + " | ".join(str(c) for c in cells) + " |"
        print(row + (f"  <!-- {note} -->" if note else ""), flush=True)
        self.rows.append(row)
        self._write()
        if self.jsonl and record is not None:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps(record) + "\n")

    def markdown(self):
        return f"{self.title}\n\n{self.header()}\n" + "".join(r + "\n" for r in self.rows)

    def _write(self):
        if self.path:
            with open(self.path, "w") as f:
                f.write(self.markdown())

    def finish(self):
        print("\n" + self.markdown(), flush=True)


def load_jsonl(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def gib(x):
    return f"{x / GiB:.2f}"


def fmt(x, digits=1):
    """``x`` with ``digits`` decimals; "–" for None or a non-finite number."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.{digits}f}"


def base_parser(doc):
    return argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
