# Copyright © 2026 turboquant_mlx contributors.

"""Named cache configurations (:class:`KVPreset`, :data:`PRESETS`), their bits per
coordinate, and how a preset's layer exceptions (``fp16_layers``,
``layer_schedule``, ``layer_overrides``) resolve to per-layer cache arguments.
"""

import dataclasses
import math
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from ._common import _PREFIX, _check_int

__all__ = ["KVPreset", "PRESETS", "DEFAULT_PRESET", "get_preset"]


@dataclasses.dataclass(frozen=True)
class KVPreset:
    """A named cache configuration.

    Attributes:
        name: Preset name.
        key_bits, value_bits: Bits per coordinate; ``None`` for both means no
            compression (mlx-lm's own caches).
        fp16_sink_tokens: First positions kept unquantized.
        fp16_recent_tokens: Window of most recent tokens kept unquantized.
        fp16_layers: ``(first_n, last_n)``: that many of the first and last
            compressible layers keep mlx-lm's plain ``KVCache``.
        center: Mean-centered compressed keys and values (TurboQuantKVCache).
        query_aware_keys: Query-aware key scaling (TurboQuantKVCache).
        description: One line for ``--help`` and tables.
        layer_schedule: Per-layer exceptions by *relative depth*, so that one
            schedule applies to models of any depth: ``(where, spec)`` pairs, later
            pairs winning. ``where`` is a float ``x`` in ``[0, 1]`` (the one
            compressible layer nearest to relative depth ``x``: index
            ``round(x * (n - 1))`` among the ``n`` compressible layers) or a pair
            ``(lo, hi)`` (every compressible layer ``k`` with
            ``lo <= k / (n - 1) <= hi``). ``spec`` is ``"fp16"`` (plain
            ``KVCache``), a ``(key_bits, value_bits)`` tuple or a dict of
            :class:`TurboQuantKVCache` arguments (as ``make_prompt_cache``'s
            ``layer_overrides``). Layers of ``fp16_layers`` stay fp16. An optional
            third element ``min_layers`` skips the entry on models with fewer
            compressible layers (e.g. an fp16 layer whose cost only fits the bit
            budget when spread over many layers).
    """

    name: str
    key_bits: Optional[int]
    value_bits: Optional[int]
    fp16_sink_tokens: int = 0
    fp16_recent_tokens: int = 0
    fp16_layers: Tuple[int, int] = (0, 0)
    center: bool = False
    query_aware_keys: bool = False
    description: str = ""
    layer_schedule: Tuple[Tuple[Any, ...], ...] = ()

    @property
    def compressed(self) -> bool:
        return self.key_bits is not None

    def bits_per_coordinate(
        self,
        head_dim: int,
        context: int,
        num_layers: Optional[int] = None,
        rollback_tokens: int = 16,
        dense_bits: int = 16,
        calibration_tokens: int = 32,
    ) -> float:
        """Average stored bits per cached coordinate (keys and values together).

        Counts codes, the float16 scale of every compressed vector, the fp16 sink
        tokens and window (with its rollback slack, which is held twice), the
        levers' float32 vectors per KV head (``mu_k``, ``mu_v``, ``a``) and, when
        ``num_layers`` is given, the fp16 boundary layers. Buffer capacity rounding
        is not counted.

        Args:
            head_dim: Head dim ``D``.
            context: Number of cached tokens.
            num_layers: Number of compressible layers; ``None`` ignores
                ``fp16_layers`` (estimate for one compressed layer).
            rollback_tokens: The caches' rollback slack (see TurboQuantKVCache).
            dense_bits: Bits per element of unquantized storage (16; 32 for a
                float32 model).
            calibration_tokens: The caches' ``calibration_tokens``: with a lever,
                fewer non-sink tokens than that are all held unquantized.
        """
        if context <= 0:
            raise ValueError(f"{_PREFIX} context must be positive, got {context}.")
        if not self.compressed:
            return float(dense_bits)
        base = dict(
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            fp16_sink_tokens=self.fp16_sink_tokens,
            fp16_recent_tokens=self.fp16_recent_tokens,
            center=self.center,
            query_aware_keys=self.query_aware_keys,
            rollback_tokens=rollback_tokens,
            calibration_tokens=calibration_tokens,
        )
        if num_layers is None:
            return _layer_bits(base, head_dim, context, dense_bits)
        configs = self.layer_configs(num_layers, base)
        return (
            sum(
                dense_bits if cfg is None else _layer_bits(cfg, head_dim, context, dense_bits)
                for cfg in configs
            )
            / num_layers
        )

    def layer_configs(
        self, num_layers: int, base: Optional[Dict[str, Any]] = None
    ) -> List[Optional[Dict[str, Any]]]:
        """Per-layer cache arguments for ``num_layers`` compressible layers: ``base``
        (default: this preset's settings) with ``fp16_layers`` (``None``: fp16) and
        ``layer_schedule`` applied."""
        if base is None:
            base = dict(
                key_bits=self.key_bits,
                value_bits=self.value_bits,
                fp16_sink_tokens=self.fp16_sink_tokens,
                fp16_recent_tokens=self.fp16_recent_tokens,
                center=self.center,
                query_aware_keys=self.query_aware_keys,
            )
        layers = list(range(num_layers))
        fp16 = _fp16_layer_set(tuple(self.fp16_layers), layers, num_layers)
        configs: List[Optional[Dict[str, Any]]] = [
            None if k in fp16 else dict(base) for k in layers
        ]
        for k, spec in _schedule_layers(self.layer_schedule, num_layers):
            if k not in fp16:
                configs[k] = _override_config(spec, dict(base), k)
        return configs


def _layer_bits(cfg: Mapping[str, Any], head_dim: int, context: int, dense_bits: int = 16) -> float:
    """Average stored bits per coordinate of one compressed layer (see
    :meth:`KVPreset.bits_per_coordinate`) with TurboQuantKVCache arguments ``cfg``."""
    sinks = min(cfg.get("fp16_sink_tokens", 0), context)
    rest = context - sinks
    recent = cfg.get("fp16_recent_tokens", 0)
    window = min(recent, rest)
    center = bool(cfg.get("center", False))
    levers = center or bool(cfg.get("query_aware_keys", False))
    calibrated = not levers or rest >= cfg.get("calibration_tokens", 32)
    if not calibrated:
        window = rest  # nothing is quantized before calibration
    n_comp = rest - window
    slack = min(cfg.get("rollback_tokens", 16), n_comp) if recent else 0
    per_token_comp = (head_dim * cfg["key_bits"] + 16) + (head_dim * cfg["value_bits"] + 16)
    bits = n_comp * per_token_comp + (sinks + window + slack) * 2 * head_dim * dense_bits
    if levers and calibrated:
        bits += (2 * center + bool(cfg.get("query_aware_keys", False))) * head_dim * 32
    return bits / (2 * head_dim * context)


def _schedule_layers(schedule, num_layers: int) -> List[Tuple[int, Any]]:
    """``(layer index among num_layers compressible layers, spec)`` for a
    ``KVPreset.layer_schedule``, in schedule order."""
    out = []
    span = max(num_layers - 1, 1)
    for entry in schedule:
        where, spec = entry[0], entry[1]
        if len(entry) > 2 and num_layers < int(entry[2]):
            continue  # (where, spec, min_layers): only on models that deep
        if isinstance(where, (tuple, list)):
            lo, hi = (float(x) for x in where)
            ks = [k for k in range(num_layers) if lo - 1e-9 <= k / span <= hi + 1e-9]
        else:
            x = float(where)
            if not 0.0 <= x <= 1.0:
                raise ValueError(f"{_PREFIX} layer_schedule position {x} is not in [0, 1].")
            ks = [min(num_layers - 1, int(math.floor(x * span + 0.5)))] if num_layers else []
        out.extend((k, spec) for k in ks)
    return out


# The preset table: edit here (values are to be tuned on bench/quality.py results).
_PRESET_LIST = [
    KVPreset("fp16", None, None, description="no compression (mlx-lm's own caches)"),
    # Headline presets, chosen on SmolLM2-135M-Instruct (30 layers, head dim 64) by
    # perplexity and KL to fp16 over 3072 tokens, each token scored as a decode step
    # sees the cache (bench/quality.py, bench/layer_sweep.py; README).
    #
    # Most of what 4-bit codes cost is in the most recent tokens, which hold most of
    # the attention: keeping the last 32 tokens of each layer in fp16 (a residual
    # window, as in KIVI) takes the KL to fp16 from ~51 to ~8 mnat and the perplexity
    # loss from +4.3% to +0.4..0.9%. 32 tokens cost 0.2 bits per coordinate at 3k
    # tokens and nothing measurable at long context. At equal bits it beat the
    # per-layer schedules tried before (fp16 or 3-bit layers chosen from single-layer
    # sensitivities, bench/results/smollm2_layer_sweep.md).
    #
    # 4-bit class (<= 4.5 bits per coordinate from 3k tokens on; 4.26 at 128k). Bits are
    # SmolLM2's (head dim 64); at head dim 128 the per-token norms cost half as much.
    KVPreset(
        "tq4",
        4,
        4,
        fp16_sink_tokens=4,
        fp16_recent_tokens=32,
        center=True,
        description="4-bit K/V, mean-centered, 4 fp16 sinks, last 32 tokens fp16 "
        "(4.48 bits at 3k tokens, 4.26 at 128k)",
    ),
    # 3-bit class (<= 3.5 bits from 3k tokens on; 3.26 at 128k): 2-bit values
    # cost much less than 2-bit keys (k3v3 with the same window: KL 35 vs 33 mnat at
    # 0.01 more bits, perplexity +3.8% vs +1.5% on seed 0).
    KVPreset(
        "tq3",
        4,
        2,
        fp16_sink_tokens=4,
        fp16_recent_tokens=32,
        center=True,
        description="4-bit keys, 2-bit values, mean-centered, 4 fp16 sinks, last 32 tokens "
        "fp16 (3.49 bits at 3k tokens, 3.26 at 128k)",
    ),
    # The same without the window (the previous generation of presets).
    KVPreset(
        "tq4-nowindow",
        4,
        4,
        fp16_sink_tokens=4,
        center=True,
        description="tq4 without the fp16 window (4.28 bits)",
    ),
    KVPreset(
        "tq3-nowindow",
        4,
        2,
        fp16_sink_tokens=4,
        center=True,
        description="tq3 without the fp16 window (3.28 bits)",
    ),
    # tq4's quality in fewer bytes at long context: 3-bit values paid for by a larger
    # window (on SmolLM2 the same mean perplexity as tq4 over rotation seeds 0-5).
    KVPreset(
        "k4v3",
        4,
        3,
        fp16_sink_tokens=4,
        fp16_recent_tokens=128,
        center=True,
        description="4-bit keys, 3-bit values, mean-centered, 4 fp16 sinks, last 128 tokens "
        "fp16 (4.37 bits at 3k tokens, 3.77 at 128k)",
    ),
    KVPreset(
        "k3v3",
        3,
        3,
        fp16_sink_tokens=4,
        fp16_recent_tokens=32,
        center=True,
        query_aware_keys=True,
        description="3-bit keys and values, mean-centered, query-aware keys, 4 fp16 sinks, "
        "last 32 tokens fp16",
    ),
    # Ablations: the plain codec, and with fp16 sinks only.
    KVPreset("tq4-plain", 4, 4, description="plain TurboQuant: 4-bit keys and values"),
    KVPreset("tq3-plain", 3, 3, description="plain TurboQuant: 3-bit keys and values"),
    KVPreset(
        "tq4-sink",
        4,
        4,
        fp16_sink_tokens=4,
        description="plain 4-bit, first 4 tokens (attention sinks) in fp16",
    ),
    KVPreset(
        "tq3-sink",
        3,
        3,
        fp16_sink_tokens=4,
        description="plain 3-bit, first 4 tokens (attention sinks) in fp16",
    ),
    # More fp16: a 128-token window, and the first and last layers in fp16 as well.
    KVPreset(
        "tq4-hq",
        4,
        4,
        fp16_sink_tokens=4,
        fp16_recent_tokens=128,
        center=True,
        description="tq4 with the last 128 tokens in fp16 (4.85 bits at 3k tokens, 4.26 at 128k)",
    ),
    KVPreset(
        "tq4-plus",
        4,
        4,
        fp16_sink_tokens=4,
        fp16_recent_tokens=64,
        fp16_layers=(1, 1),
        center=True,
        description="tq4 with a recent window (64) and the first and last layer in fp16",
    ),
    KVPreset(
        "tq3-plus",
        4,
        2,
        fp16_sink_tokens=4,
        fp16_recent_tokens=64,
        fp16_layers=(1, 1),
        center=True,
        description="tq3 with a recent window (64) and the first and last layer in fp16",
    ),
]
PRESETS: Dict[str, KVPreset] = {p.name: p for p in _PRESET_LIST}

# What the command-line generator uses unless told otherwise.
DEFAULT_PRESET = "tq4"


def get_preset(name: Union[str, KVPreset]) -> KVPreset:
    """Returns the preset called ``name``; raises ValueError listing the valid names.

    ``PRESET@wN`` (e.g. ``tq4@w128``) is that compressed preset with its last ``N``
    tokens kept in fp16 (``fp16_recent_tokens=N``)."""
    if isinstance(name, KVPreset):
        return name
    if isinstance(name, str) and name in PRESETS:
        return PRESETS[name]
    base, sep, window = name.rpartition("@w") if isinstance(name, str) else ("", "", "")
    if sep and window.isdigit() and base in PRESETS and PRESETS[base].compressed:
        return dataclasses.replace(
            PRESETS[base],
            name=name,
            fp16_recent_tokens=int(window),
            description=f"{base} with a {int(window)}-token fp16 window",
        )
    raise ValueError(
        f"{_PREFIX} unknown preset {name!r}; valid presets: {', '.join(PRESETS)} "
        f"(compressed ones also as PRESET@wN: the last N tokens in fp16)."
    )


def _fp16_layer_set(spec, compressible: List[int], num_caches: int) -> set:
    if spec is None:
        return set()
    if (
        isinstance(spec, tuple)
        and len(spec) == 2
        and all(isinstance(x, (int, np.integer)) for x in spec)
    ):
        first, last = (_check_int("fp16_layers", int(x)) for x in spec)
        chosen = set(compressible[:first])
        if last:
            chosen |= set(compressible[-last:])
        return chosen
    out = set()
    for i in spec:
        i = int(i)
        if not -num_caches <= i < num_caches:
            raise ValueError(
                f"{_PREFIX} fp16 layer index {i} out of range for {num_caches} layers."
            )
        out.add(i % num_caches)
    return out


def _override_config(spec, base: Dict[str, Any], layer: int) -> Optional[Dict[str, Any]]:
    """Cache kwargs for a layer override; None means a plain KVCache."""
    if spec is None or (isinstance(spec, str) and spec == "fp16"):
        return None
    if isinstance(spec, (str, KVPreset)):
        p = get_preset(spec)
        if not p.compressed:
            return None
        return dict(
            base,
            key_bits=p.key_bits,
            value_bits=p.value_bits,
            fp16_sink_tokens=p.fp16_sink_tokens,
            fp16_recent_tokens=p.fp16_recent_tokens,
            center=p.center,
            query_aware_keys=p.query_aware_keys,
        )
    if isinstance(spec, tuple) and len(spec) == 2:
        return dict(base, key_bits=spec[0], value_bits=spec[1])
    if isinstance(spec, Mapping):
        unknown = set(spec) - {
            "key_bits",
            "value_bits",
            "fp16_sink_tokens",
            "fp16_recent_tokens",
            "rollback_tokens",
            "center",
            "query_aware_keys",
            "calibration_tokens",
        }
        if unknown:
            raise ValueError(
                f"{_PREFIX} layer {layer} override has unknown keys {sorted(unknown)}."
            )
        return dict(base, **spec)
    raise ValueError(
        f"{_PREFIX} layer {layer} override must be 'fp16', None, a preset name, a "
        f"(key_bits, value_bits) tuple or a dict; got {spec!r}."
    )
