"""The non-linear extension of §5: the "boosting trick".

Gradient boosted regression trees (squared loss, T limited-depth CART trees) map x to
φ(x) = [h_1(x), …, h_T(x)]; CSTC then learns linear nodes on φ. A node that gives tree t a
non-zero weight pays for evaluating it (e_t) and for every raw feature it reads (the usage
matrix F, d x T, F_αt = 1 when tree t splits on feature α); both are cached along a path
(eq. 20–22). In the estimator's terms these are cost groups over the columns of φ: one group
per raw feature α (the trees that read it, cost c_α) and one per tree (cost e_t); the relaxed
path cost of a group is the √ of the sum of its columns' squared weights, exactly eq. 22.

Binary classification and regression only (the trees regress the 0/1 label or the value);
the tree features are not exported to bundles yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.base import BaseEstimator, TransformerMixin
from sklearn.ensemble import GradientBoostingRegressor
from sklearn.utils.validation import check_is_fitted, validate_data

Array = npt.NDArray[np.float64]


class BoostedTreeFeatures(TransformerMixin, BaseEstimator):  # type: ignore[misc]
    """φ(x) = the T trees' outputs (each scaled by the learning rate, so Σ_t φ_t + init is
    the boosted prediction). ``usage_`` is F (d x T); ``tree_costs(e)`` the e_t."""

    def __init__(
        self,
        *,
        n_trees: int = 20,
        max_depth: int = 2,
        learning_rate: float = 0.3,
        random_state: int = 0,
    ) -> None:
        self.n_trees = n_trees
        self.max_depth = max_depth
        self.learning_rate = learning_rate
        self.random_state = random_state

    def fit(self, X: Any, y: Any) -> BoostedTreeFeatures:
        X, y = validate_data(self, X, y)
        labels = np.unique(y)
        if not np.issubdtype(np.asarray(y).dtype, np.number) or len(labels) > 2:
            if len(labels) > 2:
                raise ValueError(
                    f"BoostedTreeFeatures regresses one target; y has {len(labels)} classes. "
                    "Use it for regression or two classes (one-vs-rest for more)."
                )
            y = (np.asarray(y) == labels[-1]).astype(np.float64)
        self.model_ = GradientBoostingRegressor(
            n_estimators=self.n_trees,
            max_depth=self.max_depth,
            learning_rate=self.learning_rate,
            random_state=self.random_state,
        ).fit(X, np.asarray(y, dtype=np.float64))
        d = X.shape[1]
        trees = [est[0].tree_ for est in self.model_.estimators_]
        self.usage_ = np.zeros((d, len(trees)), dtype=bool)
        for t, tree in enumerate(trees):
            used = tree.feature[tree.feature >= 0]
            self.usage_[used, t] = True
        return self

    def transform(self, X: Any) -> Array:
        check_is_fitted(self, "model_")
        X = validate_data(self, X, reset=False)
        lr = self.model_.learning_rate
        cols = [lr * est[0].predict(X) for est in self.model_.estimators_]
        return np.column_stack(cols).astype(np.float64)

    def cost_groups(
        self, feature_costs: Sequence[float], tree_cost: float | Sequence[float]
    ) -> tuple[list[list[int]], list[float], list[str]]:
        """(groups over φ's columns, their costs, their names): one group per raw feature
        some tree reads (cost c_α) and one per tree (cost e_t)."""
        check_is_fitted(self, "usage_")
        d, T = self.usage_.shape
        if len(feature_costs) != d:
            raise ValueError(f"feature_costs has {len(feature_costs)} entries; X has {d} columns")
        e = np.broadcast_to(np.asarray(tree_cost, dtype=np.float64), (T,))
        groups: list[list[int]] = []
        costs: list[float] = []
        names: list[str] = []
        for a in range(d):
            trees = np.flatnonzero(self.usage_[a]).tolist()
            if trees:
                groups.append(trees)
                costs.append(float(feature_costs[a]))
                names.append(f"feature {a}")
        for t in range(T):
            groups.append([t])
            costs.append(float(e[t]))
            names.append(f"tree {t}")
        return groups, costs, names
