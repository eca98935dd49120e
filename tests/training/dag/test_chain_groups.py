"""The DAG's groups taken from the fixed subsets' greedy forward chain (``groups: chain``,
:func:`training.bundles.dag.chain_groups`) and explicit groups (``DagClassifier(groups=...)``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from training.bundles.dag import CHAIN_CUTS, DagSpec, build_dag_bundle, chain_groups
from training.dag import DagClassifier
from training.fixed_subsets import FixedSearch, FixedSubsets

# small trees, and the greedy chain even for few sensors
SEARCH = {"num_leaves": [7], "max_trees": 30, "patience": 10, "max_exhaustive": 0}


def _many_sensors(n: int = 900, seed: int = 5) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """10 one-column sensors: s0 and s1 carry the label, s2..s4 a little, the rest noise."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 10))
    score = 1.5 * x[:, 0] + x[:, 1] + 0.4 * (x[:, 2] + x[:, 3] + x[:, 4])
    y = np.where(score + 0.5 * rng.normal(size=n) > 0, "yes", "no")
    return x, y, [f"s{i}" for i in range(10)]


def test_chain_groups_are_the_greedy_chains_increments(tmp_path: Path) -> None:
    """``groups: chain``: the DAG's groups are what the fixed-subset search's greedy chain
    adds at 1, 2, 3, 5, 8 sensors and the rest; every prefix at a cut is a DAG state, so the
    bank holds the chain's subsets and a policy can stop on any of them; the served walk is
    the trained one (its states are the chain's prefixes or unions of its steps)."""
    x, y, columns = _many_sensors()
    sensors = {c: [c] for c in columns}
    spec = DagSpec(
        name="chain",
        label="label",
        sensors=sensors,
        costs=dict.fromkeys(columns, 1.0),
        cost_scales=[0.0, 0.02],
        refine_scales=0,
        learner="linear",
        groups="chain",
        policy_inputs="features+confidence",
        folds=3,
        fixed=dict(SEARCH),
    )
    x_train, x_val, _, y_train, y_val, _ = spec.split(x, y)
    position = {c: i for i, c in enumerate(columns)}
    subsets = FixedSubsets(
        x_train,
        y_train,
        x_val,
        y_val,
        {s: [position[c] for c in cols] for s, cols in sensors.items()},
        spec.sensor_costs(),
        FixedSearch.from_mapping(SEARCH),
    )
    chain = subsets.greedy_chain()
    groups = chain_groups(subsets)
    assert [len(g) for g in groups] == [1, 1, 1, 2, 3, 2]
    flat = [s for g in groups for s in g]
    assert sorted(flat) == sorted(columns) and len(flat) == len(columns)
    for cut, k in zip(CHAIN_CUTS, range(1, len(groups)), strict=False):
        assert set(chain[cut]) == set(flat[: sum(len(g) for g in groups[:k])])
    assert set(chain[1]) <= {"s0", "s1"}, "the chain starts with an informative sensor"

    result = build_dag_bundle(tmp_path / "chain", spec, x, y, columns)
    model = result.models[0]
    assert [sorted(g) for g in model.groups_] == [sorted(g) for g in groups]
    states = {frozenset(model.state_sensors(s)) for s in model.states_}
    for cut in (1, 2, 3, 5, 8, 10):
        assert frozenset(chain[cut]) in states
    assert result.manifest.provenance.parameters["groups"] == "chain"


@pytest.mark.parametrize(
    ("groups", "n_subsets", "message"),
    [
        ([["s0"], ["s9", "zz"]], None, r"unknown: \['zz'\]"),
        ([["s0", "s1"]], None, "every sensor must be in a group"),
        ([[f"s{i}"] for i in range(9)] + [["s9"]], None, "groups must be 1 to 8"),
        ([[f"s{i}" for i in range(10)]], 3, "pass groups or n_subsets, not both"),
    ],
)
def test_explicit_groups_are_checked(groups: list, n_subsets: int | None, message: str) -> None:  # type: ignore[type-arg]
    x, y, columns = _many_sensors(200)
    with pytest.raises(ValueError, match=message):
        DagClassifier(
            sensors={c: [i] for i, c in enumerate(columns)}, groups=groups, n_subsets=n_subsets
        ).fit(x, y)
