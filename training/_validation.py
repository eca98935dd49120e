"""Parameter and data checks shared by the estimators of ``training``, worded as scikit-learn's:
what was found, what is required, and how to fix it.

The X, y estimators (ADAPT-LIN, L1, ADAPT-GBRT, the DAG) use the number, fraction and array
checks; the lattice methods (Poly-Dom, Greedy) the cost-polynomial and size-domain checks.

Every check raises ``TypeError`` for a value of the wrong kind and ``ValueError`` for a value of
the right kind out of range, and returns the value converted (``float``, ``int``, a float64
array), so that an estimator's ``fit`` reads ``p = check_fraction(self.p_full, "p_full")``.
:func:`check_fitted` is :func:`sklearn.utils.validation.check_is_fitted` raising
:class:`NotFittedError`, which is both scikit-learn's (a ``ValueError``/``AttributeError``) and a
``RuntimeError`` (what these estimators raised before they adopted the convention).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.sparse import issparse
from sklearn.exceptions import NotFittedError as _SklearnNotFitted
from sklearn.utils.multiclass import type_of_target
from sklearn.utils.validation import check_is_fitted

from service.types import FloatArray

IntArray = NDArray[np.int64]


class NotFittedError(_SklearnNotFitted, RuntimeError):  # type: ignore[misc]
    """An estimator used before ``fit``: scikit-learn's ``NotFittedError``, a ``RuntimeError``."""


def check_fitted(estimator: Any, attributes: str | list[str] | None = None) -> None:
    """Raise :class:`NotFittedError` unless ``estimator`` is fitted (its fitted attributes end
    with ``_``, or ``attributes`` are set)."""
    name = type(estimator).__name__
    try:
        check_is_fitted(estimator, attributes)
    except _SklearnNotFitted:
        raise NotFittedError(
            f"This {name} instance is not fitted yet; call 'fit' with appropriate arguments "
            "before using this estimator."
        ) from None


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_fraction(value: object, name: str) -> float:
    """A real number in [0, 1]."""
    if not _is_real(value):
        raise TypeError(
            f"{name} must be a real number in [0, 1], got {value!r}; "
            f"pass a float such as {name}=0.5"
        )
    v = float(value)  # type: ignore[arg-type]
    if not (0.0 <= v <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {v}; pass a fraction such as 0.5")
    return v


def check_nonneg(value: object, name: str) -> float:
    """A finite real number >= 0."""
    if not _is_real(value):
        raise TypeError(
            f"{name} must be a non-negative real number, got {value!r}; "
            f"pass a float such as {name}=0.0"
        )
    v = float(value)  # type: ignore[arg-type]
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{name} must be finite and >= 0, got {v}; pass a finite value >= 0")
    return v


def check_number(value: object, name: str, *, strict: bool = False) -> float:
    """A finite real number >= 0 (> 0 with ``strict``); ``ValueError`` for anything else."""
    bound = "> 0" if strict else ">= 0"
    ok = _is_real(value) and math.isfinite(float(value))  # type: ignore[arg-type]
    if not ok or not (float(value) > 0 if strict else float(value) >= 0):  # type: ignore[arg-type]
        example = "1.0" if strict else "0.0"
        raise ValueError(
            f"{name} must be a finite number {bound}, got {value!r}; "
            f"pass a number such as {name}={example}"
        )
    return float(value)  # type: ignore[arg-type]


def check_positive(value: object, name: str) -> float:
    """A finite real number > 0; ``ValueError`` for anything else."""
    return check_number(value, name, strict=True)


def check_pos_int(value: object, name: str, minimum: int = 1) -> int:
    """An integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an integer >= {minimum}, got {value!r}; "
            f"pass an int such as {name}={minimum}"
        )
    v = int(value)
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}; pass {name}={minimum} or more")
    return v


def check_X(
    X: ArrayLike, n_features: int | None = None, estimator: str = "the model"
) -> FloatArray:
    """A finite 2-D dense float array with rows (and ``n_features`` columns when given)."""
    if issparse(X):
        raise TypeError(
            f"{estimator} does not accept sparse input (found {type(X).__name__}); "
            "pass a dense array, e.g. X.toarray()"
        )
    raw = np.asarray(X)
    if np.iscomplexobj(raw):
        raise ValueError(
            "Complex data not supported: X holds complex numbers; pass their "
            "real part (X.real) or their magnitude (abs(X)) instead"
        )
    arr = np.asarray(raw, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(
            f"X must be 2-D (n_samples, n_features), got shape {arr.shape}; "
            "Reshape your data with X.reshape(-1, 1) if it has a single feature "
            "or X.reshape(1, -1) if it is a single sample"
        )
    if arr.shape[0] == 0:
        raise ValueError("X has no rows; at least one sample is required")
    if not np.all(np.isfinite(arr)):
        raise ValueError("X contains NaN or infinity; impute or drop those values first")
    if n_features is not None and arr.shape[1] != n_features:
        raise ValueError(
            f"X has {arr.shape[1]} features, but {estimator} is expecting "
            f"{n_features} features as input (the model was fitted with "
            f"{n_features}); pass the columns it was fitted on"
        )
    return arr


def check_Xy(
    X: ArrayLike, y: ArrayLike | None, estimator: str = "the model"
) -> tuple[FloatArray, NDArray[Any], IntArray]:
    """:func:`check_X`, and ``y`` 1-D class labels, one per row, at least two classes: returns
    ``(X, classes, y as class indices)``."""
    if y is None:
        raise ValueError(
            f"{estimator} requires y to be passed, but the target y is None; "
            "pass one class label per row of X"
        )
    Xa = check_X(X, estimator=estimator)
    ya = np.asarray(y)
    if ya.ndim != 1 or ya.shape[0] != Xa.shape[0]:
        raise ValueError(
            f"y must be 1-D with one label per row of X ({Xa.shape[0]}), got shape {ya.shape}"
        )
    if ya.dtype.kind == "f" and not np.all(np.isfinite(ya)):
        raise ValueError("Input y contains NaN or infinity; drop those rows or give them a label")
    if type_of_target(ya) == "continuous":
        raise ValueError(
            "Unknown label type: continuous. y holds non-integer numbers, a "
            "regression target; a classifier needs class labels (ints, strings)"
        )
    classes, y_idx = np.unique(ya, return_inverse=True)
    if classes.size < 2:
        raise ValueError(
            f"y must contain at least two classes, got {classes.size} class; "
            "a classifier needs examples of two labels or more"
        )
    return Xa, classes, y_idx.astype(np.int64)


def check_costs(costs: ArrayLike | None, n_features: int) -> FloatArray:
    """One finite cost >= 0 per feature (1.0 each when ``costs`` is None)."""
    if costs is None:
        return np.ones(n_features, dtype=np.float64)
    c = np.asarray(costs, dtype=np.float64).ravel()
    if c.shape[0] != n_features:
        raise ValueError(
            f"feature_costs has {c.shape[0]} entries, X has {n_features} features; "
            "pass one cost per column of X"
        )
    if not (np.all(np.isfinite(c)) and np.all(c >= 0.0)):
        raise ValueError(
            "feature_costs must be finite and >= 0; found "
            f"{c[~(np.isfinite(c) & (c >= 0))].tolist()}"
        )
    return c


def check_cost_polynomials(costs: ArrayLike, *, max_features: int | None = None) -> FloatArray:
    """The (n_features x degree+1) cost coefficients as floats, or a ValueError saying what
    was found and what is required."""
    arr = np.asarray(costs, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(
            f"costs has shape {arr.shape}; a 2-D (n_features x degree+1) array is required."
        )
    if max_features is not None and arr.shape[0] > max_features:
        raise ValueError(
            f"costs has {arr.shape[0]} features; at most {max_features} are supported."
        )
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(
            "costs contains negative or non-finite coefficients; finite coefficients >= 0 "
            "are required (costs must be non-negative and non-decreasing in size)."
        )
    return arr


def check_size_domain(size_domain: Any) -> tuple[float, float]:
    """``(lo, hi)`` with finite 0 <= lo < hi, or a ValueError saying what was found."""
    try:
        lo, hi = (float(v) for v in size_domain)
    except (TypeError, ValueError):
        raise ValueError(
            f"size_domain={size_domain!r}; a pair (lo, hi) of numbers is required."
        ) from None
    if not (math.isfinite(lo) and math.isfinite(hi) and 0 <= lo < hi):
        raise ValueError(f"size_domain={size_domain!r}; finite 0 <= lo < hi is required.")
    return lo, hi
