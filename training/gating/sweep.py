"""The gating sweep (paper 001): fit every configuration of a grid on the training rows, score
it on validation (and test) rows, keep the Pareto set of (cost, accuracy) operating points.
The ONNX export of a point is :mod:`training.export.gating`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from service.strategies.base import pareto as service_pareto
from service.types import FloatArray
from training.executor import INLINE, Executor
from training.export.gating import Gated
from training.gating import AdaptGbrt, AdaptLin, FittedF0, L1Baseline

G = TypeVar("G", AdaptLin, L1Baseline, AdaptGbrt)


# --------------------------------------------------------------------------------------------
# sweep and Pareto set
# --------------------------------------------------------------------------------------------


@dataclass
class SweepPoint:
    """One fitted configuration, scored on validation rows (and test rows when given)."""

    method: str
    p_full: float
    regularisation: float
    estimator: Gated
    val_accuracy: float
    val_cost: float
    val_fraction_full: float
    test_accuracy: float = math.nan
    test_cost: float = math.nan
    test_fraction_full: float = math.nan
    params: dict[str, float | str] = field(default_factory=dict)
    #: f1 alone (every item answered by the low-cost model, nothing routed)
    val_f1_accuracy: float = math.nan
    test_f1_accuracy: float = math.nan

    @property
    def id(self) -> str:
        extra = "".join(
            f"-{k}{v:g}" if isinstance(v, float) else f"-{v}"
            for k, v in sorted(self.params.items())
        )
        return f"{self.method}-p{self.p_full:g}-r{self.regularisation:g}{extra}"


@dataclass(frozen=True)
class Config:
    method: str  # adapt-gbrt | greedymiser | adapt-lin | l1
    p_full: float
    regularisation: float


METHODS = ("adapt-gbrt", "greedymiser", "adapt-lin", "l1")


def default_grid(methods: Iterable[str] = METHODS) -> list[Config]:
    """The (method, P_full, γ/λ/C) grid swept by default."""
    grid: list[Config] = []
    for method in methods:
        if method == "adapt-gbrt":
            grid += [
                Config(method, p, lam)
                for p in (0.1, 0.3, 0.5)
                for lam in (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
            ]
        elif method == "greedymiser":
            grid += [Config(method, 0.0, lam) for lam in (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)]
        elif method == "adapt-lin":
            grid += [
                Config(method, p, g) for p in (0.2, 0.4, 0.6) for g in (0.003, 0.01, 0.03, 0.1)
            ]
        elif method == "l1":  # regularisation = C; the gate threshold is swept after the fit
            grid += [Config(method, 0.0, c) for c in (0.003, 0.01, 0.03, 0.1, 1.0)]
        else:
            raise ValueError(f"unknown gating method {method!r}; known: {list(METHODS)}")
    return grid


L1_THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
ROUTE_RULES = ("zero", "expected")
#: Fractions of the validation rows the gate of a fitted ADAPT-GBRT / ADAPT-LIN system is set
#: to route (rule "value": the threshold on g is chosen on validation rows, no refit). The
#: paper's g > 0 rule routes what the soft targets q make of P_full, often next to nothing;
#: these points make the gate's ranking of items usable at every routed fraction.
ROUTED_FRACTIONS = (0.05, 0.1, 0.2, 0.3, 0.5)


def fit_config(
    config: Config,
    X: FloatArray,
    y: npt.NDArray[Any],
    *,
    costs: FloatArray,
    f0: FittedF0,
    standardize: bool = True,
    gbrt_params: Mapping[str, Any] | None = None,
    random_state: int = 0,
) -> Gated:
    """Fit one configuration of the grid (the shared f0 is not refitted); ``gbrt_params``
    (e.g. ``n_rounds``, ``num_leaves``) go to ADAPT-GBRT and GreedyMiser."""
    if config.method in ("adapt-gbrt", "greedymiser"):
        p_full = 0.0 if config.method == "greedymiser" else config.p_full  # by definition
        return AdaptGbrt(
            p_full=p_full,
            lam=config.regularisation,
            feature_costs=costs,
            f0=f0,
            random_state=random_state,
            **dict(gbrt_params or {}),
        ).fit(X, y)
    if config.method == "adapt-lin":
        return AdaptLin(
            p_full=config.p_full,
            gamma=config.regularisation,
            feature_costs=costs,
            f0=f0,
            # One start: it routes what P_full allows, and the grid's P_full and γ give the
            # variety. On letter binary a second start changed 1 of the 12 default
            # configurations (in the 4th digit) and took 66 s instead of 30 s.
            n_init=1,
            standardize=standardize,
            random_state=random_state,
        ).fit(X, y)
    if config.method == "l1":
        return L1Baseline(
            C=config.regularisation, feature_costs=costs, f0=f0, random_state=random_state
        ).fit(X, y)
    raise ValueError(f"unknown gating method {config.method!r}; known: {list(METHODS)}")


def score(est: Gated, X: FloatArray, y: npt.NDArray[Any]) -> tuple[float, float, float]:
    """A system's accuracy, average feature cost and fraction routed on rows ``X``."""
    routed = est.route(X)
    return (
        float(np.mean(est.predict(X) == y)),
        float(np.mean(est.feature_cost(X))),
        float(np.mean(routed)),
    )


def _f1_accuracy(est: Gated, X: FloatArray, y: npt.NDArray[Any]) -> float:
    """Accuracy of the low-cost model f1 alone (the same system routing nothing)."""
    if isinstance(est, L1Baseline):  # routes where P(f1 correct) < gate_threshold
        alone: Gated = _with(est, gate_threshold=0.0)
    else:
        alone = _with(est, route_rule="value", route_threshold=math.inf)
    assert not np.any(alone.route(X))
    return float(np.mean(alone.predict(X) == y))


def threshold_for_fraction(scores: FloatArray, fraction: float) -> float:
    """A threshold t such that ``mean(scores > t)`` is as close to ``fraction`` as the ties in
    ``scores`` allow (on a tie, the higher threshold: fewer items routed). It lies midway
    between two distinct scores, so float32 inference of the gate does not flip the items
    that sit on it."""
    s = np.sort(np.asarray(scores, dtype=np.float64))
    finite = s[np.isfinite(s)]
    if finite.size == 0:
        return math.inf
    distinct = np.unique(finite)
    candidates = np.concatenate(
        [[distinct[0] - 1.0], (distinct[:-1] + distinct[1:]) / 2.0, [distinct[-1] + 1.0]]
    )
    routed = 1.0 - np.searchsorted(s, candidates, side="right") / s.size
    gap = np.abs(routed - float(fraction))
    return float(candidates[int(np.flatnonzero(gap == gap.min())[-1])])


def _fit_task(
    X: FloatArray,
    y: npt.NDArray[Any],
    costs: FloatArray,
    f0: FittedF0,
    standardize: bool,
    gbrt_params: Mapping[str, Any] | None,
    random_state: int,
    config: Config,
) -> Gated:
    """One configuration, where the executor runs it. The shared f0 is detached from the
    result (it would travel back once per configuration) and re-attached by :func:`sweep`."""
    est = fit_config(
        config,
        X,
        y,
        costs=costs,
        f0=f0,
        standardize=standardize,
        gbrt_params=gbrt_params,
        random_state=random_state,
    )
    if getattr(est, "f0_", None) is f0.model:
        est.f0_ = None
        est.f0_detached_ = True
    return est


def sweep(
    X: FloatArray,
    y: npt.NDArray[Any],
    X_val: FloatArray,
    y_val: npt.NDArray[Any],
    *,
    costs: FloatArray,
    f0: FittedF0,
    grid: Sequence[Config],
    X_test: FloatArray | None = None,
    y_test: npt.NDArray[Any] | None = None,
    standardize: bool = True,
    gbrt_params: Mapping[str, Any] | None = None,
    random_state: int = 0,
    executor: Executor = INLINE,
) -> list[SweepPoint]:
    """Fit every configuration (the fits run on ``executor``: inline, joblib or Ray; the
    data and f0 are shared once) and score it (L1: one point per gate threshold; ADAPT-LIN and
    ADAPT-GBRT: one per routing rule and one per fraction of ``ROUTED_FRACTIONS``, its
    threshold set on the validation rows)."""
    fitted = executor.map(
        _fit_task, list(grid), shared=(X, y, costs, f0, standardize, gbrt_params, random_state)
    )
    points: list[SweepPoint] = []
    for config, est in zip(grid, fitted, strict=True):
        if getattr(est, "f0_detached_", False):
            est.f0_ = f0.model
            del est.f0_detached_
        variants: list[tuple[Gated, dict[str, float | str]]] = [(est, {})]
        if isinstance(est, L1Baseline):
            variants = [(_with(est, gate_threshold=tau), {"t": tau}) for tau in L1_THRESHOLDS]
        elif est.p_full > 0.0:  # the routing rules of the same fit (no refit)
            variants = [(_with(est, route_rule=rule), {"rule": rule}) for rule in ROUTE_RULES]
            val_scores = est.gate_score(X_val)
            variants += [
                (
                    _with(
                        est,
                        route_rule="value",
                        route_threshold=threshold_for_fraction(val_scores, fraction),
                    ),
                    {"routed": fraction},
                )
                for fraction in ROUTED_FRACTIONS
            ]
        val_f1 = _f1_accuracy(est, X_val, y_val)
        test_f1 = math.nan
        if X_test is not None and y_test is not None:
            test_f1 = _f1_accuracy(est, X_test, y_test)
        for variant, extra in variants:
            acc, cost, frac = score(variant, X_val, y_val)
            point = SweepPoint(
                config.method,
                config.p_full,
                config.regularisation,
                variant,
                acc,
                cost,
                frac,
                params=extra,
                val_f1_accuracy=val_f1,
                test_f1_accuracy=test_f1,
            )
            if X_test is not None and y_test is not None:
                point.test_accuracy, point.test_cost, point.test_fraction_full = score(
                    variant, X_test, y_test
                )
            points.append(point)
    return points


def _with(est: G, **routing: Any) -> G:
    """The same fitted system with other routing parameters (no refit)."""
    out = copy.copy(est)
    for name, value in routing.items():
        setattr(out, name, value)
    return out


def pareto(points: Sequence[SweepPoint]) -> list[SweepPoint]:
    """The points no other point beats on validation (cheaper and at least as accurate):
    sorted by cost, accuracy strictly rising."""
    pts = list(points)
    # service's pareto breaks ties on the id: zero-padded positions keep the given order.
    kept = service_pareto((p.val_cost, p.val_accuracy, f"{i:09d}") for i, p in enumerate(pts))
    return [pts[int(key)] for _, _, key in kept]
