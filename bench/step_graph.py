# Copyright © 2026 turboquant_mlx contributors.

"""Operations in one decode step of one layer's cache, by kind: what each cache asks of
the device per layer and token, besides the model's own work.

On a GPU each operation that computes is at least one kernel (a concatenation copies
once per input on MLX's CUDA backend), and at short context, where there is little
attention work, their number decides the step time (docs/H200_LOG.md).
The count is read from the graph of a decode step's output (``update_and_fetch`` +
attention) on a filled cache, through ``mx.export_to_dot``; views (slices, reshapes,
broadcasts) are listed apart since they launch nothing. The window presets also write
each token into their fp16 window buffer; those writes are deferred and done in batches
(every ``window_slack`` steps, or when something reads the window), so they are not
part of a step's graph. It is device independent, so it tracks this cost on a machine
without a GPU.

Usage:
  python bench/step_graph.py                      # fp16, k4v4 and the presets
  python bench/step_graph.py --caches tq4,tq4@w128 --head-dim 64
"""

import argparse
import collections
import os
import re
import sys
import tempfile

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from turboquant_mlx.cache import PRESETS, TurboQuantKVCache, get_preset

VIEWS = {"Slice", "Reshape", "Broadcast", "ExpandDims", "Squeeze", "Transpose"}


def make_cache(name):
    if name == "fp16":
        return KVCache()
    m = re.fullmatch(r"k(\d)v(\d)", name)
    if m and name not in PRESETS:  # preset names first, as in bench_decode.py
        return TurboQuantKVCache(int(m.group(1)), int(m.group(2)))
    return TurboQuantKVCache(**get_preset(name).layer_configs(2)[1])


def step_graph(name, a):
    """Primitive names of one decode step's graph (after a few steps of warm-up)."""
    cache = make_cache(name)
    B, H, D = 1, a.kv_heads, a.head_dim
    k = mx.random.normal((B, H, a.context, D)).astype(mx.float16)
    cache.update_and_fetch(k, k)
    mx.eval(k)
    for step in range(4):
        kn = mx.random.normal((B, H, 1, D)).astype(mx.float16)
        q = mx.random.normal((B, a.heads, 1, D)).astype(mx.float16)
        mx.eval(kn, q)
        keys, values = cache.update_and_fetch(kn, kn)
        if isinstance(cache, KVCache):
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=D**-0.5)
            stored = [cache.keys, cache.values]
        else:
            out = cache.attention(q, D**-0.5, None)
            stored = [x for x in cache.state if isinstance(x, mx.array)]
        if step == 3:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "step.dot")
                # What a generation loop evaluates: the step's output. (The window
                # presets' in-place window writes are not part of it: they run in
                # batches, when the window buffer is rebuilt.)
                mx.export_to_dot(path, out)
                text = open(path).read()
        mx.eval(out, *stored)
    labels = re.findall(r'label ="([^"]+)"', text)
    # Constants of the state (e.g. empty sink arrays) are graph roots, not work.
    return [x for x in labels if x != "Full"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--caches", default="fp16,k4v4,tq4-nowindow,tq4,tq3,k4v3")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    a = p.parse_args(argv)
    print(
        f"One decode step of one layer: {a.heads} query / {a.kv_heads} KV heads, head dim "
        f"{a.head_dim}, {a.context} cached tokens, {mx.default_device()}\n"
    )
    print("| cache | operations (not views) | concatenations | of which | views |")
    print("|---|---:|---:|---|---:|")
    for name in a.caches.split(","):
        labels = step_graph(name.strip(), a)
        work = [x for x in labels if x not in VIEWS and x != "Contiguous"]
        views = [x for x in labels if x in VIEWS]
        kinds = collections.Counter(work)
        detail = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items()))
        print(f"| {name} | {len(work)} | {kinds.get('Concatenate', 0)} | {detail} | {len(views)} |")
    print(
        "\nContiguous nodes are left out: they copy only when their input is a strided "
        "view (on MLX's CUDA backend a non-contiguous token slice before quantize_append)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
