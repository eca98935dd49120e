"""One DAG per cost scale λ, sharing Alg. 2's groups and the classifier bank: the operating points
a DAG bundle exports.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from training.dag.estimator import DagClassifier
from training.executor import INLINE, Executor


def sweep(
    X: Any,
    y: Any,
    X_val: Any,
    y_val: Any,
    cost_scales: Sequence[float],
    *,
    executor: Executor = INLINE,
    refine: int = 0,
    **params: Any,
) -> list[tuple[float, DagClassifier, float, float]]:
    """Fit one DAG per ``cost_scale`` and score it on the validation set: a list of
    ``(cost_scale, fitted model, mean acquired cost, error rate)``, the given scales in the given
    order, then (with ``refine``) the added ones by increasing scale.

    ``refine`` > 0 makes the grid adaptive: while two neighbouring scales (sorted) have mean
    validation costs further apart than the smallest positive sensor cost, a scale is added
    between them (the geometric mean; hi / 8 when the lower one is 0), all open gaps at once
    per round, until every gap is closed, the two scales are within 0.01 % of each other, or
    ``refine`` scales have been added. Every budget step of one sensor's cost then has its own
    operating point wherever the policies can make one.

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
    rest = executor.map(
        _score_point, [float(cs) for cs in cost_scales[1:]], shared=(base, X, X_val, y_val)
    )
    out: list[tuple[float, DagClassifier, float, float]] = []
    for cs, (policies, spent, error) in zip(cost_scales, [first, *rest], strict=True):
        model = base if policies is None else base._with_policies(policies)
        out.append((float(cs), model, spent, error))
    if isinstance(refine, bool) or not isinstance(refine, int) or refine < 0:
        raise ValueError(f"refine must be an int >= 0 (scales to add), got {refine!r}")
    positive = [c for c in base.sensor_costs_.values() if c > 0]
    step = min(positive) if positive else 0.0
    added: list[tuple[float, DagClassifier, float, float]] = []
    closed: set[tuple[float, float]] = set()
    while refine > len(added) and step > 0:
        points = sorted({p[0]: p for p in out + added}.values(), key=lambda p: p[0])
        mids = []
        for lo, hi in itertools.pairwise(points):
            if abs(lo[2] - hi[2]) <= step or (lo[0], hi[0]) in closed:
                continue
            if (lo[0] > 0 and hi[0] / lo[0] < 1.0001) or hi[0] < 1e-9:
                closed.add((lo[0], hi[0]))
                continue
            mids.append(math.sqrt(lo[0] * hi[0]) if lo[0] > 0 else hi[0] / 8)
        mids = mids[: refine - len(added)]
        if not mids:
            break
        scored = executor.map(_score_point, mids, shared=(base, X, X_val, y_val))
        for cs, (policies, spent, error) in zip(mids, scored, strict=True):
            assert policies is not None
            added.append((float(cs), base._with_policies(policies), spent, error))
    return out + sorted(added, key=lambda p: p[0])


def _score_point(
    base: DagClassifier, X: Any, X_val: Any, y_val: Any, cost_scale: float | None
) -> tuple[dict[str, Any] | None, float, float]:
    """One sweep point: the policies retrained for ``cost_scale`` (None: ``base`` as it is,
    no policies returned) and their mean acquired cost and error rate on the validation set."""
    model = base if cost_scale is None else base._with_cost_scale(cost_scale, X)
    pred, spent, _ = model.predict_with_cost(X_val)
    policies = None if cost_scale is None else model._policy_state()
    return policies, float(spent.mean()), float(np.mean(pred != np.asarray(y_val)))
