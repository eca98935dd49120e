"""The reference model f0, tuned: gradient boosting on all features with a small grid chosen
on validation rows (the paper's f0 is "the most accurate model regardless of cost"; an untuned
one makes every cost reduction look better than it is).

The grid is LightGBM's ``num_leaves`` x ``learning_rate``; the number of trees is chosen along
each fit (one fit per grid cell, scored at every checkpoint of ``trees``), so a 2 x 2 grid with
five checkpoints costs four fits. Ties go to the smaller model (fewer trees, then fewer leaves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightgbm as lgb
import numpy as np
from numpy.typing import ArrayLike

from training._validation import check_pos_int, check_X, check_Xy

__all__ = ["F0Choice", "tune_gbrt_f0"]


@dataclass(frozen=True)
class F0Choice:
    """The chosen LightGBM parameters, their validation accuracy, and every candidate's."""

    params: dict[str, Any]
    val_accuracy: float
    candidates: list[tuple[dict[str, Any], float]] = field(default_factory=list)

    def estimator(self) -> lgb.LGBMClassifier:
        """An unfitted classifier with the chosen parameters (fit it on the training rows)."""
        return lgb.LGBMClassifier(**self.params)

    def describe(self) -> str:
        p = self.params
        return (
            f"LightGBM, {p['n_estimators']} trees of {p['num_leaves']} leaves, learning rate "
            f"{p['learning_rate']:g} (validation accuracy {self.val_accuracy:.4f}, best of "
            f"{len(self.candidates)} candidates)"
        )


def tune_gbrt_f0(
    X: ArrayLike,
    y: ArrayLike,
    X_val: ArrayLike,
    y_val: ArrayLike,
    *,
    num_leaves: Sequence[int] = (15, 63),
    learning_rates: Sequence[float] = (0.05, 0.1),
    trees: Sequence[int] = (100, 200, 400, 800, 1200),
    random_state: int = 0,
) -> F0Choice:
    """Fit one LightGBM per (num_leaves, learning_rate) on (X, y) and keep the
    (num_leaves, learning_rate, trees) whose accuracy on (X_val, y_val) is highest."""
    Xa, classes, y_idx = check_Xy(X, y, "tune_gbrt_f0")
    Xv = check_X(X_val, Xa.shape[1], "tune_gbrt_f0 (validation rows)")
    yv = np.asarray(y_val)
    if yv.shape != (Xv.shape[0],):
        raise ValueError(
            f"y_val must be 1-D with one label per row of X_val ({Xv.shape[0]}), got shape "
            f"{yv.shape}"
        )
    if not (num_leaves and learning_rates and trees):
        raise ValueError("tune_gbrt_f0 needs at least one num_leaves, learning rate and tree count")
    for leaves in num_leaves:
        check_pos_int(leaves, "num_leaves", minimum=2)
    for t in trees:
        check_pos_int(t, "trees")
    checkpoints = sorted({int(t) for t in trees})
    candidates: list[tuple[dict[str, Any], float]] = []
    for leaves in sorted({int(v) for v in num_leaves}):
        for rate in sorted({float(r) for r in learning_rates}):
            params: dict[str, Any] = {
                "n_estimators": checkpoints[-1],
                "num_leaves": leaves,
                "learning_rate": rate,
                "random_state": random_state,
                "n_jobs": 1,
                "verbose": -1,
            }
            model = lgb.LGBMClassifier(**params).fit(Xa, y_idx)
            for t in checkpoints:
                pred = classes[np.asarray(model.predict(Xv, num_iteration=t), dtype=np.int64)]
                candidates.append(({**params, "n_estimators": t}, float(np.mean(pred == yv))))
    best = max(
        candidates,
        key=lambda c: (c[1], -c[0]["n_estimators"], -c[0]["num_leaves"]),
    )
    return F0Choice(best[0], best[1], candidates)
