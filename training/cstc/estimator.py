"""CSTC, CSCC and Cronus as scikit-learn estimators (paper 003).

``CSTCRegressor`` is the paper's setting (squared loss on a real label). ``CSTCClassifier``
reduces classification to squared loss on one-hot targets (C outputs per node; a feature's
weights across the C outputs form one group, so a node reads a feature for all classes or
for none) and routes on the node's prediction projected on a direction ``u``: for two
classes u = e_1 − e_0 (the paper's ±1 regression), for more the first principal direction of
the node's predictions on the rows that reach it, fixed when the node is initialised.
Probabilities are softmax(κ·h) with one temperature κ fitted on the validation rows.

``structure="cascade"`` is CSCC (one node per level, each with an early-exit terminal; loss
weighted by the probability of exiting; optional ``class_weight``); ``cost_model="cronus"``
is the Cronus baseline (cost weighted by each node's expected number of inputs inside the
mixed norm). ``depth=1`` is the single cost-sensitive classifier (the root alone).

Training follows §3.4–3.6: top-down initialisation (each node fitted as if it were a leaf),
pruning of the balanced tree on validation rows (``prune``), block coordinate descent in
level order (``n_rounds``), fine-tuning of the final classifiers without the cost term.
At test time routing is hard: upper when h·u > θ. :meth:`walk` gives each row's path, the
cost groups acquired at each node (cached ones are free) and the cost.

The module stays whole (over 450 lines): the regressor and the classifier share one fitting
schedule (initialise, prune, coordinate descent, fine-tune, export, walk) over shared state;
the optimisation itself is :mod:`training.cstc.optimise`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from scipy.optimize import minimize_scalar
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.model_selection import train_test_split
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from training.cstc.optimise import (
    Array,
    Node,
    Problem,
    finetune_leaf,
    forward,
    level_order,
    optimise_node,
)


@dataclass(frozen=True)
class ExportNode:
    """A fitted node in the units of the raw columns: ``columns`` (its non-zero rows),
    prediction h = x[columns] @ W + b, routing score x[columns] @ route_w + route_b (upper
    when > 0), children (node index or None), and the cost groups it reads."""

    columns: tuple[int, ...]
    W: Array
    b: Array
    route_w: Array
    route_b: float
    upper: int | None
    lower: int | None
    groups: tuple[int, ...]

    @property
    def routes(self) -> bool:
        return self.upper is not None or self.lower is not None

    def score(self, row: Sequence[float]) -> float:
        """The routing score, exactly rounded (math.fsum) so any caller summing the same
        products in any order agrees to the last bit."""
        return math.fsum(
            [float(w) * float(row[c]) for w, c in zip(self.route_w, self.columns, strict=True)]
            + [self.route_b]
        )


@dataclass(frozen=True)
class Walk:
    path: list[int]
    acquired: list[list[int]]  # groups acquired at each node of the path
    cost: float
    node: int  # the node that answers


class _CostTree(BaseEstimator):  # type: ignore[misc]
    def __init__(
        self,
        *,
        costs: Sequence[float] | npt.NDArray[np.float64] | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        lam: float = 0.1,
        rho: float = 0.001,
        depth: int = 3,
        structure: Literal["tree", "cascade"] = "tree",
        cost_model: Literal["paths", "cronus"] = "paths",
        sharpness: float = 1.0,
        n_rounds: int = 2,
        prune: bool = True,
        finetune: bool = True,
        validation_fraction: float = 0.2,
        standardize: bool = True,
        polish: bool = True,
        random_state: int = 0,
    ) -> None:
        self.polish = polish
        self.standardize = standardize
        self.costs = costs
        self.groups = groups
        self.lam = lam
        self.rho = rho
        self.depth = depth
        self.structure = structure
        self.cost_model = cost_model
        self.sharpness = sharpness
        self.n_rounds = n_rounds
        self.prune = prune
        self.finetune = finetune
        self.validation_fraction = validation_fraction
        self.random_state = random_state

    # ----------------------------------------------------------------------------- checks
    def _check_params(self, d: int) -> tuple[list[npt.NDArray[np.intp]], Array]:
        name = type(self).__name__
        for key in ("lam", "rho"):
            value = getattr(self, key)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"The {key!r} parameter of {name} must be >= 0. Got {value!r}.")
        if not isinstance(self.depth, int) or not 1 <= self.depth <= 8:
            raise ValueError(
                f"The 'depth' parameter of {name} must be an int in [1, 8]. Got {self.depth!r}."
            )
        if self.structure not in ("tree", "cascade"):
            raise ValueError(
                f"The 'structure' parameter of {name} must be 'tree' or 'cascade'. "
                f"Got {self.structure!r}."
            )
        if self.cost_model not in ("paths", "cronus"):
            raise ValueError(
                f"The 'cost_model' parameter of {name} must be 'paths' or 'cronus'. "
                f"Got {self.cost_model!r}."
            )
        if not isinstance(self.sharpness, int | float) or not self.sharpness > 0:
            raise ValueError(
                f"The 'sharpness' parameter of {name} must be > 0. Got {self.sharpness!r}."
            )
        if not 0 < self.validation_fraction < 1:
            raise ValueError(
                f"The 'validation_fraction' parameter of {name} must be in (0, 1). "
                f"Got {self.validation_fraction!r}."
            )
        if self.groups is None:
            groups = [np.asarray([t], dtype=np.intp) for t in range(d)]
        else:
            groups = [np.asarray(list(g), dtype=np.intp) for g in self.groups]
            if any(len(g) == 0 or g.min() < 0 or g.max() >= d for g in groups):
                raise ValueError(
                    f"The 'groups' parameter of {name} must list column indices in [0, {d}); "
                    f"got {self.groups!r}."
                )
            covered = np.zeros(d, dtype=bool)
            for g in groups:
                covered[g] = True
            if not covered.all():
                raise ValueError(
                    f"The 'groups' parameter of {name} leaves columns "
                    f"{np.flatnonzero(~covered).tolist()} in no group; every column needs one."
                )
        costs = np.ones(len(groups)) if self.costs is None else np.asarray(self.costs, float)
        if costs.shape != (len(groups),) or not np.all(np.isfinite(costs)) or (costs < 0).any():
            raise ValueError(
                f"The 'costs' parameter of {name} must give one finite cost >= 0 per group "
                f"({len(groups)}). Got {self.costs!r}."
            )
        return groups, costs

    # ----------------------------------------------------------------------------- fitting
    def _targets(self, y: Any) -> Array:
        raise NotImplementedError

    def _row_weights(self, y: Any) -> Array:
        return np.ones(len(y))

    def _direction(self, h: Array, weights: Array) -> Array:
        C = h.shape[1]
        if C == 1:
            return np.ones(1)
        if C == 2:
            return np.asarray([-1.0, 1.0]) / math.sqrt(2.0)
        w = weights / max(float(weights.sum()), 1e-12)
        centred = h - w @ h
        cov = centred.T @ (centred * w[:, None])
        _, vecs = np.linalg.eigh(cov)
        u: Array = vecs[:, -1]
        return u

    def _split(self, X: Array, y: Any) -> tuple[Array, Array, Any, Any]:
        n = len(X)
        if n < 4:
            raise ValueError(
                f"{type(self).__name__} holds out validation rows for pruning; it needs at "
                f"least 4 samples, got n_samples={n}."
            )
        stratify = y if isinstance(self, ClassifierMixin) else None
        if stratify is not None:
            counts = np.unique(stratify, return_counts=True)[1]
            if counts.min() < 2 or self.validation_fraction * n < len(counts):
                stratify = None  # too few rows of a class to stratify
        parts = train_test_split(
            X,
            y,
            test_size=self.validation_fraction,
            random_state=self.random_state,
            stratify=stratify,
        )
        return parts[0], parts[1], parts[2], parts[3]

    def _fit(self, X: Array, y: Any) -> None:
        d = X.shape[1]
        groups, costs = self._check_params(d)
        X_tr, X_val, y_tr, y_val = self._split(X, y)
        # The penalties act on standardised weights unless ``standardize`` is off (the
        # paper's raw units, where a weight's size is in the feature's own scale).
        self.mean_ = X_tr.mean(axis=0) if self.standardize else np.zeros(d)
        std = X_tr.std(axis=0) if self.standardize else np.ones(d)
        self.scale_ = np.where(std > 0, std, 1.0)
        Z = (X_tr - self.mean_) / self.scale_
        problem = Problem(
            X=Z,
            Y=self._targets(y_tr),
            weights=self._row_weights(y_tr),
            groups=groups,
            group_costs=costs,
            lam=float(self.lam),
            rho=float(self.rho),
            sharpness=float(self.sharpness),
            mode=self.structure,
            cost_model=self.cost_model,
        )
        self.groups_ = [tuple(int(c) for c in g) for g in groups]
        self.group_costs_ = costs
        nodes = self._initialise(problem)
        if self.prune and self.structure == "tree":
            nodes = self._prune(nodes, problem, X_val, y_val)
        for _ in range(self.n_rounds):
            for k in level_order(nodes):
                optimise_node(problem, nodes, k)
        if self.polish:
            self._polish(nodes, problem, X_val, y_val)
        if self.finetune:
            for k in level_order(nodes):
                if not nodes[k].routes:
                    finetune_leaf(problem, nodes, k)
        self.nodes_ = nodes
        self.n_features_in_ = d
        self._export()
        self._after_fit(X_val, y_val)
        self.objective_ = float(_objective(problem, nodes))

    def _after_fit(self, X_val: Array, y_val: Any) -> None:
        return None

    def _new_node(self, C: int, d: int) -> Node:
        return Node(upper=None, lower=None, B=np.zeros((d, C)), b=np.zeros(C), u=np.ones(C))

    def _initialise(self, problem: Problem) -> list[Node]:
        """§3.4.2: top-down, each node fitted as a leaf (its children cut off), then its
        routing direction and a threshold sending half of its rows (by reach) upward."""
        d = problem.X.shape[1]
        C = problem.Y.shape[1]
        root = self._new_node(C, d)
        root.B[:] = 1e-2  # every column starts in play; the closed form sets the weights
        nodes = [root]
        frontier = [(0, 0)]  # (node, level)
        while frontier:
            k, level = frontier.pop(0)
            optimise_node(problem, nodes, k)
            last = level + 1 >= self.depth
            if last:
                continue
            fw = forward(problem, nodes)
            nd = nodes[k]
            nd.u = self._direction(fw.h[k], fw.reach[k])
            proj = fw.h[k] @ nd.u
            nd.theta = _weighted_median(proj, fw.reach[k])
            kids = [] if self.structure == "cascade" else ["lower"]
            for side in ["upper", *kids]:
                child = self._new_node(C, d)
                child.B[:] = 1e-2
                nodes.append(child)
                setattr(nd, side, len(nodes) - 1)
                frontier.append((len(nodes) - 1, level + 1))
        return nodes

    def _prune(self, nodes: list[Node], problem: Problem, X_val: Array, y_val: Any) -> list[Node]:
        """§3.6.1: bottom-up, cut the children of a node whose children are both leaves
        when that does not make the validation error (MSE for regression) worse."""
        changed = True
        while changed:
            changed = False
            for k in reversed(level_order(nodes)):
                nd = nodes[k]
                kids = [nd.upper, nd.lower]
                if any(c is None for c in kids):
                    continue
                if any(nodes[c].routes for c in kids if c is not None):
                    continue
                before = self._val_error(nodes, X_val, y_val)
                saved = (nd.upper, nd.lower)
                nd.upper = nd.lower = None
                after = self._val_error(nodes, X_val, y_val)
                if after <= before:
                    changed = True
                else:
                    nd.upper, nd.lower = saved
        return _compact(nodes)

    def _polish(self, nodes: list[Node], problem: Problem, X_val: Array, y_val: Any) -> None:
        """Our addition to the paper (``polish``): the relaxed cost leaves small weights
        that the ℓ0 cost charges in full (a feature read for a 0.02 weight). Deepest nodes
        first, drop a node's cost group (its weights replaced by their mean contribution on
        the training rows, folded into the intercept) when the validation error of the
        hard tree grows by at most 1 % (relative); the leaves are fine-tuned after."""
        mean = problem.X.mean(axis=0)
        for k in reversed(level_order(nodes)):
            nd = nodes[k]
            for cols in problem.groups:
                if not nd.B[cols].any():
                    continue
                before = self._val_loss(nodes, X_val, y_val)
                saved_B, saved_b = nd.B.copy(), nd.b.copy()
                nd.b = nd.b + mean[cols] @ nd.B[cols]
                nd.B[cols] = 0.0
                after = self._val_loss(nodes, X_val, y_val)
                if after > before + 0.01 * max(before, 1e-3):
                    nd.B, nd.b = saved_B, saved_b

    def _val_error(self, nodes: list[Node], X_val: Array, y_val: Any) -> float:
        Z = (X_val - self.mean_) / self.scale_
        return self._error(_hard_outputs(nodes, Z), y_val)

    def _val_loss(self, nodes: list[Node], X_val: Array, y_val: Any) -> float:
        """The training loss (squared, on the targets) of the hard tree on validation rows:
        finer than the error rate, which a rare class leaves flat."""
        Z = (X_val - self.mean_) / self.scale_
        h = _hard_outputs(nodes, Z)
        return float(np.sum((h - self._targets(y_val)) ** 2)) / max(len(Z), 1)

    def _error(self, h: Array, y: Any) -> float:
        raise NotImplementedError

    def _export(self) -> None:
        """The fitted nodes in raw-column units (what the bundle ships and :meth:`walk`
        runs)."""
        out = []
        for nd in self.nodes_:
            cols = np.flatnonzero(np.any(nd.B != 0, axis=1))
            W = nd.B[cols] / self.scale_[cols, None]
            b = nd.b - (self.mean_[cols] / self.scale_[cols]) @ nd.B[cols]
            route_w = W @ nd.u if nd.routes else np.zeros(len(cols))
            route_b = float(b @ nd.u - nd.theta) if nd.routes else 0.0
            used = tuple(
                g for g, members in enumerate(self.groups_) if set(members) & set(cols.tolist())
            )
            out.append(
                ExportNode(
                    columns=tuple(int(c) for c in cols),
                    W=W,
                    b=b,
                    route_w=route_w,
                    route_b=route_b,
                    upper=nd.upper,
                    lower=nd.lower,
                    groups=used,
                )
            )
        self.export_nodes_ = out

    # ----------------------------------------------------------------------------- test time
    def walk(self, X: Any) -> list[Walk]:
        """Each row's hard walk: the nodes visited, the cost groups first acquired at each
        (a group read by an earlier node is in hand, free), the total cost, the answering
        node."""
        check_is_fitted(self, "export_nodes_")
        X = validate_data(self, X, reset=False)
        out = []
        for row in np.asarray(X, dtype=np.float64):
            k, path, acquired, have = 0, [], [], set[int]()
            while True:
                nd = self.export_nodes_[k]
                path.append(k)
                new = [g for g in nd.groups if g not in have]
                have.update(new)
                acquired.append(new)
                if not nd.routes:
                    break
                nxt = nd.upper if nd.score(row.tolist()) > 0 else nd.lower
                if nxt is None:
                    break
                k = nxt
            cost = float(sum(self.group_costs_[g] for g in have))
            out.append(Walk(path, acquired, cost, k))
        return out

    def _outputs(self, X: Any) -> tuple[Array, list[Walk]]:
        walks = self.walk(X)
        X = np.asarray(X, dtype=np.float64)
        C = self.export_nodes_[0].b.shape[0]
        h = np.zeros((len(walks), C))
        for i, w in enumerate(walks):
            nd = self.export_nodes_[w.node]
            h[i] = X[i, list(nd.columns)] @ nd.W + nd.b
        return h, walks

    def average_cost(self, X: Any) -> float:
        return float(np.mean([w.cost for w in self.walk(X)]))


def _hard_outputs(nodes: list[Node], Z: Array) -> Array:
    """Each row's prediction by the node its hard walk ends at (standardised inputs)."""
    at = np.zeros(len(Z), dtype=np.intp)
    done = np.zeros(len(Z), dtype=bool)
    out = np.zeros((len(Z), nodes[0].B.shape[1]))
    for k in level_order(nodes):
        rows = np.flatnonzero((at == k) & ~done)
        if not len(rows):
            continue
        nd = nodes[k]
        h = Z[rows] @ nd.B + nd.b
        out[rows] = h
        if not nd.routes:
            done[rows] = True
            continue
        up = (h @ nd.u - nd.theta) > 0
        for mask, child in ((up, nd.upper), (~up, nd.lower)):
            if child is None:
                done[rows[mask]] = True
            else:
                at[rows[mask]] = child
    return out


def _weighted_median(values: Array, weights: Array) -> float:
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    if cum[-1] <= 0:
        return float(np.median(values))
    i = int(np.searchsorted(cum, 0.5 * cum[-1]))
    return float(values[order][min(i, len(values) - 1)])


def _compact(nodes: list[Node]) -> list[Node]:
    order = level_order(nodes)
    index = {old: new for new, old in enumerate(order)}
    out = []
    for old in order:
        nd = nodes[old]
        out.append(
            Node(
                upper=None if nd.upper is None else index[nd.upper],
                lower=None if nd.lower is None else index[nd.lower],
                B=nd.B,
                b=nd.b,
                u=nd.u,
                theta=nd.theta,
            )
        )
    return out


def _objective(problem: Problem, nodes: list[Node]) -> float:
    from training.cstc.optimise import objective

    return objective(problem, nodes)


class CSTCRegressor(RegressorMixin, _CostTree):  # type: ignore[misc]
    """CSTC for a real label (the paper's setting). See the module docstring."""

    def fit(self, X: Any, y: Any) -> CSTCRegressor:
        X, y = validate_data(self, X, y, y_numeric=True)
        self._fit(np.asarray(X, dtype=np.float64), np.asarray(y, dtype=np.float64))
        return self

    def _targets(self, y: Any) -> Array:
        return np.asarray(y, dtype=np.float64).reshape(-1, 1)

    def _error(self, h: Array, y: Any) -> float:
        return float(np.mean((h[:, 0] - y) ** 2))

    def predict(self, X: Any) -> Array:
        h, _ = self._outputs(X)
        out: Array = h[:, 0]
        return out


class CSTCClassifier(ClassifierMixin, _CostTree):  # type: ignore[misc]
    """CSTC / CSCC / Cronus for class labels: squared loss on one-hot targets.
    ``class_weight``: None, "balanced" or {label: weight} (eq. 19's w_y)."""

    def __init__(
        self,
        *,
        costs: Sequence[float] | npt.NDArray[np.float64] | None = None,
        groups: Sequence[Sequence[int]] | None = None,
        lam: float = 0.1,
        rho: float = 0.001,
        depth: int = 3,
        structure: Literal["tree", "cascade"] = "tree",
        cost_model: Literal["paths", "cronus"] = "paths",
        sharpness: float = 1.0,
        n_rounds: int = 2,
        prune: bool = True,
        finetune: bool = True,
        validation_fraction: float = 0.2,
        standardize: bool = True,
        polish: bool = True,
        random_state: int = 0,
        class_weight: str | dict[Any, float] | None = None,
    ) -> None:
        super().__init__(
            costs=costs,
            groups=groups,
            lam=lam,
            rho=rho,
            depth=depth,
            structure=structure,
            cost_model=cost_model,
            sharpness=sharpness,
            n_rounds=n_rounds,
            prune=prune,
            finetune=finetune,
            validation_fraction=validation_fraction,
            standardize=standardize,
            polish=polish,
            random_state=random_state,
        )
        self.class_weight = class_weight

    def fit(self, X: Any, y: Any) -> CSTCClassifier:
        X, y = validate_data(self, X, y)
        check_classification_targets(y)
        self.classes_, encoded = np.unique(y, return_inverse=True)
        if len(self.classes_) < 2:
            raise ValueError(
                f"{type(self).__name__} needs at least 2 classes in y; got 1 class "
                f"({self.classes_[0]!r}). Fit it on rows of two classes or more."
            )
        self._fit(np.asarray(X, dtype=np.float64), encoded)
        return self

    def _targets(self, y: Any) -> Array:
        Y = np.zeros((len(y), len(self.classes_)))
        Y[np.arange(len(y)), y] = 1.0
        return Y

    def _row_weights(self, y: Any) -> Array:
        cw = self.class_weight
        if cw is None:
            return np.ones(len(y))
        counts = np.bincount(y, minlength=len(self.classes_)).astype(float)
        if cw == "balanced":
            per = len(y) / (len(self.classes_) * np.maximum(counts, 1.0))
        elif isinstance(cw, dict):
            per = np.asarray([float(cw.get(c, 1.0)) for c in self.classes_])
        else:
            raise ValueError(
                f"The 'class_weight' parameter of {type(self).__name__} must be None, "
                f"'balanced' or a dict. Got {cw!r}."
            )
        # Normalised so the average row weight is 1 (λ keeps its meaning).
        w = per[y]
        out: Array = w / w.mean()
        return out

    def _direction(self, h: Array, weights: Array) -> Array:
        if len(self.classes_) == 2 and self.structure == "cascade":
            # The cascade goes on with the rows that look like the minority class.
            counts = self._counts
            u = np.zeros(2)
            u[int(np.argmin(counts))] = 1.0
            u[int(np.argmax(counts))] = -1.0
            return u / math.sqrt(2.0)
        return super()._direction(h, weights)

    def _fit(self, X: Array, y: Any) -> None:
        self._counts = np.bincount(y, minlength=len(self.classes_))
        super()._fit(X, y)

    def _error(self, h: Array, y: Any) -> float:
        return float(np.mean(np.argmax(h, axis=1) != y))

    def _after_fit(self, X_val: Array, y_val: Any) -> None:
        h, _ = self._outputs(X_val)
        z = h - h.max(axis=1, keepdims=True)

        def nll(log_kappa: float) -> float:
            s = math.exp(log_kappa) * z
            s = s - s.max(axis=1, keepdims=True)
            logp = s - np.log(np.exp(s).sum(axis=1, keepdims=True))
            return -float(np.mean(logp[np.arange(len(y_val)), y_val]))

        res = minimize_scalar(nll, bounds=(-3.0, 5.0), method="bounded")
        self.temperature_ = float(math.exp(float(res.x)))

    def decision_function(self, X: Any) -> Array:
        """The answering node's outputs h (n x classes); for two classes h_1 − h_0, as
        scikit-learn's binary convention has it."""
        h, _ = self._outputs(X)
        if len(self.classes_) == 2:
            out: Array = h[:, 1] - h[:, 0]
            return out
        return h

    def predict_proba(self, X: Any) -> Array:
        h, _ = self._outputs(X)
        return softmax(self.temperature_ * h)

    def predict(self, X: Any) -> npt.NDArray[Any]:
        h, _ = self._outputs(X)
        out: npt.NDArray[Any] = self.classes_[np.argmax(h, axis=1)]
        return out


def softmax(s: Array) -> Array:
    z = s - s.max(axis=1, keepdims=True)
    e = np.exp(z)
    out: Array = e / e.sum(axis=1, keepdims=True)
    return out
