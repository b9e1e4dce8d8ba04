"""Folding the value rotation into W_v/W_o on SmolLM2-135M: quality, weight memory, speed.

The GGUF's linear layers are 4-bit (group 32). :func:`turboquant_mlx.fold.fold_value_rotation`
either dequantizes the folded ``v_proj``/``o_proj`` to float (``dequantize``: exact) or
quantizes them again with the same bits and group size (``requantize``: a second rounding
of those two matrices). This script compares both with the unfolded model, each with its
matching compressed cache (``make_prompt_cache`` of the same preset and seed):

(a) Perplexity over the first ``--ppl-tokens`` tokens of the license texts that
    ``bench/quality.py`` uses (its machinery: chunks of ``--chunk`` tokens, linear
    layers dequantized to float32 and multiplied by NumPy on the CPU -- so the
    ``dequantize`` fold differs from the unfolded model only by float rounding). The
    compressed cache makes the perplexity sensitive to float rounding anywhere (a code
    is a discontinuous function of its input): the row "control" is the unfolded model
    with only the summation of ``v_proj`` changed (float64), i.e. the noise floor of a
    difference that is not a change of the model.
(b) Bytes of the ``v_proj``/``o_proj`` parameters of all layers and of the whole model,
    with the scales (and dequantized weights) in float32 -- as the model runs on the CPU --
    and in float16 -- as on a GPU.
(c) Decode tokens/s with MLX's own matmuls (the ``turboquant_mlx.generate`` path):
    ``--decode-context`` prompt tokens prefilled, then ``--decode-steps`` greedy steps
    timed; the modes are measured in turn, ``--decode-repeats`` rounds, median reported.

Example::

    python bench/fold.py --ppl-tokens 1024 --presets tq4-sink --seeds 0,1,2
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quality  # noqa: E402  (sets OPENBLAS_NUM_THREADS before NumPy loads)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from turboquant_mlx.cache import make_prompt_cache  # noqa: E402
from turboquant_mlx.fold import fold_value_rotation  # noqa: E402

MODES = ("unfolded", "dequantize", "requantize")
# Bench names of cache settings besides the presets: "fp16-window" is a TurboQuant
# cache whose fp16 window holds every token (nothing quantized), so that only the
# weights differ between the rows (the fold still applies: values stored rotated).
SETTINGS = {"fp16-window": dict(preset="tq4", fp16_recent_tokens=1 << 20)}


def settings(preset: str):
    return dict(SETTINGS.get(preset, dict(preset=preset)))


def load(mode: str, preset: str, seed: int, dtype=mx.float32):
    gguf = quality._gguf_module()
    model, tok = gguf.load_gguf(gguf.default_smollm2_path(), dtype=dtype)
    if mode in ("dequantize", "requantize"):
        fold_value_rotation(model, seed=seed, mode=mode, **settings(preset))
    return model, tok


class Float64Linear(quality.NumpyLinear):
    """The control: the same float32 weight, products summed in float64."""

    def __call__(self, x):
        xn = np.asarray(x.astype(mx.float32)).astype(np.float64)
        y = xn.reshape(-1, xn.shape[-1]) @ self._wt.astype(np.float64)
        if self._bias is not None:
            y += self._bias
        return mx.array(y.astype(np.float32).reshape(*xn.shape[:-1], y.shape[-1]))


def cache_for(model, preset, seed):
    caches = make_prompt_cache(model, seed=seed, **settings(preset))
    # As bench/quality.py: uncompressed layers hold float16 like the fp16 reference.
    return [quality.Float16KVCache() if type(c) is quality.KVCache else c for c in caches]


def param_bytes(model):
    attn = total = 0
    for name, p in tree_flatten(model.parameters()):
        total += p.nbytes
        if ".self_attn.v_proj." in name or ".self_attn.o_proj." in name:
            attn += p.nbytes
    return attn, total


def decode_tps(model, tok, ids, preset, seed, steps):
    cache = make_prompt_cache(model, seed=seed, **settings(preset))
    for s in range(0, len(ids), 256):
        model(mx.array(ids[s : s + 256])[None], cache=cache)
        mx.eval([c.state for c in cache])
    y = mx.array([[ids[-1]]])
    logits = model(y, cache=cache)  # warm-up step
    y = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(y)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model(y, cache=cache)
        y = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(y)
    return steps / (time.perf_counter() - t0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--presets",
        default="tq4-sink",
        help="comma-separated presets, or fp16-window (nothing quantized)",
    )
    p.add_argument("--seeds", default="0", help="comma list of base rotation seeds")
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--decode-repeats", type=int, default=2)
    p.add_argument("--skip", default="", help="comma list of parts to skip: ppl,memory,decode")
    args = p.parse_args(argv)
    presets = [s.strip() for s in args.presets.split(",") if s.strip()]
    skip = {s.strip() for s in args.skip.split(",")}
    seeds = [int(x) for x in args.seeds.split(",")]
    args.seed = seeds[0]
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    print(f"mlx {mx.__version__}, device {mx.default_device()}, {os.cpu_count()} CPUs\n")

    if "ppl" not in skip:
        print(
            f"## (a) Perplexity, {args.ppl_tokens} tokens, chunk {args.chunk}, "
            f"rotation seeds {seeds}\n"
        )
        print("| preset | seed | weights | perplexity | vs unfolded | time (s) |")
        print("|---|---|---|---|---|---|")
        model, tok = load("unfolded", "tq4", 0)
        ids = tok.encode(quality.license_text())[: args.ppl_tokens]
        ppl, _ = quality.perplexity(
            quality.Runner(model, "numpy"),
            [quality.Float16KVCache() for _ in model.layers],
            ids,
            args.chunk,
        )
        print(f"| fp16 KV | – | 4-bit, unfolded | {ppl:.4f} | | |", flush=True)
        labels = {
            "unfolded": "4-bit, unfolded",
            "dequantize": "fold, v/o dequantized",
            "requantize": "fold, v/o requantized 4-bit g32",
            "control": "control: unfolded, v_proj summed in float64",
        }
        summary = []
        for preset in presets:
            deltas = {m: [] for m in ("dequantize", "requantize", "control")}
            base_ppls = []
            for seed in seeds:
                base = None
                for mode in MODES + ("control",):
                    model, _ = load("unfolded" if mode == "control" else mode, preset, seed)
                    runner = quality.Runner(model, "numpy")
                    if mode == "control":
                        for layer in model.layers:
                            layer.self_attn.v_proj.__class__ = Float64Linear
                    t0 = time.perf_counter()
                    ppl, _ = quality.perplexity(
                        runner, cache_for(model, preset, seed), ids, args.chunk
                    )
                    dt = time.perf_counter() - t0
                    if mode == "unfolded":
                        base = ppl
                        base_ppls.append(ppl)
                        delta = ""
                    else:
                        deltas[mode].append(100 * (ppl / base - 1))
                        delta = f"{deltas[mode][-1]:+.3f}%"
                    print(
                        f"| {preset} | {seed} | {labels[mode]} | {ppl:.4f} | {delta} | {dt:.0f} |",
                        flush=True,
                    )
                    log(f"[ppl] {preset} seed {seed} {mode}: {ppl:.4f} ({dt:.0f} s)")
            sd = (
                statistics.stdev(base_ppls) / statistics.mean(base_ppls) * 100
                if len(seeds) > 1
                else 0
            )
            summary.append(f"| {preset} | unfolded: seed-to-seed spread | {sd:.3f}% (std) |")
            for mode, d in deltas.items():
                spread = f" ± {statistics.stdev(d):.3f}" if len(d) > 1 else ""
                summary.append(
                    f"| {preset} | {labels[mode]} | {statistics.mean(d):+.3f}%{spread} |"
                )
        print("\nMean change vs the unfolded model with the same seed (± std over seeds):\n")
        print("| preset | weights | perplexity change |")
        print("|---|---|---|")
        print("\n".join(summary))
        print()

    if "memory" not in skip:
        print("## (b) Weight memory (MB)\n")
        print(
            "| weights | v_proj+o_proj, fp32 scales (CPU) | model, fp32 | "
            "v_proj+o_proj, fp16 scales (GPU) | model, fp16 |"
        )
        print("|---|---|---|---|---|")
        for mode in MODES:
            row = []
            for dtype in (mx.float32, mx.float16):
                model, _ = load(mode, presets[0], args.seed, dtype=dtype)
                row += [f"{b / 1e6:.2f}" for b in param_bytes(model)]
            print(f"| {mode} | " + " | ".join(row) + " |", flush=True)
        print()

    if "decode" not in skip:
        print(
            f"## (c) Decode on {mx.default_device()}, MLX matmuls, context "
            f"{args.decode_context}, {args.decode_steps} steps, preset {presets[0]}\n"
        )
        models = {m: load(m, presets[0], args.seed) for m in MODES}
        tok = models["unfolded"][1]
        ids = tok.encode(quality.license_text())[: args.decode_context]
        rates = {m: [] for m in MODES}
        for r in range(args.decode_repeats):
            for m in MODES:
                rates[m].append(
                    decode_tps(models[m][0], tok, ids, presets[0], args.seed, args.decode_steps)
                )
                log(f"[decode] round {r} {m}: {rates[m][-1]:.2f} tok/s")
        print("| weights | tokens/s (median) | runs |")
        print("|---|---|---|")
        for m in MODES:
            runs = ", ".join(f"{x:.2f}" for x in rates[m])
            print(f"| {m} | {statistics.median(rates[m]):.2f} | {runs} |", flush=True)


if __name__ == "__main__":
    main()
