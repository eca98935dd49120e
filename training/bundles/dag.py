"""Build a DAG bundle (paper 000) from tabular data: sensors with declared costs, a sweep of
the cost trade-off, every classifier and policy exported to ONNX and checked.

The bundle's items are ``{"values": {column: number}}``; each sensor is an instance of the
built-in ``sensor`` extractor serving its columns at a declared cost (``cost_basis:
"declared"``: budgets and spent costs are in the bundle's unit, not in milliseconds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.bundle import (
    DagStrategy,
    Manifest,
    write_manifest,
)
from training.bundles.writer import bundle_version, capped_numbers, provenance, staging
from training.dag import DagClassifier, sweep
from training.dag.policies import check_policy_options
from training.data.tabular import (
    TabularSpec,
    column_positions,
    fingerprint,
    read_csv,
    sensor_extractors,
    tabular_item,
)
from training.executor import INLINE, Executor
from training.export.dag import DagExportMismatch, export_bank, export_policy, verify_policy
from training.export.fixed import export_fixed
from training.fixed_subsets import (
    FixedSubsets,
    SubsetFit,
    WithFixedSubsets,
    fixed_summary,
)

__all__ = ["DagBuildResult", "DagExportMismatch", "DagSpec", "build_dag_bundle", "read_csv"]

#: How the classifier bank is fitted: each state as its tuned fixed subset, or ``learner``.
BANKS = ("tuned", "learner")


@dataclass
class DagSpec(WithFixedSubsets, TabularSpec):
    """What ``budgetserve-train dag`` reads besides the CSV (JSON or YAML): the tabular spec
    plus the cost trade-offs to sweep, how many scales the adaptive grid may add between them
    (``refine_scales``, see :func:`training.dag.sweep`), the learners of the classifier bank
    and of the policies (``linear``, ``poly2``, ``poly3``, ``gbrt``), what the policies see
    (``policy_inputs``: ``features+confidence``, the default, or ``features``: the state's
    columns only; served, the state's classifier's confidence took the DAG on letter from
    +1.0 to +7.6 points over the best fixed mixture at a mean of 1.5 sensors) and, for many sensors,
    the number of groups (``n_subsets``: Alg. 2) or ``groups: chain``: the increments of
    the fixed-subset search's greedy forward chain at 1, 2, 3, 5, 8 and 13 sensors, and the
    rest (the states then hold the chain's best subsets, which Alg. 2's small complementary
    subsets did not: on the MiniBooNE sample its 7 single features never beat the tuned
    fixed subsets). ``bank: tuned`` (default) fits each state's classifier as
    its fixed subset, chosen on the validation rows (:mod:`training.fixed_subsets`; ``fixed``
    sets that search); ``bank: learner`` uses ``learner``. The bundle also carries the best
    fixed subsets (``fixed: false`` leaves them out)."""

    cost_scales: list[float] = field(
        default_factory=lambda: [0.0, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0]
    )
    refine_scales: int = 16
    learner: str = "linear"
    policy_learner: str | None = None
    policy_inputs: str = "features+confidence"
    n_subsets: int | None = None
    groups: str | None = None
    bank: str = "tuned"
    folds: int = 5

    def check(self) -> None:
        super().check()
        if self.bank not in BANKS:
            raise ValueError(
                f"bank must be one of {list(BANKS)}, got {self.bank!r}: 'tuned' fits each "
                "state's classifier as its fixed subset (chosen on validation rows), "
                "'learner' uses `learner` as it is"
            )
        if self.groups not in (None, "chain"):
            raise ValueError(
                f"groups must be 'chain' (the fixed-subset search's greedy chain, in "
                f"increments) or left out, got {self.groups!r}"
            )
        if self.groups is not None and self.n_subsets is not None:
            raise ValueError("give groups: chain or n_subsets (Alg. 2), not both")
        if self.groups is not None and self.fixed_search() is None:
            raise ValueError(
                "groups: chain takes the fixed-subset search's chain; it needs `fixed`"
            )
        if self.bank == "tuned" and self.fixed_search() is None:
            raise ValueError("bank: tuned fits the states as fixed subsets; it needs `fixed`")
        if not self.cost_scales or any(c < 0 for c in self.cost_scales):
            raise ValueError("cost_scales must be a non-empty list of numbers >= 0")
        if (
            isinstance(self.refine_scales, bool)
            or not isinstance(self.refine_scales, int)
            or self.refine_scales < 0
        ):
            raise ValueError(
                f"refine_scales must be an int >= 0 (cost scales the adaptive grid may add), "
                f"got {self.refine_scales!r}"
            )
        check_policy_options(self.learner, self.policy_learner, self.policy_inputs)


@dataclass
class DagBuildResult:
    manifest: Manifest
    path: Path
    points: list[dict[str, float]]
    models: list[DagClassifier] = field(default_factory=list)  # one per policy, in order
    fixed: list[SubsetFit] = field(default_factory=list)  # the bundle's fixed points


#: Where ``groups: chain`` cuts the greedy chain (sensors in the prefix); the rest is one group.
CHAIN_CUTS = (1, 2, 3, 5, 8, 13)


def chain_groups(subsets: FixedSubsets) -> list[list[str]]:
    """The greedy forward chain (:meth:`FixedSubsets.greedy_chain`, by its proxy fits, also
    where the search itself is exhaustive) cut at :data:`CHAIN_CUTS`: each group the sensors
    its prefix adds, the last one every sensor left."""
    chain = subsets.greedy_chain()
    names = list(chain[-1])
    groups: list[list[str]] = []
    done: list[str] = []
    for cut in (*[c for c in CHAIN_CUTS if c < len(names)], len(names)):
        added = [n for n in chain[cut] if n not in done]
        if added:
            groups.append(added)
            done += added
    return groups


def build_dag_bundle(
    out_dir: Path,
    spec: DagSpec,
    x: npt.NDArray[np.float64],
    y: npt.NDArray[Any],
    columns: Sequence[str],
    *,
    data_fingerprint: str | None = None,
    executor: Executor = INLINE,
) -> DagBuildResult:
    """Split, sweep the cost trade-off (its tasks on ``executor``), export, verify, write
    ``out_dir`` atomically."""
    spec.check()
    position = {c: i for i, c in enumerate(columns)}
    sensors = column_positions(spec, columns)
    costs = spec.sensor_costs()
    x_train, x_val, x_test, y_train, y_val, y_test = spec.split(x, y)
    search = spec.fixed_search()
    if search is not None and spec.bank == "tuned" and spec.learner not in search.learners:
        # the bank's guarantee: no state weaker on validation than its subset fitted alone
        # with the DAG's learner
        search = dataclasses.replace(search, learners=(*search.learners, spec.learner))
    subsets = (
        None
        if search is None
        else FixedSubsets(
            x_train, y_train, x_val, y_val, sensors, costs, search, spec.seed, executor
        )
    )
    fits = sweep(
        x_train,
        y_train,
        x_val,
        y_val,
        spec.cost_scales,
        sensors=sensors,
        costs=costs,
        n_subsets=spec.n_subsets,
        groups=None if subsets is None or spec.groups is None else chain_groups(subsets),
        random_state=spec.seed,
        executor=executor,
        refine=spec.refine_scales,
        learner=spec.learner,
        policy_learner=spec.policy_learner,
        policy_inputs=spec.policy_inputs,
        bank=subsets if spec.bank == "tuned" else None,
        folds=spec.folds,
    )
    base = fits[0][1]
    fixed = [] if subsets is None else subsets.best([base.state_sensors(s) for s in base.states_])
    classes = [str(c) for c in base.classes_]
    sensor_names = list(spec.sensors)
    # The policy input: every sensor's columns, sensors in declaration order.
    offsets, width = {}, 0
    for name in sensor_names:
        offsets[name] = width
        width += len(spec.sensors[name])
    global_of_column = {
        position[c]: offsets[s] + j for s in sensor_names for j, c in enumerate(spec.sensors[s])
    }

    with staging(out_dir) as tmp:
        models = export_bank(tmp, base, classes, x_test)
        fixed_models, fixed_points = export_fixed(tmp, fixed, x_test)
        models += fixed_models
        policies, points = [], []
        for i, (scale, model, val_cost, val_error) in enumerate(fits):
            policy = export_policy(tmp, f"policy_{i}.onnx", model, width, global_of_column)
            verify_policy(tmp / policy.file, policy, model, x_val, global_of_column)
            pred, spent, _ = model.predict_with_cost(x_test)
            test_error = float(np.mean(pred != y_test))
            policies.append(
                policy.model_copy(
                    update={
                        "cost_scale": scale,
                        "mean_cost": val_cost,
                        "error": val_error,
                        "capped": _capped(model, x_val, y_val),
                    }
                )
            )
            points.append(
                {
                    "cost_scale": scale,
                    "validation_cost": val_cost,
                    "validation_error": val_error,
                    "test_cost": float(np.mean(spent)),
                    "test_error": test_error,
                }
            )
        manifest = Manifest(
            name=spec.name,
            version=bundle_version(tmp),
            classes=classes,
            cost_unit=spec.unit,
            cost_basis="declared",
            item=tabular_item(spec.sensors),
            extractors=sensor_extractors(spec.sensors, costs, spec.unit),
            models=models,
            strategies=[
                DagStrategy(
                    name="dag",
                    groups=[list(g) for g in base.groups_],
                    inputs=sensor_names,
                    policies=policies,
                    fixed=fixed_points,
                    **spec.margin_fields(len(y_val)),
                )
            ],
            default_strategy="dag",
            provenance=provenance(
                data_fingerprint or fingerprint(x, y),
                {
                    "label": spec.label,
                    "sensors": spec.sensors,
                    "costs": costs,
                    "cost_scales": spec.cost_scales,
                    "refine_scales": spec.refine_scales,
                    "swept_scales": [f[0] for f in fits],
                    "learner": spec.learner,
                    "policy_learner": spec.policy_learner or spec.learner,
                    "policy_inputs": spec.policy_inputs,
                    "n_subsets": spec.n_subsets,
                    "groups": spec.groups,
                    "bank": spec.bank,
                    "folds": spec.folds,
                    "fixed_search": None if search is None else vars(search),
                    "fixed_points": fixed_summary(fixed),
                    "seed": spec.seed,
                    "rows": {"train": len(y_train), "validation": len(y_val), "test": len(y_test)},
                    "operating_points": points,
                },
            ),
        )
        write_manifest(tmp, manifest)
    return DagBuildResult(manifest, out_dir, points, [model for _, model, _, _ in fits], fixed)


def _capped(model: DagClassifier, x: npt.NDArray[np.float64], y: npt.NDArray[Any]) -> Any:
    """The policy's validation numbers with every walk stopped at each cost a walk can stop
    at (the service's budget is a per-item hard cap)."""
    _, paths = model.acquisition(x)
    caps = {model.state_cost(s) for path in paths for s in path}

    def evaluate(cap: float) -> tuple[float, float]:
        pred, spent, _ = model.predict_with_cost(x, budget=cap)
        return float(np.mean(pred == np.asarray(y))), float(np.mean(spent))

    return capped_numbers(caps, evaluate)
