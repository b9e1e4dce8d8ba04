"""TurboQuant KV-cache compression for MLX."""

from ._mlx_version import check_mlx_version as _check_mlx_version

# Before the extension loads: an mlx other than the build's is a clear ImportError,
# not a crash or an undefined symbol (_mlx_version.py).
_check_mlx_version()

from . import _ext  # noqa: E402, F401  (fail at import when the extension is not built)

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


# mlx-lm rebuilds caches by class name from the globals of mlx_lm.models.cache
# (load_prompt_cache, CacheList): the name must be there whenever this package is,
# without importing mlx-lm here. Until turboquant_mlx.cache is imported (which puts
# the class itself there), a stand-in resolves it on first use; it is registered as
# soon as mlx_lm.models.cache is, or now if it is already.
_MLX_LM_CACHE = "mlx_lm.models.cache"


class _CacheClassStandIn:
    """``TurboQuantKVCache`` in ``mlx_lm.models.cache`` until the class is imported."""

    __name__ = __qualname__ = "TurboQuantKVCache"

    @staticmethod
    def _cls():
        from .cache import TurboQuantKVCache

        return TurboQuantKVCache

    def from_state(self, *args, **kwargs):
        return self._cls().from_state(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        return self._cls()(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._cls(), name)

    def __repr__(self):
        return "<stand-in for turboquant_mlx.cache.TurboQuantKVCache>"


def _register_with_mlx_lm(module):
    if "TurboQuantKVCache" not in module.__dict__:
        module.TurboQuantKVCache = _CacheClassStandIn()


class _RegisteringLoader:
    """Runs the original loader of mlx_lm.models.cache, then registers the class."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register_with_mlx_lm(module)
        # Leave no trace of the wrapper on the module.
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _MlxLmCacheFinder:
    """A meta path finder that wraps the loader of mlx_lm.models.cache, once."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname != _MLX_LM_CACHE:
            return None
        import sys

        for finder in list(sys.meta_path):
            if finder is cls or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if cls in sys.meta_path:
            sys.meta_path.remove(cls)
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def _register_now_or_on_import():
    import sys

    module = sys.modules.get(_MLX_LM_CACHE)
    if module is not None:
        _register_with_mlx_lm(module)
    elif _MlxLmCacheFinder not in sys.meta_path:
        sys.meta_path.insert(0, _MlxLmCacheFinder)


_register_now_or_on_import()
