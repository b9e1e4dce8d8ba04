# Copyright © 2026 turboquant_mlx contributors.

"""Lloyd–Max codebooks for the coordinates of a rotated unit vector.

After a random rotation, one coordinate ``t`` of a uniformly random unit vector
in ``R^d`` has the density

    f(t) = (1 - t^2)^((d - 3) / 2) / Z   on [-1, 1],

i.e. ``(t + 1) / 2 ~ Beta((d - 1) / 2, (d - 1) / 2)``. The codebooks here are
the optimal (minimum mean squared error) scalar quantizers for that density,
computed once per ``(d, bits)`` in float64 with Lloyd's algorithm and cached.

The integrals are taken in the angle ``t = sin(theta)``, where the weight
becomes ``cos(theta)^(d - 2) dtheta``: a smooth function without endpoint
singularities, so composite Gauss–Legendre quadrature is accurate to rounding.
Only NumPy is needed at runtime.
"""

import functools
import math

import mlx.core as mx
import numpy as np

_ERROR_PREFIX = "[turboquant_mlx.codebook]"
_SUPPORTED_BITS = (2, 3, 4)

# Gauss–Legendre rule used on every quadrature panel, and panels per cell.
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(24)
_PANELS_PER_CELL = 8

# The weight is below exp(-_TAIL_SIGMAS**2 / 2) ~ 1e-43 beyond this many standard
# deviations, so the integration range is cut there; without the cut a large d
# would leave the whole peak between two quadrature nodes of the outer cells.
_TAIL_SIGMAS = 14.0

_MAX_ITERATIONS = 100_000
_TOLERANCE = 1e-14  # on the centroids, relative to the standard deviation 1/sqrt(d)


def _validate(head_dim, bits):
    if isinstance(head_dim, bool) or not isinstance(head_dim, (int, np.integer)):
        raise ValueError(f"{_ERROR_PREFIX} head_dim must be an integer, got {head_dim!r}.")
    if head_dim < 8:
        raise ValueError(f"{_ERROR_PREFIX} head_dim must be at least 8, got {head_dim}.")
    if isinstance(bits, bool) or bits not in _SUPPORTED_BITS:
        raise ValueError(f"{_ERROR_PREFIX} bits must be one of 2, 3, 4, got {bits!r}.")


def _cell_integrals(theta_edges, head_dim, integrand):
    """Integrates ``integrand(sin(theta), theta) * cos(theta)^(d-2)`` over each cell.

    Args:
        theta_edges: Ascending float64 array of ``n + 1`` cell edges in the angle.
        head_dim: The dimension ``d``.
        integrand: Callable ``g(t, cell_index_array) -> array`` evaluated on a
            ``(n, nodes)`` grid of ``t = sin(theta)`` values.

    Returns:
        A float64 array of ``n`` integrals (unnormalized).
    """
    lo = theta_edges[:-1, None]
    width = (theta_edges[1:] - theta_edges[:-1])[:, None]
    # Composite rule: split each cell into equal panels, map the nodes onto each.
    panel = width / _PANELS_PER_CELL
    starts = lo + panel * np.arange(_PANELS_PER_CELL)[None, :]
    nodes = starts[:, :, None] + panel[:, :, None] * (0.5 * (_GL_NODES + 1.0))
    weights = panel[:, :, None] * (0.5 * _GL_WEIGHTS)
    num_cells = theta_edges.size - 1
    nodes = nodes.reshape(num_cells, -1)
    weights = np.broadcast_to(weights, (num_cells, _PANELS_PER_CELL, _GL_NODES.size))
    weights = weights.reshape(num_cells, -1)
    density = np.cos(nodes) ** (head_dim - 2)
    values = integrand(np.sin(nodes), np.arange(num_cells)[:, None])
    return np.sum(weights * density * values, axis=-1)


def _theta_edges(boundaries, head_dim):
    """Cell edges in the angle for the given interior boundaries in ``t``."""
    theta_max = min(math.pi / 2, _TAIL_SIGMAS / math.sqrt(head_dim - 2))
    inner = np.clip(np.arcsin(np.clip(boundaries, -1.0, 1.0)), -theta_max, theta_max)
    return np.concatenate([[-theta_max], inner, [theta_max]])


def _conditional_means(boundaries, head_dim):
    """Mean of ``t`` within each cell delimited by ``boundaries``."""
    edges = _theta_edges(boundaries, head_dim)
    mass = _cell_integrals(edges, head_dim, lambda t, k: 1.0)
    first = _cell_integrals(edges, head_dim, lambda t, k: t)
    return first / mass


@functools.lru_cache(maxsize=None)
def _lloyd_max(head_dim, bits):
    levels = 1 << bits
    sigma = 1.0 / math.sqrt(head_dim)
    # Start from evenly spaced levels over +-2 sigma; Lloyd's algorithm converges to
    # the unique optimum from any start because the density is log-concave.
    centroids = sigma * np.linspace(-2.0, 2.0, levels)
    for _ in range(_MAX_ITERATIONS):
        boundaries = 0.5 * (centroids[:-1] + centroids[1:])
        updated = _conditional_means(boundaries, head_dim)
        # The density is even: keep the iterate exactly symmetric.
        updated = 0.5 * (updated - updated[::-1])
        step = np.max(np.abs(updated - centroids))
        centroids = updated
        if step <= _TOLERANCE * sigma:
            break
    else:
        raise RuntimeError(
            f"{_ERROR_PREFIX} Lloyd iteration did not converge for head_dim={head_dim}, "
            f"bits={bits}."
        )
    centroids.setflags(write=False)
    return centroids


def lloyd_max_centroids(head_dim: int, bits: int) -> np.ndarray:
    """Returns the optimal ``bits``-bit codebook for one coordinate in ``R^head_dim``.

    Args:
        head_dim: Dimension ``d`` of the vectors (at least 8).
        bits: Bits per coordinate, one of 2, 3, 4.

    Returns:
        A float64 array of ``2**bits`` ascending centroids, symmetric about 0.

    Raises:
        ValueError: If ``head_dim`` or ``bits`` is out of range.
    """
    _validate(head_dim, bits)
    return _lloyd_max(int(head_dim), int(bits)).copy()


def centroids(head_dim: int, bits: int) -> mx.array:
    """Returns the codebook of :func:`lloyd_max_centroids` as a float32 ``mx.array``."""
    return mx.array(lloyd_max_centroids(head_dim, bits).astype(np.float32))


def boundaries_f32(centroids_f32: np.ndarray) -> np.ndarray:
    """Returns the decision boundaries shared by every implementation of the codec.

    The boundaries are the float32 midpoints ``(c[k] + c[k + 1]) * 0.5f`` of the
    float32 centroids, rounded exactly as the kernels round them, so that all
    implementations assign the same code to the same input.

    Args:
        centroids_f32: Ascending centroids; converted to float32 first.

    Returns:
        A float32 array of ``len(centroids_f32) - 1`` boundaries.
    """
    c = np.asarray(centroids_f32, dtype=np.float32)
    if c.ndim != 1 or c.size < 2:
        raise ValueError(
            f"{_ERROR_PREFIX} centroids must be a 1-D array of at least 2 values, "
            f"got shape {c.shape}."
        )
    return (c[:-1] + c[1:]) * np.float32(0.5)


def lloyd_max_distortion(head_dim: int, bits: int) -> float:
    """Returns the mean squared error per coordinate ``E[(t - Q(t))^2]``.

    The expectation is over the coordinate density ``f`` in ``R^head_dim`` with
    the float64 codebook of :func:`lloyd_max_centroids`. For unit vectors the
    total squared error is ``head_dim`` times this value.

    Args:
        head_dim: Dimension ``d`` of the vectors (at least 8).
        bits: Bits per coordinate, one of 2, 3, 4.

    Returns:
        The distortion as a Python float.
    """
    c = lloyd_max_centroids(head_dim, bits)
    edges = _theta_edges(0.5 * (c[:-1] + c[1:]), head_dim)
    mass = _cell_integrals(edges, head_dim, lambda t, k: 1.0)
    error = _cell_integrals(edges, head_dim, lambda t, k: (t - c[k]) ** 2)
    return float(np.sum(error) / np.sum(mass))
