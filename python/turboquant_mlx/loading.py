# Copyright © 2026 turboquant_mlx contributors.

"""Loading a model for the CLI, the server and the demo, and what makes it fast on
the CPU: float weights instead of MLX's quantized matrix products where a fast BLAS
runs them, and the system's OpenBLAS preloaded where MLX would use the reference BLAS
(the process re-executes itself once)."""

import glob
import os
import sys
from typing import List, Optional

import mlx.core as mx

from .cli_args import _dtype

__all__ = ["load_model", "dequantize_weights", "dequantized_nbytes", "use_fast_blas"]


def load_model(
    path: Optional[str],
    dtype_name: str = "auto",
    trust_remote_code=False,
    tokenizer_config=None,
    dequantize=False,
):
    """Loads ``(model, tokenizer)`` from a .gguf file, an MLX directory or a repo.

    ``dequantize``: True replaces the quantized layers by float ones in the
    activation dtype (:func:`dequantize_weights`); ``"auto"`` does so on the CPU
    with float32 activations when the float weights take at most a quarter of the
    memory (:func:`_auto_dequantize`).
    """
    dtype = _dtype(dtype_name)
    if path is None or str(path).endswith(".gguf"):
        from .gguf import default_smollm2_path, load_gguf

        model, tokenizer = load_gguf(path or default_smollm2_path(), dtype=dtype or mx.float16)
    else:
        from mlx_lm.utils import load

        config = dict(tokenizer_config or {})
        config["trust_remote_code"] = trust_remote_code
        model, tokenizer = load(path, tokenizer_config=config)
        if dtype is not None:
            model.set_dtype(dtype)
            mx.eval(model.parameters())
    if dequantize == "auto":
        dequantize = _auto_dequantize(model)
    if dequantize:
        dequantize_weights(model)
    return model, tokenizer


def _quantized_modules(model):
    import mlx.nn as nn

    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    ]


def _float_dtype(model):
    """The dtype the model's quantized layers compute in (that of their scales)."""
    for _, m in _quantized_modules(model):
        return m.scales.dtype
    return None


def dequantized_nbytes(model) -> int:
    """Bytes the quantized layers' weights would take as float weights."""
    return sum(
        m.scales.size * m.group_size * m.scales.dtype.size for _, m in _quantized_modules(model)
    )


def _physical_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _auto_dequantize(model) -> bool:
    """Whether ``--dequantize-weights auto`` dequantizes: on the CPU with float32
    activations and a fast BLAS (a float32 matrix product runs on the BLAS, many
    times faster there than MLX's quantized one; on the reference BLAS it is no
    faster), when the float weights fit in a quarter of the memory."""
    dtype = _float_dtype(model)
    if mx.default_device().type != mx.cpu or dtype is None or dtype != mx.float32:
        return False
    if _reference_blas():
        return False
    memory = _physical_memory()
    return memory is None or dequantized_nbytes(model) <= memory // 4


def dequantize_weights(model) -> int:
    """Replaces the model's quantized linear and embedding layers by float ones (the
    dtype of their scales), as ``load_gguf(dequantize=True)`` loads them; returns how
    many layers were replaced."""
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    swaps = []
    for name, m in _quantized_modules(model):
        weight = mx.dequantize(
            m.weight, m.scales, m.get("biases"), m.group_size, m.bits, mode=m.mode
        ).astype(m.scales.dtype)
        if isinstance(m, nn.QuantizedEmbedding):
            layer = nn.Embedding(*weight.shape)
        else:
            layer = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in m)
            if "bias" in m:
                layer.bias = m.bias
        layer.weight = weight
        swaps.append((name, layer))
    if swaps:
        model.update_modules(tree_unflatten(swaps))
        mx.eval(model.parameters())
    return len(swaps)


def _reference_blas() -> bool:
    """Whether MLX's matrix products run on the reference (netlib) BLAS: MLX's Linux
    CPU wheel links it, and it runs float32 products many times slower than OpenBLAS.
    False once OpenBLAS is preloaded."""
    if sys.platform != "linux" or "openblas" in os.environ.get("LD_PRELOAD", ""):
        return False
    site = os.path.dirname(os.path.dirname(mx.__file__))
    return bool(glob.glob(os.path.join(site, "mlx*.libs", "libblas-*.so*")))


def _system_openblas() -> Optional[str]:
    """The system's OpenBLAS (Debian/Ubuntu: ``apt install libopenblas0-pthread``),
    whose BLAS symbols MLX then calls when it is preloaded; None where there is none."""
    found = sorted(
        glob.glob("/usr/lib/*/openblas*/libblas.so.3") + glob.glob("/usr/lib*/libopenblas*.so.0")
    )
    return found[0] if found else None


# Set in the re-executed process: it never re-executes again.
_REEXEC_MARK = "TURBOQUANT_BLAS_REEXEC"


def use_fast_blas(module: str, argv: List[str]) -> Optional[str]:
    """On the CPU, where MLX would use the reference BLAS, re-executes
    ``python -m module argv`` with the system's OpenBLAS preloaded. Returns a note
    for the user (the BLAS the re-executed process preloaded; without OpenBLAS, how
    to get it), or None."""
    if os.environ.get(_REEXEC_MARK):
        preloaded = os.environ.get("LD_PRELOAD", "").split()
        blas = next((p for p in preloaded if "openblas" in p), None)
        return f"using the system's OpenBLAS ({blas}) for MLX's matrix products" if blas else None
    if mx.default_device() != mx.cpu or not _reference_blas():
        return None
    blas = _system_openblas()
    if blas:
        preload = " ".join(x for x in (os.environ.get("LD_PRELOAD"), blas) if x)
        env = dict(os.environ, LD_PRELOAD=preload, **{_REEXEC_MARK: "1"})
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
    return (
        "MLX's Linux CPU wheel uses the reference BLAS, which reads prompts several times "
        "slower: `apt install libopenblas0-pthread` (which this program then preloads) or "
        "set LD_PRELOAD to another BLAS."
    )
