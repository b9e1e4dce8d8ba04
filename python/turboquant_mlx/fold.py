# Copyright © 2026 turboquant_mlx contributors.

"""Folding the value rotation of the compressed cache into the model's weights.

A :class:`~turboquant_mlx.cache.TurboQuantKVCache` rotates every value with its
layer's orthogonal rotation ``R`` before quantizing it, and rotates the attention
output's value accumulation back (``o = R^T o~``) once per step and head. Both
rotations can live in the weights instead:

* ``W_v <- blockdiag(R, ..., R) W_v`` (one block per KV head; the bias of
  ``v_proj`` too): the model hands the cache values already rotated, and
* ``W_o <- W_o blockdiag(R^T, ..., R^T)`` (one block per query head, each with the
  rotation of the KV head it reads -- one ``R`` per layer here, but the mapping is
  grouped-query aware): ``o_proj`` undoes the rotation of the attention output.

Attention is linear in the values, so with float weights the folded model computes
exactly the function of the original one (up to float rounding). The cache must
then neither rotate values nor un-rotate the output: ``rotate_values=False``. Keys
cannot be folded (RoPE is applied after ``W_k``), so the cache keeps rotating them.

Usage::

    from turboquant_mlx import fold_value_rotation, make_prompt_cache

    fold_value_rotation(model, "tq4-plus", seed=0, mode="dequantize")
    cache = make_prompt_cache(model, "tq4-plus", seed=0)   # rotate_values=False where folded

The fold takes the rotations from the very caches the factory builds for the same
arguments (its per-layer seeds, its fp16 layers, its layer overrides), or from a
prompt cache given explicitly. Only layers with a compressed cache are folded.

Quantized projections (``nn.QuantizedLinear``) are dequantized and folded in
float64; ``mode="dequantize"`` keeps the folded weights as float ``nn.Linear``
(exact, but larger: the weights' 4 bits become 16/32), ``mode="requantize"``
quantizes them again with the original bits, group size and mode (as small as
before, but adds a second rounding of those two matrices).

Safety: the model is marked (attribute ``turboquant_value_fold``, a
:class:`ValueFold`), a second fold is refused, and every attention module of the
model checks the cache it is called with: a folded layer accepts only a
TurboQuant cache with ``rotate_values=False`` and that layer's rotation seed (or
no cache at all), an unfolded layer refuses a cache with ``rotate_values=False``.
Any other combination raises :class:`ValueFoldError` -- it would be silently wrong
(cache contents in the other convention), or pointless (values rotated twice, an
fp16 layer paying a requantization for nothing). Saved prompt caches do not record
``rotate_values``, so a folded model cannot continue from a saved cache.

Supported: mlx-lm's ``llama`` (also the models it serves, e.g. mistral), ``qwen2``
and ``qwen3`` modules. Other architectures are refused, not guessed.
"""

import dataclasses
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import KVPreset, TurboQuantKVCache, make_prompt_cache
from .rotation import Rotation

__all__ = ["fold_value_rotation", "value_fold_of", "ValueFold", "ValueFoldError", "FOLD_ATTRIBUTE"]

_PREFIX = "[turboquant_mlx.fold]"
# Also read (as a literal) by turboquant_mlx.cache.make_prompt_cache.
FOLD_ATTRIBUTE = "turboquant_value_fold"
_LAYER_ATTRIBUTE = "_turboquant_fold_layer"
_MODES = ("dequantize", "requantize")
# mlx-lm model modules whose attention is q/k/v/o projections with ``n_heads`` and
# ``n_kv_heads``, values taken straight from ``v_proj`` and the attention output
# straight into ``o_proj``.
SUPPORTED_MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2", "mlx_lm.models.qwen3")


class ValueFoldError(ValueError):
    """A fold is refused, or a folded model met a cache that does not match it."""


@dataclasses.dataclass(frozen=True)
class ValueFold:
    """What :func:`fold_value_rotation` did to a model (its ``turboquant_value_fold``).

    Attributes:
        architecture: The mlx-lm model module.
        num_layers: Number of layers (= caches) of the model.
        head_dim: Head dim of the folded rotations.
        layer_seeds: ``{layer: rotation seed}`` of the folded layers.
        base_seed: The factory's base seed the rotations came from (None when the
            fold was given a prompt cache).
        mode: ``"float"`` (only float weights were folded), ``"dequantize"`` or
            ``"requantize"`` (what happened to quantized ``v_proj``/``o_proj``).
    """

    architecture: str
    num_layers: int
    head_dim: int
    layer_seeds: Mapping[int, int]
    base_seed: Optional[int]
    mode: str

    def folds(self, layer: int) -> bool:
        """Whether ``layer``'s ``W_v``/``W_o`` carry the value rotation."""
        return layer in self.layer_seeds

    def cache_problem(self, layer: int, cache: Any) -> Optional[str]:
        """Why ``cache`` cannot serve ``layer`` of the folded model; None if it can."""
        rotates = getattr(cache, "rotate_values", True)
        if not self.folds(layer):
            if isinstance(cache, TurboQuantKVCache) and not rotates:
                return (
                    f"layer {layer} is not folded (its cache was not compressed when the "
                    "model was folded) but its cache has rotate_values=False: its values "
                    "would be quantized unrotated. Build the caches with "
                    "turboquant_mlx.make_prompt_cache(model, ...) with the fold's settings."
                )
            return None
        if cache is None:
            return None  # nothing stored: the folded layer computes the same function
        seed = self.layer_seeds[layer]
        how = (
            f"make_prompt_cache(model, ..., seed={self.base_seed}) with the preset, "
            "fp16_layers and layer_overrides the model was folded with"
            if self.base_seed is not None
            else "the prompt cache the model was folded with"
        )
        if not isinstance(cache, TurboQuantKVCache):
            return (
                f"layer {layer}'s W_v/W_o are folded with its cache rotation (seed {seed}) "
                f"but it got a {type(cache).__name__}, which does not store values in that "
                f"rotated space (an fp16/uncompressed layer, or mlx-lm's own cache). Use {how}, "
                "or fold with that layer kept fp16 (fp16_layers) -- or load the model unfolded."
            )
        if rotates:
            return (
                f"layer {layer}'s W_v/W_o are folded, but its TurboQuantKVCache rotates values "
                "itself (rotate_values=True: built without the fold, or loaded from a saved "
                f"state, which does not record the fold). Use {how}."
            )
        if cache.seed != seed:
            return (
                f"layer {layer} is folded with rotation seed {seed} but its cache uses seed "
                f"{cache.seed}. Use {how}."
            )
        return None

    def check_prompt_cache(self, caches: Sequence[Any]) -> None:
        """Raises :class:`ValueFoldError` unless every cache fits its layer."""
        if len(caches) != self.num_layers:
            raise ValueFoldError(
                f"{_PREFIX} the model has {self.num_layers} layers but the prompt cache "
                f"{len(caches)} entries."
            )
        problems = [p for i, c in enumerate(caches) if (p := self.cache_problem(i, c))]
        if problems:
            more = f" (and {len(problems) - 1} more layers)" if len(problems) > 1 else ""
            raise ValueFoldError(f"{_PREFIX} {problems[0]}{more}")


@dataclasses.dataclass(frozen=True)
class _LayerFold:
    fold: ValueFold
    layer: int


def value_fold_of(model) -> Optional[ValueFold]:
    """The model's :class:`ValueFold`, or None if it was not folded."""
    return getattr(model, FOLD_ATTRIBUTE, None)


# ---------------------------------------------------------------------------
# Guard: every attention module of a folded model checks its cache.

_GUARDED: Dict[type, type] = {}


def _guarded_class(cls: type) -> type:
    sub = _GUARDED.get(cls)
    if sub is not None:
        return sub

    def __call__(self, *args, **kwargs):
        info = self.__dict__.get(_LAYER_ATTRIBUTE)
        if info is not None:
            cache = kwargs["cache"] if "cache" in kwargs else (args[2] if len(args) > 2 else None)
            problem = info.fold.cache_problem(info.layer, cache)
            if problem is not None:
                raise ValueFoldError(f"{_PREFIX} {problem}")
        return cls.__call__(self, *args, **kwargs)

    # Same name and module as the original: the cache factory recognizes the model
    # modules that call mlx-lm's (hooked) attention by their module names.
    sub = type(
        cls.__name__,
        (cls,),
        {
            "__call__": __call__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        },
    )
    _GUARDED[cls] = sub
    return sub


# ---------------------------------------------------------------------------
# Weights


def _is_quantized(module) -> bool:
    return isinstance(module, nn.QuantizedLinear)


def _dense(module) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """float64 weight ``(out, in)`` and bias of a (quantized) linear layer."""
    w = module.weight
    if _is_quantized(module):
        w = mx.dequantize(
            w,
            module.scales,
            module.get("biases"),
            group_size=module.group_size,
            bits=module.bits,
            mode=getattr(module, "mode", "affine"),
        )
    bias = module["bias"] if "bias" in module else None
    return (
        np.array(w.astype(mx.float32), dtype=np.float64),
        None if bias is None else np.array(bias.astype(mx.float32), dtype=np.float64),
    )


def _rebuild(module, w: np.ndarray, bias: Optional[np.ndarray], mode: str, dtype):
    """A layer like ``module`` with float64 weight ``w`` and ``bias``."""
    out_dims, in_dims = w.shape
    if not _is_quantized(module):
        new = nn.Linear(in_dims, out_dims, bias=bias is not None)
        new.weight = mx.array(w.astype(np.float32)).astype(module.weight.dtype)
        if bias is not None:
            new.bias = mx.array(bias.astype(np.float32)).astype(module.bias.dtype)
        return new
    float_dtype = dtype or (
        module.scales.dtype if mx.issubdtype(module.scales.dtype, mx.floating) else mx.float16
    )
    new = nn.Linear(in_dims, out_dims, bias=bias is not None)
    new.weight = mx.array(w.astype(np.float32)).astype(float_dtype)
    if bias is not None:
        new.bias = mx.array(bias.astype(np.float32)).astype(module.bias.dtype)
    if mode == "dequantize":
        return new
    qmode = getattr(module, "mode", "affine")
    if qmode == "affine":
        # Scales and biases come out in the dtype of the weights given to quantize.
        new.weight = new.weight.astype(module.scales.dtype)
    return nn.QuantizedLinear.from_linear(new, module.group_size, module.bits, mode=qmode)


def _folded_layers(attn, rotations: Sequence[np.ndarray], mode: str, dtype):
    """New ``(v_proj, o_proj)`` of ``attn`` with per-KV-head rotations ``R_h`` folded in."""
    n_q, n_kv = attn.n_heads, attn.n_kv_heads
    D = rotations[0].shape[0]
    group = n_q // n_kv
    wv, bv = _dense(attn.v_proj)
    wo, bo = _dense(attn.o_proj)
    # v_proj rows of KV head h: R_h W_h (and R_h b_h).
    wv = wv.reshape(n_kv, D, -1)
    wv = np.stack([rotations[h] @ wv[h] for h in range(n_kv)]).reshape(n_kv * D, -1)
    if bv is not None:
        bv = bv.reshape(n_kv, D)
        bv = np.stack([rotations[h] @ bv[h] for h in range(n_kv)]).reshape(-1)
    # o_proj columns of query head j read KV head j // group: W_j R_h^T.
    out_dims = wo.shape[0]
    wo = wo.reshape(out_dims, n_q, D)
    wo = np.stack([wo[:, j] @ rotations[j // group].T for j in range(n_q)], axis=1)
    wo = wo.reshape(out_dims, n_q * D)
    return _rebuild(attn.v_proj, wv, bv, mode, dtype), _rebuild(attn.o_proj, wo, bo, mode, dtype)


def _attention_modules(model) -> Tuple[str, List[Any], int]:
    """``(architecture, attention modules, head_dim)``; refuses what is not supported."""
    arch = type(model).__module__
    if arch not in SUPPORTED_MODULES:
        raise ValueFoldError(
            f"{_PREFIX} cannot fold the value rotation into a {arch}.{type(model).__name__}: "
            f"only mlx-lm's {', '.join(m.rsplit('.', 1)[1] for m in SUPPORTED_MODULES)} "
            "models are supported (their attention modules' v_proj/o_proj layout is known)."
        )
    try:
        layers = list(model.layers)
    except AttributeError:
        raise ValueFoldError(f"{_PREFIX} the model has no `layers`.") from None
    attns, head_dims = [], set()
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        ok = (
            attn is not None
            and type(attn).__module__ == arch
            and all(hasattr(attn, name) for name in ("v_proj", "o_proj", "n_heads", "n_kv_heads"))
        )
        if ok:
            v = attn.v_proj
            ok = isinstance(v, (nn.Linear, nn.QuantizedLinear)) and isinstance(
                attn.o_proj, (nn.Linear, nn.QuantizedLinear)
            )
        if not ok:
            raise ValueFoldError(
                f"{_PREFIX} layer {i} of {arch} has no attention module with v_proj/o_proj "
                "(nn.Linear or nn.QuantizedLinear), n_heads and n_kv_heads."
            )
        v_out = attn.v_proj.weight.shape[0]  # output features (quantized: packed along inputs)
        n_q, n_kv = attn.n_heads, attn.n_kv_heads
        if n_kv <= 0 or n_q % n_kv or v_out % n_kv:
            raise ValueFoldError(
                f"{_PREFIX} layer {i}: {n_q} query heads, {n_kv} KV heads and {v_out} "
                "value features do not form grouped-query attention."
            )
        head_dim = v_out // n_kv
        if getattr(attn, "head_dim", head_dim) != head_dim:
            raise ValueFoldError(f"{_PREFIX} layer {i}: head_dim does not match v_proj.")
        if head_dim % 32:
            raise ValueFoldError(
                f"{_PREFIX} layer {i}: head dim {head_dim} is not a multiple of 32; the cache "
                "stores it zero-padded with a rotation of the padded dim, which W_v/W_o "
                "cannot carry. Use the cache without folding."
            )
        head_dims.add(head_dim)
        attns.append(attn)
    if len(head_dims) > 1:
        raise ValueFoldError(f"{_PREFIX} layers with different head dims {sorted(head_dims)}.")
    return arch, attns, head_dims.pop() if head_dims else 0


def _caches_from(model, spec, cache_kwargs) -> Tuple[List[Any], Optional[int]]:
    """The prompt cache the fold follows and the base seed (None for a given cache)."""
    if isinstance(spec, (list, tuple)):
        if cache_kwargs:
            raise ValueError(
                f"{_PREFIX} factory arguments {sorted(cache_kwargs)} given with a prompt cache."
            )
        for i, c in enumerate(spec):
            if isinstance(c, TurboQuantKVCache) and (c.offset or not c.empty()):
                raise ValueFoldError(
                    f"{_PREFIX} layer {i}'s cache already holds tokens (stored without the "
                    "fold): give a fresh prompt cache."
                )
        return list(spec), None
    kwargs = dict(cache_kwargs)
    if spec is not None:
        if isinstance(spec, Mapping):
            overlap = set(spec) & set(kwargs)
            if overlap:
                raise ValueError(f"{_PREFIX} {sorted(overlap)} given twice.")
            kwargs.update(spec)
        elif isinstance(spec, (str, KVPreset)):
            if "preset" in kwargs:
                raise ValueError(f"{_PREFIX} preset given twice.")
            kwargs["preset"] = spec
        else:
            raise TypeError(
                f"{_PREFIX} prompt_cache_or_config must be a prompt cache (list), a preset "
                f"name, a KVPreset or a dict of make_prompt_cache arguments; got {type(spec).__name__}."
            )
    return make_prompt_cache(model, **kwargs), int(kwargs.get("seed", 0))


def fold_value_rotation(
    model,
    prompt_cache_or_config: Union[None, str, KVPreset, Mapping[str, Any], Sequence[Any]] = None,
    *,
    mode: str = "dequantize",
    dtype: Optional[mx.Dtype] = None,
    **cache_kwargs,
) -> ValueFold:
    """Folds each compressed layer's value rotation into ``v_proj``/``o_proj``, in place.

    Args:
        model: An mlx-lm llama, qwen2 or qwen3 model (not folded yet).
        prompt_cache_or_config: Which caches the model will run with, hence which
            layers are folded and with which rotation:

            * ``None``, a preset name or a :class:`~turboquant_mlx.cache.KVPreset`,
              or a dict of :func:`~turboquant_mlx.cache.make_prompt_cache`
              arguments (also accepted as keyword arguments ``cache_kwargs``, e.g.
              ``seed=0, fp16_layers=(1, 1)``): the caches the factory builds for
              them. Build the model's caches later with the same arguments.
            * A fresh prompt cache (list, as made by ``make_prompt_cache``): its
              TurboQuant caches' seeds are folded and the caches are switched to
              ``rotate_values=False`` in place, ready to use.
        mode: For quantized ``v_proj``/``o_proj``: ``"dequantize"`` (float
            ``nn.Linear`` with the folded weights; exact) or ``"requantize"``
            (quantized again with the original bits, group size and mode). Float
            layers are folded exactly either way.
        dtype: Float dtype of dequantized layers (default: their scales' dtype,
            i.e. the model's activation dtype).
        **cache_kwargs: ``make_prompt_cache`` arguments (see above).

    Returns:
        The :class:`ValueFold`, also stored as ``model.turboquant_value_fold``.

    Raises:
        ValueFoldError: Unsupported architecture, a model folded already, a prompt
            cache that holds tokens, or nothing to fold (no compressed layer).
        ValueError: Unknown ``mode``.
    """
    if mode not in _MODES:
        raise ValueError(f"{_PREFIX} mode must be one of {', '.join(_MODES)}, got {mode!r}.")
    previous = value_fold_of(model)
    if previous is not None:
        raise ValueFoldError(
            f"{_PREFIX} the model is folded already ({len(previous.layer_seeds)} layers, "
            f"mode {previous.mode!r}); folding twice would rotate its values twice. Load "
            "the model again to fold it differently."
        )
    arch, attns, head_dim = _attention_modules(model)
    caches, base_seed = _caches_from(model, prompt_cache_or_config, cache_kwargs)
    if len(caches) != len(attns):
        raise ValueFoldError(
            f"{_PREFIX} the prompt cache has {len(caches)} entries for {len(attns)} layers."
        )
    targets = {i: c for i, c in enumerate(caches) if isinstance(c, TurboQuantKVCache)}
    if not targets:
        raise ValueFoldError(
            f"{_PREFIX} no layer has a compressed cache with these settings: nothing to fold."
        )
    for i, c in targets.items():
        if c.head_dim is not None and c.head_dim != head_dim:
            raise ValueFoldError(f"{_PREFIX} layer {i}: cache head dim {c.head_dim} != {head_dim}.")

    quantized = any(
        _is_quantized(attns[i].v_proj) or _is_quantized(attns[i].o_proj) for i in targets
    )
    new = {}  # computed first: a failure leaves the model untouched
    for i, c in targets.items():
        R = Rotation(head_dim, c.seed).matrix()  # one rotation per layer, all KV heads
        new[i] = _folded_layers(attns[i], [R] * attns[i].n_kv_heads, mode, dtype)
        mx.eval(new[i][0].parameters(), new[i][1].parameters())
    for i, (v_proj, o_proj) in new.items():
        attns[i].v_proj, attns[i].o_proj = v_proj, o_proj

    fold = ValueFold(
        architecture=arch,
        num_layers=len(attns),
        head_dim=head_dim,
        layer_seeds={i: int(c.seed) for i, c in targets.items()},
        base_seed=base_seed,
        mode=mode if quantized else "float",
    )
    for i, attn in enumerate(attns):
        object.__setattr__(attn, _LAYER_ATTRIBUTE, _LayerFold(fold, i))
        attn.__class__ = _guarded_class(type(attn))
    object.__setattr__(model, FOLD_ATTRIBUTE, fold)
    if isinstance(prompt_cache_or_config, (list, tuple)):
        for c in targets.values():
            c.rotate_values = False
    return fold
