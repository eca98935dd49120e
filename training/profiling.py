"""Extractor cost profiling: time each extractor at several sizes, fit c_f(n).

:func:`profile_extractors` times ``extract`` calls (``time.perf_counter``, ms, after a
warm-up, with the garbage collector paused) on square images of several sides.
:func:`fit_cost_polynomial` fits a polynomial in the pixel count ``n`` with
non-negative coefficients (NNLS) to a per-size quantile of those times, choosing the
smallest degree that fits about as well as the best one.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy.optimize import linprog, nnls

from service.allocator import DEFAULT_KEEP_MIB, keep_freed_memory
from service.bundle import CostPolynomial
from service.extractors.base import Extractor
from service.inference import limit_blas_threads

__all__ = [
    "Timings",
    "fit_cost_polynomial",
    "fit_profiles",
    "noise_image",
    "profile_extractors",
    "select_degree",
]

#: ``timings[extractor name][n] = [ms, ms, ...]`` (one entry per repeat).
Timings = dict[str, dict[int, list[float]]]

ImageFactory = Callable[[int, np.random.Generator], npt.NDArray[np.float32]]

#: A degree is accepted when its relative RMS error is within these of the best degree's.
DEGREE_REL_TOLERANCE = 0.25
DEGREE_ABS_TOLERANCE = 0.01


def noise_image(side: int, rng: np.random.Generator) -> npt.NDArray[np.float32]:
    """The default profiling item: a ``side`` x ``side`` uniform-noise image."""
    return rng.random((side, side), dtype=np.float32)


def _named(extractors: Mapping[str, Extractor] | Sequence[Extractor]) -> dict[str, Extractor]:
    if isinstance(extractors, Mapping):
        return dict(extractors)
    named: dict[str, Extractor] = {}
    for extractor in extractors:
        if extractor.name in named:
            raise ValueError(f"extractor {extractor.name!r} given twice")
        named[extractor.name] = extractor
    return named


def profile_extractors(
    extractors: Mapping[str, Extractor] | Sequence[Extractor],
    sides: Sequence[int],
    repeats: int = 5,
    rng: np.random.Generator | int | None = 0,
    progress: bool | Callable[[str, int, int], None] = False,
    *,
    warmup: int = 2,
    interleave: bool = False,
    image_factory: ImageFactory = noise_image,
    allocator_keep_mib: int = DEFAULT_KEEP_MIB,
) -> Timings:
    """Time every extractor's ``extract`` on one image per side, ``repeats`` times.

    Returns ``timings[name][n]`` (``n = side * side``) as a list of milliseconds; a
    side given twice adds its samples to the same ``n``. For each side the image is built
    once and each extractor is warmed up ``warmup`` times. By default an extractor's
    repeats run back to back (steady-state cost, the cleanest curves); ``interleave``
    runs the extractors round-robin instead, so each call finds caches disturbed by the
    others (closer to a request that computes several features, but noisier).
    ``progress``: True shows a ``rich`` progress bar; a callable is called as
    ``progress("profile", done, total)`` instead (e.g. ``StageProgress.update``).
    ``allocator_keep_mib``: the C allocator's thresholds, set as the service sets them
    (``service.allocator.keep_freed_memory``; 0: left as they are).
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    limit_blas_threads()  # as the service runs them
    # As the service runs them (service.allocator: large arrays reuse their pages; 0
    # leaves the allocator as it is, a threshold once raised stays for the process).
    keep_freed_memory(allocator_keep_mib)
    named = _named(extractors)
    generator = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    timings: Timings = {name: {} for name in named}
    total = len(sides) * len(named) * (repeats + warmup)

    bar: Any = None
    task: Any = None
    report = progress if callable(progress) else None
    done = 0
    if progress is True:
        from rich.progress import Progress

        bar = Progress(transient=False)
        bar.start()
        task = bar.add_task("profiling extractors", total=total)
    elif report is not None:
        report("profile", 0, total)

    def warm(name: str, extractor: Extractor, image: npt.NDArray[np.float32]) -> None:
        nonlocal done
        for _ in range(warmup):
            extractor.extract(image)
        done += warmup
        if bar is not None:
            bar.update(task, advance=warmup, description=f"{name} @ {image.shape[0]}px")
        elif report is not None:
            report("profile", done, total)

    def record(name: str, extractor: Extractor, image: npt.NDArray[np.float32], n: int) -> None:
        nonlocal done
        timings[name].setdefault(n, []).append(_time_ms(extractor, image))
        done += 1
        if bar is not None:
            bar.update(task, advance=1)
        elif report is not None:
            report("profile", done, total)

    was_enabled = gc.isenabled()
    try:
        for side in sides:
            image = image_factory(int(side), generator)
            n = int(image.shape[0] * image.shape[1])
            gc.collect()
            gc.disable()
            if interleave:
                for name, extractor in named.items():
                    warm(name, extractor, image)
                for _ in range(repeats):
                    for name, extractor in named.items():
                        record(name, extractor, image, n)
            else:
                for name, extractor in named.items():
                    warm(name, extractor, image)
                    for _ in range(repeats):
                        record(name, extractor, image, n)
            if was_enabled:
                gc.enable()
    finally:
        if was_enabled:
            gc.enable()
        if bar is not None:
            bar.stop()
    return timings


def _time_ms(extractor: Extractor, image: npt.NDArray[np.float32]) -> float:
    start = time.perf_counter()
    extractor.extract(image)
    return (time.perf_counter() - start) * 1000.0


def _group(
    sizes_n: Sequence[float], times_ms: Sequence[float] | Sequence[Sequence[float]]
) -> dict[float, list[float]]:
    """Samples per size from either one sequence per size or flat aligned samples."""
    if len(sizes_n) != len(times_ms):
        raise ValueError("sizes_n and times_ms must have the same length")
    grouped: dict[float, list[float]] = {}
    for n, t in zip(sizes_n, times_ms, strict=True):
        value: Any = t
        samples = [float(value)] if np.ndim(value) == 0 else [float(x) for x in np.ravel(value)]
        grouped.setdefault(float(n), []).extend(samples)
    if not grouped or any(not s for s in grouped.values()):
        raise ValueError("every size needs at least one timing")
    return grouped


def _fit_degree(
    n: npt.NDArray[np.float64], target: npt.NDArray[np.float64], degree: int
) -> tuple[list[float], float]:
    """NNLS fit of ``target`` by ``sum c_i n^i``, minimising the relative error.

    Columns are scaled to ``(n / n_max)^i`` and rows weighted by ``1 / target``; returns
    the power-basis coefficients and the relative RMS error.
    """
    scale = float(n.max())
    x = n / scale
    weights = 1.0 / np.maximum(target, 1e-9)
    design = np.vander(x, degree + 1, increasing=True)
    solution, _ = nnls(design * weights[:, None], target * weights)
    coefficients = [float(b) / scale**i for i, b in enumerate(solution)]
    predicted = design @ solution
    error = float(np.sqrt(np.mean(((predicted - target) * weights) ** 2)))
    return coefficients, error


def _envelope_degree(
    n: npt.NDArray[np.float64], target: npt.NDArray[np.float64], degree: int
) -> tuple[list[float], float]:
    """The tightest ``sum c_i n^i`` (``c_i >= 0``) on or above ``target`` at every size.

    A least-squares curve sits below the measured quantile at some sizes, and a budget
    planned on it is overrun there; the paper provisions for the worst case instead. This
    linear programme minimises the mean relative excess ``(c(n_k) - t_k) / t_k`` subject to
    ``c(n_k) >= t_k``. Returns the coefficients and the relative RMS error of the curve.
    """
    scale = float(n.max())
    design = np.vander(n / scale, degree + 1, increasing=True)
    weights = 1.0 / np.maximum(target, 1e-9)
    result = linprog(
        c=(design * weights[:, None]).sum(axis=0),
        A_ub=-design,
        b_ub=-target,
        bounds=[(0, None)] * (degree + 1),
        method="highs",
    )
    if not result.success:  # pragma: no cover - always feasible: a large constant fits
        return _fit_degree(n, target, degree)
    solution = np.asarray(result.x, dtype=np.float64)
    predicted = design @ solution
    error = float(np.sqrt(np.mean(((predicted - target) * weights) ** 2)))
    return [float(b) / scale**i for i, b in enumerate(solution)], error


def select_degree(
    errors: Sequence[float],
    rel_tolerance: float = DEGREE_REL_TOLERANCE,
    abs_tolerance: float = DEGREE_ABS_TOLERANCE,
) -> int:
    """The smallest degree whose error is within tolerance of the best degree's error."""
    best = min(errors)
    limit = max(best * (1.0 + rel_tolerance), best + abs_tolerance)
    return next(d for d, e in enumerate(errors) if e <= limit)


def fit_cost_polynomial(
    sizes_n: Sequence[float],
    times_ms: Sequence[float] | Sequence[Sequence[float]],
    quantile: float = 0.95,
    max_degree: int = 2,
    *,
    unit: str = "ms",
    min_degree: int = 0,
    envelope: bool = True,
) -> CostPolynomial:
    """Fit ``c(n) = sum_i c_i n^i`` (all ``c_i >= 0``) to the per-size ``quantile`` of times.

    ``times_ms`` is either one sequence of samples per entry of ``sizes_n`` or one sample
    per entry (sizes may repeat). With ``envelope`` the fitted curve is scaled up to lie
    on or above the quantile at every profiled size. Degrees ``min_degree..max_degree``
    (capped at the number of distinct sizes minus one) are fitted by NNLS on the relative
    error; the smallest degree whose relative RMS error is within tolerance of the best is kept (see
    :func:`select_degree`). The result records ``quantile``, ``fit_error`` and
    ``profiled_sizes``.
    """
    if not 0.0 <= quantile <= 1.0:
        raise ValueError("quantile must be in [0, 1]")
    grouped = _group(sizes_n, times_ms)
    sizes = sorted(grouped)
    if sizes[0] <= 0:
        raise ValueError("sizes must be > 0")
    n = np.asarray(sizes, dtype=np.float64)
    target = np.asarray(
        [float(np.quantile(np.asarray(grouped[s]), quantile)) for s in sizes], dtype=np.float64
    )
    if not np.all(np.isfinite(target)) or np.any(target < 0):
        raise ValueError("timings must be finite and >= 0")
    top = max(0, min(max_degree, len(sizes) - 1))
    low = max(0, min(min_degree, top))
    fits = [_fit_degree(n, target, d) for d in range(low, top + 1)]
    chosen = select_degree([err for _, err in fits])  # the shape, judged by least squares
    coefficients, error = fits[chosen]
    if envelope:
        coefficients, error = _envelope_degree(n, target, low + chosen)
    return CostPolynomial(
        coefficients=coefficients,
        unit=unit,
        quantile=quantile,
        fit_error=error if math.isfinite(error) else None,
        profiled_sizes=[round(s) for s in sizes],
    )


def fit_profiles(
    timings: Timings, quantile: float = 0.95, max_degree: int = 2
) -> dict[str, CostPolynomial]:
    """:func:`fit_cost_polynomial` for every extractor of a :func:`profile_extractors` result."""
    return {
        name: fit_cost_polynomial(list(by_n), list(by_n.values()), quantile, max_degree)
        for name, by_n in timings.items()
    }
