"""A small CSTC bundle built by the real builder (training.bundles.cstc) from synthetic
rows: three classes, four sensors (one of two columns) with costs 1, 2, 4, 8."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from training.bundles.cstc import CstcBuildResult, CstcSpec, build_cstc_bundle

COLUMNS = ["a", "b1", "b2", "c", "d"]
SENSORS = {"a": ["a"], "b": ["b1", "b2"], "c": ["c"], "d": ["d"]}
COSTS = {"a": 1.0, "b": 2.0, "c": 4.0, "d": 8.0}


def make_data(n: int = 900, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, len(COLUMNS)))
    gate = X[:, 0] > 0  # sensor a decides whether c or d tells the class
    score = 2.0 * X[:, 0] + 0.5 * X[:, 1] + 2.0 * np.where(gate, X[:, 3], X[:, 4])
    y = np.where(score > 0.8, "high", np.where(score < -0.8, "low", "mid"))
    return X, y


def build(out: Path, methods: list[str] | None = None, *, tuned: bool = False) -> CstcBuildResult:
    """Linear nodes and no fixed points (the trained walk and nodes as they are), unless
    ``tuned``: refit nodes, a cascade with confidence exits and fixed points, with a small
    search and every point kept (not only the validation Pareto set)."""
    X, y = make_data()
    spec = CstcSpec(
        name=out.name,
        label="label",
        sensors=dict(SENSORS),
        costs=dict(COSTS),
        methods=methods or (["cstc", "cscc"] if tuned else ["cstc", "cscc", "root-only"]),
        lambdas=[0.03, 0.1] if tuned else [0.03, 0.1, 0.3],
        depth=3,
        node_models="tuned" if tuned else "linear",
        fixed={"num_leaves": [7], "max_trees": 60, "patience": 15} if tuned else False,
        exit_levels=[0.8],
        pareto=not tuned,
    )
    return build_cstc_bundle(out, spec, X, y, COLUMNS)
