"""Adaptive sensor acquisition by a directed acyclic graph (Wang, Trapeznikov & Saligrama,
NIPS 2015): the training side.

Model
-----
* **Sensors** are named groups of columns of ``X`` with an acquisition cost each. **Groups** are
  what one DAG action acquires: with ``n_subsets=None`` every sensor is a group (at most 8
  sensors: 256 states); with ``n_subsets=t`` the groups are the non-empty subsets σ_1..σ_t chosen
  by Alg. 2 (:func:`select_subsets`) plus the full set of sensors, each treated as one
  super-sensor whose cost given a state is the sum of the costs of its sensors not yet acquired.
* **States** are bitmasks over groups (bit g = group g acquired); the empty state 0 is the root.
  A state is *closed*: it also holds every group whose sensors it already has all of (so e.g.
  any state holding the full-set group is the full state), hence every action adds at least one
  new sensor, distinct states have distinct sensor sets, and a path never buys a sensor twice.
  The state's columns (:meth:`DagClassifier.state_columns`) are its sensors' columns, sensors in
  declaration order (the order of ``sensors``), each sensor's columns in the given order.
* **Classifier bank**: one ``StandardScaler + LogisticRegression(C)`` per non-empty state on that
  state's columns, refit on all training rows; the empty state predicts the training prior.
  The stop cost used to train the policies is the 0/1 loss of *out-of-fold* predictions
  (``cross_val_predict`` with ``folds`` stratified folds), so that policies do not learn from
  overfit training errors.
* **Graph-Reduce** (Alg. 1): states are processed leaf-to-root (decreasing number of groups). At
  state s the actions are, in this fixed order: action 0 = stop and classify (cost: the OOF loss
  of f_s on the row), then one action per group g ∉ s in increasing group index (cost:
  ``cost_scale · cost(g | s) + cost_to_go(s ∪ g, row)``). The full state can only stop. The
  k-action cost-sensitive problem is solved by a **filter tree** (Beygelzimer, Langford &
  Ravikumar 2007) of importance-weighted binary logistic regressions
  (``StandardScaler + LogisticRegression(policy_C)``) on the state's columns only; the root sees
  no columns and takes the constant action of minimum mean cost. After π_s is trained,
  ``cost_to_go(s, row)`` is the cost of the action π_s chooses for the row.
* **Prediction** walks from the root applying the policies. With ``budget`` the acquisition cost
  (real, unscaled) is a hard cap: when the chosen acquisition does not fit in what is left, the
  walk stops and classifies at the current state.

Filter tree layout (what :meth:`DagClassifier.policy_nodes` exports)
-------------------------------------------------------------------
For k actions the tree is built over the action range [0, k): a range of one action is a leaf;
otherwise it is an internal node whose left child covers the first ``ceil(len / 2)`` actions and
whose right child the rest. Nodes are numbered in pre-order (node 0 is the root). Leaves are
``{"action": a}``; internal nodes are ``{"left": i, "right": j, "weights": w, "bias": b,
"constant": bool}`` meaning *go right iff* ``w · x_s + b > 0`` where ``x_s`` are the state's
columns in the state's column order and the StandardScaler is folded into ``w`` and ``b``. A
constant node has ``w = 0`` and ``b = +1`` (always right) or ``b = -1`` (always left).

Binary node training: each training row's winners of the left and right subtrees (under the
already trained lower nodes) are compared; label = 1 if the right winner is strictly cheaper,
sample weight = |cost difference|; rows with zero weight are dropped; a node whose weighted rows
hold a single class (or none) becomes a constant decision (left when there are none).
"""

from __future__ import annotations

import copy
import math
import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.exceptions import NotFittedError
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold, cross_val_predict
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler

from training.executor import INLINE, Executor

FloatArray = npt.NDArray[np.float64]
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
        raise ValueError(
            f"sensors reference column {max_col} but X has only {Xa.shape[1]} columns"
        )
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


# --------------------------------------------------------------------------------------------
# Alg. 2: greedy submodular selection of sensor subsets
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubsetSelection:
    """Result of :func:`select_subsets`.

    ``subsets``: the t subsets (sensor names in declaration order; some may be empty if the
    budget or the gains ran out); ``steps``: the greedy additions in order, each
    ``(subset index, sensor name, reward G after the addition)``; ``reward``: the final G;
    ``prior_reward``: G of t empty subsets (the majority-class accuracy); ``evaluations``: the
    number of distinct subsets whose out-of-fold correctness was computed; ``seconds``: wall
    time; ``budget``: the cost constraint used.
    """

    subsets: list[list[str]]
    steps: list[tuple[int, str, float]]
    reward: float
    prior_reward: float
    evaluations: int
    seconds: float
    budget: float


class _LeastSquaresOOF:
    """Out-of-fold correctness of a ridge least-squares classifier (one-hot targets, argmax) on
    any subset of columns, from per-fold Gram matrices computed once: each evaluation costs one
    small linear solve per fold. Data are standardised once globally (selection only)."""

    def __init__(
        self, X: FloatArray, y: IntArray, folds: int, random_state: int, ridge: float
    ) -> None:
        n = X.shape[0]
        std = X.std(axis=0)
        Z = (X - X.mean(axis=0)) / np.where(std > 0, std, 1.0)
        self.Z = np.hstack([np.ones((n, 1)), Z])  # column 0: intercept
        n_classes = int(y.max()) + 1
        Y = np.eye(n_classes)[y]
        self.y = y
        self.ridge = ridge
        self.splits: list[tuple[IntArray, IntArray, FloatArray, FloatArray]] = []
        cv = StratifiedKFold(n_splits=folds, shuffle=True, random_state=random_state)
        for tr, va in cv.split(X, y):
            Ztr = self.Z[tr]
            self.splits.append((tr, va, Ztr.T @ Ztr, Ztr.T @ Y[tr]))

    def correct(self, cols: Sequence[int]) -> BoolArray:
        """Out-of-fold correctness (one bool per row) using the given columns of X."""
        idx = np.array([0, *(c + 1 for c in cols)], dtype=np.int64)
        out = np.zeros(self.y.shape[0], dtype=bool)
        penalty = self.ridge * np.eye(idx.size)
        penalty[0, 0] = 0.0
        for _tr, va, gram, rhs in self.splits:
            A = gram[np.ix_(idx, idx)] + penalty
            beta = np.linalg.lstsq(A, rhs[idx], rcond=None)[0]
            pred = np.argmax(self.Z[np.ix_(va, idx)] @ beta, axis=1)
            out[va] = pred == self.y[va]
        return out


def select_subsets(
    X: Any,
    y: Any,
    *,
    sensors: Mapping[str, Sequence[int]],
    n_subsets: int,
    costs: Mapping[str, float] | None = None,
    budget: float | None = None,
    folds: int = 5,
    random_state: int = 0,
    ridge: float = 1.0,
) -> SubsetSelection:
    """Alg. 2: greedily choose ``n_subsets`` sensor subsets maximising
    ``G(σ_1..σ_t) = (1/N) Σ_i max_j 1[f_σj(x_i) = y_i]`` under ``Σ_j cost(σ_j) <= budget``.

    f_σ is a cheap ridge least-squares classifier on the standardised columns of σ (out-of-fold
    over ``folds`` stratified folds); a still-empty subset counts for nothing. Each step adds the
    (subset j, sensor m ∉ σ_j) pair with the largest gain in G per unit cost of m (for uniform
    costs: the largest gain, as in the paper; for non-uniform costs the cost-benefit variant) among
    pairs that fit the budget; ties go to the lower subset index, then the earlier sensor. Empty
    subsets are interchangeable, so only the first empty one is tried. When no pair gains, an
    empty subset is still started with the sensor whose classifier is most accurate on its own
    (the paper's loop runs until the size budget is spent, so all t subsets get used).
    Selection stops when no pair fits, or every subset is in use and no pair gains. ``budget``
    defaults to twice the total cost of all sensors (2 x the number of sensors for unit
    costs). Correctness vectors are cached per sensor set, so a step only evaluates the sets
    grown from the subset changed by the previous step.
    """
    t0 = time.perf_counter()
    names, columns, cost_arr = _validate_sensors(sensors, costs)
    if isinstance(n_subsets, bool) or not isinstance(n_subsets, int) or n_subsets < 1:
        raise ValueError(f"n_subsets must be an int >= 1, got {n_subsets!r}")
    if not isinstance(folds, int) or folds < 2:
        raise ValueError(f"folds must be an int >= 2, got {folds!r}")
    Xa, y_enc, _classes = _validate_xy(X, y, columns, folds)
    if budget is None:
        budget = 2.0 * float(cost_arr.sum())
    if not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"subset budget must be finite and > 0, got {budget!r}")
    oof = _LeastSquaresOOF(Xa, y_enc, folds, random_state, ridge)
    prior_correct = y_enc == int(np.argmax(np.bincount(y_enc)))
    cache: dict[frozenset[int], BoolArray] = {frozenset(): prior_correct}

    def correct(members: frozenset[int]) -> BoolArray:
        hit = cache.get(members)
        if hit is None:
            cols = [c for m in sorted(members) for c in columns[m]]
            hit = oof.correct(cols)
            cache[members] = hit
        return hit

    t = n_subsets
    subsets: list[frozenset[int]] = [frozenset() for _ in range(t)]
    # An empty subset is not a classifier of the system: it gets no credit. (Crediting it as
    # a majority-class classifier lets one subset right on the other classes saturate G at 1
    # after a single step on balanced data, and the greedy stops.)
    corr = np.zeros((t, len(y_enc)), dtype=bool)
    reward = 0.0
    prior_reward = float(prior_correct.mean())
    spent = 0.0
    steps: list[tuple[int, str, float]] = []
    m_count = len(names)
    while True:
        count = corr.sum(axis=0)
        best: tuple[tuple[float, float], int, int, float, BoolArray] | None = None
        first_empty_seen = False
        for j in range(t):
            if not subsets[j]:
                if first_empty_seen:
                    continue
                first_empty_seen = True
            others = (count - corr[j]) > 0
            for m in range(m_count):
                if m in subsets[j] or spent + cost_arr[m] > budget + _BUDGET_SLACK:
                    continue
                grown = subsets[j] | {m}
                if grown in subsets:  # a copy of another subset adds nothing to the DAG
                    continue
                c = correct(grown)
                g = float(np.mean(others | c))
                gain = g - reward
                if gain <= _TIE and subsets[j]:
                    continue
                # Positive gains first (per unit cost); a step without gain may still start
                # an empty subset, so that all t subsets get filled as in the paper's loop,
                # the most accurate one on its own first.
                rate = 0.0 if gain <= _TIE else (
                    gain / cost_arr[m] if cost_arr[m] > 0 else math.inf
                )
                score = (rate, float(np.mean(c)))
                if best is None or score > best[0]:
                    best = (score, j, m, g, c)
        if best is None:
            break
        _, j, m, g, c = best
        subsets[j] = subsets[j] | {m}
        corr[j] = c
        spent += float(cost_arr[m])
        reward = g
        steps.append((j, names[m], g))
    return SubsetSelection(
        subsets=[[names[m] for m in sorted(s)] for s in subsets],
        steps=steps,
        reward=reward,
        prior_reward=prior_reward,
        evaluations=len(cache) - 1,
        seconds=time.perf_counter() - t0,
        budget=float(budget),
    )


# --------------------------------------------------------------------------------------------
# Filter-tree policies
# --------------------------------------------------------------------------------------------


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
    """The trained policy of one state: ``actions[a]`` is None for stop, else a group index."""

    actions: list[int | None]
    nodes: list[_Node]

    def predict(self, Xs: FloatArray) -> IntArray:
        """Action index per row (uses the fitted sklearn pipelines)."""
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


def _binary_pipeline(C: float, random_state: int) -> Pipeline:
    return Pipeline(
        [
            ("scale", StandardScaler()),
            ("clf", LogisticRegression(C=C, max_iter=_MAX_ITER, random_state=random_state)),
        ]
    )


@dataclass(frozen=True)
class _BankJob:
    """What every classifier-bank task reads (shared with the executor's workers once)."""

    X: FloatArray
    y: IntArray
    C: float
    folds: int
    random_state: int


def _fit_bank_member(job: _BankJob, cols: IntArray) -> tuple[FloatArray, Pipeline]:
    """One state's classifier on columns ``cols``: its out-of-fold 0/1 loss per training row
    (seeded stratified folds) and the pipeline refit on every row."""
    Xs = job.X[:, cols]
    cv = StratifiedKFold(n_splits=job.folds, shuffle=True, random_state=job.random_state)
    oof = cross_val_predict(_binary_pipeline(job.C, job.random_state), Xs, job.y, cv=cv)
    loss = (np.asarray(oof) != job.y).astype(np.float64)
    return loss, _binary_pipeline(job.C, job.random_state).fit(Xs, job.y)


def _train_filter_tree(
    Xs: FloatArray, costs: FloatArray, C: float, random_state: int
) -> list[_Node]:
    """Train a filter tree for the cost matrix ``costs`` (rows x k actions) on features Xs."""
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
            est = _binary_pipeline(C, random_state)
            est.fit(Xs[keep], label[keep], clf__sample_weight=weight[keep])
            node.estimator = est
        if node.constant is not None:
            go_right = np.full(n, node.constant)
        else:
            go_right = np.asarray(node.estimator.predict(Xs)) == 1
        return np.where(go_right, win_r, win_l)

    train(0)
    return nodes


def _export_node(node: _Node, d: int) -> dict[str, Any]:
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
            w = np.asarray(node["weights"], dtype=np.float64)
            margin = X2[rows] @ w + float(node["bias"]) if w.size else np.full(
                rows.size, float(node["bias"])
            )
            node_of[rows] = np.where(margin > 0, int(node["right"]), int(node["left"]))
            nxt.append(rows)
        pending = np.concatenate(nxt) if nxt else np.zeros(0, np.int64)
    return int(out[0]) if single else out


# --------------------------------------------------------------------------------------------
# The estimator
# --------------------------------------------------------------------------------------------


class DagClassifier:
    """Adaptive sensor-acquisition DAG trained by Graph-Reduce (see the module docstring).

    Parameters
    ----------
    sensors: sensor name -> column indices of X (sensors must not share columns).
    costs: per-sensor acquisition cost (default 1.0 each), finite and >= 0.
    cost_scale: λ >= 0, multiplies the sensor costs in the training loss (error + λ·cost).
    n_subsets: None for the exhaustive DAG over all subsets of sensors (at most 8 sensors), or
        t in [1, 12]: Alg. 2 chooses t subsets, the full set is added as one more group, and the
        states are all unions of these groups.
    subset_budget: Alg. 2's constraint on the total cost of the t subsets (only with
        ``n_subsets``; default: twice the total cost of all sensors).
    C: inverse regularisation of the classifier bank's logistic regressions.
    policy_C: inverse regularisation of the filter trees' logistic regressions (their sample
        weights are cost differences, in units of one misclassification).
    folds: stratified folds of the out-of-fold losses (and of Alg. 2's evaluations).
    random_state: seeds the folds and the solvers.

    Fitted attributes
    -----------------
    ``classes_``, ``prior_`` (class frequencies), ``n_features_in_``, ``sensor_names_``,
    ``sensor_costs_`` (dict), ``groups_`` (sensor names per group), ``states_`` (closed group
    bitmasks, by increasing number of groups), ``classifiers_`` (state -> fitted pipeline, None
    for the empty state), ``policies_`` (state -> trained policy), ``oof_error_`` (state ->
    out-of-fold error rate of its classifier), ``train_objective_`` (mean over training rows of
    error + λ·cost under the learned policies, with OOF losses), ``subset_selection_`` (the
    :class:`SubsetSelection` with ``n_subsets``, else None), ``fit_seconds_``.
    """

    def __init__(
        self,
        *,
        sensors: Mapping[str, Sequence[int]],
        costs: Mapping[str, float] | None = None,
        cost_scale: float = 1.0,
        n_subsets: int | None = None,
        subset_budget: float | None = None,
        C: float = 1.0,
        policy_C: float = 1.0,
        folds: int = 5,
        random_state: int = 0,
    ) -> None:
        self.sensors = sensors
        self.costs = costs
        self.cost_scale = cost_scale
        self.n_subsets = n_subsets
        self.subset_budget = subset_budget
        self.C = C
        self.policy_C = policy_C
        self.folds = folds
        self.random_state = random_state

    _PARAMS = (
        "sensors",
        "costs",
        "cost_scale",
        "n_subsets",
        "subset_budget",
        "C",
        "policy_C",
        "folds",
        "random_state",
    )

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._PARAMS}

    def set_params(self, **params: Any) -> DagClassifier:
        for name, value in params.items():
            if name not in self._PARAMS:
                raise ValueError(f"unknown parameter {name!r}; valid: {list(self._PARAMS)}")
            setattr(self, name, value)
        return self

    # ---------------------------------------------------------------- validation

    def _check_params(self) -> tuple[list[str], list[list[int]], FloatArray]:
        names, columns, cost_arr = _validate_sensors(self.sensors, self.costs)

        def positive(name: str, value: Any) -> None:
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                math.isfinite(float(value)) and float(value) > 0
            ):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")

        cs = self.cost_scale
        if isinstance(cs, bool) or not isinstance(cs, numbers.Real) or not (
            math.isfinite(float(cs)) and float(cs) >= 0
        ):
            raise ValueError(f"cost_scale must be a finite number >= 0, got {cs!r}")
        positive("C", self.C)
        positive("policy_C", self.policy_C)
        if isinstance(self.folds, bool) or not isinstance(self.folds, int) or self.folds < 2:
            raise ValueError(f"folds must be an int >= 2, got {self.folds!r}")
        if self.n_subsets is None:
            if len(names) > MAX_EXHAUSTIVE_SENSORS:
                raise ValueError(
                    f"the exhaustive DAG (n_subsets=None) supports at most "
                    f"{MAX_EXHAUSTIVE_SENSORS} sensors, got {len(names)}; pass n_subsets "
                    "to select sensor subsets with Alg. 2"
                )
            if self.subset_budget is not None:
                raise ValueError(
                    f"subset_budget={self.subset_budget!r} requires n_subsets (Alg. 2); "
                    "got n_subsets=None"
                )
        else:
            t = self.n_subsets
            if isinstance(t, bool) or not isinstance(t, int) or not 1 <= t <= MAX_SUBSETS:
                raise ValueError(
                    f"n_subsets must be None or an int in [1, {MAX_SUBSETS}], got {t!r}"
                )
            if self.subset_budget is not None:
                positive("subset_budget", self.subset_budget)
        return names, columns, cost_arr

    # ---------------------------------------------------------------- fit

    def fit(self, X: Any, y: Any, *, executor: Executor = INLINE) -> DagClassifier:
        """Alg. 2 (with ``n_subsets``), the classifier bank (its cross-validations and fits
        run on ``executor``, in this process by default) and Graph-Reduce."""
        t0 = time.perf_counter()
        names, columns, cost_arr = self._check_params()
        Xa, y_enc, classes = _validate_xy(X, y, columns, self.folds)
        self.classes_ = classes
        self.prior_ = np.bincount(y_enc, minlength=classes.size) / y_enc.size
        self.n_features_in_ = Xa.shape[1]
        self.sensor_names_ = names
        self.sensor_costs_ = {n: float(c) for n, c in zip(names, cost_arr, strict=True)}
        self._sensor_columns = columns
        self._sensor_costs = cost_arr

        # Groups.
        if self.n_subsets is None:
            self.subset_selection_: SubsetSelection | None = None
            groups = [[n] for n in names]
        else:
            sel = select_subsets(
                Xa,
                y_enc,
                sensors=self.sensors,
                costs=self.costs,
                n_subsets=self.n_subsets,
                budget=self.subset_budget,
                folds=self.folds,
                random_state=self.random_state,
            )
            self.subset_selection_ = sel
            groups = []
            for subset in sel.subsets:
                if subset and subset not in groups:
                    groups.append(subset)
            if names not in groups:
                groups.append(list(names))
        self.groups_: list[list[str]] = groups
        index = {n: i for i, n in enumerate(names)}
        self._group_sensor_mask = [sum(1 << index[n] for n in g) for g in groups]

        # States: closed unions of groups, reachable from the root.
        states = {0}
        frontier = [0]
        self._transitions: dict[int, list[tuple[int, int, float]]] = {}
        while frontier:
            s = frontier.pop()
            have = self._sensor_mask(s)
            moves = []
            for g in range(len(groups)):
                if s >> g & 1:
                    continue
                nxt = self._closure(s | (1 << g))
                new = self._group_sensor_mask[g] & ~have
                step = float(sum(cost_arr[i] for i in range(len(names)) if new >> i & 1))
                moves.append((g, nxt, step))
                if nxt not in states:
                    states.add(nxt)
                    frontier.append(nxt)
            self._transitions[s] = moves
        self.states_: list[int] = sorted(states, key=lambda s: (_popcount(s), s))

        # Classifier bank with out-of-fold losses: one independent task per non-empty state.
        majority = int(np.argmax(self.prior_))
        self.classifiers_: dict[int, Any] = {0: None}
        self._losses: dict[int, FloatArray] = {0: (y_enc != majority).astype(np.float64)}
        job = _BankJob(Xa, y_enc, self.C, self.folds, self.random_state)
        members = [s for s in self.states_ if s != 0]
        fitted = executor.map(_fit_bank_member, [self._cols(s) for s in members], shared=(job,))
        for s, (loss, clf) in zip(members, fitted, strict=True):
            self._losses[s] = loss
            self.classifiers_[s] = clf
        self.oof_error_: dict[int, float] = {s: float(self._losses[s].mean())
                                             for s in self.states_}

        self._fit_policies(Xa)
        self.fit_seconds_ = time.perf_counter() - t0
        return self

    def _fit_policies(self, Xa: FloatArray) -> None:
        """Graph-Reduce (Alg. 1) with the current ``cost_scale`` over the fitted bank."""
        lam = float(self.cost_scale)
        n = Xa.shape[0]
        ctg: dict[int, FloatArray] = {}
        self.policies_: dict[int, _Policy] = {}
        for s in sorted(self.states_, key=lambda s: (-_popcount(s), s)):
            moves = self._transitions[s]
            actions: list[int | None] = [None, *(g for g, _, _ in moves)]
            cost_cols = [self._losses[s]]
            cost_cols += [lam * step + ctg[nxt] for _, nxt, step in moves]
            costs = np.column_stack(cost_cols)
            if len(actions) == 1:
                nodes = _tree_layout(1)
            elif s == 0:
                nodes = _tree_layout(len(actions))
                _constant_path(nodes, int(np.argmin(costs.mean(axis=0))))
            else:
                Xs = Xa[:, self._cols(s)]
                nodes = _train_filter_tree(Xs, costs, float(self.policy_C), self.random_state)
            policy = _Policy(actions=actions, nodes=nodes)
            self.policies_[s] = policy
            chosen = policy.predict(Xa[:, self._cols(s)])
            ctg[s] = costs[np.arange(n), chosen]
        self.train_objective_ = float(ctg[0].mean())
        d = {s: len(self.state_columns(s)) for s in self.states_}
        self._exported = {
            s: [_export_node(node, d[s]) for node in p.nodes] for s, p in self.policies_.items()
        }

    def _with_cost_scale(self, cost_scale: float, X: Any) -> DagClassifier:
        """A copy sharing this model's groups and classifier bank, with policies retrained for
        ``cost_scale``. ``X`` must be the training X this model was fitted on."""
        self._check_fitted()
        other = copy.copy(self)
        other.cost_scale = cost_scale
        other._check_params()
        t0 = time.perf_counter()
        other._fit_policies(np.asarray(X, dtype=np.float64))
        other.fit_seconds_ = time.perf_counter() - t0
        return other

    _POLICY_STATE = ("cost_scale", "policies_", "train_objective_", "_exported", "fit_seconds_")

    def _policy_state(self) -> dict[str, Any]:
        """What :meth:`_with_cost_scale` changes: the cost scale and the trained policies."""
        return {name: getattr(self, name) for name in self._POLICY_STATE}

    def _with_policies(self, state: Mapping[str, Any]) -> DagClassifier:
        """A copy sharing this model's groups and bank with the policies of ``state`` (from
        :meth:`_policy_state`, e.g. trained by an executor's worker)."""
        other = copy.copy(self)
        for name in self._POLICY_STATE:
            setattr(other, name, state[name])
        return other

    # ---------------------------------------------------------------- states

    def _check_fitted(self) -> None:
        if not hasattr(self, "policies_"):
            raise NotFittedError("this DagClassifier is not fitted yet; call fit(X, y) first")

    def _sensor_mask(self, state: int) -> int:
        mask = 0
        for g, gm in enumerate(self._group_sensor_mask):
            if state >> g & 1:
                mask |= gm
        return mask

    def _closure(self, state: int) -> int:
        have = self._sensor_mask(state)
        for g, gm in enumerate(self._group_sensor_mask):
            if gm & ~have == 0:
                state |= 1 << g
        return state

    def _check_state(self, state: int) -> None:
        self._check_fitted()
        if state not in self.policies_:
            raise ValueError(f"state {state!r} is not a state of this DAG; states: {self.states_}")

    def state_sensors(self, state: int) -> list[str]:
        """Names of the sensors acquired in ``state`` (declaration order)."""
        self._check_state(state)
        mask = self._sensor_mask(state)
        return [n for i, n in enumerate(self.sensor_names_) if mask >> i & 1]

    def state_columns(self, state: int) -> list[int]:
        """Columns of X seen in ``state``: its sensors' columns (sensors in declaration order)."""
        if not hasattr(self, "_group_sensor_mask"):
            raise NotFittedError("this DagClassifier is not fitted yet; call fit(X, y) first")
        mask = self._sensor_mask(state)
        return [c for i, cols in enumerate(self._sensor_columns) if mask >> i & 1 for c in cols]

    def _cols(self, state: int) -> IntArray:
        return np.asarray(self.state_columns(state), dtype=np.int64)

    def state_cost(self, state: int) -> float:
        """Total (unscaled) cost of the sensors acquired in ``state``."""
        self._check_state(state)
        mask = self._sensor_mask(state)
        return float(sum(c for i, c in enumerate(self._sensor_costs) if mask >> i & 1))

    def state_actions(self, state: int) -> list[int | None]:
        """Actions of ``state`` in filter-tree order: None = stop (action 0), then group
        indices (increasing)."""
        self._check_state(state)
        return list(self.policies_[state].actions)

    def transitions(self, state: int) -> list[tuple[int, int, float]]:
        """``(group, next state, unscaled cost of the group given state)`` per acquisition."""
        self._check_state(state)
        return list(self._transitions[state])

    # ---------------------------------------------------------------- policies

    def policy_nodes(self, state: int) -> list[dict[str, Any]]:
        """The filter tree of ``state`` in export form (see the module docstring)."""
        self._check_state(state)
        return [dict(node) for node in self._exported[state]]

    def decide(self, state: int, x_state_columns: Any) -> Any:
        """Action(s) of ``state``'s policy from the exported arrays only (pure numpy): an int for
        a 1-D row of the state's columns, an array for a 2-D block."""
        nodes = self.policy_nodes(state)
        return decide_nodes(nodes, x_state_columns)

    def policy_action(self, state: int, X_state_columns: Any) -> IntArray:
        """Action per row of ``state``'s policy using the fitted sklearn pipelines."""
        self._check_state(state)
        Xs = np.asarray(X_state_columns, dtype=np.float64)
        if Xs.ndim == 1:
            Xs = Xs[None, :]
        return self.policies_[state].predict(Xs)

    def export_policies(self) -> dict[str, Any]:
        """JSON-ready description of the DAG: sensors, groups, and per state its sensors,
        columns, actions and filter-tree nodes (arrays as lists)."""
        self._check_fitted()
        states = []
        for s in self.states_:
            nodes = [
                {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in node.items()}
                for node in self._exported[s]
            ]
            states.append(
                {
                    "state": s,
                    "sensors": self.state_sensors(s),
                    "columns": self.state_columns(s),
                    "actions": self.state_actions(s),
                    "transitions": [list(t) for t in self._transitions[s]],
                    "nodes": nodes,
                }
            )
        return {
            "sensors": {
                n: list(c) for n, c in zip(self.sensor_names_, self._sensor_columns, strict=True)
            },
            "costs": dict(self.sensor_costs_),
            "groups": [list(g) for g in self.groups_],
            "classes": self.classes_.tolist(),
            "states": states,
        }

    # ---------------------------------------------------------------- prediction

    def _walk(self, X: Any, budget: float | None) -> tuple[IntArray, FloatArray, list[list[int]]]:
        self._check_fitted()
        Xa = np.asarray(X, dtype=np.float64)
        if Xa.ndim != 2 or Xa.shape[1] != self.n_features_in_:
            raise ValueError(
                f"X must be 2-D with {self.n_features_in_} columns, got shape {Xa.shape}"
            )
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, numbers.Real) or math.isnan(budget)
            or budget < 0
        ):
            raise ValueError(f"budget must be None or a number >= 0, got {budget!r}")
        n = Xa.shape[0]
        final = np.zeros(n, dtype=np.int64)
        spent = np.zeros(n)
        paths: list[list[int]] = [[0] for _ in range(n)]
        members: dict[int, list[IntArray]] = {0: [np.arange(n)]}
        for s in self.states_:  # increasing number of groups: successors come later
            parts = members.pop(s, None)
            if not parts:
                continue
            idx = np.concatenate(parts)
            if idx.size == 0:
                continue
            policy = self.policies_[s]
            if len(policy.actions) == 1:
                final[idx] = s
                continue
            acts = policy.predict(Xa[np.ix_(idx, self._cols(s))])
            final[idx[acts == STOP]] = s
            for a in np.unique(acts[acts != STOP]):
                rows = idx[acts == a]
                _g, nxt, step = self._transitions[s][int(a) - 1]
                if budget is not None:
                    fits = spent[rows] + step <= budget + _BUDGET_SLACK
                    final[rows[~fits]] = s
                    rows = rows[fits]
                spent[rows] += step
                for r in rows.tolist():
                    paths[r].append(nxt)
                members.setdefault(nxt, []).append(rows)
        return final, spent, paths

    def _proba_at(self, Xa: FloatArray, final: IntArray) -> FloatArray:
        proba = np.zeros((Xa.shape[0], self.classes_.size))
        for s in np.unique(final):
            rows = np.flatnonzero(final == s)
            clf = self.classifiers_[int(s)]
            if clf is None:
                proba[rows] = self.prior_
            else:
                proba[rows] = clf.predict_proba(Xa[np.ix_(rows, self._cols(int(s)))])
        return proba

    def predict_proba(self, X: Any, budget: float | None = None) -> FloatArray:
        """Class probabilities (columns: ``classes_``) from the classifier of the state where
        each row's walk stops."""
        final, _, _ = self._walk(X, budget)
        return self._proba_at(np.asarray(X, dtype=np.float64), final)

    def predict(self, X: Any, budget: float | None = None) -> npt.NDArray[Any]:
        proba = self.predict_proba(X, budget)
        return np.asarray(self.classes_[np.argmax(proba, axis=1)])

    def acquisition(
        self, X: Any, budget: float | None = None
    ) -> tuple[FloatArray, list[list[int]]]:
        """Per row: the acquired (unscaled) cost and the path of states visited (root first)."""
        _, spent, paths = self._walk(X, budget)
        return spent, paths

    def predict_with_cost(
        self, X: Any, budget: float | None = None
    ) -> tuple[npt.NDArray[Any], FloatArray, IntArray]:
        """Predictions, acquired costs and final states in one walk."""
        final, spent, _ = self._walk(X, budget)
        proba = self._proba_at(np.asarray(X, dtype=np.float64), final)
        return np.asarray(self.classes_[np.argmax(proba, axis=1)]), spent, final


def sweep(
    X: Any,
    y: Any,
    X_val: Any,
    y_val: Any,
    cost_scales: Sequence[float],
    *,
    executor: Executor = INLINE,
    **params: Any,
) -> list[tuple[float, DagClassifier, float, float]]:
    """Fit one DAG per ``cost_scale`` and score it on the validation set: a list of
    ``(cost_scale, fitted model, mean acquired cost, error rate)`` in the given order.

    The groups (Alg. 2) and the classifier bank do not depend on the cost scale, so they are
    fitted once and shared (by reference) between the returned models; only the policies are
    retrained per cost scale. The bank's members and the cost scales after the first run on
    ``executor`` (in this process by default; the fitted model is shipped to the workers
    once), with the same results on any executor."""
    if len(cost_scales) == 0:
        raise ValueError("cost_scales must hold at least one value, got none")
    if "cost_scale" in params:
        raise ValueError("pass the cost scales in cost_scales, not as cost_scale=")
    base = DagClassifier(cost_scale=float(cost_scales[0]), **params).fit(X, y, executor=executor)
    first = _score_point(base, X, X_val, y_val, None)
    rest = executor.map(_score_point, [float(cs) for cs in cost_scales[1:]],
                        shared=(base, X, X_val, y_val))
    out: list[tuple[float, DagClassifier, float, float]] = []
    for cs, (policies, spent, error) in zip(cost_scales, [first, *rest], strict=True):
        model = base if policies is None else base._with_policies(policies)
        out.append((float(cs), model, spent, error))
    return out


def _score_point(
    base: DagClassifier, X: Any, X_val: Any, y_val: Any, cost_scale: float | None
) -> tuple[dict[str, Any] | None, float, float]:
    """One sweep point: the policies retrained for ``cost_scale`` (None: ``base`` as it is,
    no policies returned) and their mean acquired cost and error rate on the validation set."""
    model = base if cost_scale is None else base._with_cost_scale(cost_scale, X)
    pred, spent, _ = model.predict_with_cost(X_val)
    policies = None if cost_scale is None else model._policy_state()
    return policies, float(spent.mean()), float(np.mean(pred != np.asarray(y_val)))
