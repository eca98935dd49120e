"""The baselines of paper 004's policies, on any :class:`StructuredProblem`:
:func:`uniform_states` (random part-level actions) and :func:`myopic_states` ("cheap
features everywhere, all expensive ones when the size-normalised confidence is below a
threshold")."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from training.structured.problem import StructuredProblem

F64 = npt.NDArray[np.float64]
Bool = npt.NDArray[np.bool_]


def uniform_states(
    problem: StructuredProblem, fraction: float, rng: np.random.Generator
) -> list[Bool]:
    """Each optional (part, template) pair acquired independently with probability
    ``fraction`` (the paper's uniform policy: random part-level actions)."""
    ts = problem.templates
    out = []
    for i in range(problem.n_examples):
        s = ts.initial(problem.parts(i))
        for k in ts.optional:
            s[:, k] |= rng.random(len(s)) < fraction
        out.append(s)
    return out


def myopic_states(problem: StructuredProblem, threshold: float) -> tuple[list[Bool], F64]:
    """Run the predictor on S0; examples whose size-normalised confidence is below
    ``threshold`` get every template on every part (whole-example selection). Returns the
    states and the S0 confidences."""
    ts = problem.templates
    idx = list(range(problem.n_examples))
    start = [ts.initial(problem.parts(i)) for i in idx]
    conf = problem.confidence(idx, start)
    states = [ts.full(len(s)) if c < threshold else s for s, c in zip(start, conf, strict=True)]
    return states, conf
