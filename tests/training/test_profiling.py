"""Cost profiling: timing extractors and fitting non-negative cost polynomials."""

from __future__ import annotations

import numpy as np
import pytest

from service.bundle import CostPolynomial
from service.extractors.base import Extractor
from service.extractors.builtin import HOG, IntensityHistogram, Thumbnail
from training.profiling import (
    fit_cost_polynomial,
    fit_profiles,
    profile_extractors,
    select_degree,
)

SIDES = [16, 32, 64, 96, 128, 192, 256, 384]
SIZES = [s * s for s in SIDES]


def _synthetic(
    coefficients: list[float], noise: float = 0.03, repeats: int = 30, seed: int = 0
) -> list[list[float]]:
    """Samples per size: true cost times (1 + |N(0, noise)|): timing noise only adds."""
    rng = np.random.default_rng(seed)
    out = []
    for n in SIZES:
        true = sum(c * n**i for i, c in enumerate(coefficients))
        out.append(list(true * (1 + np.abs(rng.normal(0, noise, repeats)))))
    return out


def test_recovers_linear_coefficients() -> None:
    fit = fit_cost_polynomial(SIZES, _synthetic([0.05, 2e-5]), quantile=0.5)
    assert len(fit.coefficients) == 2
    c0, c1 = fit.coefficients
    # median of |N(0, 0.03)| is ~0.02: the fit sits ~2 % above the true curve
    assert c0 == pytest.approx(0.05 * 1.02, rel=0.15)
    assert c1 == pytest.approx(2e-5 * 1.02, rel=0.05)
    assert fit.fit_error is not None and fit.fit_error < 0.02


def test_recovers_quadratic_coefficients() -> None:
    fit = fit_cost_polynomial(SIZES, _synthetic([0.1, 1e-5, 3e-10]), quantile=0.5)
    assert len(fit.coefficients) == 3
    c0, c1, c2 = fit.coefficients
    assert c2 == pytest.approx(3e-10 * 1.02, rel=0.1)
    assert c1 == pytest.approx(1e-5 * 1.02, rel=0.25)
    assert c0 == pytest.approx(0.1 * 1.02, rel=0.25)


def test_degree_selection() -> None:
    assert len(fit_cost_polynomial(SIZES, _synthetic([0.3])).coefficients) == 1
    assert len(fit_cost_polynomial(SIZES, _synthetic([0.01, 1e-5], seed=1)).coefficients) == 2
    quadratic = fit_cost_polynomial(SIZES, _synthetic([0.01, 1e-6, 1e-10], seed=2))
    assert len(quadratic.coefficients) == 3
    capped = fit_cost_polynomial(SIZES, _synthetic([0.01, 1e-6, 1e-10]), max_degree=1)
    assert len(capped.coefficients) == 2
    assert select_degree([0.5, 0.031, 0.03]) == 1
    assert select_degree([0.5, 0.2, 0.03]) == 2
    assert select_degree([0.01, 0.009]) == 0


def test_coefficients_non_negative_even_when_data_decreases() -> None:
    times = [[10.0 - i] for i in range(len(SIZES))]
    fit = fit_cost_polynomial(SIZES, times)
    assert all(c >= 0 for c in fit.coefficients)
    CostPolynomial.model_validate(fit.model_dump())  # passes the bundle validator


def test_quantile_is_respected() -> None:
    samples = _synthetic([0.2, 1e-5], noise=0.1, repeats=200, seed=5)
    high = fit_cost_polynomial(SIZES, samples, quantile=0.95)
    low = fit_cost_polynomial(SIZES, samples, quantile=0.5)
    assert high.quantile == 0.95 and low.quantile == 0.5
    below = [np.mean(np.asarray(s) <= high(n)) for n, s in zip(SIZES, samples, strict=True)]
    assert 0.85 <= float(np.mean(below)) <= 1.0
    assert all(high(n) > low(n) for n in SIZES)
    assert high.profiled_sizes == SIZES


def test_flat_samples_with_repeated_sizes() -> None:
    sizes = [n for n in SIZES for _ in range(3)]
    times = [1.0 + 1e-4 * n for n in sizes]
    fit = fit_cost_polynomial(sizes, times)
    assert fit.profiled_sizes == SIZES
    assert fit(SIZES[-1]) == pytest.approx(1.0 + 1e-4 * SIZES[-1], rel=1e-6)


def test_single_size_fits_a_constant() -> None:
    fit = fit_cost_polynomial([1024], [[1.0, 2.0, 3.0]], quantile=0.5)
    assert fit.coefficients == [pytest.approx(2.0)]


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        fit_cost_polynomial([1, 2], [[1.0]])
    with pytest.raises(ValueError):
        fit_cost_polynomial([1, 2], [[1.0], []])
    with pytest.raises(ValueError):
        fit_cost_polynomial([1], [[1.0]], quantile=1.5)


def test_profile_real_extractors() -> None:
    extractors: list[Extractor] = [Thumbnail(), IntensityHistogram(), HOG()]
    timings = profile_extractors(extractors, [16, 64, 128], repeats=3, rng=0)
    assert set(timings) == {"thumbnail", "histogram", "hog"}
    for by_n in timings.values():
        assert sorted(by_n) == [256, 4096, 16384]
        assert all(len(t) == 3 and min(t) > 0 for t in by_n.values())
    fits = fit_profiles(timings)
    for fit in fits.values():
        assert all(c >= 0 for c in fit.coefficients)
        assert fit.profiled_sizes == [256, 4096, 16384]


def test_profile_with_progress_bar() -> None:
    timings = profile_extractors({"t": Thumbnail()}, [8], repeats=2, progress=True)
    assert len(timings["t"][64]) == 2


def test_profile_interleaved_and_repeated_sides() -> None:
    timings = profile_extractors(
        [Thumbnail(), IntensityHistogram()], [8, 16, 8], repeats=2, interleave=True, warmup=0
    )
    assert {n: len(t) for n, t in timings["histogram"].items()} == {64: 4, 256: 2}
    with pytest.raises(ValueError):
        profile_extractors([Thumbnail(), Thumbnail()], [8])
    with pytest.raises(ValueError):
        profile_extractors([Thumbnail()], [8], repeats=0)


def test_envelope_covers_every_profiled_quantile_tightly() -> None:
    samples = _synthetic([0.05, 2e-5], noise=0.1, seed=4)
    samples[1] = [t * 1.6 for t in samples[1]]  # one size with a timing hiccup
    fit = fit_cost_polynomial(SIZES, samples, quantile=0.95)
    loose = fit_cost_polynomial(SIZES, samples, quantile=0.95, envelope=False)
    for n, times in zip(SIZES, samples, strict=True):
        assert fit(n) >= float(np.quantile(times, 0.95)) * (1 - 1e-9)
    below = sum(loose(n) < float(np.quantile(t, 0.95)) for n, t in zip(SIZES, samples, strict=True))
    assert below > 0, "the least-squares curve undershoots somewhere: the envelope matters"
    # tight: at the largest size, no more than a few % above the measured quantile
    assert fit(SIZES[-1]) <= 1.05 * float(np.quantile(samples[-1], 0.95))
