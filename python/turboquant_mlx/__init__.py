"""TurboQuant KV-cache compression for MLX."""

from . import _ext

__version__ = "0.1.0"

# The mlx-lm integration imports mlx_lm (slow, optional dependency): load it on
# first use of one of these names.
_LAZY = {
    "TurboQuantKVCache": "cache",
    "KVPreset": "cache",
    "PRESETS": "cache",
    "get_preset": "cache",
    "make_prompt_cache": "cache",
    "install_hook": "attention",
    "uninstall_hook": "attention",
    "save_prompt_cache": "prompt_cache",
    "load_prompt_cache": "prompt_cache",
    "fold_value_rotation": "fold",
    "ValueFoldError": "fold",
}


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'turboquant_mlx' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
