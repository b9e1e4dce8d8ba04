"""TurboQuant KV-cache compression for MLX."""

from . import _ext

__version__ = "0.1.0"
