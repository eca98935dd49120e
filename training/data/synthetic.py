"""Constructed data sets with known answers: the DAG's router problems (:mod:`training.dag`) and
the gating paper's Synthetic-2 (:func:`make_synthetic2`, :mod:`training.gating`).

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
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.types import FloatArray
from training._validation import IntArray, check_nonneg

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


# --------------------------------------------------------------------------------------------
# Synthetic-2
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Synthetic2:
    X: FloatArray
    y: IntArray
    cluster: IntArray


# cluster centres (feature 1 = horizontal x, feature 2 = vertical y) and labels
SYNTHETIC2_CENTRES: tuple[tuple[float, float], ...] = (
    (-4.0, 4.0),
    (0.0, 4.0),
    (0.0, 0.0),
    (0.0, -4.0),
)
SYNTHETIC2_LABELS: tuple[int, ...] = (1, 0, 1, 0)


def make_synthetic2(
    n_per_cluster: int | Sequence[int] = 100, *, std: float = 0.25, seed: int = 0
) -> Synthetic2:
    """The paper's Synthetic-2 (Fig. 3): four Gaussian clusters, two unit-cost features.

    The paper gives no coordinates; this layout has the properties its text states:

    * cluster 1 (left, top, class 1) is split from the rest by a *vertical* line (feature 1),
      and feature 1 is the first to enter the L1 path (|corr(x_1, y)| ≈ 0.58 > |corr(x_2, y)|
      ≈ 0.30), so the L1 baseline picks feature 1; with feature 1 alone f1 can only be sure of
      cluster 1, so its best full-accuracy system sends clusters 2-4 to f0: cost 1 + 3/4 = 1.75;
    * clusters 1, 2 (top) vs 3, 4 (bottom) are split by a *horizontal* line, and so are
      clusters 3 and 4: g and f1 on feature 2 alone send 1, 2 to f0 and classify 3, 4, which is
      the optimal adaptive system at full accuracy, cost 0.5·2 + 0.5·1 = 1.5.

    Clusters have equal size by default (the text says clusters 1 and 2 get more points, but the
    quoted costs 1.75 and 1.5 are those of equal clusters).
    """
    counts = (
        [int(n_per_cluster)] * 4
        if isinstance(n_per_cluster, int)
        else [int(c) for c in n_per_cluster]
    )
    if len(counts) != 4 or min(counts) < 1:
        raise ValueError("n_per_cluster must be a positive int or four positive ints")
    check_nonneg(std, "std")
    rng = np.random.default_rng(seed)
    xs, ys, cs = [], [], []
    for c, (centre, label, cnt) in enumerate(
        zip(SYNTHETIC2_CENTRES, SYNTHETIC2_LABELS, counts, strict=True)
    ):
        xs.append(rng.normal(loc=centre, scale=std, size=(cnt, 2)))
        ys.append(np.full(cnt, label, dtype=np.int64))
        cs.append(np.full(cnt, c, dtype=np.int64))
    return Synthetic2(np.vstack(xs), np.concatenate(ys), np.concatenate(cs))
