"""Build a CSTC / CSCC / Cronus bundle (paper 003) from tabular data: fit one tree (or
cascade) per (method, λ), keep the validation Pareto set as one ``cstc`` strategy, export
every node and check it.

Each sensor is a cost group (its columns are read together, at its declared cost). What the
bundle ships, and why: a node's *routing* (its weights on its sensors' values and its bias)
is a manifest array, so the service computes the score with the same exactly rounded sum as
the estimator and takes the same branch to the last bit, and the walk can be read and
audited in the manifest; a node's *prediction* is an ONNX graph, so answers go through the
same inference path as every other strategy: with ``node_models: tuned`` (the default) the
fixed-subset model of every sensor the walk has bought at the node (LightGBM or logistic
regression tuned on validation rows, :mod:`training.fixed_subsets`; shared by every node with
the same sensors in hand), with ``linear`` the node's own classifier softmax(κ·(xW + b)), one
bundle model per node (a node without features is a prior). Beside the points the bundle
carries the best fixed sensor subsets. Values are rounded to float32 before training, as the
sensor extractor serves them.

The module stays whole (over 450 lines): fitting the trees, choosing the validation Pareto
set, the cascade's exits and the export all read one spec and one set of fitted trees, in
that order, and nothing else builds from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.bundle import CstcPoint, CstcStrategy, Manifest, ModelSpec, write_manifest
from training.bundles.writer import bundle_version, capped_numbers, provenance, staging
from training.cstc import CSTCClassifier
from training.data.tabular import TabularSpec, column_positions, fingerprint
from training.executor import INLINE, Executor
from training.export.cstc import CstcExportMismatch, export_point, node_probabilities
from training.export.fixed import export_fixed
from training.fixed_subsets import (
    FixedSubsets,
    SubsetFit,
    WithFixedSubsets,
    fixed_summary,
)

__all__ = ["CstcExportMismatch", "CstcSpec", "build_cstc_bundle"]

METHODS = ("cstc", "cscc", "cronus", "root-only")


#: What answers at a node: the trained linear node, or the node's path refit (``tuned``).
NODE_MODELS = ("tuned", "linear")


@dataclass
class CstcSpec(WithFixedSubsets, TabularSpec):
    """``budgetserve-train cstc`` reads this beside the CSV. ``node_models: tuned`` (the
    default) answers at each node with the fixed-subset model of every sensor the walk has
    bought when it is there (the node's and its ancestors'; LightGBM or logistic regression,
    chosen on the validation rows, :mod:`training.fixed_subsets`): the tree's routing and
    costs are CSTC's, its answers non-linear; ``linear``: the trained linear node itself.
    ``fixed``: the fixed-subset search (false: no fixed points, and linear nodes). With
    tuned nodes, each CSCC cascade and CSTC tree also gives one point per ``exit_levels``
    level: the same walk, but a node (a cascade's stage, a tree's routing node) answers as
    soon as its model's top class probability reaches the level, so confident items stop
    early and pay less."""

    methods: list[str] | None = None  # default: ["cstc", "root-only"]; cascade: ["cscc", ...]
    cascade: bool = False
    lambdas: list[float] = field(default_factory=lambda: [0.001, 0.003, 0.01, 0.03, 0.1])
    depth: int = 3
    sharpness: float = 10.0
    rho: float = 0.001
    n_rounds: int = 2
    class_weight: str | None = None
    tolerance: float = 0.0
    pareto: bool = True
    node_models: str = "tuned"
    exit_levels: list[float] = field(default_factory=lambda: [0.8, 0.9, 0.95, 0.99])

    def __post_init__(self) -> None:
        if isinstance(self.sensors, list):
            self.sensors = {str(c): [str(c)] for c in self.sensors}

    def chosen_methods(self) -> list[str]:
        if self.methods is not None:
            return list(self.methods)
        return ["cscc", "cronus"] if self.cascade else ["cstc", "root-only"]

    def check(self) -> None:
        super().check()
        unknown = [m for m in self.chosen_methods() if m not in METHODS]
        if unknown:
            raise ValueError(f"methods {unknown} are unknown; known: {list(METHODS)}")
        if not self.lambdas or any(not isinstance(v, int | float) or v < 0 for v in self.lambdas):
            raise ValueError(
                f"lambdas must be a non-empty list of numbers >= 0, got {self.lambdas!r}"
            )
        if not isinstance(self.depth, int) or not 1 <= self.depth <= 8:
            raise ValueError(f"depth must be an integer in [1, 8], got {self.depth!r}")
        if not isinstance(self.sharpness, int | float) or self.sharpness <= 0:
            raise ValueError(f"sharpness must be a number > 0, got {self.sharpness!r}")
        if self.class_weight not in (None, "balanced"):
            raise ValueError(f"class_weight must be null or 'balanced', got {self.class_weight!r}")
        if self.node_models not in NODE_MODELS:
            raise ValueError(
                f"node_models must be one of {list(NODE_MODELS)}, got {self.node_models!r}"
            )
        if not isinstance(self.exit_levels, list) or any(
            isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1
            for v in self.exit_levels
        ):
            # (1 itself: the service's float32 model saturates to 1.0 where the fit gives
            # 0.99999999, so served and trained walks would leave at different nodes)
            raise ValueError(
                f"exit_levels must be a list of numbers in (0, 1), got {self.exit_levels!r}"
            )
        if self.node_models == "tuned" and self.fixed_search() is None:
            raise ValueError(
                "node_models: tuned refits the nodes as fixed subsets: it needs `fixed`"
            )


@dataclass(frozen=True)
class Config:
    method: str
    lam: float

    @property
    def id(self) -> str:
        return f"{self.method}-l{self.lam:g}"


def estimator_for(
    config: Config,
    groups: list[list[int]],
    costs: Any,
    *,
    rho: float,
    depth: int,
    sharpness: float,
    n_rounds: int,
    seed: int,
    class_weight: str | dict[Any, float] | None = None,
) -> CSTCClassifier:
    """The estimator a method name stands for: ``root-only`` is a depth-1 tree, ``cscc`` and
    ``cronus`` are cascades, ``cronus`` prices features with Cronus's cost form."""
    method = config.method
    return CSTCClassifier(
        costs=costs,
        groups=groups,
        lam=config.lam,
        rho=rho,
        depth=1 if method == "root-only" else depth,
        structure="cascade" if method in ("cscc", "cronus") else "tree",
        cost_model="cronus" if method == "cronus" else "paths",
        sharpness=sharpness,
        n_rounds=n_rounds,
        class_weight=class_weight,
        random_state=seed,
    )


def make_estimator(
    spec: CstcSpec, config: Config, groups: list[list[int]], costs: list[float]
) -> CSTCClassifier:
    return estimator_for(
        config,
        groups,
        costs,
        rho=spec.rho,
        depth=spec.depth,
        sharpness=spec.sharpness,
        n_rounds=spec.n_rounds,
        seed=spec.seed,
        class_weight=spec.class_weight,
    )


def _fit(
    spec: CstcSpec,
    groups: list[list[int]],
    costs: list[float],
    x: npt.NDArray[np.float64],
    y: npt.NDArray[Any],
    config: Config,
) -> CSTCClassifier:
    return make_estimator(spec, config, groups, costs).fit(x, y)


@dataclass
class CstcBuildResult:
    manifest: Manifest
    path: Path
    points: list[dict[str, Any]]
    estimators: dict[str, CSTCClassifier] = field(default_factory=dict)
    test_rows: tuple[npt.NDArray[np.float64], npt.NDArray[Any]] | None = None
    fixed: list[SubsetFit] = field(default_factory=list)  # the bundle's fixed points
    node_fits: dict[str, list[SubsetFit]] = field(default_factory=dict)  # point -> per node


def held_costs(est: CSTCClassifier, group_costs: list[float]) -> list[float]:
    """Per node of a fitted tree, the cost of the sensors in hand when the walk is there
    (its own and its ancestors'): what a walk that ends there has spent."""
    return [sum(group_costs[g] for g in h) for h in _held_groups(est)]


def held_sensors(est: CSTCClassifier, names: list[str]) -> list[tuple[str, ...]]:
    """Per node of a fitted tree, the sensors in hand when the walk is there: its own and its
    ancestors' (declaration order)."""
    return [tuple(names[g] for g in sorted(h)) for h in _held_groups(est)]


def _answers(
    est: CSTCClassifier,
    X: npt.NDArray[np.float64],
    node_fits: list[SubsetFit] | None,
) -> tuple[npt.NDArray[Any], float]:
    """Each row's prediction by the node its walk ends at (the node's refit model when
    ``node_fits`` is given, else the linear node) and the average cost."""
    walks = est.walk(X)
    cost = float(np.mean([w.cost for w in walks])) if walks else 0.0
    if node_fits is None:
        return np.asarray(est.predict(X)), cost
    ends = np.asarray([w.node for w in walks], dtype=np.int64)
    pred = np.empty(len(X), dtype=np.int64)
    for k in np.unique(ends):
        rows = np.flatnonzero(ends == k)
        pred[rows] = np.argmax(node_fits[int(k)].predict_proba(X[rows]), axis=1)
    return np.asarray(est.classes_[pred]), cost


def cascade_order(est: CSTCClassifier) -> list[int]:
    """A cascade's nodes from the root, each followed by its one child (empty for a node
    that has two: a tree)."""
    order, k = [0], 0
    while True:
        node = est.export_nodes_[k]
        children = [c for c in (node.upper, node.lower) if c is not None]
        if not children:
            return order
        if len(children) > 1:
            return []
        k = children[0]
        order.append(k)


EXIT_METHODS = {"cscc": "cscc-exit", "cstc": "cstc-exit"}


def exit_nodes(est: CSTCClassifier, method: str) -> list[bool]:
    """Per node, whether it has a confidence exit in ``method``'s exit points: a cascade's
    stages (one child: where the walk goes on), a tree's routing nodes (two children: the
    walk goes on by its routing score). A leaf has none: it answers."""
    both = method != "cscc"
    return [
        (n.upper is not None and n.lower is not None)
        if both
        else (n.upper is None) != (n.lower is None)
        for n in est.export_nodes_
    ]


def exit_answers(
    est: CSTCClassifier,
    node_fits: list[SubsetFit],
    level: float,
    X: npt.NDArray[np.float64],
    group_costs: list[float],
    exits: list[bool] | None = None,
) -> tuple[npt.NDArray[Any], npt.NDArray[np.float64], npt.NDArray[np.int64], list[list[int]]]:
    """A tree or cascade with confidence exits (``exit_confidence`` on the nodes ``exits``
    marks; default: a cascade's stages): each row walks from the root; at a node with an
    exit it leaves when the node model's top class probability reaches ``level``, else goes
    on (to its one child, or by its routing score to one of two); elsewhere it routes as
    the tree does, leaving at a leaf or a terminal element. Predictions, each row's cost
    (the sensors bought up to where it left), the node it left at and its path: the
    service's walk (:class:`service.strategies.cstc.CstcSession`) step for step."""
    nodes = est.export_nodes_
    exits = exit_nodes(est, "cscc") if exits is None else exits
    held = held_costs(est, group_costs)
    n = len(X)
    at = np.zeros(n, dtype=np.int64)
    left = np.full(n, -1, dtype=np.int64)
    pred = np.zeros(n, dtype=np.int64)
    paths: list[list[int]] = [[] for _ in range(n)]
    for k, node in enumerate(nodes):  # a child comes after its parent
        rows = np.flatnonzero((at == k) & (left < 0))
        if rows.size == 0:
            continue
        proba = node_fits[k].predict_proba(X[rows])
        top = np.argmax(proba, axis=1)
        sure = (np.max(proba, axis=1) >= level) & exits[k]
        for j, i in enumerate(rows):
            paths[i].append(k)
            nxt: int | None
            if exits[k] and not sure[j] and (node.upper is None or node.lower is None):
                nxt = node.upper if node.upper is not None else node.lower
            elif (exits[k] and sure[j]) or not node.routes:
                nxt = None
            else:
                nxt = node.upper if node.score(X[i].tolist()) > 0 else node.lower
            if nxt is None:
                left[i], pred[i] = k, top[j]
            else:
                at[i] = nxt
    cost = np.asarray([held[k] for k in left], dtype=np.float64)
    return np.asarray(est.classes_[pred]), cost, left, paths


def capped_point(
    est: CSTCClassifier,
    node_fits: list[SubsetFit] | None,
    level: float | None,
    X: npt.NDArray[np.float64],
    y: npt.NDArray[Any],
    group_costs: list[float],
    prior_label: Any,
    exits: list[bool] | None = None,
) -> list[Any]:
    """A point's validation numbers with every walk stopped at each cap (the service's
    budget is a per-item hard cap): a walk does not enter a node whose sensors, with its
    ancestors', cost more than the cap, and the last node it entered answers (the prior when
    it could not pay for the root). ``level``: confidence exits at the nodes ``exits``
    marks (:func:`exit_answers`)."""
    held = held_costs(est, group_costs)
    if level is None:
        paths = [w.path for w in est.walk(X)]
    else:
        paths = exit_answers(est, node_fits or [], level, X, group_costs, exits)[3]
    right_at: dict[int, npt.NDArray[np.bool_]] = {}

    def right(k: int) -> npt.NDArray[np.bool_]:
        if k not in right_at:
            if node_fits is not None:
                proba = node_fits[k].predict_proba(X)
            else:
                proba = node_probabilities(est, est.export_nodes_[k], X)
            right_at[k] = est.classes_[np.argmax(proba, axis=1)] == np.asarray(y)
        return right_at[k]

    prior_right = np.asarray(y) == prior_label

    def evaluate(cap: float) -> tuple[float, float]:
        correct = np.zeros(len(X), dtype=bool)
        spent = np.zeros(len(X))
        for i, path in enumerate(paths):
            entered = [k for k in path if held[k] <= cap + 1e-9]
            if entered:
                correct[i] = right(entered[-1])[i]
                spent[i] = held[entered[-1]]
            else:
                correct[i] = prior_right[i]
        return float(correct.mean()), float(spent.mean())

    return capped_numbers({held[k] for path in paths for k in path}, evaluate)


def _held_groups(est: CSTCClassifier) -> list[set[int]]:
    held: list[set[int]] = [set() for _ in est.export_nodes_]
    for k, node in enumerate(est.export_nodes_):
        held[k] |= set(node.groups)
        for child in (node.upper, node.lower):
            if child is not None:
                held[child] |= held[k]
    return held


def build_cstc_bundle(
    out_dir: Path,
    spec: CstcSpec,
    x: npt.NDArray[np.float64],
    y: npt.NDArray[Any],
    columns: list[str],
    *,
    data_fingerprint: str | None = None,
    executor: Executor = INLINE,
) -> CstcBuildResult:
    """Split, fit every (method, λ) on ``executor``, refit the nodes (``node_models:
    tuned``), fit the fixed subsets, keep the validation Pareto set, export, verify, write
    atomically. Points are chosen, and their accuracies and costs in the manifest (which the
    service chooses between) measured, on validation rows; test rows only check the export
    and are reported in the sweep (provenance), never used in a choice."""
    spec.check()
    positions = column_positions(spec, columns)
    sensor_names = list(spec.sensors)
    order = [c for s in sensor_names for c in positions[s]]
    x = np.asarray(x[:, order], dtype=np.float32).astype(np.float64)
    groups: list[list[int]] = []
    start = 0
    for s in sensor_names:
        groups.append(list(range(start, start + len(positions[s]))))
        start += len(positions[s])
    sensor_costs = spec.sensor_costs()
    costs = [sensor_costs[s] for s in sensor_names]
    x_train, x_val, x_test, y_train, y_val, y_test = spec.split(x, y)
    classes = np.unique(y_train)
    configs = [Config(m, float(lam)) for m in spec.chosen_methods() for lam in spec.lambdas]
    fitted = executor.map(_fit, configs, shared=(spec, groups, costs, x_train, y_train))
    search = spec.fixed_search()
    subsets = (
        None
        if search is None
        else FixedSubsets(
            x_train,
            y_train,
            x_val,
            y_val,
            dict(zip(sensor_names, groups, strict=True)),
            sensor_costs,
            search,
            spec.seed,
            executor,
        )
    )
    fixed = [] if subsets is None else subsets.best()
    node_fits: dict[str, list[SubsetFit] | None] = {}
    if subsets is not None and spec.node_models == "tuned":
        helds = [held_sensors(est, sensor_names) for est in fitted]
        fits = subsets.fit(h for held in helds for h in held)
        for config, held in zip(configs, helds, strict=True):
            node_fits[config.id] = [fits[h] for h in held]
    rows: list[dict[str, Any]] = []
    for config, est in zip(configs, fitted, strict=True):
        tuned = node_fits.get(config.id)
        val_pred, val_cost = _answers(est, x_val, tuned)
        test_pred, test_cost = _answers(est, x_test, tuned)
        rows.append(
            {
                "id": config.id,
                "method": config.method,
                "lam": config.lam,
                "validation_accuracy": float(np.mean(val_pred == y_val)),
                "validation_cost": val_cost,
                "test_accuracy": float(np.mean(test_pred == y_test)),
                "test_cost": test_cost,
                "linear_validation_accuracy": float(np.mean(est.predict(x_val) == y_val)),
                "nodes": len(est.nodes_),
            }
        )
    # point id -> (the tree or cascade it stops early, level, the nodes with an exit)
    exits: dict[str, tuple[str, float, list[bool]]] = {}
    for config, est in zip(configs, fitted, strict=True):
        tuned = node_fits.get(config.id)
        method = EXIT_METHODS.get(config.method)
        if method is None or tuned is None:
            continue
        at = exit_nodes(est, config.method)
        if (config.method == "cscc" and not cascade_order(est)) or not any(at):
            continue
        for level in spec.exit_levels:
            point_id = f"{config.id}-exit{level:g}"
            exits[point_id] = (config.id, float(level), at)
            val_pred, val_costs, _, _ = exit_answers(est, tuned, level, x_val, costs, at)
            test_pred, test_costs, _, _ = exit_answers(est, tuned, level, x_test, costs, at)
            rows.append(
                {
                    "id": point_id,
                    "method": method,
                    "lam": config.lam,
                    "validation_accuracy": float(np.mean(val_pred == y_val)),
                    "validation_cost": float(val_costs.mean()),
                    "test_accuracy": float(np.mean(test_pred == y_test)),
                    "test_cost": float(test_costs.mean()),
                    "linear_validation_accuracy": math.nan,
                    "nodes": len(est.nodes_),
                }
            )
    kept = pareto_points(rows) if spec.pareto else rows
    by_id = dict(zip((c.id for c in configs), fitted, strict=True))
    for point_id, (base, _, _) in exits.items():
        by_id[point_id] = by_id[base]
        if base in node_fits:
            node_fits[point_id] = node_fits[base]
    prior = np.asarray([np.mean(y_train == c) for c in classes])
    with staging(out_dir) as tmp:
        models = [
            ModelSpec(
                id="prior",
                features=[],
                accuracy=float(np.mean(y_val == classes[int(np.argmax(prior))])),
                prior=[float(p) for p in prior],
                input_dims=0,
            )
        ]
        fixed_models, fixed_points = export_fixed(tmp, fixed, x_test)
        models += fixed_models
        have = {m.id for m in models}
        node_only = {
            f.model_id: f
            for row in kept
            for f in node_fits.get(row["id"]) or []
            if f.estimator is not None and f.model_id not in have
        }
        models += export_fixed(tmp, list(node_only.values()), x_test)[0]
        points = []
        for row in kept:
            est = by_id[row["id"]]
            node_models, nodes = export_point(
                tmp,
                row["id"],
                est,
                groups,
                sensor_names,
                (x_val, y_val),
                x_test,
                node_fits.get(row["id"]),
            )
            models += node_models
            exit_level: float | None = None
            exit_at: list[bool] | None = None
            if row["id"] in exits:
                exit_level, exit_at = exits[row["id"]][1:]
                nodes = [
                    n.model_copy(update={"exit_confidence": exit_level}) if has else n
                    for n, has in zip(nodes, exit_at, strict=True)
                ]
            capped = capped_point(
                est,
                node_fits.get(row["id"]),
                exit_level,
                x_val,
                y_val,
                costs,
                classes[int(np.argmax(prior))],
                exit_at,
            )
            points.append(
                CstcPoint(
                    id=row["id"],
                    method=row["method"],
                    lam=row["lam"],
                    mean_cost=row["validation_cost"],
                    accuracy=row["validation_accuracy"],
                    nodes=nodes,
                    capped=capped,
                )
            )
        manifest = Manifest(
            name=spec.name,
            version=bundle_version(tmp),
            classes=[str(c) for c in classes],
            cost_unit=spec.unit,
            cost_basis="declared",
            item=spec.item(),
            extractors=spec.extractors(),
            models=models,
            strategies=[
                CstcStrategy(
                    name="cstc",
                    points=points,
                    tolerance=spec.tolerance,
                    fixed=fixed_points,
                    **spec.margin_fields(len(y_val)),
                )
            ],
            default_strategy="cstc",
            provenance=provenance(
                data_fingerprint or fingerprint(x, y),
                {
                    "label": spec.label,
                    "sensors": spec.sensors,
                    "costs": sensor_costs,
                    "methods": spec.chosen_methods(),
                    "lambdas": spec.lambdas,
                    "depth": spec.depth,
                    "sharpness": spec.sharpness,
                    "rho": spec.rho,
                    "seed": spec.seed,
                    "node_models": spec.node_models if subsets is not None else "linear",
                    "rows": {"train": len(y_train), "validation": len(y_val), "test": len(y_test)},
                    "fixed_search": None if search is None else vars(search),
                    "fixed_points": fixed_summary(fixed),
                    "sweep": rows,
                },
            ),
        )
        write_manifest(tmp, manifest)
    return CstcBuildResult(
        manifest,
        out_dir,
        rows,
        {r["id"]: by_id[r["id"]] for r in kept},
        (x_test, y_test),
        fixed,
        {r["id"]: nf for r in kept if (nf := node_fits.get(r["id"])) is not None},
    )


def pareto_points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for row in sorted(rows, key=lambda r: (r["validation_cost"], -r["validation_accuracy"])):
        if not out or row["validation_accuracy"] > out[-1]["validation_accuracy"]:
            out.append(row)
    return out
