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
values, freed before the next layer, never a full-precision copy of the cache. Decode
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
"""

import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as _mlx_cache
from mlx_lm.models.cache import KVCache

from . import ops
from ._common import _PREFIX, _check_int, padded_head_dim
from .ops import MAX_TAIL_TOKENS  # noqa: F401  (read here by tests)
from .attention import install_hook, module_uses_hook
from .presets import (  # (_layer_bits: bench/layer_sweep.py reads it here)
    DEFAULT_PRESET, PRESETS, KVPreset, _fp16_layer_set, _layer_bits, _override_config,  # noqa: F401
    _schedule_layers, get_preset,
)
from .kv_cache import TurboQuantKVCache
from .state import (  # (the format's names: read here by older code)
    _ARRAY_FIELDS, _CONFIG_FIELDS, _CONFIG_FIELDS_V1, _CONFIG_FIELDS_V3, _N_ARRAYS,  # noqa: F401
    _N_ARRAYS_V1,  # noqa: F401
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

def layer_seed(seed: int, layer_idx: int) -> int:
    """Rotation seed of layer ``layer_idx`` derived from a base seed (32-bit)."""
    seed = _check_int("seed", seed)
    layer_idx = _check_int("layer_idx", layer_idx)
    return int(np.random.SeedSequence([seed, layer_idx]).generate_state(1)[0])


# ---------------------------------------------------------------------------
# Factory


def _uses_mlx_lm_attention(model) -> bool:
    """Whether the model's modules call the (hooked) mlx-lm attention function."""
    names = {type(model).__module__}
    try:
        for _, m in model.named_modules():
            names.add(type(m).__module__)
    except AttributeError:
        pass
    return any(module_uses_hook(n) for n in names)


def _rope_pairing_of(model) -> Dict[str, Any]:
    """``rope_pairing``/``rope_dims`` of the model's first RoPE module (mlx-lm's RoPE
    classes have ``traditional`` and ``dims``); mlx-lm's default if none is found."""
    try:
        modules = model.named_modules()
    except AttributeError:
        modules = []
    for _, m in modules:
        traditional = getattr(m, "traditional", None)
        dims = getattr(m, "dims", None)
        if isinstance(traditional, bool) and isinstance(dims, (int, np.integer)):
            return dict(rope_pairing="interleaved" if traditional else "half", rope_dims=int(dims))
    return dict(rope_pairing="half", rope_dims=0)


def make_prompt_cache(
    model,
    preset: Union[str, KVPreset] = "tq4",
    *,
    key_bits: Optional[int] = None,
    value_bits: Optional[int] = None,
    fp16_sink_tokens: Optional[int] = None,
    fp16_recent_tokens: Optional[int] = None,
    fp16_layers: Union[None, Tuple[int, int], Iterable[int]] = None,
    layer_overrides: Optional[Mapping[int, Any]] = None,
    max_kv_size: Optional[int] = None,
    seed: int = 0,
    rollback_tokens: int = 16,
    prefill_budget_bytes: Optional[int] = None,
    window_dtype: Optional[mx.Dtype] = None,
    center: Optional[bool] = None,
    query_aware_keys: Optional[bool] = None,
    calibration_tokens: int = 32,
    rope_pairing: Optional[str] = None,
) -> List[Any]:
    """Builds the model's prompt cache with TurboQuant compression.

    The caches mlx-lm would build (``model.make_cache()`` if the model has it,
    honouring ``max_kv_size`` exactly as ``mlx_lm.models.cache.make_prompt_cache``
    does) are made first; then every plain ``KVCache`` (full attention) is replaced
    by a :class:`TurboQuantKVCache`, except fp16 layers. Linear-attention and
    sliding-window caches are kept. Installs the attention hook. On a model folded
    by :func:`turboquant_mlx.fold.fold_value_rotation`, folded layers get
    ``rotate_values=False``, and caches that do not match the fold (other seed, an
    uncompressed cache on a folded layer) raise ``turboquant_mlx.fold.ValueFoldError``.

    Args:
        model: An mlx-lm model.
        preset: A name from :data:`PRESETS` (or a :class:`KVPreset`).
        key_bits, value_bits: Override the preset's bit widths.
        fp16_sink_tokens, fp16_recent_tokens: Override the preset's fp16 windows.
        fp16_layers: Layers kept as plain ``KVCache``: a tuple ``(first_n, last_n)``
            counts among the compressible layers (so on hybrid models it protects the
            first/last attention layers); any other iterable lists cache indices
            (negative ones count from the end). Overrides the preset's.
        layer_overrides: ``{layer_index: spec}`` with spec ``"fp16"``/``None``
            (plain KVCache), a preset name, a ``(key_bits, value_bits)`` tuple, or a
            dict of :class:`TurboQuantKVCache` arguments. Only for compressible layers.
            Applied after the preset's ``layer_schedule`` (which ``key_bits`` or
            ``value_bits`` switch off: explicit bit widths apply to every layer).
        max_kv_size: Passed to mlx-lm's factory (rotating caches stay uncompressed).
        seed: Base seed of the per-layer rotations (:func:`layer_seed`).
        rollback_tokens, prefill_budget_bytes, window_dtype, calibration_tokens: See
            :class:`TurboQuantKVCache`.
        center, query_aware_keys: Override the preset's levers.
        rope_pairing: ``"half"``, ``"interleaved"`` or ``"none"``; default: read
            from the model's RoPE modules (``traditional`` RoPE pairs adjacent
            channels, mlx-lm's default pairs ``i`` with ``i + dims/2``), with their
            ``dims`` as ``rope_dims`` (partial RoPE).

    Returns:
        A list with one cache per layer, usable with ``mlx_lm.generate``,
        ``stream_generate`` and ``generate_step`` (``prompt_cache=``).
    """
    p = get_preset(preset)
    kb = key_bits if key_bits is not None else p.key_bits
    vb = value_bits if value_bits is not None else p.value_bits
    if (kb is None) != (vb is None):
        # e.g. preset "fp16" with only one of the bit widths given
        kb = kb if kb is not None else vb
        vb = vb if vb is not None else kb
    compress = kb is not None
    base = dict(
        key_bits=kb,
        value_bits=vb,
        fp16_sink_tokens=p.fp16_sink_tokens if fp16_sink_tokens is None else fp16_sink_tokens,
        fp16_recent_tokens=p.fp16_recent_tokens if fp16_recent_tokens is None else fp16_recent_tokens,
        rollback_tokens=rollback_tokens,
        center=p.center if center is None else bool(center),
        query_aware_keys=p.query_aware_keys if query_aware_keys is None else bool(query_aware_keys),
        calibration_tokens=calibration_tokens,
    )
    if rope_pairing is None:
        base.update(_rope_pairing_of(model))
    else:
        base.update(rope_pairing=rope_pairing, rope_dims=0)

    caches = list(_mlx_cache.make_prompt_cache(model, max_kv_size=max_kv_size))
    compressible = [i for i, c in enumerate(caches) if type(c) is KVCache]
    fp16 = _fp16_layer_set(fp16_layers if fp16_layers is not None else p.fp16_layers, compressible, len(caches))

    configs: Dict[int, Optional[Dict[str, Any]]] = {}
    for i in compressible:
        configs[i] = None if (not compress or i in fp16) else dict(base)
    if compress and key_bits is None and value_bits is None:
        # The preset's per-layer schedule (explicit bit widths make every layer uniform).
        for k, spec in _schedule_layers(p.layer_schedule, len(compressible)):
            i = compressible[k]
            if i not in fp16:
                configs[i] = _override_config(spec, dict(base), i)
    for i, spec in (layer_overrides or {}).items():
        i = int(i)
        j = i % len(caches) if -len(caches) <= i < len(caches) else None
        if j is None or j not in configs:
            raise ValueError(
                f"{_PREFIX} layer {i} cannot be overridden: it is not a full-attention "
                f"KVCache layer (compressible layers: {compressible})."
            )
        configs[j] = _override_config(spec, dict(base), j)

    # A model whose W_v/W_o carry the value rotation (turboquant_mlx.fold) gets caches
    # that do not rotate values on its folded layers, and refuses caches that do not fit.
    fold = getattr(model, "turboquant_value_fold", None)
    if not any(cfg is not None for cfg in configs.values()):
        return _fold_checked(fold, caches)

    install_hook()
    if not _uses_mlx_lm_attention(model):
        warnings.warn(
            f"{_PREFIX} {type(model).__module__} does not call mlx_lm.models.base."
            "scaled_dot_product_attention, so a compressed cache would be bypassed; "
            "keeping mlx-lm's caches.",
            stacklevel=2,
        )
        return _fold_checked(fold, caches)

    for i, cfg in configs.items():
        if cfg is None:
            continue
        if cfg["key_bits"] is None or cfg["value_bits"] is None:
            raise ValueError(f"{_PREFIX} layer {i}: key_bits and value_bits are required.")
        _check_layer_head_dim(model, i, cfg)
        caches[i] = TurboQuantKVCache(
            seed=layer_seed(seed, i), prefill_budget_bytes=prefill_budget_bytes,
            window_dtype=window_dtype, rotate_values=fold is None or not fold.folds(i), **cfg
        )
    return _fold_checked(fold, caches)


def _check_layer_head_dim(model, i: int, cfg: Mapping[str, Any]):
    """Refuses, before any token is seen, a layer whose head dim the cache does not
    take, even padded (read from the layer's attention module where it says, as
    mlx-lm's do)."""
    try:
        layer = model.layers[i]
    except (AttributeError, IndexError, TypeError):
        return
    for name in ("self_attn", "attention", "attn", "mixer"):
        attn = getattr(layer, name, None)
        head_dim = getattr(attn, "head_dim", None)
        if isinstance(head_dim, (int, np.integer)):
            break
    else:
        return
    for bits in {cfg["key_bits"], cfg["value_bits"]}:
        try:
            ops.words_per_token(padded_head_dim(head_dim), bits)
        except ValueError as e:
            raise ValueError(
                f"{_PREFIX} layer {i} ({name} of {type(layer).__name__}) has head dim "
                f"{head_dim}, which the compressed cache does not support ({e}); keep it in "
                f"fp16 with fp16_layers={{{i}}} or layer_overrides={{{i}: 'fp16'}}."
            ) from None


def _fold_checked(fold, caches: List[Any]) -> List[Any]:
    """``caches``, after ``fold.check_prompt_cache`` (raises on a mismatch) if any."""
    if fold is not None:
        fold.check_prompt_cache(caches)
    return caches


def cache_nbytes(prompt_cache: Sequence[Any]) -> Dict[str, int]:
    """Byte counts of a prompt cache.

    Returns:
        ``{"total": ..., "compressed_layers": ..., "dense_equivalent": ...}`` where
        ``dense_equivalent`` is what fp16 storage of the compressed layers' tokens
        would take (other layers counted as they are).
    """
    total = comp = dense = 0
    for c in prompt_cache:
        nb = c.nbytes
        total += nb
        if isinstance(c, TurboQuantKVCache):
            comp += nb
            dense += c.dense_nbytes(2)
        else:
            dense += nb
    return {"total": total, "compressed_layers": comp, "dense_equivalent": dense}
