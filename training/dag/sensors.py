"""The DAG's inputs: sensors (named column groups with costs) and X, y, checked; the constants
shared by Alg. 2, the filter-tree policies and the estimator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from service.types import FloatArray

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]

#: Most sensors for the exhaustive DAG (``n_subsets=None``): 2**8 = 256 states.
MAX_EXHAUSTIVE_SENSORS = 8
#: Most Alg.-2 subsets (plus the full set: at most 2**13 group bitmasks).
MAX_SUBSETS = 12
#: Action index of "stop and classify" at every state.
STOP = 0
#: Cost differences at or below this are ties (zero importance weight).
_TIE = 1e-12
#: Slack when comparing an acquisition cost with the remaining budget.
_BUDGET_SLACK = 1e-9
_MAX_ITER = 1000


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _validate_sensors(
    sensors: Mapping[str, Sequence[int]], costs: Mapping[str, float] | None
) -> tuple[list[str], list[list[int]], FloatArray]:
    """Names, columns per sensor and costs (declaration order), or ValueError."""
    if not isinstance(sensors, Mapping) or len(sensors) == 0:
        raise ValueError(
            f"sensors must be a non-empty mapping name -> column indices, got {sensors!r}"
        )
    names: list[str] = []
    columns: list[list[int]] = []
    seen: dict[int, str] = {}
    for name, cols in sensors.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"sensor names must be non-empty strings, got {name!r}")
        try:
            col_list = [int(c) for c in cols]
        except (TypeError, ValueError):
            raise ValueError(
                f"sensor {name!r}: columns must be a sequence of ints, got {cols!r}"
            ) from None
        if not col_list:
            raise ValueError(f"sensor {name!r} has no columns; every sensor needs at least one")
        for c in col_list:
            if c < 0:
                raise ValueError(f"sensor {name!r}: column indices must be >= 0, got {c}")
            if c in seen:
                raise ValueError(
                    f"column {c} belongs to both sensor {seen[c]!r} and sensor {name!r}; "
                    "sensors must not share columns"
                )
            seen[c] = name
        names.append(name)
        columns.append(col_list)
    if costs is None:
        cost_arr = np.ones(len(names))
    else:
        missing = [n for n in names if n not in costs]
        extra = [k for k in costs if k not in sensors]
        if missing or extra:
            raise ValueError(
                f"costs must have exactly the sensors' names; missing {missing}, unknown {extra}"
            )
        cost_arr = np.array([float(costs[n]) for n in names])
        bad = [
            (n, float(costs[n])) for n in names if not (math.isfinite(costs[n]) and costs[n] >= 0)
        ]
        if bad:
            raise ValueError(f"sensor costs must be finite and >= 0, got {bad}")
    return names, columns, cost_arr


def _validate_xy(
    X: Any, y: Any, columns: list[list[int]], folds: int
) -> tuple[FloatArray, IntArray, npt.NDArray[Any]]:
    """Float X, encoded y (0..L-1) and the classes, or ValueError."""
    Xa = np.asarray(X, dtype=np.float64)
    if Xa.ndim != 2:
        raise ValueError(f"X must be 2-D (rows x columns), got shape {Xa.shape}")
    ya = np.asarray(y)
    if ya.ndim != 1 or ya.shape[0] != Xa.shape[0]:
        raise ValueError(
            f"y must be 1-D with one label per row of X ({Xa.shape[0]}), got shape {ya.shape}"
        )
    if not np.all(np.isfinite(Xa)):
        raise ValueError("X contains NaN or infinite values; all entries must be finite")
    max_col = max(max(c) for c in columns)
    if max_col >= Xa.shape[1]:
        raise ValueError(f"sensors reference column {max_col} but X has only {Xa.shape[1]} columns")
    classes, y_enc = np.unique(ya, return_inverse=True)
    if classes.size < 2:
        raise ValueError(f"y must hold at least 2 classes, got {classes.size}")
    smallest = int(np.bincount(y_enc).min())
    if smallest < folds:
        raise ValueError(
            f"every class needs at least folds={folds} rows for the out-of-fold losses; "
            f"the smallest class has {smallest}"
        )
    return Xa, y_enc.astype(np.int64), classes


def _popcount(mask: int) -> int:
    return bin(mask).count("1")
