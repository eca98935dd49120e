"""The DAG's per-state policies: filter trees (Beygelzimer, Langford & Ravikumar 2007) of
importance-weighted binary logistic regressions, and the classifier bank's fit jobs.

Filter tree layout (what :meth:`DagClassifier.policy_nodes` exports)
-------------------------------------------------------------------
For k actions the tree is built over the action range [0, k): a range of one action is a leaf;
otherwise it is an internal node whose left child covers the first ``ceil(len / 2)`` actions and
whose right child the rest. Nodes are numbered in pre-order (node 0 is the root). Leaves are
``{"action": a}``; internal nodes are ``{"left": i, "right": j, "weights": w, "bias": b,
"constant": bool}`` meaning *go right iff* ``w · x_s + b > 0`` where ``x_s`` are the state's
columns in the state's column order and the StandardScaler is folded into ``w`` and ``b``. A
constant node has ``w = 0`` and ``b = +1`` (always right) or ``b = -1`` (always left).
Non-linear nodes (:mod:`training.dag.learners`) replace ``weights``/``bias``'s input:

* polynomial (``poly2``/``poly3``): ``"powers"`` (monomials x state columns), ``"mean"`` and
  ``"scale"`` (the model's standardisation of the state's columns): go right iff
  ``w · φ(z) + b > 0`` with ``z = (x_s - mean) / scale`` and ``φ_m(z) = Π_j z_j ** powers[m][j]``;
* trees (``gbrt``): ``"trees"`` (:func:`~training.dag.learners.lgbm_trees`, feature indices
  into the state's columns): go right iff the sum of the trees' leaf values is > 0.

Binary node training: each training row's winners of the left and right subtrees (under the
already trained lower nodes) are compared; label = 1 if the right winner is strictly cheaper,
sample weight = |cost difference|; rows with zero weight are dropped; a node whose weighted rows
hold a single class (or none) becomes a constant decision (left when there are none).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.base import clone
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_predict
from sklearn.preprocessing import PolynomialFeatures, StandardScaler

from service.types import FloatArray
from training.dag.learners import (
    Float32Lgbm,
    check_learner,
    fit_classifier,
    lgbm_trees,
    make_classifier,
    tree_scores,
)
from training.dag.sensors import (
    _TIE,
    IntArray,
)


@dataclass
class _Node:
    """A filter-tree node: a leaf (``action``) or an internal node with either a fitted binary
    pipeline (``estimator``) or a constant decision (``constant``: True = always right)."""

    action: int | None = None
    left: int = -1
    right: int = -1
    estimator: Any = None
    constant: bool | None = None


def _tree_layout(k: int) -> list[_Node]:
    """Filter-tree skeleton over actions 0..k-1 (pre-order, root first)."""
    nodes: list[_Node] = []

    def build(lo: int, hi: int) -> int:
        idx = len(nodes)
        nodes.append(_Node())
        if hi - lo == 1:
            nodes[idx].action = lo
            return idx
        mid = lo + (hi - lo + 1) // 2
        nodes[idx].left = build(lo, mid)
        nodes[idx].right = build(mid, hi)
        return idx

    build(0, k)
    return nodes


def _constant_path(nodes: list[_Node], action: int) -> None:
    """Make every internal node a constant so that the tree always returns ``action``."""

    def contains(idx: int) -> bool:
        node = nodes[idx]
        if node.action is not None:
            return node.action == action
        return contains(node.left) or contains(node.right)

    for node in nodes:
        if node.action is None:
            node.constant = contains(node.right)


@dataclass
class _Policy:
    """The trained policy of one state: ``actions[a]`` is None for stop, else a group index.
    ``mean``/``scale``: the fixed standardisation of the state's columns the nodes were
    trained on (polynomial learners), else None."""

    actions: list[int | None]
    nodes: list[_Node]
    mean: FloatArray | None = None
    scale: FloatArray | None = None

    def predict(self, Xs: FloatArray) -> IntArray:
        """Action index per row (uses the fitted sklearn pipelines)."""
        if self.mean is not None and self.scale is not None:
            Xs = (Xs - self.mean) / self.scale
        n = Xs.shape[0]
        node_of = np.zeros(n, dtype=np.int64)
        out = np.full(n, -1, dtype=np.int64)
        pending = np.arange(n)
        while pending.size:
            next_pending = []
            for idx in np.unique(node_of[pending]):
                rows = pending[node_of[pending] == idx]
                node = self.nodes[int(idx)]
                if node.action is not None:
                    out[rows] = node.action
                    continue
                if node.constant is not None:
                    go_right = np.full(rows.size, node.constant)
                else:
                    go_right = np.asarray(node.estimator.predict(Xs[rows])) == 1
                node_of[rows] = np.where(go_right, node.right, node.left)
                next_pending.append(rows)
            pending = np.concatenate(next_pending) if next_pending else np.zeros(0, np.int64)
        return out


@dataclass(frozen=True)
class _BankJob:
    """What every classifier-bank task reads (shared with the executor's workers once)."""

    X: FloatArray
    y: IntArray
    C: float
    folds: int
    random_state: int
    learner: str = "linear"


def _fit_bank_member(
    job: _BankJob, task: tuple[IntArray, Any]
) -> tuple[FloatArray, FloatArray, Any]:
    """One state's classifier on columns ``cols`` (``task = (cols, given)``): its
    out-of-fold 0/1 loss per training row (seeded stratified folds; the class of the largest
    out-of-fold probability), the out-of-fold :func:`confidence` per row and the classifier
    refit on every row. ``given``: a classifier already fitted on these columns of every
    training row (a tuned fixed subset), used as the refit, its out-of-fold predictions from
    clones of it; None: one of ``job.learner``."""
    cols, given = task
    Xs = job.X[:, cols]
    cv = StratifiedKFold(n_splits=job.folds, shuffle=True, random_state=job.random_state)
    est = (
        clone(given) if given is not None else make_classifier(job.learner, job.C, job.random_state)
    )
    oof = np.asarray(cross_val_predict(est, Xs, job.y, cv=cv, method="predict_proba"))
    loss = (np.argmax(oof, axis=1) != job.y).astype(np.float64)
    if given is not None:
        return loss, confidence(oof), given
    fitted = make_classifier(job.learner, job.C, job.random_state).fit(Xs, job.y)
    return loss, confidence(oof), fitted


#: What ``policy_inputs`` may be: the state's columns only, or also its classifier's confidence.
POLICY_INPUTS = ("features", "features+confidence")
#: Columns :func:`confidence` appends to a state's columns.
CONFIDENCE_COLUMNS = ("top1", "margin")


def check_policy_options(learner: Any, policy_learner: Any, policy_inputs: Any) -> None:
    """Raise ``ValueError`` naming the option when the learners or the policy inputs are not
    ones the DAG knows (shared by :class:`~training.dag.DagClassifier` and the bundle spec)."""
    check_learner(learner, "learner")
    if policy_learner is not None:
        check_learner(policy_learner, "policy_learner")
    if policy_inputs not in POLICY_INPUTS:
        raise ValueError(
            f"policy_inputs must be one of {', '.join(POLICY_INPUTS)}, got "
            f"{policy_inputs!r}; e.g. policy_inputs: features+confidence"
        )


def confidence(proba: Any) -> FloatArray:
    """Per row of class probabilities: the top probability and its margin over the second
    (rows x 2, :data:`CONFIDENCE_COLUMNS`); one class: (1, 1)."""
    p = np.asarray(proba, dtype=np.float64)
    if p.shape[1] < 2:
        return np.column_stack([p[:, 0], p[:, 0]])
    top2 = -np.sort(-p, axis=1)[:, :2]
    return np.column_stack([top2[:, 0], top2[:, 0] - top2[:, 1]])


def _train_filter_tree(
    Xs: FloatArray, costs: FloatArray, C: float, random_state: int, learner: str = "linear"
) -> list[_Node]:
    """Train a filter tree for the cost matrix ``costs`` (rows x k actions) on features Xs
    (already standardised by the model for the polynomial learners)."""
    n, k = costs.shape
    nodes = _tree_layout(k)
    rows = np.arange(n)

    def train(idx: int) -> IntArray:
        node = nodes[idx]
        if node.action is not None:
            return np.full(n, node.action, dtype=np.int64)
        win_l = train(node.left)
        win_r = train(node.right)
        c_l = costs[rows, win_l]
        c_r = costs[rows, win_r]
        weight = np.abs(c_l - c_r)
        label = (c_r < c_l).astype(np.int64)
        keep = weight > _TIE
        labels_kept = np.unique(label[keep])
        if labels_kept.size == 0:
            node.constant = False
        elif labels_kept.size == 1:
            node.constant = bool(labels_kept[0] == 1)
        else:
            est = make_classifier(learner, C, random_state, standardised=True)
            node.estimator = fit_classifier(est, Xs[keep], label[keep], weight[keep])
        if node.constant is not None:
            go_right = np.full(n, node.constant)
        else:
            go_right = np.asarray(node.estimator.predict(Xs)) == 1
        return np.where(go_right, win_r, win_l)

    train(0)
    return nodes


def _export_node(
    node: _Node, d: int, mean: FloatArray | None = None, scale: FloatArray | None = None
) -> dict[str, Any]:
    if node.action is not None:
        return {"action": node.action}
    if node.constant is not None:
        return {
            "left": node.left,
            "right": node.right,
            "weights": np.zeros(d),
            "bias": 1.0 if node.constant else -1.0,
            "constant": True,
        }
    if isinstance(node.estimator, Float32Lgbm):
        return {
            "left": node.left,
            "right": node.right,
            "trees": lgbm_trees(node.estimator),
            "constant": False,
        }
    if "poly" in node.estimator.named_steps:
        poly: PolynomialFeatures = node.estimator.named_steps["poly"]
        sp: StandardScaler = node.estimator.named_steps["scale_poly"]
        lr: LogisticRegression = node.estimator.named_steps["clf"]
        c = np.asarray(lr.coef_, dtype=np.float64)[0] / np.asarray(sp.scale_, dtype=np.float64)
        b = float(lr.intercept_[0]) - float(np.dot(c, np.asarray(sp.mean_, dtype=np.float64)))
        assert mean is not None and scale is not None
        return {
            "left": node.left,
            "right": node.right,
            "powers": np.asarray(poly.powers_, dtype=np.int64),
            "mean": np.asarray(mean, dtype=np.float64),
            "scale": np.asarray(scale, dtype=np.float64),
            "weights": c,
            "bias": b,
            "constant": False,
        }
    scaler: StandardScaler = node.estimator.named_steps["scale"]
    clf: LogisticRegression = node.estimator.named_steps["clf"]
    coef = np.asarray(clf.coef_, dtype=np.float64)[0]
    scale = np.asarray(scaler.scale_, dtype=np.float64)
    mean = np.asarray(scaler.mean_, dtype=np.float64)
    weights = coef / scale
    bias = float(np.asarray(clf.intercept_, dtype=np.float64)[0] - float(np.dot(weights, mean)))
    return {
        "left": node.left,
        "right": node.right,
        "weights": weights,
        "bias": bias,
        "constant": False,
    }


def decide_nodes(nodes: Sequence[Mapping[str, Any]], x: Any) -> Any:
    """Run exported filter-tree ``nodes`` (see module docstring) on the state's columns ``x``:
    a 1-D row gives an ``int`` action, a 2-D array gives one action per row. Pure numpy."""
    xa = np.asarray(x, dtype=np.float64)
    single = xa.ndim == 1
    X2 = xa[None, :] if single else xa
    n = X2.shape[0]
    out = np.empty(n, dtype=np.int64)
    node_of = np.zeros(n, dtype=np.int64)
    pending = np.arange(n)
    while pending.size:
        nxt = []
        for idx in np.unique(node_of[pending]):
            rows = pending[node_of[pending] == idx]
            node = nodes[int(idx)]
            if "action" in node:
                out[rows] = int(node["action"])
                continue
            margin = node_margin(node, X2[rows])
            node_of[rows] = np.where(margin > 0, int(node["right"]), int(node["left"]))
            nxt.append(rows)
        pending = np.concatenate(nxt) if nxt else np.zeros(0, np.int64)
    return int(out[0]) if single else out


def poly_terms(powers: Any, Z: FloatArray) -> FloatArray:
    """The monomials ``Π_j Z[:, j] ** powers[m][j]`` (rows x monomials)."""
    p = np.asarray(powers, dtype=np.int64)
    out = np.ones((Z.shape[0], p.shape[0]))
    for j in range(p.shape[1]):
        for m in np.flatnonzero(p[:, j]):
            out[:, m] *= Z[:, j] ** int(p[m, j])
    return out


def node_margin(node: Mapping[str, Any], X: FloatArray) -> FloatArray:
    """The decision value of an internal exported node on rows of the state's columns (go
    right iff > 0); see the module docstring for the node kinds."""
    if node.get("constant") or not ("trees" in node or len(node.get("weights", ())) > 0):
        return np.full(X.shape[0], float(node["bias"]))
    if "trees" in node:
        return tree_scores(node["trees"], X, 1)[:, 0]
    w = np.asarray(node["weights"], dtype=np.float64)
    if "powers" in node:
        Z = (X - np.asarray(node["mean"])) / np.asarray(node["scale"])
        return poly_terms(node["powers"], Z) @ w + float(node["bias"])
    return X @ w + float(node["bias"])
