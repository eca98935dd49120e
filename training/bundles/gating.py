"""Build a gating bundle (paper 001) from tabular data: sweep ADAPT-GBRT, ADAPT-LIN, the L1
baseline and GreedyMiser over (P_full, λ/γ/C), add f1's own confidence as a gate to f0 or to a
fixed subset's model, keep the validation Pareto set (plus f0 alone) as one ``gating``
strategy with the best fixed sensor subsets beside it, export every gate and model to ONNX
and check it.

Each sensor is a ``sensor`` extractor with a declared cost: one column (the paper's
per-feature costs) or several (a sensor's cost paid once, whatever columns of it are read:
ADAPT-GBRT and GreedyMiser only); budgets and spent costs are in the bundle's unit.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from sklearn.ensemble import RandomForestClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import SVC

from service.bundle import (
    GatePoint,
    GatingStrategy,
    Manifest,
    ModelSpec,
    write_manifest,
)
from training.bundles.writer import bundle_version, provenance, staging
from training.data.tabular import TabularSpec, column_positions, fingerprint
from training.executor import INLINE, Executor
from training.export.fixed import export_fixed
from training.export.gating import (
    ExportedModel,
    export_f0,
    export_system,
    system_outputs,
    verify_f0,
    verify_system,
)
from training.fixed_subsets import (
    FixedSubsets,
    SubsetFit,
    WithFixedSubsets,
    fixed_summary,
)
from training.gating import AdaptGbrt, FittedF0, default_gbrt_f0, tune_gbrt_f0
from training.gating.confidence import (
    ConfidenceGate,
    HighModel,
    confidence_points,
    confidence_systems,
)
from training.gating.sweep import (
    METHODS,
    ROUTED_FRACTIONS,
    Config,
    SweepPoint,
    default_grid,
    pareto,
    sweep,
)

#: "lightgbm-tuned": LightGBM tuned on the validation rows (:func:`tune_gbrt_f0`), the
#: strongest f0 the benchmark found; "lightgbm": one fixed setting (faster to build).
F0_KINDS = ("lightgbm", "lightgbm-tuned", "random-forest", "rbf-svm")


#: The methods that take sensors of several columns (a sensor's cost paid once).
GROUPED_METHODS = ("adapt-gbrt", "greedymiser")


@dataclass
class GatingSpec(WithFixedSubsets, TabularSpec):
    """``budgetserve-train gating`` reads this beside the CSV. ``sensors`` may be a list of
    column names (one sensor per column, named after it) or sensors of several columns (a
    sensor's cost is paid once, whatever columns of it are read; ADAPT-GBRT and GreedyMiser
    only). ``confidence``: also try f1's own confidence as the gate, to f0 or to a fixed
    subset's model (:mod:`training.gating.confidence`). ``fixed``: the fixed-subset search
    (:mod:`training.fixed_subsets`; false: none)."""

    methods: list[str] | None = None  # default: every method (grouped sensors: GBRT ones)
    f0: str = "lightgbm"
    grid: list[dict[str, Any]] | None = None  # [{method, p_full, regularisation}], optional
    pareto: bool = True  # keep the validation Pareto set only (False: every point, to inspect)
    tolerance: float = 0.0  # served: the most accurate on validation (a request may differ)
    standardize: bool = True  # ADAPT-LIN's group penalty on standardised weights
    confidence: bool = True
    gbrt: dict[str, Any] | None = None  # ADAPT-GBRT / GreedyMiser settings, e.g. n_rounds

    def __post_init__(self) -> None:
        if isinstance(self.sensors, list):
            self.sensors = {str(c): [str(c)] for c in self.sensors}

    @property
    def grouped(self) -> bool:
        return isinstance(self.sensors, dict) and any(
            isinstance(cols, list) and len(cols) > 1 for cols in self.sensors.values()
        )

    def chosen_methods(self) -> list[str]:
        if self.methods is not None:
            return list(self.methods)
        return list(GROUPED_METHODS if self.grouped else METHODS)

    def check(self) -> None:
        super().check()
        linear = (
            [c.method for c in self.configs() if c.method not in GROUPED_METHODS]
            if self.grouped
            else []
        )
        if linear:
            several = {s: cols for s, cols in self.sensors.items() if len(cols) != 1}
            raise ValueError(
                f"methods {sorted(set(linear))} need one column per sensor; {several} have "
                f"several: use methods {list(GROUPED_METHODS)} (a sensor's cost is paid once), "
                "or split the sensors"
            )
        if not isinstance(self.tolerance, int | float) or not 0 <= self.tolerance <= 1:
            raise ValueError(f"tolerance must be a number in [0, 1], got {self.tolerance!r}")
        if self.f0 not in F0_KINDS:
            raise ValueError(f"f0 must be one of {list(F0_KINDS)}, got {self.f0!r}")
        self.configs()  # validates methods and grid
        allowed = {"n_rounds", "trees_per_round", "num_leaves", "learning_rate", "f1_cv"}
        if self.gbrt is not None and (
            not isinstance(self.gbrt, dict) or not set(self.gbrt) <= allowed
        ):
            raise ValueError(
                f"gbrt must be a mapping of {sorted(allowed)} (ADAPT-GBRT and GreedyMiser "
                f"settings), got {self.gbrt!r}"
            )
        self.fixed_search()  # validates the fixed-subset search

    def configs(self) -> list[Config]:
        if self.grid is None:
            return default_grid(self.chosen_methods())
        out = []
        for entry in self.grid:
            if not isinstance(entry, dict) or set(entry) != {"method", "p_full", "regularisation"}:
                raise ValueError(
                    f"grid entries are {{method, p_full, regularisation}} mappings, got {entry!r}"
                )
            if entry["method"] not in METHODS:
                raise ValueError(f"unknown gating method {entry['method']!r}; known: {METHODS}")
            out.append(
                Config(str(entry["method"]), float(entry["p_full"]), float(entry["regularisation"]))
            )
        return out

    def make_f0(self) -> Any:
        if self.f0 == "random-forest":
            return RandomForestClassifier(n_estimators=200, random_state=self.seed, n_jobs=1)
        if self.f0 == "rbf-svm":  # the paper's other f0 (Fig. 4d, 5); Platt probabilities
            return make_pipeline(
                StandardScaler(), SVC(kernel="rbf", probability=True, random_state=self.seed)
            )
        return default_gbrt_f0(self.seed)


@dataclass
class GatingBuildResult:
    manifest: Manifest
    path: Path
    points: list[dict[str, Any]]  # the whole sweep, validation and test numbers
    f0_accuracy: dict[str, float]
    estimators: dict[str, Any] = field(default_factory=dict)  # exported point id -> fitted
    fixed: list[SubsetFit] = field(default_factory=list)  # the bundle's fixed points


def _file_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def build_gating_bundle(
    out_dir: Path,
    spec: GatingSpec,
    x: npt.NDArray[np.float64],
    y: npt.NDArray[Any],
    columns: Sequence[str],
    *,
    data_fingerprint: str | None = None,
    executor: Executor = INLINE,
) -> GatingBuildResult:
    """Split, fit f0 once, sweep (its fits on ``executor``), add the confidence gates and
    the fixed subsets, keep the validation Pareto set, export, verify, write atomically.
    Every choice is made on the validation rows, and the accuracies, costs and routed
    fractions written to the manifest (what the service chooses by) are the validation
    rows'; the test rows took no part in any choice and are reported in the provenance."""
    spec.check()
    positions = column_positions(spec, columns)
    sensor_names = list(spec.sensors)
    order = [c for s in sensor_names for c in positions[s]]  # the sensors' columns, in order
    x = x[:, order]
    groups: list[list[int]] = []
    for s in sensor_names:
        start = sum(len(g) for g in groups)
        groups.append(list(range(start, start + len(positions[s]))))
    sensor_of = {c: s for s, g in zip(sensor_names, groups, strict=True) for c in g}
    sensor_costs = spec.sensor_costs()
    costs = np.asarray([sensor_costs[s] for s in sensor_names for _ in positions[s]])
    x_train, x_val, x_test, y_train, y_val, y_test = spec.split(x, y)
    classes = np.unique(y_train)
    f0_model = spec.make_f0()
    f0_choice: dict[str, Any] | None = None
    if spec.f0 == "lightgbm-tuned":
        tuned = tune_gbrt_f0(x_train, y_train, x_val, y_val, random_state=spec.seed)
        f0_model = tuned.estimator()
        f0_choice = {k: tuned.params[k] for k in ("n_estimators", "num_leaves", "learning_rate")}
    f0 = FittedF0.fit(f0_model, x_train, y_train, random_state=spec.seed)
    points = sweep(
        x_train,
        y_train,
        x_val,
        y_val,
        costs=costs,
        f0=f0,
        grid=spec.configs(),
        X_test=x_test,
        y_test=y_test,
        standardize=spec.standardize,
        gbrt_params={
            **(spec.gbrt or {}),
            **({"feature_groups": groups} if spec.grouped else {}),
        },
        random_state=spec.seed,
        executor=executor,
    )
    search = spec.fixed_search()
    fixed: list[SubsetFit] = []
    if search is not None:
        sensors = {s: g for s, g in zip(sensor_names, groups, strict=True)}
        subsets = FixedSubsets(
            x_train, y_train, x_val, y_val, sensors, sensor_costs, search, spec.seed, executor
        )
        fixed = subsets.best()
    if spec.confidence:
        highs = [HighModel("f0", f0.model, list(range(x.shape[1])))]
        highs += [HighModel(f.model_id, f.estimator, f.columns) for f in fixed if f.estimator]
        sources = [(p.id, p.estimator) for p in points if isinstance(p.estimator, AdaptGbrt)]
        systems = confidence_systems(sources, highs, x_val, y_val, ROUTED_FRACTIONS)
        # derived from fits already made: only their own validation Pareto set is worth
        # adding (also with pareto: false)
        points += pareto(confidence_points(systems, x_val, y_val, x_test, y_test))
    f0_val = float(np.mean(classes[f0.model.predict(x_val)] == y_val))
    f0_test = float(np.mean(classes[f0.model.predict(x_test)] == y_test))
    full_cost = float(sum(sensor_costs.values()))
    kept = pareto(points) if spec.pareto else sorted(points, key=lambda p: p.val_cost)
    # f0 alone is a point of its own: drop what it dominates (full cost, no more accurate).
    front = [p for p in kept if p.val_cost < full_cost or p.val_accuracy > f0_val]

    def features(cols: Sequence[int]) -> list[str]:
        return list(dict.fromkeys(sensor_of[int(c)] for c in cols))

    with staging(out_dir) as tmp:
        prior = np.asarray([np.mean(y_train == c) for c in classes])
        f0_exported = export_f0(f0.model, x.shape[1], x_train)
        verify_f0(f0_exported, f0.model, x_test)
        assert f0_exported.onnx is not None
        (tmp / "f0.onnx").write_bytes(f0_exported.onnx)
        models = [
            ModelSpec(
                id="prior",
                features=[],
                accuracy=float(np.mean(y_val == classes[int(np.argmax(prior))])),
                prior=[float(p) for p in prior],
                input_dims=0,
            ),
            ModelSpec(
                id="f0",
                features=list(sensor_names),
                accuracy=f0_val,
                file="f0.onnx",
                input_dims=x.shape[1],
            ),
        ]
        fixed_models, fixed_points = export_fixed(tmp, fixed, x_test)
        models += fixed_models
        gate_points = [
            GatePoint(
                id="f0",
                method="f0",
                p_full=1.0,
                regularisation=0.0,
                low_model="f0",
                high_model="f0",
                mean_cost=full_cost,
                fraction_full=1.0,
                accuracy=f0_val,
            )
        ]
        exported: dict[str, Any] = {"f0": f0.model}
        for point in front:
            system = export_system(point.estimator, x_train)
            if system.always_full:
                continue  # the gate sends everything to f0: the f0 point already covers it
            verify_system(point.estimator, system, x_test, label=point.id)
            exported[point.id] = point.estimator
            low_id = f"{point.id}.f1"
            models.append(
                _low_model(tmp, low_id, system.f1, features(system.f1.columns), point, x_val, y_val)
            )
            gate_file = None
            if system.gate.onnx is not None:
                gate_file = _file_name(f"{point.id}.gate.onnx")
                (tmp / gate_file).write_bytes(system.gate.onnx)
            high = (
                point.estimator.high.model_id
                if isinstance(point.estimator, ConfidenceGate)
                else "f0"
            )
            gate_points.append(
                GatePoint(
                    id=point.id,
                    method=point.method,
                    p_full=point.p_full,
                    regularisation=point.regularisation,
                    gate_file=gate_file,
                    gate_features=features(system.gate.columns),
                    gate_input_dims=len(system.gate.columns),
                    threshold=system.gate.threshold,
                    low_model=low_id,
                    high_model=high,
                    mean_cost=point.val_cost,
                    fraction_full=point.val_fraction_full,
                    accuracy=point.val_accuracy,
                )
            )
        summary = [_summary(p) for p in points]
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
                GatingStrategy(
                    name="gating",
                    points=gate_points,
                    tolerance=spec.tolerance,
                    fixed=fixed_points,
                    **spec.margin_fields(len(y_val)),
                )
            ],
            default_strategy="gating",
            provenance=provenance(
                data_fingerprint or fingerprint(x, y),
                {
                    "label": spec.label,
                    "sensors": spec.sensors,
                    "costs": sensor_costs,
                    "f0": spec.f0,
                    "f0_params": f0_choice,
                    "methods": spec.chosen_methods(),
                    "confidence": spec.confidence,
                    "seed": spec.seed,
                    "rows": {"train": len(y_train), "validation": len(y_val), "test": len(y_test)},
                    "f0_accuracy": {"validation": f0_val, "test": f0_test},
                    "fixed_search": None if search is None else vars(search),
                    "fixed_points": fixed_summary(fixed),
                    "sweep": summary,
                },
            ),
        )
        write_manifest(tmp, manifest)
    return GatingBuildResult(
        manifest, out_dir, summary, {"validation": f0_val, "test": f0_test}, exported, fixed
    )


def _summary(p: SweepPoint) -> dict[str, Any]:
    return {
        "id": p.id,
        "method": p.method,
        "p_full": p.p_full,
        "regularisation": p.regularisation,
        "validation_accuracy": p.val_accuracy,
        "validation_cost": p.val_cost,
        "validation_fraction_full": p.val_fraction_full,
        "validation_f1_accuracy": p.val_f1_accuracy,
        "test_accuracy": p.test_accuracy,
        "test_cost": p.test_cost,
        "test_fraction_full": p.test_fraction_full,
        "test_f1_accuracy": p.test_f1_accuracy,
    }


def _low_model(
    folder: Path,
    model_id: str,
    f1: ExportedModel,
    features: list[str],
    point: SweepPoint,
    x_val: npt.NDArray[np.float64],
    y_val: npt.NDArray[Any],
) -> ModelSpec:
    """f1 of an operating point as a bundle model; its accuracy is f1 alone on the
    validation rows."""
    est = point.estimator
    proba = system_outputs(est, x_val)[1]
    accuracy = float(np.mean(est.classes_[np.argmax(proba, axis=1)] == y_val))
    if f1.onnx is None:
        assert f1.prior is not None
        return ModelSpec(id=model_id, features=[], accuracy=accuracy, prior=f1.prior, input_dims=0)
    file = _file_name(f"{model_id}.onnx")
    (folder / file).write_bytes(f1.onnx)
    return ModelSpec(
        id=model_id,
        features=features,
        accuracy=accuracy,
        file=file,
        input_dims=len(f1.columns),
    )
