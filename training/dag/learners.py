"""The DAG's learners: what the classifier bank and the filter-tree nodes are made of.

* ``linear``: ``StandardScaler + LogisticRegression(C)`` (the original DAG learner).
* ``poly2`` / ``poly3``: the paper's polynomial expansion, ``StandardScaler +
  PolynomialFeatures(degree) + StandardScaler + LogisticRegression(C)``. The bank exports with
  skl2onnx (it converts the whole pipeline); a policy node is trained on the columns
  standardised by the *model's* global mean and scale (so that one ONNX graph can expand every
  state's columns once) and exports its monomials' powers, weights and bias.
* ``gbrt``: LightGBM gradient-boosted trees (:class:`Float32Lgbm`). Inputs are rounded to
  float32 before fitting and predicting, so every value the trees ever see is a float32; the
  exported thresholds are the largest float32 <= each fitted (double) threshold, so for every
  float32 input — in particular every training value — the exported tree takes exactly the
  fitted tree's branch (:func:`lgbm_trees`). The service feeds float32, so parity is exact up
  to the float32 sum of the leaf values.
"""

from __future__ import annotations

from typing import Any

import lightgbm as lgb
import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import PolynomialFeatures, StandardScaler

from service.types import FloatArray
from training.dag.sensors import _MAX_ITER

#: The learners a DAG's bank and policies may use.
LEARNERS = ("linear", "poly2", "poly3", "gbrt")


def check_learner(value: Any, name: str) -> str:
    if value not in LEARNERS:
        raise ValueError(
            f"{name} must be one of {', '.join(LEARNERS)}, got {value!r}; "
            "choose e.g. learner: gbrt in the spec"
        )
    return str(value)


def poly_degree(learner: str) -> int:
    """2 or 3 for the polynomial learners, 0 otherwise."""
    return {"poly2": 2, "poly3": 3}.get(learner, 0)


class Float32Lgbm(ClassifierMixin, BaseEstimator):  # type: ignore[misc]
    """``lightgbm.LGBMClassifier`` whose inputs are rounded to float32 (fit and predict), so the
    fitted trees can be exported with float32 thresholds that decide every input alike.

    ``n_estimators``, ``learning_rate``, ``num_leaves``, ``min_child_samples`` and
    ``random_state`` are LightGBM's; one thread, no output."""

    def __init__(
        self,
        *,
        n_estimators: int = 100,
        learning_rate: float = 0.1,
        num_leaves: int = 31,
        min_child_samples: int = 20,
        random_state: int = 0,
    ) -> None:
        self.n_estimators = n_estimators
        self.learning_rate = learning_rate
        self.num_leaves = num_leaves
        self.min_child_samples = min_child_samples
        self.random_state = random_state

    @staticmethod
    def _f32(X: Any) -> FloatArray:
        return np.asarray(np.asarray(X, dtype=np.float32), dtype=np.float64)

    def fit(self, X: Any, y: Any, sample_weight: Any = None) -> Float32Lgbm:
        self.model_ = lgb.LGBMClassifier(
            n_estimators=self.n_estimators,
            learning_rate=self.learning_rate,
            num_leaves=self.num_leaves,
            min_child_samples=self.min_child_samples,
            random_state=self.random_state,
            n_jobs=1,
            verbose=-1,
        )
        self.model_.fit(self._f32(X), y, sample_weight=sample_weight)
        self.classes_ = self.model_.classes_
        self.n_features_in_ = int(np.asarray(X).shape[1])
        return self

    def predict_proba(self, X: Any) -> FloatArray:
        return np.asarray(self.model_.predict_proba(self._f32(X)), dtype=np.float64)

    def predict(self, X: Any) -> Any:
        return self.classes_[np.argmax(self.predict_proba(X), axis=1)]

    def raw_score(self, X: Any) -> FloatArray:
        """LightGBM's raw margins: (N,) for two classes, (N, classes) otherwise."""
        return np.asarray(self.model_.predict(self._f32(X), raw_score=True), dtype=np.float64)


def make_classifier(
    learner: str, C: float, random_state: int, *, standardised: bool = False
) -> Any:
    """An unfitted classifier of ``learner``. ``standardised``: a filter-tree node, whose inputs
    are already standardised by a fixed transform for the polynomial learners (the first scaler
    is left out); its trees are fewer and smaller (50 trees of 15 leaves, against 100 of 31 in
    the bank), since every cost scale refits them."""
    if learner == "gbrt":
        if standardised:  # a filter-tree node: a binary decision, refit per cost scale
            return Float32Lgbm(n_estimators=50, num_leaves=15, random_state=random_state)
        return Float32Lgbm(n_estimators=100, random_state=random_state)
    lr = LogisticRegression(C=C, max_iter=_MAX_ITER, random_state=random_state)
    degree = poly_degree(learner)
    if degree == 0:
        return Pipeline([("scale", StandardScaler()), ("clf", lr)])
    steps: list[tuple[str, Any]] = [] if standardised else [("scale", StandardScaler())]
    steps += [
        ("poly", PolynomialFeatures(degree=degree, include_bias=False)),
        ("scale_poly", StandardScaler()),
        ("clf", lr),
    ]
    return Pipeline(steps)


def fit_classifier(est: Any, X: FloatArray, y: Any, sample_weight: Any = None) -> Any:
    """Fit a :func:`make_classifier` estimator (the weights go to its final step)."""
    if sample_weight is None:
        return est.fit(X, y)
    if isinstance(est, Pipeline):
        return est.fit(X, y, clf__sample_weight=sample_weight)
    return est.fit(X, y, sample_weight=sample_weight)


# --------------------------------------------------------------------------------------------
# Trees as arrays
# --------------------------------------------------------------------------------------------


def f32_floor(value: float) -> float:
    """The largest float32 <= ``value`` (as a Python float)."""
    v32 = np.float32(value)
    if float(v32) > value:
        v32 = np.nextafter(v32, np.float32(-np.inf))
    return float(v32)


def lgbm_trees(est: Float32Lgbm) -> list[dict[str, Any]]:
    """The fitted booster's trees as flat arrays, in booster order: per tree ``feature``,
    ``threshold`` (float32, rounded down), ``left``, ``right`` (node indices; -1 at leaves) and
    ``value`` (leaf values, 0 at internal nodes), root first. A row goes left iff
    ``float32(x[feature]) <= threshold``."""
    dump = est.model_.booster_.dump_model()
    return [_flatten(info["tree_structure"]) for info in dump["tree_info"]]


def _flatten(root: dict[str, Any]) -> dict[str, Any]:
    """One dumped LightGBM tree as the arrays of :func:`lgbm_trees` (pre-order)."""
    tree: dict[str, list[Any]] = {k: [] for k in ("feature", "threshold", "left", "right", "value")}

    def add(node: dict[str, Any]) -> int:
        idx = len(tree["feature"])
        for key, empty in (("feature", 0), ("threshold", 0.0), ("left", -1), ("right", -1)):
            tree[key].append(empty)
        tree["value"].append(0.0)
        if "leaf_value" in node or "split_feature" not in node:
            tree["value"][idx] = float(node.get("leaf_value", 0.0))
            return idx
        if node.get("decision_type", "<=") != "<=":
            raise ValueError(
                f"LightGBM split {node.get('decision_type')!r} cannot be exported; "
                "only numerical '<=' splits are supported"
            )
        tree["feature"][idx] = int(node["split_feature"])
        tree["threshold"][idx] = f32_floor(float(node["threshold"]))
        tree["left"][idx] = add(node["left_child"])
        tree["right"][idx] = add(node["right_child"])
        return idx

    add(root)
    return tree


def tree_scores(trees: list[dict[str, Any]], X: Any, n_outputs: int) -> FloatArray:
    """Sum of leaf values per output (tree i feeds output ``i % n_outputs``) for rows ``X``
    compared in float32, from the arrays of :func:`lgbm_trees` only (pure numpy)."""
    x32 = np.asarray(X, dtype=np.float32)
    n = x32.shape[0]
    out = np.zeros((n, n_outputs))
    rows = np.arange(n)
    for i, tree in enumerate(trees):
        feat = np.asarray(tree["feature"], dtype=np.int64)
        thr = np.asarray(tree["threshold"], dtype=np.float32)
        left = np.asarray(tree["left"], dtype=np.int64)
        right = np.asarray(tree["right"], dtype=np.int64)
        value = np.asarray(tree["value"], dtype=np.float64)
        node = np.zeros(n, dtype=np.int64)
        while True:
            inner = left[node] >= 0
            if not inner.any():
                break
            r = rows[inner]
            nd = node[inner]
            go_left = x32[r, feat[nd]] <= thr[nd]
            node[r] = np.where(go_left, left[nd], right[nd])
        out[:, i % n_outputs] += value[node]
    return out
