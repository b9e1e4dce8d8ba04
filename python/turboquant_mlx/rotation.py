# Copyright © 2026 turboquant_mlx contributors.

"""Seeded orthogonal rotations applied to head vectors before quantization.

A rotation spreads every vector's energy evenly over its coordinates, so that
each coordinate follows the same known marginal distribution and one fixed
codebook fits all of them. For head dims ``2^k`` and ``12 * 2^k`` the rotation
is a randomized Walsh–Hadamard transform, ``R x = H (s * x) / sqrt(D)`` with
random signs ``s``, computed in ``O(D log D)`` by ``mx.hadamard_transform``;
other head dims use a seeded dense random orthogonal matrix.
"""

import math
from typing import Optional

import mlx.core as mx
import numpy as np

from ._ext import RotationSigns

_ERROR_PREFIX = "[turboquant_mlx.rotation]"


def _is_hadamard_size(head_dim):
    """True for ``2^k`` and ``12 * 2^k``, sizes with a symmetric Hadamard matrix."""

    def is_power_of_two(n):
        return n > 0 and n & (n - 1) == 0

    return is_power_of_two(head_dim) or (head_dim % 12 == 0 and is_power_of_two(head_dim // 12))


def rotate_forward(x: mx.array, signs, matrix, scale: float) -> mx.array:
    """``R x`` along the last axis of a float32 ``x``, from :meth:`Rotation.params`.

    A pure function of its arguments, so that callers can put it inside
    ``mx.compile`` with the rotation's arrays as inputs.
    """
    if signs is not None:
        return mx.hadamard_transform(signs * x, scale=scale)
    return x @ matrix.T


def rotate_inverse(y: mx.array, signs, matrix, scale: float) -> mx.array:
    """``R^T y`` along the last axis of a float32 ``y`` (see :func:`rotate_forward`)."""
    if signs is not None:
        # H is symmetric for these sizes, so (H S / sqrt(D))^T = S H / sqrt(D).
        return signs * mx.hadamard_transform(y, scale=scale)
    return y @ matrix


class Rotation:
    """An orthogonal rotation ``R`` of the last axis, reproducible from a seed.

    Args:
        head_dim: Size ``D`` of the rotated axis.
        seed: Seed of the NumPy generator that draws the signs (Hadamard sizes)
            or the Gaussian matrix (other sizes).

    Raises:
        ValueError: If ``head_dim`` is not a positive integer or ``seed`` is not a
            non-negative integer.
    """

    def __init__(self, head_dim: int, seed: int):
        if (
            isinstance(head_dim, bool)
            or not isinstance(head_dim, (int, np.integer))
            or head_dim <= 0
        ):
            raise ValueError(
                f"{_ERROR_PREFIX} head_dim must be a positive integer, got {head_dim!r}."
            )
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"{_ERROR_PREFIX} seed must be a non-negative integer, got {seed!r}.")
        self._head_dim = int(head_dim)
        self._seed = int(seed)
        self._uses_hadamard = _is_hadamard_size(self._head_dim)
        self._kernel_signs = None
        rng = np.random.default_rng(seed)
        if self._uses_hadamard:
            self._signs_np = (2 * rng.integers(0, 2, self._head_dim) - 1).astype(np.float32)
            self._signs = mx.array(self._signs_np)
            self._scale = 1.0 / math.sqrt(self._head_dim)
        else:
            gaussian = rng.standard_normal((self._head_dim, self._head_dim))
            q, r = np.linalg.qr(gaussian)
            # QR is unique only up to the signs of R's diagonal; fixing them makes
            # the matrix a deterministic function of the seed (and Haar-distributed).
            self._matrix_np = q * np.sign(np.diag(r))[None, :]
            self._matrix = mx.array(self._matrix_np.astype(np.float32))

    @property
    def head_dim(self) -> int:
        """Size of the rotated axis."""
        return self._head_dim

    @property
    def seed(self) -> int:
        """Seed the rotation was drawn from."""
        return self._seed

    @property
    def uses_hadamard(self) -> bool:
        """Whether the rotation is a randomized Hadamard transform."""
        return self._uses_hadamard

    def _check(self, x):
        if x.ndim == 0 or x.shape[-1] != self._head_dim:
            raise ValueError(
                f"{_ERROR_PREFIX} expected last axis of size {self._head_dim}, "
                f"got shape {tuple(x.shape)}."
            )
        return x.astype(mx.float32)

    def forward(self, x: mx.array) -> mx.array:
        """Returns ``R x`` along the last axis, in float32.

        Args:
            x: Array of shape ``(..., head_dim)`` of any float dtype.

        Returns:
            A float32 array of the same shape.
        """
        return rotate_forward(self._check(x), *self.params())

    def inverse(self, y: mx.array) -> mx.array:
        """Returns ``R^T y`` along the last axis, in float32.

        Args:
            y: Array of shape ``(..., head_dim)`` of any float dtype.

        Returns:
            A float32 array of the same shape.
        """
        return rotate_inverse(self._check(y), *self.params())

    @property
    def kernel_signs(self) -> Optional[RotationSigns]:
        """The signs ``s`` for ops that apply the rotation in their kernels
        (``rotation_signs`` of :func:`turboquant_mlx.ops.quantize_append` and
        :func:`~turboquant_mlx.ops.compressed_attention`; a sequence of floats, built
        once so that the ops do not convert them on every call), or None when the
        kernels cannot: only a power-of-two head dim's Hadamard rotation."""
        d = self._head_dim
        if not self._uses_hadamard or d & (d - 1):
            return None
        if self._kernel_signs is None:
            self._kernel_signs = RotationSigns([float(v) for v in self._signs_np])
        return self._kernel_signs

    def params(self):
        """``(signs, matrix, scale)``, the arguments of :func:`rotate_forward` and
        :func:`rotate_inverse`: the signs and ``1/sqrt(D)`` of a Hadamard rotation
        (``matrix`` None), or the dense matrix ``R`` (``signs`` None, ``scale`` 1)."""
        if self._uses_hadamard:
            return self._signs, None, self._scale
        return None, self._matrix, 1.0

    def matrix(self) -> np.ndarray:
        """Returns the float64 ``(D, D)`` matrix ``R`` with ``forward(x) = R x``."""
        if not self._uses_hadamard:
            return self._matrix_np.copy()
        # The transform of the identity has entries +-1, exact in float32. Row i of
        # the result is H e_i, i.e. column i of H, hence the transpose.
        eye = mx.eye(self._head_dim, dtype=mx.float32)
        hadamard = np.array(mx.hadamard_transform(eye, scale=1.0), dtype=np.float64).T
        signs = self._signs_np.astype(np.float64)
        return hadamard * signs[None, :] / math.sqrt(self._head_dim)

    def __repr__(self):
        kind = "hadamard" if self._uses_hadamard else "dense"
        return f"Rotation(head_dim={self._head_dim}, seed={self._seed!r}, kind={kind!r})"
