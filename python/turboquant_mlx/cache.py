# Copyright © 2026 turboquant_mlx contributors.

"""mlx-lm KV cache on TurboQuant-compressed storage, presets and the cache factory.

:class:`TurboQuantKVCache` follows mlx-lm's cache protocol (``update_and_fetch``,
``offset``, ``state``/``meta_state``/``from_state``, ``trim``, ``make_mask``,
``nbytes``, ``empty``, ``size``). It stores one layer's keys and values as packed
2/3/4-bit Lloyd–Max codes plus one float16 scale per token vector, after the
layer's rotation (docs/ARCHITECTURE.md), and computes attention directly on that
storage through :func:`~turboquant_mlx.attention.install_hook`.

Token layout of one layer, in position order::

    [0, S)            fp16 sink tokens          (``fp16_sink_tokens`` = S)
    [S, S + c)        compressed tokens         (codes + scales)
    [S + c, offset)   fp16 window of recent tokens (``fp16_recent_tokens`` = R)

"fp16" means the keys' own dtype (what mlx-lm's ``KVCache`` would store). The
window holds the last ``min(R, offset - S)`` tokens; older tokens are quantized
when they leave it. The window buffer keeps ``rollback_tokens`` more fp16 tokens
(already quantized too), for speculative decoding: a verification block's first
queries read the tokens that its later tokens pushed out of the window in fp16, as
single-token steps would, and trimming up to that many tokens (the rejected drafts)
leaves exactly the cache that never saw the trimmed tokens.

Two exact transforms of the compressed segment (options ``center`` and
``query_aware_keys``; off by default, on in the headline presets) make the codec's
job easier without changing what attention computes in exact arithmetic:

* Mean centering: the compressed tokens store ``k - mu_k`` and ``v - mu_v``, with
  ``mu_k``, ``mu_v`` (per batch row and KV head, float32) the means of the
  calibration tokens. Softmax is invariant to a per-query constant, so the
  compressed segment's normalized output only gains ``+ mu_v`` and its
  log-sum-exp ``+ scale * (q . mu_k)`` -- which is what the segment merge needs.
* Query-aware key scaling: keys are stored as ``a * (k - mu_k)`` and the queries
  of the compressed segment are divided by ``a`` (``q/a . a k = q . k``), with a
  diagonal ``a`` chosen so that the codec's (isotropic, after the rotation) error
  weighs the key channels the queries read most: ``a_i^2`` proportional to
  ``sqrt(E[q_i^2] / E[k_i^2])`` (mean ``a^2`` = 1, ``a`` clamped to
  ``[1/key_scale_max, key_scale_max]``), channel energies averaged over each RoPE
  pair (``rope_pairing``) so that ``a`` does not depend on the position.

Both are estimated once per layer, at *calibration*: until then the cache holds
its non-sink tokens unquantized (in the window buffer) and accumulates the energy
of the queries it attends with (those at positions ``>= fp16_sink_tokens``). It
calibrates in the first attention call at which it holds at least
``calibration_tokens`` non-sink tokens -- for a prompt that long, the prefill,
with the prompt's own queries -- from every non-sink token held and the queries
seen so far, quantizes what its layout says must be quantized, then attends; an
``update_and_fetch`` that finds that many tokens already held (no attention call
came) calibrates with the queries seen so far (none: ``a = 1``). A decode or
verification block (``L <= 8``) calibrates as single-token steps would: at its
query whose position brings the count to ``calibration_tokens``, from those tokens
and the queries up to it, so that drafts after it take no part. A trim back before
the calibration (within ``rollback_tokens`` tokens of it) undoes it, and a trim
takes back the energies of the queries at the trimmed positions. ``mu`` and ``a``
are part of the state.

Attention combines the three segments with their log-sum-exp
(:func:`~turboquant_mlx.attention.merge_attention`). Decode and verification
(``L <= 8`` queries) run :func:`~turboquant_mlx.ops.compressed_attention` on the
compressed segment. Prefill (``L > 8``) decodes the compressed segment once, in the
model's dtype and in code space, into one buffer of the layer's keys and one of its
values that also take the fp16 segments (transformed as the codec transforms what it
quantizes), and runs MLX's fused attention on them with the queries in code space
(:meth:`TurboQuantKVCache._attend_prefill`): the temporary is one layer's keys and
values, one buffer pair reused by every layer, never a full-precision copy of the cache. Decode
and verification queries see every token through the stored (quantized or fp16)
representation, as a generated token does: each query of a verification block sees the
cache as a single-token step at its position would (the tokens before ``p + 1 - R``
after the sinks quantized, the later ones in fp16), so that greedy speculative decoding
gives the tokens of plain decoding. The queries of a prefill block see the
block itself as it arrived (the caller holds it for the call anyway), and every older
token as stored: prompt processing is then never worse than what decoding sees.

:func:`make_prompt_cache` builds a model's caches with mlx-lm's own factory and
replaces only plain full-attention ``KVCache`` entries: linear-attention state
(``ArraysCache``, Qwen3.5/Qwen3-Next) and sliding-window ``RotatingKVCache``
layers are kept as they are.

Where the code is (docs/ARCHITECTURE.md, "The Python wing", says which part owns
which state)::

    cache.py        this overview; the package's cache API, gathered from:
    kv_cache.py     TurboQuantKVCache: configuration, update_and_fetch, attention's
                    entry, trim and the rest of mlx-lm's protocol
    codec.py        Codec: the layer's rotation, codebooks and head dims
    buffer.py       CompressedKV: the compressed codes and scales (both caches)
    plan.py         which kernel calls a decode/verify step makes (a table of routes)
    levers.py       the levers' statistics (QueryEnergies) and the key scale's maths
    storage.py      the compressed segment's appends and read-back, byte counts
    window.py       the fp16 window, the code tail and the ring
    calibration.py  the levers' calibration (centering, query-aware key scale), undo
    decode.py       decode and verification attention (L <= 8 queries): the routes
    prefill.py      prefill attention (L > 8 queries)
    codespace.py    the code-space transforms and their mx.compile'd wrappers
    state.py        the state format (state, meta_state, from_state; formats 1-3)
    presets.py      KVPreset, PRESETS, get_preset, bits per coordinate, schedules
    factory.py      make_prompt_cache, layer_seed, cache_nbytes
    _common.py      the error prefix, argument checks, head-dim padding
"""

from . import ops  # noqa: F401  (tests patch the ops through this module's name)
from ._common import padded_head_dim  # noqa: F401
from .factory import cache_nbytes, layer_seed, make_prompt_cache
from .kv_cache import TurboQuantKVCache
from .ops import MAX_TAIL_TOKENS  # noqa: F401  (read here by tests)
from .presets import DEFAULT_PRESET, PRESETS, KVPreset, get_preset
from .presets import _layer_bits  # noqa: F401  (bench/layer_sweep.py reads it here)
from .state import (  # noqa: F401  (the state format's names, read here by prompt_cache.py)
    _ARRAY_FIELDS,
    _CONFIG_FIELDS,
    _CONFIG_FIELDS_V1,
    _CONFIG_FIELDS_V3,
    _N_ARRAYS,
    _N_ARRAYS_V1,
)

__all__ = [
    "TurboQuantKVCache",
    "KVPreset",
    "PRESETS",
    "DEFAULT_PRESET",
    "get_preset",
    "layer_seed",
    "make_prompt_cache",
    "cache_nbytes",
]
