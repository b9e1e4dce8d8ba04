"""Runs compressed_attention a few times on one random cache: a target for profilers
(e.g. `ncu --kernel-name regex:tq_attention python bench/attention_once.py`).

    python bench/attention_once.py --context 131072 --q-heads 32 --kv-heads 8 --head-dim 128
"""

import argparse
import math
import os
import sys

import mlx.core as mx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_gpu import random_cache  # noqa: E402
from turboquant_mlx import codebook, ops  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--key-bits", type=int, default=4)
    ap.add_argument("--value-bits", type=int, default=4)
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    n, d, hkv = a.context, a.head_dim, a.kv_heads

    kc, ks = random_cache(1, hkv, n, d, a.key_bits)
    vc, vs = random_cache(1, hkv, n, d, a.value_bits)
    q = mx.random.normal((1, a.q_heads, 1, d)).astype(getattr(mx, a.dtype))
    kcent = mx.array(codebook.lloyd_max_centroids(d, a.key_bits).astype(np.float32))
    vcent = mx.array(codebook.lloyd_max_centroids(d, a.value_bits).astype(np.float32))
    mx.eval(kc, ks, vc, vs, q)
    for _ in range(a.calls):
        out, lse = ops.compressed_attention(
            q, kc, ks, vc, vs, kcent, vcent, n, 1.0 / math.sqrt(d), a.key_bits, a.value_bits, True
        )
        mx.eval(out, lse)
    print("ok", out.shape, float(mx.abs(out).max()))


if __name__ == "__main__":
    main()
