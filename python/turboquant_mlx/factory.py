# Copyright © 2026 turboquant_mlx contributors.

"""The cache factory: :func:`make_prompt_cache` builds a model's caches with mlx-lm's
own factory and replaces only plain full-attention ``KVCache`` entries by
:class:`~turboquant_mlx.kv_cache.TurboQuantKVCache` (linear-attention state and
sliding-window caches are kept), with per-layer rotation seeds
(:func:`layer_seed`), fp16 layers, the preset's layer schedule, the value-rotation
fold's checks and what it reads from the model (RoPE pairing, head dims). Also
:func:`cache_nbytes`, the byte counts of a prompt cache.
"""

import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as _mlx_cache
from mlx_lm.models.cache import KVCache

from . import ops
from ._common import _PREFIX, _check_int, padded_head_dim
from .attention import install_hook, module_uses_hook
from .kv_cache import TurboQuantKVCache
from .presets import KVPreset, _fp16_layer_set, _override_config, _schedule_layers, get_preset

__all__ = ["layer_seed", "make_prompt_cache", "cache_nbytes"]


def layer_seed(seed: int, layer_idx: int) -> int:
    """Rotation seed of layer ``layer_idx`` derived from a base seed (32-bit)."""
    seed = _check_int("seed", seed)
    layer_idx = _check_int("layer_idx", layer_idx)
    return int(np.random.SeedSequence([seed, layer_idx]).generate_state(1)[0])


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
        fp16_recent_tokens=p.fp16_recent_tokens
        if fp16_recent_tokens is None
        else fp16_recent_tokens,
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
    fp16 = _fp16_layer_set(
        fp16_layers if fp16_layers is not None else p.fp16_layers, compressible, len(caches)
    )

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
            seed=layer_seed(seed, i),
            prefill_budget_bytes=prefill_budget_bytes,
            window_dtype=window_dtype,
            rotate_values=fold is None or not fold.folds(i),
            **cfg,
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
