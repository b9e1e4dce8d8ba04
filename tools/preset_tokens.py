# Copyright © 2026 turboquant_mlx contributors.

"""Digests of what every preset generates on SmolLM2-135M: a check that a change which
should not change behaviour (a refactor) leaves tokens and logits bit-identical.

For each preset: a prompt read in several prefill blocks, greedy decode steps, then a
trim of the last tokens and a verification block over them (the speculative-decoding
path), and a batch of two prompts through mlx-lm's batched generation. Prints one line
per preset: the sha1 of the generated tokens and of the logits' bytes. Run it before and
after the change and compare (``diff``).

    python tools/preset_tokens.py > before.txt   # (on the old commit)
    python tools/preset_tokens.py > after.txt
    diff before.txt after.txt
"""

import argparse
import hashlib
import os
import sys

import mlx.core as mx


def _digest(arrays) -> str:
    h = hashlib.sha1()
    for a in arrays:
        h.update(memoryview(mx.array(a).astype(mx.float32)))
    return h.hexdigest()[:16]


def single(model, make_cache, prompt, new_tokens, block):
    cache = make_cache()
    logits_seen, tokens = [], []
    for i in range(0, len(prompt) - 1, block):
        model(mx.array(prompt[i : min(i + block, len(prompt) - 1)])[None], cache=cache)
    y = mx.array([prompt[-1]])
    for _ in range(new_tokens):
        logits = model(y[None], cache=cache)[:, -1]
        logits_seen.append(logits)
        y = mx.argmax(logits, axis=-1)
        tokens.append(int(y.item()))
    # A verification block over the last 4 tokens, after a trim of 3.
    for c in cache:
        c.trim(3)
    verify = model(mx.array(tokens[-4:])[None], cache=cache)
    logits_seen.append(verify)
    return tokens, logits_seen


def batch(model, make_cache, prompts, new_tokens):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, stop_tokens=None)
    uids = gen.insert(prompts, [new_tokens] * len(prompts), caches=[make_cache() for _ in prompts])
    out = {u: [] for u in uids}
    while responses := gen.next_generated():
        for r in responses:
            out[r.uid].append(r.token)
            out[r.uid].append(mx.array(r.logprobs))
    gen.close()
    return [x for u in uids for x in out[u]]


def main():
    from turboquant_mlx import cache as tq
    from turboquant_mlx.gguf import default_smollm2_path, load_gguf

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--presets", default=",".join(n for n in tq.PRESETS if n != "fp16"))
    p.add_argument("--prompt-tokens", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=40)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--no-batch", action="store_true")
    args = p.parse_args()
    mx.random.seed(0)
    model, tokenizer = load_gguf(default_smollm2_path(), dequantize=True)
    text = open(os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")).read()
    ids = tokenizer.encode(text)
    prompt = ids[: args.prompt_tokens]
    prompts = [ids[: args.prompt_tokens // 2], ids[100 : 100 + args.prompt_tokens // 3]]
    for name in args.presets.split(","):

        def make_cache(name=name):
            return tq.make_prompt_cache(model, preset=name)

        tokens, logits = single(model, make_cache, prompt, args.new_tokens, args.block)
        line = f"{name:14s} single {_digest([mx.array(tokens)])} logits {_digest(logits)}"
        if not args.no_batch:
            try:
                rows = batch(model, make_cache, prompts, args.new_tokens // 2)
                line += f" batch {_digest(rows)}"
            except Exception as e:  # a preset the batch cache refuses: say so
                line += f" batch refused ({type(e).__name__})"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
