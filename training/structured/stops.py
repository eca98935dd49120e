"""The anytime policy's stop (our addition to paper 004's Alg. 2): Alg. 2 ends an example at
the first step whose best (part, template) pair π_t scores below a threshold, so an example
the policies see as done stops buying before its budget is spent. The threshold is chosen on
the examples the policies learned from (cross-fitted), never on held-out ones, as the
highest of a grid that costs at most a tolerance of accuracy with every budget; a bundle
carries one per tolerance of :data:`STOP_TOLERANCES` (its stop table), so that a request can
say how much accuracy it accepts to lose for time (0: the top).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from training.structured.policies import AnytimePolicy
from training.structured.problem import StructuredProblem

#: Thresholds tried on π_t's best score.
STOP_GRID = tuple(np.round(np.arange(-4.0, 0.01, 0.25), 2).tolist())
#: How much accuracy with every budget the bundle's default stop may cost.
STOP_TOLERANCE = 0.005
#: The tolerances a bundle's stop table answers.
STOP_TOLERANCES = (0.0, 0.0025, 0.005, 0.01, 0.02)


def stop_table(
    policy: AnytimePolicy,
    problem: StructuredProblem,
    *,
    grid: Sequence[float] = STOP_GRID,
    tolerances: Sequence[float] = STOP_TOLERANCES,
) -> list[tuple[float, float | None]]:
    """For each tolerance, the highest threshold of ``grid`` at which Alg. 2 with every
    budget (all pairs allowed) is at most that much less accurate (Hamming) on ``problem``'s
    examples than without a stop; None when none is. Choose it on the examples the policies
    learned from (cross-fitted), never on held-out ones: a higher threshold stops sooner and
    saves more."""
    idx = list(range(problem.n_examples))
    if not idx:
        return [(float(t), None) for t in sorted(tolerances)]
    ts = problem.templates
    letters = sum(problem.parts(i) for i in idx)
    inputs = [problem.policy_inputs(i) for i in idx]
    starts = [ts.initial(problem.parts(i)) for i in idx]

    def accuracy(stop: float | None) -> float:
        rule = AnytimePolicy(policy.lam, policy.optional, policy.scorer, policy.steps, [], stop)
        states = [rule.run(x, s, ts, np.inf) for x, s in zip(inputs, starts, strict=True)]
        return 1.0 - float(problem.losses(idx, states, soft=False).sum()) / letters

    top = accuracy(None)
    scored = [(float(stop), accuracy(stop)) for stop in sorted(grid, reverse=True)]
    out: list[tuple[float, float | None]] = []
    for tolerance in sorted(tolerances):
        kept = next((stop for stop, acc in scored if acc >= top - tolerance), None)
        out.append((float(tolerance), kept))
    return out
