"""Ablations of the cache's quality levers, measured with bench/quality.py.

Registers extra configurations (built from :class:`turboquant_mlx.cache.KVPreset`
objects, not presets of the package) next to quality.py's own, then runs
quality.py's ``main`` with the remaining arguments. Names spell the configuration:
``k<key bits>v<value bits>`` (``k4`` = ``k4v4``), then ``c`` (mean centering,
``center=True``), ``q`` (query-aware key scaling, ``query_aware_keys=True``), ``s``
(4 fp16 sink tokens) and ``_w<N>`` (an fp16 window of N recent tokens).

``--tq-seed N`` sets the rotation seed of every TurboQuant configuration (the
package's presets too; default 0 as in quality.py): on 1-2k tokens the perplexity
of one configuration moves by a few percent from one seed to another, so compare
levers over several seeds or long texts.

Examples::

    python bench/levers.py --list-configs
    python bench/levers.py --configs fp16,k4,k4s,k4c,k4cs,k4cqs --tasks ppl --ppl-tokens 3072
    python bench/levers.py --tq-seed 1 --configs fp16,k4cs --tasks ppl --ppl-tokens 2048
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import quality  # noqa: E402  (sets OPENBLAS_NUM_THREADS before NumPy loads)
from mlx_lm.models.cache import KVCache  # noqa: E402


def _variants():
    out = []
    for kb, vb in ((4, 4), (3, 3), (4, 2), (4, 3)):
        base = f"k{kb}" if kb == vb else f"k{kb}v{vb}"
        for levers in ("", "s", "c", "cs", "q", "cq", "cqs"):
            out.append((base + levers, kb, vb, levers, 0))
        for w in (16, 32, 64):
            out.append((f"{base}cs_w{w}", kb, vb, "cs", w))
            out.append((f"{base}cqs_w{w}", kb, vb, "cqs", w))
    return out


def lever_configs():
    import turboquant_mlx.cache as tq

    configs = []
    for name, kb, vb, levers, window in _variants():
        if name in tq.PRESETS:  # the package's preset of that name wins
            continue
        preset = tq.KVPreset(
            name,
            kb,
            vb,
            fp16_sink_tokens=4 if "s" in levers else 0,
            fp16_recent_tokens=window,
            center="c" in levers,
            query_aware_keys="q" in levers,
            description=name,
        )

        def make(model, preset=preset):
            caches = tq.make_prompt_cache(model, preset=preset)
            return [quality.Float16KVCache() if type(c) is KVCache else c for c in caches]

        def nominal(ctx, preset=preset):
            info = quality._MODEL_INFO
            return preset.bits_per_coordinate(info["head_dim"], ctx, num_layers=info["num_layers"])

        desc = f"{kb}-bit keys, {vb}-bit values" + "".join(
            f", {x}"
            for x, on in (
                ("centered", "c" in levers),
                ("query-aware keys", "q" in levers),
                ("4 fp16 sinks", "s" in levers),
                (f"fp16 window {window}", window),
            )
            if on
        )
        configs.append(quality.CacheConfig(name, make, "ablation: " + desc, nominal))
    return configs


def _set_seed(seed: int):
    import turboquant_mlx.cache as tq

    original = tq.make_prompt_cache

    def make_prompt_cache(*args, **kwargs):
        kwargs.setdefault("seed", seed)
        return original(*args, **kwargs)

    tq.make_prompt_cache = make_prompt_cache


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--tq-seed" in argv:
        i = argv.index("--tq-seed")
        _set_seed(int(argv[i + 1]))
        del argv[i : i + 2]
    own = quality.turboquant_configs
    quality.turboquant_configs = lambda: own() + lever_configs()
    return quality.main(argv)


if __name__ == "__main__":
    sys.exit(main())
