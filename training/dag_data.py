"""Constructed data sets for the sensor-acquisition DAG (:mod:`training.dag`).

:func:`make_router_data` is a problem whose optimal adaptive policy is known:

* sensor ``"r"`` (cost 1, one column) is a *router*: ``r ~ N(0, 1)``; its sign says which of the
  two expensive sensors carries the label;
* sensors ``"a"`` and ``"b"`` (cost 5 each, two columns each). When ``r > 0``, the first column
  of ``a`` is ``±signal + N(0, 1)`` (sign = label) and ``b`` is pure noise; when ``r < 0`` the
  roles swap. The second column of each expensive sensor is always pure noise (it only checks
  that multi-column sensors are mapped correctly).

The optimal adaptive policy acquires ``r`` and then exactly the right expensive sensor: average
cost 6 and error equal to the noise floor ``Φ(-signal)`` (≈ 0.6 % for the default
``signal = 2.5``). A fixed subset has to buy ``r``, ``a`` and ``b`` (cost 11) to reach that error
with a Bayes-optimal classifier; with the bank's *linear* classifiers no fixed subset reaches it at
all (a linear rule cannot switch on the sign of ``r``; the best, ``sign(a + b)``, errs
``Φ(-signal / √2)`` ≈ 3.9 %), while the DAG's linear classifier at state ``{r, a}`` only has to
be right on the rows the policy routes there.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

ROUTER_SENSORS: dict[str, list[int]] = {"r": [0], "a": [1, 2], "b": [3, 4]}
ROUTER_COSTS: dict[str, float] = {"r": 1.0, "a": 5.0, "b": 5.0}


def router_noise_floor(signal: float = 2.5) -> float:
    """Bayes error of the router problem given the right expensive sensor: ``Φ(-signal)``."""
    return 0.5 * math.erfc(signal / math.sqrt(2.0))


def make_router_data(
    n: int, *, signal: float = 2.5, seed: int = 0
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """``n`` rows of the router problem: ``X`` (n x 5, columns as in :data:`ROUTER_SENSORS`)
    and binary labels ``y`` in {0, 1}."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, size=n).astype(np.int64)
    sign = 2.0 * y - 1.0
    r = rng.normal(size=n)
    X = rng.normal(size=(n, 5))
    X[:, 0] = r
    route_a = r > 0
    X[route_a, 1] += signal * sign[route_a]
    X[~route_a, 3] += signal * sign[~route_a]
    return X, y


def make_informative_data(
    n: int, *, n_sensors: int = 10, n_informative: int = 3, seed: int = 0
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """``n`` rows, ``n_sensors`` single-column sensors; the label is the sign of the sum of the
    first ``n_informative`` columns plus a little noise, the other columns are pure noise."""
    if not 1 <= n_informative <= n_sensors:
        raise ValueError(
            f"n_informative must be in [1, n_sensors={n_sensors}], got {n_informative}"
        )
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, n_sensors))
    score = X[:, :n_informative].sum(axis=1) + 0.3 * rng.normal(size=n)
    y = (score > 0).astype(np.int64)
    return X, y


def make_many_sensor_data(
    n: int, *, n_sensors: int = 50, n_classes: int = 3, seed: int = 0, structure_seed: int = 0
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """``n`` rows, ``n_sensors`` single-column sensors, ``n_classes`` Gaussian classes whose
    means differ on a few columns each (different columns help different classes), so that
    several distinct small subsets are useful: a workload for Alg. 2. The class means depend
    only on ``structure_seed`` (train and validation sets share them); ``seed`` draws the rows."""
    structure = np.random.default_rng(structure_seed)
    means = np.zeros((n_classes, n_sensors))
    for k in range(n_classes):
        cols = structure.choice(n_sensors, size=max(2, n_sensors // 10), replace=False)
        means[k, cols] = structure.uniform(0.5, 1.5, size=cols.size)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, n_classes, size=n).astype(np.int64)
    X = means[y] + rng.normal(size=(n, n_sensors))
    return X, y
