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

    ``refine`` > 0 makes the grid adaptive (:func:`refine_midpoints`): each round bisects the
    neighbouring scales (sorted) whose mean validation costs are furthest apart — every gap
    wider than :data:`GAP_FRACTION` of the smallest positive sensor cost and at least half as
    wide as the widest such gap, widest first — at their geometric mean (hi / 8 when the lower
    one is 0); a gap whose two scales are within 1 % of each other is not bisected again. It
    stops when no gap is open or ``refine`` scales have been added. The budget's open cost
    ranges thus get operating points first, wherever the policies can make them.

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
    while refine > len(added) and step > 0:
        points = sorted({p[0]: p for p in out + added}.values(), key=lambda p: p[0])
        mids = refine_midpoints([(p[0], p[2]) for p in points], step)[: refine - len(added)]
        if not mids:
            break
        scored = executor.map(_score_point, mids, shared=(base, X, X_val, y_val))
        for cs, (policies, spent, error) in zip(mids, scored, strict=True):
            assert policies is not None
            added.append((float(cs), base._with_policies(policies), spent, error))
    return out + sorted(added, key=lambda p: p[0])


#: A cost gap between neighbouring scales is open when wider than this fraction of the
#: smallest positive sensor cost.
GAP_FRACTION = 0.25
#: Two scales closer than this ratio are not bisected again.
MIN_RATIO = 1.01


def refine_midpoints(points: Sequence[tuple[float, float]], step: float) -> list[float]:
    """One round of the adaptive grid: ``points`` are ``(cost scale, mean validation cost)``
    sorted by scale, ``step`` the smallest positive sensor cost. Returns the scales to add,
    widest cost gap first: the geometric mean of every neighbouring pair whose costs differ by
    more than ``GAP_FRACTION * step`` and by at least half the widest such difference, unless
    the pair's scales are within ``MIN_RATIO`` of each other (or both below 1e-9)."""
    gaps: list[tuple[float, float]] = []
    for (lo, c_lo), (hi, c_hi) in itertools.pairwise(points):
        gap = abs(c_lo - c_hi)
        if gap <= GAP_FRACTION * step or hi < 1e-9:
            continue
        if lo > 0 and hi / lo < MIN_RATIO:
            continue
        gaps.append((gap, math.sqrt(lo * hi) if lo > 0 else hi / 8))
    if not gaps:
        return []
    widest = max(g for g, _ in gaps)
    gaps.sort(key=lambda g: -g[0])
    return [mid for gap, mid in gaps if gap >= widest / 2]


def _score_point(
    base: DagClassifier, X: Any, X_val: Any, y_val: Any, cost_scale: float | None
) -> tuple[dict[str, Any] | None, float, float]:
    """One sweep point: the policies retrained for ``cost_scale`` (None: ``base`` as it is,
    no policies returned) and their mean acquired cost and error rate on the validation set."""
    model = base if cost_scale is None else base._with_cost_scale(cost_scale, X)
    pred, spent, _ = model.predict_with_cost(X_val)
    policies = None if cost_scale is None else model._policy_state()
    return policies, float(spent.mean()), float(np.mean(pred != np.asarray(y_val)))
