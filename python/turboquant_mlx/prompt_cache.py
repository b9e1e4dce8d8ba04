# Copyright © 2026 turboquant_mlx contributors.

"""Save and load prompt caches that contain TurboQuant caches, with an integrity check.

The file is an ordinary mlx-lm prompt-cache file (``.safetensors``: every cache's
``state`` flattened, scalars stored as arrays, and the metadata list
``[user metadata, class names, scalar kinds]``), so ``mlx_lm``'s own
``load_prompt_cache`` reads it once :mod:`turboquant_mlx` is imported (that
registers the class name with mlx-lm). In addition the user metadata carries

* ``tq_format``: the format tag of this module, and
* ``tq_checksum``: SHA-256 over every array (name, dtype, shape, bytes) and every
  other metadata entry,

so :func:`load_prompt_cache` refuses a truncated or altered file with a clear
error instead of generating from garbage. The round trip is exact: codes, scales,
fp16 windows, offsets, bit widths and seeds come back bit for bit.

A loaded cache needs no :func:`~turboquant_mlx.attention.install_hook` call: a
TurboQuant cache installs the hook itself whenever it is missing, in ``update_and_fetch``.
"""

import hashlib
import os
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["save_prompt_cache", "load_prompt_cache", "PromptCacheError"]

_PREFIX = "[turboquant_mlx.prompt_cache]"
FORMAT_TAG = "turboquant_mlx.prompt_cache/1"
_CHECKSUM_KEY = "tq_checksum"
_FORMAT_KEY = "tq_format"
# Flattened metadata keys: element 0 of [metadata, classes, scalars] is the user dict.
_FLAT_CHECKSUM_KEY = "0." + _CHECKSUM_KEY


class PromptCacheError(ValueError):
    """A prompt-cache file is unreadable, truncated, altered or inconsistent."""


def _array_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(a)).tobytes()


def _checksum(arrays: Dict[str, mx.array], metadata: Dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"A|{name}|{a.dtype}|{tuple(a.shape)}|".encode())
        h.update(_array_bytes(a))
    for key in sorted(metadata):
        if key == _FLAT_CHECKSUM_KEY:
            continue
        h.update(f"M|{key}|{metadata[key]}|".encode())
    return h.hexdigest()


def _flatten_states(cache: List[Any]) -> Tuple[Dict[str, mx.array], List[Any]]:
    """Arrays keyed by tree path, and the list of non-array leaves and their kinds."""
    kinds: List[Any] = [""]  # a leading entry keeps the list non-empty when flattened
    arrays: Dict[str, mx.array] = {}
    for key, value in tree_flatten([c.state for c in cache]):
        if isinstance(value, mx.array):
            arrays[key] = value
        elif isinstance(value, bool) or isinstance(value, (int, float, np.integer, np.floating)):
            arrays[key] = mx.array(value)
            kinds.append((key, "scalar"))
        elif isinstance(value, str):
            arrays[key] = mx.array([ord(ch) for ch in value])
            kinds.append((key, "string"))
        elif value is None:
            arrays[key] = mx.array([])
            kinds.append((key, "none"))
        else:
            raise PromptCacheError(
                f"{_PREFIX} cache state of type {type(value).__name__} cannot be saved."
            )
    return arrays, kinds


def save_prompt_cache(
    path: str, cache: List[Any], metadata: Optional[Dict[str, str]] = None
) -> None:
    """Saves a prompt cache (any mix of TurboQuant and mlx-lm caches).

    Args:
        path: Output ``.safetensors`` file name.
        cache: The per-layer caches.
        metadata: Optional ``str -> str`` metadata (keys without dots, as in mlx-lm).
    """
    from . import cache as _cache_module  # noqa: F401  (registers the class name)

    metadata = dict(metadata or {})
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str) or "." in k:
            raise ValueError(
                f"{_PREFIX} metadata must map dot-free str keys to str values; got {k!r}: {v!r}."
            )
    metadata.pop(_CHECKSUM_KEY, None)
    metadata[_FORMAT_KEY] = FORMAT_TAG
    for i, c in enumerate(cache):
        if not getattr(c, "rotate_values", True):
            # Its sinks, window and value mean are in a folded model's rotated space,
            # which the state does not record: loaded into an unfolded model it would
            # be read as unrotated values.
            raise PromptCacheError(
                f"{_PREFIX} layer {i}'s cache serves a model with a folded value rotation "
                "(rotate_values=False), which the file format does not record; it cannot be saved."
            )
    arrays, kinds = _flatten_states(cache)
    classes = [type(c).__name__ for c in cache]
    flat_meta = dict(tree_flatten([metadata, classes, kinds]))
    mx.eval(arrays)
    flat_meta[_FLAT_CHECKSUM_KEY] = _checksum(arrays, flat_meta)
    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        raise ValueError(f"{_PREFIX} the file name must end in .safetensors, got {path!r}.")
    tmp = path + ".tmp.safetensors"
    mx.save_safetensors(tmp, arrays, flat_meta)
    os.replace(tmp, path)


def _class_by_name(name: str):
    from mlx_lm.models import cache as mlx_cache

    from . import cache as tq_cache

    if name == "TurboQuantKVCache":
        return tq_cache.TurboQuantKVCache
    cls = getattr(mlx_cache, name, None)
    if cls is None or not isinstance(cls, type):
        raise PromptCacheError(f"{_PREFIX} unknown cache class {name!r} in the file.")
    return cls


def load_prompt_cache(
    path: str, return_metadata: bool = False, allow_unverified: bool = False
):
    """Loads a prompt cache saved by :func:`save_prompt_cache` (or by mlx-lm).

    Args:
        path: The ``.safetensors`` file.
        return_metadata: Also return the user metadata (without the integrity keys).
        allow_unverified: Accept a file without a checksum (e.g. written by
            ``mlx_lm.models.cache.save_prompt_cache``); such a file cannot be checked.

    Returns:
        The list of caches, or ``(caches, metadata)``.

    Raises:
        PromptCacheError: The file is unreadable, truncated, altered (checksum
            mismatch), has no checksum (unless ``allow_unverified``) or holds an
            inconsistent cache state.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{_PREFIX} no such file: {path!r}.")
    try:
        arrays, flat_meta = mx.load(path, return_metadata=True)
        mx.eval(arrays)
    except Exception as e:
        raise PromptCacheError(
            f"{_PREFIX} {path!r} cannot be read (truncated or not a prompt-cache file): {e}"
        ) from e
    stored = flat_meta.get(_FLAT_CHECKSUM_KEY)
    if stored is None:
        if not allow_unverified:
            raise PromptCacheError(
                f"{_PREFIX} {path!r} has no checksum, so its integrity cannot be verified "
                "(pass allow_unverified=True to load a file written by mlx-lm)."
            )
    else:
        computed = _checksum(arrays, flat_meta)
        if computed != stored:
            raise PromptCacheError(
                f"{_PREFIX} {path!r} is corrupted: checksum mismatch (stored {stored[:16]}..., "
                f"computed {computed[:16]}...)."
            )
    try:
        metadata, classes, kinds = tree_unflatten(list(flat_meta.items()))
        values: Dict[str, Any] = dict(arrays)
        for key, kind in kinds[1:]:
            a = values[key]
            if kind == "scalar":
                values[key] = a.item()
            elif kind == "string":
                values[key] = "".join(chr(i) for i in a.tolist())
            elif kind == "none":
                values[key] = None
            else:
                raise PromptCacheError(f"{_PREFIX} unknown scalar kind {kind!r}.")
        states = tree_unflatten(list(values.items())) if values else []
        if len(states) != len(classes):
            raise PromptCacheError(
                f"{_PREFIX} {len(classes)} cache classes but {len(states)} states."
            )
        cache = [_class_by_name(c).from_state(s) for c, s in zip(classes, states)]
    except PromptCacheError:
        raise
    except Exception as e:
        raise PromptCacheError(f"{_PREFIX} {path!r} holds an invalid prompt cache: {e}") from e
    if return_metadata:
        metadata = {k: v for k, v in metadata.items() if k not in (_CHECKSUM_KEY, _FORMAT_KEY)}
        return cache, metadata
    return cache
