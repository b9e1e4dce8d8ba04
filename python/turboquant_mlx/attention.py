# Copyright © 2026 turboquant_mlx contributors.

"""The hook that routes mlx-lm's attention to the compressed cache, and the
segment arithmetic the cache uses to combine its parts.

mlx-lm's attention modules call ``scaled_dot_product_attention(queries, keys,
values, cache=cache, scale=..., mask=...)`` from ``mlx_lm.models.base`` (each
model module imports the name). :func:`install_hook` replaces that function, in
``mlx_lm.models.base`` and in every loaded module that imported it, by a wrapper
that sends a :class:`~turboquant_mlx.cache.TurboQuantKVCache` to
``cache.attention(...)`` and calls the original, unchanged, for everything else.
A TurboQuant cache also installs it itself at each ``update_and_fetch`` where it is
not installed (:func:`ensure_hook`), so that a cache made by hand or loaded from a file
never meets mlx-lm's own attention, which would see only the new tokens. Modules
imported after the installation bind the hook from ``mlx_lm.models.base``.

The cache splits its keys into segments (fp16 sink tokens, the compressed
tokens, an fp16 window of recent tokens). Attention over each segment gives a
normalized output and the log-sum-exp (lse) of its scaled, masked scores;
:func:`merge_attention` combines such partial results exactly:

    m = max_i lse_i,   w_i = exp(lse_i - m),
    out = sum_i w_i out_i / sum_i w_i,   lse = m + log(sum_i w_i).

A segment with no visible key has ``lse = -inf`` and weight 0; a query that
sees no key at all gets ``out = 0`` and ``lse = -inf``.
"""

import sys
import threading
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

__all__ = [
    "install_hook",
    "ensure_hook",
    "uninstall_hook",
    "hook_installed",
    "hooked_scaled_dot_product_attention",
    "dense_attention",
    "merge_attention",
    "merge_two",
    "register_cache_class",
]

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------
# Segment arithmetic


def merge_two(a: Tuple[mx.array, mx.array], b: Tuple[mx.array, mx.array]):
    """Merges two partial attention results ``(out, lse)`` over disjoint key sets.

    Args:
        a, b: ``(out, lse)`` with ``out`` ``(..., L, D)`` normalized within its key
            set and ``lse`` ``(..., L)`` the log-sum-exp of that set's scores
            (``-inf`` when the set is empty or fully masked).

    Returns:
        ``(out, lse)`` of the union, float32.
    """
    (oa, la), (ob, lb) = a, b
    m = mx.maximum(la, lb)
    m = mx.where(m == _NEG_INF, 0.0, m)
    wa = mx.exp(la - m)
    wb = mx.exp(lb - m)
    total = wa + wb
    inv = mx.where(total > 0, 1.0 / mx.where(total > 0, total, 1.0), 0.0)
    out = (oa * (wa * inv)[..., None]) + (ob * (wb * inv)[..., None])
    return out, m + mx.log(total)


def merge_attention(parts: Sequence[Tuple[mx.array, mx.array]]):
    """Merges any number of partial attention results ``(out, lse)`` (see module doc).

    Returns:
        ``(out, lse)`` float32 over the union of the parts' key sets.
    """
    if not parts:
        raise ValueError("[turboquant_mlx.merge_attention] no partial results to merge.")
    if len(parts) == 1:
        out, lse = parts[0]
        return out.astype(mx.float32), lse.astype(mx.float32)
    if len(parts) == 2:
        return merge_two(parts[0], parts[1])
    outs = mx.stack([p[0].astype(mx.float32) for p in parts])
    lses = mx.stack([p[1].astype(mx.float32) for p in parts])
    m = mx.max(lses, axis=0)
    m = mx.where(m == _NEG_INF, 0.0, m)
    w = mx.exp(lses - m)
    total = mx.sum(w, axis=0)
    inv = mx.where(total > 0, 1.0 / mx.where(total > 0, total, 1.0), 0.0)
    out = mx.sum(outs * (w * inv)[..., None], axis=0)
    return out, m + mx.log(total)


def dense_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask=None,
    max_score_bytes: Optional[int] = None,
):
    """Attention with its log-sum-exp, on uncompressed keys and values.

    Args:
        q: Queries ``(B, Hq, L, D)``.
        k, v: Keys and values ``(B, Hkv, N, D)``, ``Hq % Hkv == 0`` (grouped queries).
        scale: Score scale.
        mask: ``None``, or a bool (True = keep) or additive array broadcastable to
            ``(B, Hq, L, N)``.
        max_score_bytes: the queries go in chunks whose float32 scores (with their
            exponentials and probabilities) stay within this many bytes; None: one
            chunk. A long prompt block over a long cache would otherwise materialize
            ``B * Hq * L * N`` floats at once.

    Returns:
        ``out`` ``(B, Hq, L, D)`` and ``lse`` ``(B, Hq, L)``, float32. Rows without a
        visible key give ``out = 0`` and ``lse = -inf``.
    """
    B, n_q, L, D = q.shape
    n_kv, N = k.shape[1], k.shape[2]
    if max_score_bytes is not None:
        chunk = max(1, max_score_bytes // max(1, B * n_q * N * 4 * 3))
        if chunk < L:
            parts = []
            for a in range(0, L, chunk):
                b = min(a + chunk, L)
                m = mask
                if mask is not None and mask.ndim >= 2 and mask.shape[-2] == L:
                    m = mask[..., a:b, :]
                parts.append(dense_attention(q[:, :, a:b], k, v, scale, m))
            return (
                mx.concatenate([o for o, _ in parts], axis=2),
                mx.concatenate([x for _, x in parts], axis=2),
            )
    G = n_q // n_kv
    qf = q.astype(mx.float32).reshape(B, n_kv, G, L, D)
    kf = k.astype(mx.float32)[:, :, None]
    vf = v.astype(mx.float32)[:, :, None]
    scores = (qf @ kf.swapaxes(-1, -2)) * scale
    scores = scores.reshape(B, n_q, L, N)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, _NEG_INF)
        else:
            scores = scores + mask.astype(mx.float32)
    lse = mx.logsumexp(scores, axis=-1)
    safe = mx.where(lse == _NEG_INF, 0.0, lse)
    probs = mx.exp(scores - safe[..., None])
    out = probs.reshape(B, n_kv, G, L, N) @ vf
    return out.reshape(B, n_q, L, D), lse


# ---------------------------------------------------------------------------
# The hook

_lock = threading.Lock()
_original = None  # mlx_lm.models.base.scaled_dot_product_attention before patching
# The cache classes whose attention the hook routes to ``cache.attention(...)``. The
# classes register themselves (:func:`register_cache_class`), so that this module
# never imports them: a cache exists only once its class is defined.
_cache_classes: Tuple[type, ...] = ()


def register_cache_class(cls: type) -> type:
    """Routes the hook's attention for caches of ``cls`` (and its subclasses) to their
    ``attention(queries, scale=..., mask=..., sinks=...)`` method. Idempotent; returns
    ``cls``."""
    global _cache_classes
    with _lock:
        if cls not in _cache_classes:
            _cache_classes = _cache_classes + (cls,)
    return cls


def hooked_scaled_dot_product_attention(
    queries, keys, values, cache, scale: float, mask: Optional[mx.array], sinks=None
):
    """Drop-in replacement of ``mlx_lm.models.base.scaled_dot_product_attention``.

    A cache of a registered class (:func:`register_cache_class`; a
    :class:`~turboquant_mlx.cache.TurboQuantKVCache`) computes attention on its
    compressed storage (``keys``/``values`` returned by its ``update_and_fetch``
    are ignored); any other cache goes to the original function unchanged.
    """
    if isinstance(cache, _cache_classes):
        return cache.attention(queries, scale=scale, mask=mask, sinks=sinks)
    original = _original
    if original is None:  # called after uninstall through a stale reference
        from mlx_lm.models import base

        original = base.scaled_dot_product_attention
        if original is hooked_scaled_dot_product_attention:
            raise RuntimeError("[turboquant_mlx.attention] hook state is inconsistent.")
    return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _patch_modules(old, new) -> List[str]:
    patched = []
    # Any module that bound the original function object (mlx-lm's model modules,
    # and third-party models built on mlx-lm's base). Reading the module dict
    # directly never triggers a lazy module's __getattr__.
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        if namespace.get("scaled_dot_product_attention") is old:
            setattr(module, "scaled_dot_product_attention", new)
            patched.append(name)
    return patched


def install_hook() -> List[str]:
    """Routes mlx-lm's attention for TurboQuant caches to the compressed path.

    Idempotent; call it again after importing more model modules (the factory
    :func:`~turboquant_mlx.cache.make_prompt_cache` does). Models whose caches are
    not TurboQuant caches compute exactly what they computed before.

    Returns:
        Names of the modules patched by this call.
    """
    global _original
    from mlx_lm.models import base

    with _lock:
        if _original is None:
            current = base.scaled_dot_product_attention
            if current is hooked_scaled_dot_product_attention:
                raise RuntimeError("[turboquant_mlx.attention] hook state is inconsistent.")
            _original = current
        return _patch_modules(_original, hooked_scaled_dot_product_attention)


def ensure_hook() -> None:
    """Installs the hook if it is not installed (:func:`install_hook`).

    A :class:`~turboquant_mlx.cache.TurboQuantKVCache` calls this at every
    ``update_and_fetch``: without the hook, the attention that follows would run
    ``mx.fast.scaled_dot_product_attention`` on what ``update_and_fetch`` returned
    (only the new tokens) and silently ignore the cache. This is what makes a cache
    built by hand, rebuilt from a state or loaded from a file, or used after
    :func:`uninstall_hook`, compute the same as one from the factory. Once installed,
    the check is one global read.

    Which functions see the hook: every loaded module whose
    ``scaled_dot_product_attention`` is mlx-lm's (patched at installation), and every
    module imported later (``from mlx_lm.models.base import scaled_dot_product_attention``
    then binds the hook). Code that bound mlx-lm's function somewhere else (a closure,
    a namespace outside ``sys.modules``) before the hook was installed keeps it: call
    :func:`install_hook` after creating it, or look the function up in
    ``mlx_lm.models.base`` at call time.
    """
    if _original is None:
        install_hook()


def uninstall_hook() -> List[str]:
    """Restores mlx-lm's original attention function everywhere it was replaced.

    A :class:`~turboquant_mlx.cache.TurboQuantKVCache` installs the hook again at its
    next ``update_and_fetch`` (see :func:`ensure_hook`).

    Returns:
        Names of the modules restored.
    """
    global _original
    with _lock:
        if _original is None:
            return []
        restored = _patch_modules(hooked_scaled_dot_product_attention, _original)
        _original = None
        return restored


def hook_installed() -> bool:
    """Whether ``mlx_lm.models.base.scaled_dot_product_attention`` is the hook."""
    base = sys.modules.get("mlx_lm.models.base")
    return (
        base is not None
        and getattr(base, "scaled_dot_product_attention", None)
        is hooked_scaled_dot_product_attention
    )


def module_uses_hook(module_name: str) -> bool:
    """Whether the module's global ``scaled_dot_product_attention`` is the hook."""
    module = sys.modules.get(module_name)
    namespace = getattr(module, "__dict__", None) or {}
    return namespace.get("scaled_dot_product_attention") is hooked_scaled_dot_product_attention
