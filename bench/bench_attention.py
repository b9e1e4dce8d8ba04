"""Decode attention on the compressed cache vs MLX's SDPA on fp16/fp32 K/V, and append cost.

Prints markdown tables. All variants run in the same process, on the same device:

    python bench/bench_attention.py                      # CPU, contexts 1k..64k
    python bench/bench_attention.py --device gpu --contexts 4096,32768,131072,262144

"Effective GB/s" counts the bytes each variant must read: the packed codes + scales for
the compressed cache, the K/V tensors for SDPA.
"""

import argparse
import math
import time

import mlx.core as mx
import numpy as np

from turboquant_mlx import codebook, ops
from turboquant_mlx.rotation import Rotation


def timeit(fn, warmup=2, min_runs=5, min_seconds=1.0):
    """Median wall time (µs) of fn() followed by mx.eval of its outputs."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return 1e6 * float(np.median(times))


def make_compressed(batch, kv_heads, context, head_dim, bits, rotation, chunk=8192):
    """A compressed cache filled with random tokens (appended in chunks)."""
    words = ops.words_per_token(head_dim, bits)
    codes = mx.zeros((batch, kv_heads, context, words), dtype=mx.uint32)
    scales = mx.zeros((batch, kv_heads, context), dtype=mx.float16)
    cents = codebook.centroids(head_dim, bits)
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        x = mx.random.normal((batch, kv_heads, n, head_dim)).astype(mx.float16)
        codes, scales = ops.quantize_append(codes, scales, rotation.forward(x), cents, start, bits)
        mx.eval(codes, scales)
    return codes, scales, cents


def affine_attention(q, kq, vq, scale, group_size=64, bits=4):
    """mlx-lm's quantized SDPA path: two quantized matmuls around a softmax."""
    B, n_q, L, D = q.shape
    n_kv = kq[0].shape[1]
    q = (q * scale).reshape(B, n_kv, n_q // n_kv, L, D)
    kq = tuple(t[:, :, None] for t in kq)
    vq = tuple(t[:, :, None] for t in vq)
    s = mx.quantized_matmul(q, *kq, transpose=True, group_size=group_size, bits=bits)
    p = mx.softmax(s, axis=-1, precise=True)
    o = mx.quantized_matmul(p, *vq, transpose=False, group_size=group_size, bits=bits)
    return o.reshape(B, n_q, L, D)


def bench_attention(args, device):
    B, n_q, n_kv, D = 1, args.q_heads, args.kv_heads, args.head_dim
    scale = 1.0 / math.sqrt(D)
    rot = Rotation(D, seed=0)
    rows = []
    for ctx in args.contexts:
        q = mx.random.normal((B, n_q, 1, D)).astype(mx.float16)
        k16 = mx.random.normal((B, n_kv, ctx, D)).astype(mx.float16)
        v16 = mx.random.normal((B, n_kv, ctx, D)).astype(mx.float16)
        mx.eval(q, k16, v16)
        kv16_bytes = 2 * k16.nbytes
        t16 = timeit(lambda: mx.fast.scaled_dot_product_attention(q, k16, v16, scale=scale))
        row = {"context": ctx, "fp16 SDPA": (t16, kv16_bytes)}
        if args.fp32_baseline:
            k32, v32, q32 = k16.astype(mx.float32), v16.astype(mx.float32), q.astype(mx.float32)
            mx.eval(k32, v32, q32)
            t32 = timeit(lambda: mx.fast.scaled_dot_product_attention(q32, k32, v32, scale=scale))
            row["fp32 SDPA"] = (t32, 2 * k32.nbytes)
            del k32, v32
        if args.affine:
            # On the CPU, mlx-lm models run in float32 (quantized matmuls with float16
            # activations are tens of times slower there), so the affine baseline does too.
            adt = mx.float32 if device == "CPU" else mx.float16
            qa = q.astype(adt)
            kq = mx.quantize(k16.astype(adt), group_size=64, bits=4)
            vq = mx.quantize(v16.astype(adt), group_size=64, bits=4)
            mx.eval(qa, kq, vq)
            ta = timeit(lambda: affine_attention(qa, kq, vq, scale))
            row["affine4 g64"] = (ta, sum(t.nbytes for t in kq + vq))
            del kq, vq
        k16 = v16 = None  # drop the arrays (not del: the lambdas above name them)
        for kb, vb in args.bit_pairs:
            kc, ks, kcent = make_compressed(B, n_kv, ctx, D, kb, rot)
            vc, vs, vcent = make_compressed(B, n_kv, ctx, D, vb, rot)

            def tq():
                # The full decode step: rotate the query, attend, rotate the output back.
                out, _ = ops.compressed_attention(
                    rot.forward(q), kc, ks, vc, vs, kcent, vcent, ctx, scale, kb, vb, True
                )
                return rot.inverse(out).astype(q.dtype)

            t = timeit(tq)
            row[f"TQ K{kb}V{vb}"] = (t, kc.nbytes + ks.nbytes + vc.nbytes + vs.nbytes)
            kc = ks = vc = vs = None
        rows.append(row)
        mx.clear_cache()

    names = [k for k in rows[0] if k != "context"]
    print(
        f"\n### Decode attention, {device}: B=1, {n_q} query heads, {n_kv} KV heads, "
        f"head dim {D}, 1 query token\n"
    )
    print(
        "| context | "
        + " | ".join(f"{n} µs (GB/s)" for n in names)
        + " | "
        + " | ".join(f"{n} speed-up vs fp16" for n in names if n.startswith("TQ"))
        + " |"
    )
    print("|" + "---|" * (1 + len(names) + sum(n.startswith("TQ") for n in names)))
    for row in rows:
        t16 = row["fp16 SDPA"][0]
        cells = [f"{row[n][0]:,.0f} ({row[n][1] / row[n][0] / 1e3:.1f})" for n in names]
        ratios = [f"{t16 / row[n][0]:.2f}x" for n in names if n.startswith("TQ")]
        print(f"| {row['context'] // 1024}k | " + " | ".join(cells + ratios) + " |")


def bench_append(args, device):
    """Cost of appending one token (decode) at growing cache lengths: must stay flat."""
    B, n_kv, D, bits = 1, args.kv_heads, args.head_dim, 4
    rot = Rotation(D, seed=0)
    cents = codebook.centroids(D, bits)
    words = ops.words_per_token(D, bits)
    print(f"\n### Append one token, {device}: B=1, {n_kv} KV heads, head dim {D}, 4-bit\n")
    print("| cache length | µs per append (incl. rotation) | vs shortest |")
    print("|---|---|---|")
    base = None
    for ctx in args.append_contexts:
        state = {
            "codes": mx.zeros((B, n_kv, ctx + 64, words), dtype=mx.uint32),
            "scales": mx.zeros((B, n_kv, ctx + 64), dtype=mx.float16),
        }
        mx.eval(state["codes"], state["scales"])
        x = rot.forward(mx.random.normal((B, n_kv, 1, D)))
        mx.eval(x)
        n = 0

        def step():
            nonlocal n
            # Replace the cache arrays in place, as the cache class does, so the
            # primitive can donate their buffers.
            state["codes"], state["scales"] = ops.quantize_append(
                state.pop("codes"), state.pop("scales"), x, cents, ctx + (n % 64), bits
            )
            n += 1
            return state["codes"], state["scales"]

        t = timeit(step, min_runs=50, min_seconds=0.5)
        base = base or t
        print(f"| {ctx // 1024}k | {t:.1f} | {t / base:.2f}x |")
        state = None
        mx.clear_cache()


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--contexts", default="1024,4096,16384,32768,65536")
    p.add_argument("--append-contexts", default="1024,4096,16384,65536")
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--bits", default="4:4,3:3", help="key:value bit pairs")
    p.add_argument("--no-fp32-baseline", dest="fp32_baseline", action="store_false")
    p.add_argument("--no-affine", dest="affine", action="store_false")
    p.add_argument("--skip-append", action="store_true")
    args = p.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.append_contexts = [int(c) for c in args.append_contexts.split(",")]
    args.bit_pairs = [tuple(int(b) for b in pair.split(":")) for pair in args.bits.split(",")]
    mx.set_default_device(mx.cpu if args.device == "cpu" else mx.gpu)
    device = "CPU" if args.device == "cpu" else "GPU"
    mx.random.seed(0)
    bench_attention(args, device)
    if not args.skip_append:
        bench_append(args, device)


if __name__ == "__main__":
    main()
