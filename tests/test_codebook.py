# Copyright © 2026 turboquant_mlx contributors.

"""Codebooks checked against an independent SciPy computation and sampling."""

import math

import numpy as np
import pytest
from scipy import integrate, optimize, special

from turboquant_mlx import codebook

HEAD_DIMS = (64, 96, 128, 256)
BITS = (2, 3, 4)

# Gaussian Lloyd–Max quantizers (Max, 1960): positive centroids and mean squared
# error for a unit-variance source. A coordinate of a random unit vector in R^d
# tends to N(0, 1/d), so sqrt(d) * centroids approach these for large d.
GAUSSIAN_CENTROIDS = {
    2: [0.4528, 1.5104],
    3: [0.2451, 0.7560, 1.3439, 2.1520],
    4: [0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326],
}
GAUSSIAN_DISTORTION = {2: 0.1175, 3: 0.03455, 4: 0.009497}


def scipy_conditional_means(centroids, head_dim):
    """Cell means of t with (t + 1) / 2 ~ Beta(a, a), a = (d - 1) / 2, via betainc.

    Uses E[X; X < x] = a / (2a) * I(a + 1, a; x) for X ~ Beta(a, a).
    """
    a = 0.5 * (head_dim - 1)
    boundaries = 0.5 * (centroids[:-1] + centroids[1:])
    x = np.concatenate([[0.0], 0.5 * (boundaries + 1.0), [1.0]])
    mass = np.diff(special.betainc(a, a, x))
    mean_x = 0.5 * np.diff(special.betainc(a + 1, a, x))
    return (2.0 * mean_x - mass) / mass


def scipy_lloyd_max(head_dim, bits):
    """Solves the centroid condition c = E[t | cell(c)] with a root finder."""
    half = 1 << (bits - 1)
    sigma = 1.0 / math.sqrt(head_dim)

    def full(positive):
        return np.concatenate([-positive[::-1], positive])

    def residual(positive):
        c = full(positive)
        return (c - scipy_conditional_means(c, head_dim))[half:] / sigma

    start = sigma * np.asarray(GAUSSIAN_CENTROIDS[bits])
    positive = optimize.fsolve(residual, start, xtol=1e-12)
    assert np.max(np.abs(residual(positive))) < 1e-10
    return full(positive)


def density(t, head_dim):
    """Unnormalized coordinate density (1 - t^2)^((d - 3) / 2)."""
    return (1.0 - t * t) ** (0.5 * (head_dim - 3))


def random_unit_vectors(count, head_dim, rng):
    x = rng.standard_normal((count, head_dim))
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_matches_scipy_lloyd_max(head_dim, bits):
    c = codebook.lloyd_max_centroids(head_dim, bits)
    expected = scipy_lloyd_max(head_dim, bits)
    assert c.dtype == np.float64 and c.shape == (1 << bits,)
    np.testing.assert_allclose(c, expected, rtol=0, atol=1e-6)
    # Both solutions are converged far beyond the required tolerance.
    np.testing.assert_allclose(c, expected, rtol=1e-9, atol=0)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_symmetric_and_ascending(head_dim, bits):
    c = codebook.lloyd_max_centroids(head_dim, bits)
    assert np.all(np.diff(c) > 0)
    np.testing.assert_array_equal(c, -c[::-1])
    assert c[-1] < 1.0

    c32 = np.array(codebook.centroids(head_dim, bits))
    assert c32.dtype == np.float32
    np.testing.assert_array_equal(c32, c.astype(np.float32))
    np.testing.assert_array_equal(c32, -c32[::-1])


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_centroid_condition(head_dim, bits):
    """Each centroid is the conditional mean of its cell (adaptive quadrature)."""
    c = codebook.lloyd_max_centroids(head_dim, bits)
    edges = np.concatenate([[-1.0], 0.5 * (c[:-1] + c[1:]), [1.0]])
    for k in range(c.size):
        lo, hi = edges[k], edges[k + 1]
        opts = dict(epsabs=0.0, epsrel=1e-12, limit=200)
        mass, _ = integrate.quad(density, lo, hi, args=(head_dim,), **opts)
        first, _ = integrate.quad(lambda t: t * density(t, head_dim), lo, hi, **opts)
        assert first / mass == pytest.approx(c[k], rel=1e-9)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_distortion(head_dim, bits):
    c = codebook.lloyd_max_centroids(head_dim, bits)
    distortion = codebook.lloyd_max_distortion(head_dim, bits)
    assert isinstance(distortion, float)

    # Against adaptive quadrature of the squared error.
    edges = np.concatenate([[-1.0], 0.5 * (c[:-1] + c[1:]), [1.0]])
    opts = dict(epsabs=0.0, epsrel=1e-12, limit=200)
    total, _ = integrate.quad(density, -1.0, 1.0, args=(head_dim,), **opts)
    error = sum(
        integrate.quad(lambda t: (t - ck) ** 2 * density(t, head_dim), lo, hi, **opts)[0]
        for ck, lo, hi in zip(c, edges[:-1], edges[1:])
    )
    assert distortion == pytest.approx(error / total, rel=1e-9)

    # Against sampling: quantize coordinates of actual random unit vectors.
    rng = np.random.default_rng(1000 * head_dim + bits)
    u = random_unit_vectors(2**19 // head_dim, head_dim, rng)
    codes = np.searchsorted(0.5 * (c[:-1] + c[1:]), u)
    sampled = np.mean((u - c[codes]) ** 2)
    assert sampled == pytest.approx(distortion, rel=0.02)


@pytest.mark.parametrize("bits", BITS)
def test_approaches_gaussian_lloyd_max(bits):
    head_dim = 16384
    scaled = math.sqrt(head_dim) * codebook.lloyd_max_centroids(head_dim, bits)
    half = 1 << (bits - 1)
    np.testing.assert_allclose(scaled[half:], GAUSSIAN_CENTROIDS[bits], atol=2e-3)
    scaled_distortion = head_dim * codebook.lloyd_max_distortion(head_dim, bits)
    assert scaled_distortion == pytest.approx(GAUSSIAN_DISTORTION[bits], rel=5e-3)


def test_distortion_decreases_with_bits():
    for head_dim in HEAD_DIMS:
        values = [codebook.lloyd_max_distortion(head_dim, b) for b in BITS]
        assert values[0] > values[1] > values[2] > 0


def test_cached_result_is_not_shared():
    first = codebook.lloyd_max_centroids(128, 3)
    first[:] = 0.0
    second = codebook.lloyd_max_centroids(128, 3)
    assert np.all(np.diff(second) > 0)


def test_boundaries_f32():
    c32 = np.array(codebook.centroids(128, 4))
    t = codebook.boundaries_f32(c32)
    assert t.dtype == np.float32 and t.shape == (15,)
    assert np.all(c32[:-1] < t) and np.all(t < c32[1:])
    for k in range(15):
        assert t[k] == (c32[k] + c32[k + 1]) * np.float32(0.5)
    # float64 input is rounded to the stored float32 centroids first.
    c64 = codebook.lloyd_max_centroids(128, 4)
    np.testing.assert_array_equal(codebook.boundaries_f32(c64), t)


@pytest.mark.parametrize("bits", [0, 1, 5, 8, -3])
def test_bad_bits(bits):
    with pytest.raises(ValueError, match=rf"^\[turboquant_mlx\.codebook\].*{bits}"):
        codebook.lloyd_max_centroids(128, bits)
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.codebook\]"):
        codebook.centroids(128, bits)
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.codebook\]"):
        codebook.lloyd_max_distortion(128, bits)


@pytest.mark.parametrize("head_dim", [7, 3, 0, -64])
def test_bad_head_dim(head_dim):
    with pytest.raises(ValueError, match=rf"^\[turboquant_mlx\.codebook\].*{head_dim}"):
        codebook.lloyd_max_centroids(head_dim, 3)
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.codebook\]"):
        codebook.lloyd_max_distortion(head_dim, 3)


def test_bad_boundaries_input():
    with pytest.raises(ValueError, match=r"^\[turboquant_mlx\.codebook\]"):
        codebook.boundaries_f32(np.zeros((1,), np.float32))
