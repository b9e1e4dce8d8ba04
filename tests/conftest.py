# Copyright © 2026 turboquant_mlx contributors.

"""Makes the in-tree package importable when it is not installed."""

import importlib.util
import os
import sys

# An installed package (with its compiled extension) takes precedence over the
# sources; only fall back to python/ when nothing is installed.
if importlib.util.find_spec("turboquant_mlx") is None:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "python"))
