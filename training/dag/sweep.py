"""One DAG per cost scale λ, sharing Alg. 2's groups and the classifier bank: the operating points
a DAG bundle exports.
"""

from __future__ import annotations

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
    rest = executor.map(
        _score_point, [float(cs) for cs in cost_scales[1:]], shared=(base, X, X_val, y_val)
    )
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
