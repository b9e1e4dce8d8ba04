# Copyright © 2026 turboquant_mlx contributors.

"""End-to-end decode speed of an 8B-shaped 4-bit llama: fp16 KV cache vs compressed caches.

The model is mlx-lm's llama with random weights in a Llama-3-8B shape (32 layers,
hidden 4096, 32 query heads, 8 KV heads, head dim 128, intermediate 14336, vocab
128256), its linear layers and embedding quantized to 4 bits (group size 64), run in
float16 on the GPU (float32 on the CPU, where MLX's fp16 quantized matmul is slow).

For each context length and each cache, every layer's cache is filled directly with
random keys and values of the model's dtype (``update_and_fetch`` in chunks, evaluated
after each) -- no prefill through the model -- then the model decodes one token at a
time with that cache: a step is one forward pass of one token and its greedy next
token, pipelined as mlx-lm's ``generate_step`` does it (the next step's graph is
built while the device computes the current one; ``--sync`` evaluates each step
before building the next, which adds the host-side time). All caches of one context are filled first and then timed in
``--rounds`` interleaved rounds (warm-up steps, then ``--steps`` timed steps each;
the order rotates between rounds), so that a shared GPU's drifting clocks and
neighbours weigh on every cache alike; the median step time over all rounds gives
tokens/s.

Columns: "KV GiB" is what the caches hold after the timed steps (allocated buffers,
all layers) and "KV /
fp16" its ratio to the fp16 cache's; "peak GiB" is MLX's peak memory over the cache's
timed steps (weights + caches + temporaries) less the other caches held at the time
(least over the rounds);
"× fp16" is decode tokens/s over the fp16 cache's at the same context (the fp16 cache
must come first in ``--caches``).

Caches (``--caches``): ``fp16`` (mlx-lm's KVCache), ``fp16:inplace`` (the same with each
token written into its buffers in place, see InPlaceKVCache: CPU and CUDA), a preset
name of
turboquant_mlx.cache.PRESETS (through ``make_prompt_cache(model, preset=...)``),
``k<b>v<b>`` that is not a preset name (a plain TurboQuantKVCache with those bit
widths: no sinks, window or levers; ``k4v3`` is the preset),
``PRESET@wN`` (that preset with its last N tokens in fp16), or
``affine<b>`` (mlx-lm's QuantizedKVCache, group size 64; with MLX 0.32.4's CUDA backend
its decode step fails in ``mx.quantized_matmul`` -- "No implementation for problem
shape" -- and the row shows that error). A cache that fails is reported in its row and
the others still run.

Usage:
  python bench/bench_decode.py                      # GPU, 4k/32k/128k, default caches
  python bench/bench_decode.py --contexts 4096 --caches fp16,k4v4
  python bench/bench_decode.py --device cpu --layers 2 --hidden 256 --heads 4 \\
      --kv-heads 2 --head-dim 64 --intermediate 512 --vocab 1024 --contexts 512,1024
"""

import argparse
import gc
import re
import statistics
import sys
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from turboquant_mlx import _ext
from turboquant_mlx.attention import install_hook
from turboquant_mlx.cache import (
    PRESETS,
    TurboQuantKVCache,
    get_preset,
    layer_seed,
    make_prompt_cache,
)

GiB = 2**30
DEFAULT_CACHES = "fp16,k4v4,tq4-nowindow,tq4,tq3,k4v3"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--contexts",
        default="4096,32768,131072",
        help="comma-separated context lengths (tokens already cached)",
    )
    p.add_argument("--caches", default=DEFAULT_CACHES, help=f"default: {DEFAULT_CACHES}")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps first")
    p.add_argument(
        "--sync",
        action="store_true",
        help="evaluate each step before building the next (default: pipelined "
        "like mlx-lm's generate_step)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="interleaved timing rounds over the caches of one context",
    )
    p.add_argument("--chunk", type=int, default=4096, help="tokens per cache fill call")
    p.add_argument(
        "--device", choices=("gpu", "cpu"), default=None, help="default: gpu if MLX has one"
    )
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        default=None,
        help="activations and KV dtype (default: float16 on GPU, float32 on CPU)",
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--weight-bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build_model(a, dtype):
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        intermediate_size=a.intermediate,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        rms_norm_eps=1e-5,
        vocab_size=a.vocab,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=False,
    )
    model = llama.Model(args)  # random init, lazy
    model.set_dtype(dtype)
    nn.quantize(model, group_size=a.group_size, bits=a.weight_bits)
    # Evaluate module by module so the float weights never all exist at once.
    for layer in model.model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def weight_bytes(model):
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


class InPlaceKVCache(KVCache):
    """mlx-lm's fp16 KVCache with each new token written into its buffers in place
    (``_ext.write_tokens``). mlx-lm writes with ``slice_update``, which reuses a buffer
    only when nothing else references it; under pipelined decoding the previous step's
    kernels still do, and the buffer is copied. This is the fp16 baseline without those
    copies. Growth is mlx-lm's; for benchmarks only (a trim followed by writes would
    overwrite slots that arrays taken before it still show)."""

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or prev + keys.shape[2] > self.keys.shape[2]:
            return super().update_and_fetch(keys, values)
        self.offset += keys.shape[2]
        self.keys = _ext.write_tokens(self.keys, keys, prev)
        self.values = _ext.write_tokens(self.values, values, prev)
        return self.keys_and_values()


def make_caches(model, name, total_tokens):
    """The prompt cache called ``name`` (see the module docstring)."""
    n = len(model.layers)
    if name == "fp16":
        return [KVCache() for _ in range(n)]
    if name == "fp16:inplace":
        return [InPlaceKVCache() for _ in range(n)]
    m = re.fullmatch(r"affine(\d)", name)
    if m:
        return [QuantizedKVCache(group_size=64, bits=int(m.group(1))) for _ in range(n)]
    m = re.fullmatch(r"k(\d)v(\d)", name)
    if name in PRESETS or "@w" in name:  # before k<b>v<b>: "k4v3" is a preset
        caches = make_prompt_cache(model, preset=get_preset(name))
    elif m:
        install_hook()
        caches = [
            TurboQuantKVCache(
                key_bits=int(m.group(1)), value_bits=int(m.group(2)), seed=layer_seed(0, i)
            )
            for i in range(n)
        ]
    else:
        raise ValueError(
            f"unknown cache {name!r}: fp16, k<b>v<b>, affine<b> or one of {', '.join(PRESETS)}"
        )
    for c in caches:
        if isinstance(c, TurboQuantKVCache):
            c.reserve(total_tokens)
    return caches


def _arrays(tree):
    """The arrays of a cache's ``state`` (nested tuples/lists, integers skipped)."""
    if isinstance(tree, (list, tuple)):
        return [x for t in tree for x in _arrays(t)]
    return [tree] if isinstance(tree, mx.array) else []


def fill(caches, context, a, dtype):
    """Puts ``context`` random tokens in every layer's cache, chunk by chunk."""
    for c in caches:
        done = 0
        while done < context:
            n = min(a.chunk, context - done)
            shape = (1, a.kv_heads, n, a.head_dim)
            keys = mx.random.normal(shape).astype(dtype)
            values = mx.random.normal(shape).astype(dtype)
            c.update_and_fetch(keys, values)
            del keys, values
            mx.eval(_arrays(c.state))
            done += n
        assert c.offset == context, (c.offset, context)


def kv_bytes(caches):
    return sum(c.nbytes for c in caches)


def time_decode(model, caches, a):
    """Step times of ``a.warmup`` untimed then ``a.steps`` timed decode steps, the
    peak memory over the timed ones, whether the last logits are finite, and the
    compressed-cache buffer copies per timed step (an append that cannot reuse its
    buffer copies all of it: see csrc/buffer_copies.h).

    By default the steps run as mlx-lm's ``generate_step`` runs them: the next
    step's graph is built (Python, the caches' bookkeeping) while the GPU computes
    the current one (``mx.async_eval``), each step feeding its greedy token to the
    next. With ``--sync`` every step is built, then evaluated, so that the host-side
    time adds to the device time.
    """

    def step(tok):
        logits = model(tok[:, None], cache=caches)[:, -1]
        return mx.argmax(logits, axis=-1).astype(mx.int32), logits

    tok = mx.array([1], dtype=mx.int32)
    if a.sync:

        def run(n):
            times, logits = [], None
            for _ in range(n):
                t0 = time.perf_counter()
                _, logits = step(tok)
                mx.eval(logits)
                times.append(time.perf_counter() - t0)
            return times, logits
    else:

        def run(n):
            y, logits = step(tok)
            mx.async_eval(y, logits)
            times = []
            t0 = time.perf_counter()
            for _ in range(n):
                next_y, next_logits = step(y)
                mx.async_eval(next_y, next_logits)
                y.item()  # as generate_step hands out each token
                t1 = time.perf_counter()
                times.append(t1 - t0)
                t0 = t1
                y, logits = next_y, next_logits
            mx.eval(logits)
            return times, logits

    run(a.warmup)
    mx.synchronize()
    reset_peak_memory()
    copies = _ext.buffer_copies()
    times, logits = run(a.steps)
    mx.synchronize()
    copies = _ext.buffer_copies() - copies
    peak = peak_memory()
    finite = bool(mx.isfinite(logits.astype(mx.float32)).all().item())
    return times, peak, finite, copies / a.steps


def reset_peak_memory():
    """Restarts the peak of :func:`peak_memory`."""
    mx.reset_peak_memory()
    _ext.gpu_pool_memory(reset_peak=True)


def peak_memory():
    """MLX's peak memory plus the peak of what the extension's GPU backend allocates
    outside MLX's allocator (the CUDA backend's outputs and temporaries), in bytes: a
    bound on the device's peak (the two peaks may come at different times)."""
    return mx.get_peak_memory() + _ext.gpu_pool_memory()[1]


def main(argv=None):
    a = parse_args(argv)
    if a.device is None:
        a.device = "gpu" if mx.is_available(mx.gpu) else "cpu"
    mx.set_default_device(mx.gpu if a.device == "gpu" else mx.cpu)
    if a.dtype is None:
        a.dtype = "float16" if a.device == "gpu" else "float32"
    dtype = getattr(mx, a.dtype)
    contexts = [int(x) for x in a.contexts.split(",")]
    names = [x.strip() for x in a.caches.split(",") if x.strip()]
    mx.random.seed(a.seed)

    print(
        f"mlx {mx.__version__}, device {mx.default_device()}, turboquant GPU kernels: "
        f"{_ext.gpu_backend()} ({_ext.gpu_available()}), activations {a.dtype}"
    )
    t0 = time.perf_counter()
    model = build_model(a, dtype)
    print(
        f"model: {a.layers} layers, hidden {a.hidden}, {a.heads} q / {a.kv_heads} kv heads, "
        f"head dim {a.head_dim}, intermediate {a.intermediate}, vocab {a.vocab}, "
        f"{a.weight_bits}-bit g{a.group_size} weights {weight_bytes(model) / GiB:.2f} GiB "
        f"(built in {time.perf_counter() - t0:.1f} s); {a.rounds} rounds of {a.warmup} "
        f"warm-up + {a.steps} timed steps, median",
        flush=True,
    )

    rows = []
    header = (
        "| context | cache | KV GiB | KV / fp16 | decode tok/s | ms/token | × fp16 | peak GiB "
        "| buffer copies/step |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    print("\n" + header, flush=True)
    for ctx in contexts:
        label = f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)
        held, errors, t_fill = {}, {}, {}
        for name in names:
            try:
                t1 = time.perf_counter()
                caches = make_caches(model, name, ctx + a.rounds * (a.warmup + a.steps) + 1)
                fill(caches, ctx, a, dtype)
                held[name] = caches
                t_fill[name] = time.perf_counter() - t1
            except Exception as e:  # keep measuring the other caches
                errors[name] = e
                gc.collect()
                mx.clear_cache()
        times = {name: [] for name in held}
        peaks = {name: float("inf") for name in held}
        finite = {name: True for name in held}
        copies = {name: 0.0 for name in held}
        order = list(held)
        for r in range(a.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:
                try:
                    t, peak, ok, cp = time_decode(model, held[name], a)
                except Exception as e:
                    errors[name] = e
                    continue
                times[name] += t
                # The other caches' bytes are subtracted; until their first decode
                # step, caches still hold their last fill chunk (a prefill block's
                # reference), so the least of the rounds is the cache's own peak.
                others = sum(kv_bytes(c) for n, c in held.items() if n != name)
                peaks[name] = min(peaks[name], peak - others)
                finite[name] &= ok
                copies[name] = max(copies[name], cp)
        base = base_bytes = None
        for name in names:
            if name in errors or not times.get(name):
                e = errors.get(name)
                row = (
                    f"| {label} | {name} | error: {type(e).__name__}: {str(e)[:160]} | | | | | | |"
                )
                print(row, flush=True)
                rows.append(row)
                continue
            med, best = statistics.median(times[name]), min(times[name])
            # After decoding: caches with levers hold a fill of one chunk unquantized
            # until the next append calibrates them.
            nbytes = kv_bytes(held[name])
            if name == "fp16":
                base, base_bytes = med, nbytes
            ratio = f"{base / med:.2f}" if base else "–"
            bratio = f"{nbytes / base_bytes:.3f}" if base_bytes else "–"
            row = (
                f"| {label} | {name} | {nbytes / GiB:.3f} | {bratio} | {1 / med:.1f} | "
                f"{med * 1e3:.2f} | {ratio} | {peaks[name] / GiB:.2f} | {copies[name]:.1f} |"
                + ("" if finite[name] else " non-finite logits")
            )
            print(
                row + f"  <!-- fill {t_fill[name]:.1f} s, best {best * 1e3:.2f} ms -->", flush=True
            )
            rows.append(row)
        del held
        gc.collect()
        mx.clear_cache()

    print(
        "\n### Decode, 8B-shaped llama"
        if a.layers == 32 and a.hidden == 4096
        else "\n### Decode, reduced llama",
        f"({a.weight_bits}-bit weights, {a.dtype}, {mx.default_device()}, B=1)\n",
    )
    print(header)
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
