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

so :func:`load_prompt_cache` refuses a truncated or damaged file with a clear
error instead of generating from garbage. The checksum is not keyed: it detects
damage, not tampering (anyone who can write the file can recompute it). The loader
therefore treats the file as untrusted input and checks its structure and every
cache's arrays against that cache's configuration before it builds the caches; a
well-formed file can still hold arbitrary cache contents, so load prompt caches only
from sources you trust. The round trip is exact: codes, scales, fp16 windows,
offsets, bit widths and seeds come back bit for bit.

A loaded cache needs no :func:`~turboquant_mlx.attention.install_hook` call: a
TurboQuant cache installs the hook itself whenever it is missing, in ``update_and_fetch``.
"""

import hashlib
import os
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

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

    The file carries a SHA-256 checksum of its arrays and metadata, which
    :func:`load_prompt_cache` verifies: it detects a damaged file (truncated, partly
    written, altered bytes), not a forged one -- it is not keyed, and anyone who can
    write the file can recompute it.

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


def _class_by_name(name: str, where: str):
    from mlx_lm.models import cache as mlx_cache

    from . import cache as tq_cache

    if name == "TurboQuantKVCache":
        return tq_cache.TurboQuantKVCache
    cls = mlx_cache.__dict__.get(name)
    if not (isinstance(cls, type) and issubclass(cls, mlx_cache._BaseCache)):
        raise PromptCacheError(f"{_PREFIX} {where}: unknown cache class {name!r}.")
    return cls


# The file's metadata and array names are untrusted input (the checksum can be
# recomputed by anyone): they are parsed here without mlx.utils.tree_unflatten, which
# builds a list as long as the largest index it is given.
_MAX_DEPTH = 8  # nesting of a cache's state (mlx-lm's CacheList nests states twice)
_KINDS = ("scalar", "string", "none")


def _index(text: str) -> Optional[int]:
    """A list index written by tree_flatten (``0``, ``1``, ... without leading zeros)."""
    if text.isascii() and text.isdigit() and len(text) <= 9 and (text == "0" or text[0] != "0"):
        return int(text)
    return None


def _dense(items: Dict[int, Any], what: str, where: str, first: int = 0) -> List[Any]:
    """The values of ``items`` as a list, if its keys are exactly ``first, first + 1, ...``."""
    if set(items) != set(range(first, first + len(items))):
        missing = sorted(set(range(first, first + len(items))) - set(items))
        raise PromptCacheError(
            f"{_PREFIX} {where}: the {what} indices are not {first}..{first + len(items) - 1} "
            f"(index {missing[0]} is missing)."
        )
    return [items[i] for i in range(first, first + len(items))]


def _parse_metadata(flat_meta: Dict[str, str], arrays: Dict[str, mx.array], where: str):
    """``(user metadata, class names, [(array name, kind)])`` from the flat metadata."""
    user: Dict[str, str] = {}
    classes: Dict[int, str] = {}
    kinds: Dict[int, Dict[str, str]] = {}
    lead = False
    for key, value in flat_meta.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise PromptCacheError(f"{_PREFIX} {where}: metadata entry {key!r} is not a string.")
        head, _, rest = key.partition(".")
        k, _, j = rest.partition(".")  # kinds: "2.0" is "", "2.<k>.0" a name, "2.<k>.1" its kind
        if head == "0" and rest:
            user[rest] = value
        elif head == "1" and _index(rest) is not None:
            classes[_index(rest)] = value
        elif head == "2" and rest == "0":
            if value != "":
                raise PromptCacheError(f"{_PREFIX} {where}: metadata entry '2.0' must be empty.")
            lead = True
        elif head == "2" and (_index(k) or 0) > 0 and j in ("0", "1"):
            kinds.setdefault(_index(k), {})[j] = value
        else:
            raise PromptCacheError(f"{_PREFIX} {where}: unexpected metadata key {key[:80]!r}.")
    if not lead:
        raise PromptCacheError(f"{_PREFIX} {where}: the metadata has no scalar-kind list.")
    class_list = _dense(classes, "cache class", where)
    kind_list = []
    for i, entry in enumerate(_dense(kinds, "scalar-kind", where, first=1), start=1):
        name, kind = entry.get("0"), entry.get("1")
        if name is None or kind is None:
            raise PromptCacheError(f"{_PREFIX} {where}: scalar-kind entry {i} is incomplete.")
        if kind not in _KINDS:
            raise PromptCacheError(f"{_PREFIX} {where}: unknown scalar kind {kind!r} of {name!r}.")
        if name not in arrays:
            raise PromptCacheError(
                f"{_PREFIX} {where}: scalar-kind entry {i} names array {name!r}, which the "
                "file does not hold."
            )
        kind_list.append((name, kind))
    if len({name for name, _ in kind_list}) != len(kind_list):
        raise PromptCacheError(f"{_PREFIX} {where}: an array has two scalar kinds.")
    return user, class_list, kind_list


def _scalar_value(name: str, a: mx.array, kind: str, where: str):
    if kind == "scalar":
        if a.ndim != 0:
            raise PromptCacheError(
                f"{_PREFIX} {where}: scalar {name!r} has shape {tuple(a.shape)}."
            )
        return a.item()
    if kind == "string":
        if a.ndim != 1 or (a.size and not mx.issubdtype(a.dtype, mx.integer)):
            raise PromptCacheError(
                f"{_PREFIX} {where}: string {name!r} is not a 1-D integer array."
            )
        codes = a.tolist()
        if any(not 0 <= c <= 0x10FFFF for c in codes):
            raise PromptCacheError(f"{_PREFIX} {where}: string {name!r} has invalid characters.")
        return "".join(chr(c) for c in codes)
    if a.size != 0:
        raise PromptCacheError(f"{_PREFIX} {where}: None entry {name!r} is not empty.")
    return None


def _states(values: Dict[str, Any], n_caches: int, where: str) -> List[List[Any]]:
    """The caches' states from the flat ``name -> value`` map (names ``i.j...``)."""
    root: Dict[int, Any] = {}
    for name, value in values.items():
        parts = name.split(".")
        idx = [_index(p) for p in parts]
        if any(i is None for i in idx) or len(idx) < 2 or len(idx) > _MAX_DEPTH + 1:
            raise PromptCacheError(
                f"{_PREFIX} {where}: array name {name[:80]!r} is not a state path "
                "(cache index, then at most "
                f"{_MAX_DEPTH} list indices)."
            )
        if idx[0] >= n_caches:
            raise PromptCacheError(
                f"{_PREFIX} {where}: array {name!r} belongs to cache {idx[0]}, but the file "
                f"has {n_caches} caches."
            )
        node = root
        for i in idx[:-1]:
            node = node.setdefault(i, {})
            if not isinstance(node, dict):
                raise PromptCacheError(f"{_PREFIX} {where}: array {name!r} is inside a value.")
        if idx[-1] in node:
            raise PromptCacheError(f"{_PREFIX} {where}: array {name!r} holds a nested state.")
        node[idx[-1]] = value

    def build(node: Dict[int, Any], path: str) -> List[Any]:
        items = _dense(node, f"cache {path} state", where)
        return [build(x, f"{path}.{i}") if isinstance(x, dict) else x for i, x in enumerate(items)]

    # A cache whose state is empty has no arrays.
    return [build(root[i], str(i)) if i in root else [] for i in range(n_caches)]


def _check_kv_cache_state(state: List[Any]) -> None:
    """mlx-lm's KVCache: ``(keys, values, offset)``, keys and values with the same
    batch, heads and token capacity (which holds ``offset`` tokens)."""
    if len(state) != 3:
        raise ValueError(f"a state of {len(state)} entries, expected 3 (keys, values, offset)")
    keys, values, offset = state
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise ValueError(f"offset is a {type(offset).__name__}, not an integer")
    if keys is None and values is None:
        if offset != 0:
            raise ValueError(f"offset {offset} without keys")
        return
    for name, a in (("keys", keys), ("values", values)):
        if not isinstance(a, mx.array) or a.ndim != 4 or not mx.issubdtype(a.dtype, mx.floating):
            raise ValueError(f"{name} are not a 4-D floating-point array")
    if keys.shape[:3] != values.shape[:3] or keys.dtype != values.dtype:
        raise ValueError(
            f"keys {tuple(keys.shape)} / {keys.dtype} and values {tuple(values.shape)} / "
            f"{values.dtype} do not match"
        )
    if not 0 <= offset <= keys.shape[2]:
        raise ValueError(f"offset {offset} beyond the {keys.shape[2]} stored tokens")


def _check_turboquant_state(state: List[Any]) -> None:
    """The layout of a TurboQuantKVCache state: its arrays, then its integers (the
    cache checks their values against each other)."""
    from . import cache as tq_cache

    layouts = {
        tq_cache._N_ARRAYS + len(tq_cache._CONFIG_FIELDS): tq_cache._N_ARRAYS,
        tq_cache._N_ARRAYS + len(tq_cache._CONFIG_FIELDS_V3): tq_cache._N_ARRAYS,
        tq_cache._N_ARRAYS_V1 + len(tq_cache._CONFIG_FIELDS_V1): tq_cache._N_ARRAYS_V1,
    }
    n = layouts.get(len(state))
    if n is None:
        raise ValueError(
            f"a state of {len(state)} entries, expected {sorted(layouts)[::-1]} "
            "(arrays, then configuration integers)"
        )
    for i, x in enumerate(state):
        if i < n and not isinstance(x, mx.array):
            raise ValueError(f"{tq_cache._ARRAY_FIELDS[i]} is not an array")
        if i >= n and (isinstance(x, bool) or not isinstance(x, int)):
            field = tq_cache._CONFIG_FIELDS_V3[i - n]
            raise ValueError(f"configuration value {field} is not an integer")


def load_prompt_cache(path: str, return_metadata: bool = False, allow_unverified: bool = False):
    """Loads a prompt cache saved by :func:`save_prompt_cache` (or by mlx-lm).

    The checksum detects damage (a truncated, partly written or bit-flipped file), not
    tampering: it is not keyed, and anyone who can write the file can recompute it.
    The file is therefore read as untrusted input: the structure of its metadata and
    array names, and every cache's arrays (shapes, dtypes, token counts) against the
    cache's configuration, are checked before any cache is built, and a file that
    fails a check raises :class:`PromptCacheError` (a ``ValueError``) naming the file,
    the cache index and the field. A well-formed file can still hold arbitrary cache
    contents: load prompt caches only from sources you trust.

    Args:
        path: The ``.safetensors`` file.
        return_metadata: Also return the user metadata (without the integrity keys).
        allow_unverified: Accept a file without a checksum (e.g. written by
            ``mlx_lm.models.cache.save_prompt_cache``); such a file cannot be checked
            for damage (its structure is checked all the same).

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
    where = repr(path)
    metadata, classes, kinds = _parse_metadata(flat_meta, arrays, where)
    values: Dict[str, Any] = dict(arrays)
    for name, kind in kinds:
        values[name] = _scalar_value(name, arrays[name], kind, where)
    states = _states(values, len(classes), where)
    # The layout of every state is checked before any cache is built; each cache checks
    # its arrays against its configuration before it stores them.
    checked = []
    for i, (name, state) in enumerate(zip(classes, states)):
        cls = _class_by_name(name, f"{where}, cache {i}")
        check = {"TurboQuantKVCache": _check_turboquant_state, "KVCache": _check_kv_cache_state}
        try:
            if name in check:
                check[name](state)
        except ValueError as e:
            raise PromptCacheError(f"{_PREFIX} {where}, cache {i} ({name}): {e}.") from e
        checked.append((i, name, cls, state))
    cache = []
    for i, name, cls, state in checked:
        try:
            cache.append(cls.from_state(state))
        except Exception as e:
            detail = str(e)
            for prefix in ("[turboquant_mlx.cache] ", "inconsistent state: "):
                detail = detail[len(prefix) :] if detail.startswith(prefix) else detail
            raise PromptCacheError(
                f"{_PREFIX} {where}, cache {i} ({name}): invalid state: {detail}"
            ) from e
    if return_metadata:
        metadata = {k: v for k, v in metadata.items() if k not in (_CHECKSUM_KEY, _FORMAT_KEY)}
        return cache, metadata
    return cache
