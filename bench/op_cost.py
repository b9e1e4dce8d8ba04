# Copyright © 2026 turboquant_mlx contributors.

"""Cost of one small operation in a decode step, by kind.

At short context a compressed cache's decode step is made of small operations (a
token's transform, its append, the window's bookkeeping), so what each one costs the
host (graph building, encoding, launch) and the device decides the step time, not the
bytes they move. This times chains of ``--ops`` operations of one kind on
decode-sized arrays (one token of ``--kv-heads`` heads, a window of ``--window``
tokens), evaluated as mlx-lm's generation loop does (pipelined, ``mx.async_eval``)
and, with ``--sync``, one chain at a time. The table gives microseconds per
operation and the ratio to an elementwise add.

Usage:
  python bench/op_cost.py                 # default device
  python bench/op_cost.py --sync --ops 64
"""

import argparse
import statistics
import sys
import time

import mlx.core as mx

from turboquant_mlx import _ext, ops


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=128, help="operations per timed chain")
    p.add_argument("--steps", type=int, default=30, help="timed chains")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=36, help="tokens of the window-sized arrays")
    p.add_argument("--sync", action="store_true", help="evaluate each chain before the next")
    p.add_argument(
        "--context", type=int, default=4096, help="tokens held by the attention kinds' caches"
    )
    p.add_argument("--kinds", default="", help="comma-separated substrings of the kinds to run")
    return p.parse_args(argv)


def kinds(a):
    """name -> (setup() -> state, op(state, x) -> x): ``op`` returns an array the next
    operation depends on, so that a chain cannot run in parallel."""
    H, D, W = a.kv_heads, a.head_dim, a.window
    tok = (1, H, 1, D)

    def add(st, x):
        return x + 1.0

    def hadamard(st, x):
        return mx.hadamard_transform(x, scale=D**-0.5)

    compiled_fn = mx.compile(lambda x, m: ((x - m) * 0.5).astype(mx.float32))

    def compiled(st, x):
        return compiled_fn(x, st["m"])

    def concat(st, x):
        # the window slide as a concatenation: (W - 1) kept tokens + the new one
        w = mx.concatenate([st["win"][:, :, 1:], x.astype(st["win"].dtype)], axis=2)
        st["win"] = w
        return w[:, :, -1:].astype(mx.float32)

    def slice_update(st, x):
        # the same as an in-place write into a held buffer
        i = st["i"] = (st["i"] + 1) % W
        st["win"][:, :, i : i + 1] = x.astype(st["win"].dtype)
        return st["win"][:, :, i : i + 1].astype(mx.float32)

    def strided_copy(st, x):
        return mx.contiguous(st["win"][:, :, 3:4].astype(mx.float32) + x)

    def quantize_append(st, x):
        i = st["i"] = (st["i"] + 1) % 1024
        st["codes"], st["scales"] = ops.quantize_append(
            st["codes"], st["scales"], x, st["cent"], i, 4
        )
        return x + 0.0 * st["scales"][:, :, i : i + 1, None]

    def quantize_append_in_place(st, x):
        i = st["i"] = (st["i"] + 1) % 1024
        st["codes"], st["scales"] = ops.quantize_append(
            st["codes"], st["scales"], x, st["cent"], i, 4, in_place=True
        )
        return x + 0.0 * st["scales"][:, :, i : i + 1, None]

    def write_tokens(st, x):
        # an fp16 cache's append that writes its buffer in place (bench_decode.py's
        # fp16:inplace), against the slice update above
        i = st["i"] = (st["i"] + 1) % W
        st["win"] = _ext.write_tokens(st["win"], x.astype(st["win"].dtype), i)
        return st["win"][:, :, i : i + 1].astype(mx.float32)

    C, G = a.context, 4  # a decode step's attention of 4 query heads per KV head

    def compressed_attention(tail=0):
        # K4V4 over C tokens, the queries rotated by the op; with a tail, a window
        # preset's step: centered, `tail` fp16 window tokens, a float16 output
        def op(st, x):
            q = mx.repeat(x, G, axis=1).astype(mx.float16)
            window = {}
            if tail:
                window = dict(
                    tail_k=st["win"][:, :, :tail],
                    tail_v=st["win"][:, :, :tail],
                    key_mean=st["m"],
                    value_mean=st["m"],
                    out_dtype=mx.float16,
                )
            out, _ = ops.compressed_attention(
                q,
                st["kc"],
                st["ks"],
                st["kc"],
                st["ks"],
                st["cent"],
                st["cent"],
                C,
                D**-0.5,
                4,
                4,
                False,
                rotation_signs=st["signs"],
                **window,
            )
            return out[:, ::G].astype(mx.float32)

        return op

    def quantize_append_kv(st, x):
        # a window-less preset's append: model-space tokens, rotated and centered by the op
        i = st["i"] = (st["i"] + 1) % 1024
        st["codes"], st["scales"], st["vcodes"], st["vscales"] = ops.quantize_append_kv(
            st["codes"],
            st["scales"],
            st["vcodes"],
            st["vscales"],
            x,
            x,
            st["cent"],
            st["cent"],
            i,
            4,
            4,
            key_rotation_signs=st["signs"],
            value_rotation_signs=st["signs"],
            key_mean=st["m"],
            value_mean=st["m"],
        )
        return x + 0.0 * st["scales"][:, :, i : i + 1, None]

    def ring_append_kv(st, x):
        # a window preset's step: the ring slot's token is appended, the new one takes it
        i = st["i"] = (st["i"] + 1) % 1024
        slot = i % W
        out = ops.ring_append_kv(
            st["codes"],
            st["scales"],
            st["vcodes"],
            st["vscales"],
            st["ring_k"],
            st["ring_v"],
            x.astype(mx.float16),
            x.astype(mx.float16),
            st["cent"],
            st["cent"],
            i,
            slot,
            4,
            4,
            key_rotation_signs=st["signs"],
            value_rotation_signs=st["signs"],
            key_mean=st["m"],
            value_mean=st["m"],
        )
        st["codes"], st["scales"], st["vcodes"], st["vscales"] = out[:4]
        st["ring_k"], st["ring_v"] = out[4:]
        return x + 0.0 * st["scales"][:, :, i : i + 1, None]

    def sdpa(st, x):
        q = mx.repeat(x, G, axis=1).astype(mx.float16)
        out = mx.fast.scaled_dot_product_attention(q, st["kf"], st["kf"], scale=D**-0.5)
        return out[:, ::G].astype(mx.float32)

    def setup():
        wpt = _ext.words_per_token(D, 4)
        return {
            "kc": mx.random.randint(0, 2**31, (1, H, C, wpt)).astype(mx.uint32),
            "ks": mx.full((1, H, C), 0.1, dtype=mx.float16),
            "kf": mx.random.normal((1, H, C, D)).astype(mx.float16),
            "signs": ops.RotationSigns([1.0 - 2.0 * (j % 3 == 0) for j in range(D)]),
            "m": mx.zeros(tok, dtype=mx.float32),
            "win": mx.zeros((1, H, W, D), dtype=mx.float16),
            "i": 0,
            "codes": mx.zeros((1, H, 1024, D * 4 // 32), dtype=mx.uint32),
            "scales": mx.zeros((1, H, 1024), dtype=mx.float16),
            "vcodes": mx.zeros((1, H, 1024, D * 4 // 32), dtype=mx.uint32),
            "vscales": mx.zeros((1, H, 1024), dtype=mx.float16),
            "ring_k": mx.random.normal((1, H, W, D)).astype(mx.float16),
            "ring_v": mx.random.normal((1, H, W, D)).astype(mx.float16),
            "cent": mx.array(
                [
                    -1.5,
                    -1.0,
                    -0.7,
                    -0.5,
                    -0.35,
                    -0.2,
                    -0.1,
                    -0.03,
                    0.03,
                    0.1,
                    0.2,
                    0.35,
                    0.5,
                    0.7,
                    1.0,
                    1.5,
                ]
            )
            * D**-0.5,
        }

    return {
        "add": (setup, add),
        "compiled elementwise": (setup, compiled),
        "hadamard_transform": (setup, hadamard),
        "concatenate (window slide)": (setup, concat),
        "slice update (in place)": (setup, slice_update),
        "strided slice copy": (setup, strided_copy),
        "quantize_append (codes+scales)": (setup, quantize_append),
        "quantize_append, in place": (setup, quantize_append_in_place),
        "write_tokens (fp16, in place)": (setup, write_tokens),
        f"compressed_attention K4V4 ({C} tokens)": (setup, compressed_attention()),
        "quantize_append_kv (model space, centered)": (setup, quantize_append_kv),
        "ring_append_kv (model space, centered)": (setup, ring_append_kv),
        f"compressed_attention model space, 4-token tail ({C} tokens)": (
            setup,
            compressed_attention(4),
        ),
        f"compressed_attention model space, {W}-token tail ({C} tokens)": (
            setup,
            compressed_attention(W),
        ),
        f"fp16 SDPA ({C} tokens)": (setup, sdpa),
    }


def time_kind(setup, op, a):
    st = setup()
    x = mx.random.normal((1, a.kv_heads, 1, a.head_dim))
    mx.eval(x, [v for v in st.values() if isinstance(v, mx.array)])

    def chain(x):
        for _ in range(a.ops):
            x = op(st, x)
        return x

    def run(n):
        nonlocal x
        times = []
        if a.sync:
            for _ in range(n):
                t0 = time.perf_counter()
                x = chain(x)
                mx.eval(x)
                times.append(time.perf_counter() - t0)
            return times
        y = chain(x)
        mx.async_eval(y)
        t0 = time.perf_counter()
        for _ in range(n):
            ny = chain(y)
            mx.async_eval(ny)
            mx.eval(y)
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0, y = t1, ny
        mx.eval(y)
        x = y
        return times

    run(3)
    return statistics.median(run(a.steps)) / a.ops


def main(argv=None):
    a = parse_args(argv)
    print(
        f"mlx {mx.__version__}, {mx.default_device()}, turboquant GPU kernels: "
        f"{_ext.gpu_backend()} ({_ext.gpu_available()}); chains of {a.ops} operations, "
        f"{'sync' if a.sync else 'pipelined'}, median of {a.steps}"
    )
    rows, base = [], None
    wanted = [w for w in a.kinds.split(",") if w]
    for name, (setup, op) in kinds(a).items():
        if wanted and not any(w in name for w in wanted):
            continue
        us = time_kind(setup, op, a) * 1e6
        base = base or us
        rows.append(f"| {name} | {us:.1f} | {us / base:.2f} |")
        print(rows[-1], flush=True)
    print(
        f"\n### Cost per operation ({mx.default_device()}, {'sync' if a.sync else 'pipelined'})\n"
    )
    print("| operation | µs / op | × add |\n|---|---:|---:|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
