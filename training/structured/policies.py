"""Feature-selection policies of paper 004, on any :class:`StructuredProblem`.

* :func:`greedy_trajectories` — the trajectory search of Section 2.1: from S0, repeatedly
  add the one (part, template) pair that minimises the modified loss
  C(S) = L(F(X, S), Y) + λ c(S), until every pair is in; the pseudo-label S* is the
  trajectory's state of least C, its weight W = max C − C(S*) over the trajectory (the
  trajectory's states stand in for the intractable max over all states of Thm 2.2).
* :class:`OneShotPolicy` — the reduction of Thm 2.1/2.2 with the paper's edgeless policy
  graph: one weighted classifier applied to every part, predicting which optional templates
  the part gets (its label in S*), each part weighted by its example's W.
* :class:`AnytimePolicy` — Alg. 1: π_1, …, π_T trained greedily in sequence, π_t adding one
  (part, template) pair, learned as the importance-weighted problem of Thm 2.3; Alg. 2
  (:meth:`AnytimePolicy.run`) applies them until the budget is spent, or (our addition,
  :mod:`training.structured.stops`) until π_t's best pair scores below a threshold chosen on
  the policy examples: an example the policies see as done stops buying before its budget
  is spent.

The paper's baselines (uniform and myopic selection) are in
:mod:`training.structured.baselines`.

Policies are linear scorers on standardised per-part inputs (:class:`LinearScorer`), the
form exported to ONNX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from sklearn.linear_model import LogisticRegression

from training.structured.problem import StructuredProblem
from training.structured.state import TemplateSet, additions, with_added

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
Bool = npt.NDArray[np.bool_]

# Logit of a classifier whose training rows all had one label: it always says that label.
CONSTANT_LOGIT = 30.0


@dataclass(frozen=True)
class Standardiser:
    mean: F64
    scale: F64

    @classmethod
    def fit(cls, x: F32 | F64) -> Standardiser:
        mean = np.asarray(x, dtype=np.float64).mean(axis=0)
        scale = np.asarray(x, dtype=np.float64).std(axis=0)
        return cls(mean, np.where(scale > 1e-8, scale, 1.0))

    def __call__(self, x: F32 | F64) -> F64:
        out: F64 = (np.asarray(x, dtype=np.float64) - self.mean) / self.scale
        return out


@dataclass(frozen=True)
class LinearScorer:
    """scores = ((x − mean) / scale) @ weight + bias: (n, d) → (n, C)."""

    standardiser: Standardiser
    weight: F64
    bias: F64

    def scores(self, x: F32 | F64) -> F64:
        out: F64 = self.standardiser(x) @ self.weight + self.bias
        return out

    @property
    def columns(self) -> int:
        return int(self.weight.shape[1])

    @staticmethod
    def stack(scorers: Sequence[LinearScorer]) -> LinearScorer:
        """One scorer whose columns are the given scorers' columns side by side (they share
        one standardiser)."""
        first = scorers[0].standardiser
        return LinearScorer(
            first,
            np.concatenate([s.weight for s in scorers], axis=1),
            np.concatenate([s.bias for s in scorers]),
        )


def _binary_logit(
    z: F64,
    y: npt.NDArray[np.int64],
    w: F64,
    standardiser: Standardiser,
    c: float,
    positive_weight: float = 1.0,
) -> LinearScorer:
    """A weighted logistic regression's logit of class 1 as a one-column scorer."""
    d = z.shape[1]
    if len(np.unique(y)) < 2:
        sign = 1.0 if (len(y) and y[0] == 1) else -1.0
        return LinearScorer(standardiser, np.zeros((d, 1)), np.asarray([sign * CONSTANT_LOGIT]))
    model = LogisticRegression(C=c, max_iter=300)
    w = np.where(y == 1, w * positive_weight, w)
    model.fit(z, y, sample_weight=w / w.mean())
    return LinearScorer(
        standardiser, model.coef_.T.astype(np.float64), model.intercept_.astype(np.float64)
    )


# ---------------------------------------------------------------------------- trajectories


@dataclass
class Trajectory:
    """One example's greedy trajectory S^0 … S^T, with L(F(X, S^t), Y) and c(S^t)."""

    states: list[Bool]
    losses: F64
    costs: F64

    def best(self, lam: float) -> int:
        """Index of the pseudo-label S* = argmin_t L_t + λ c_t (the earliest on ties)."""
        return int(np.argmin(self.losses + lam * self.costs))

    def weight(self, lam: float) -> float:
        """W = max_t C_t − min_t C_t."""
        c = self.losses + lam * self.costs
        return float(c.max() - c.min())


def greedy_trajectories(
    problem: StructuredProblem, lam: float = 0.0, indices: Sequence[int] | None = None
) -> list[Trajectory]:
    """The greedy trajectory of every example, searched for all examples at once (one
    batched loss evaluation per step). With one optional template, or templates of equal
    cost, the trajectory does not depend on ``lam`` (only the pseudo-label taken from it)."""
    ts = problem.templates
    idx = list(range(problem.n_examples)) if indices is None else list(indices)
    current = [ts.initial(problem.parts(i)) for i in idx]
    start = problem.losses(idx, current)
    traj = [
        Trajectory([s], np.asarray([l0]), np.asarray([ts.cost(s)]))
        for s, l0 in zip(current, start, strict=True)
    ]
    optional = ts.optional
    costs = ts.costs
    while True:
        cand_ex: list[int] = []
        cand_states: list[Bool] = []
        cand_cost: list[float] = []
        owners: list[int] = []
        for row, s in enumerate(current):
            for p, k in additions(s, optional):
                cand_ex.append(idx[row])
                cand_states.append(with_added(s, p, k))
                cand_cost.append(float(costs[k]))
                owners.append(row)
        if not cand_ex:
            break
        losses = problem.losses(cand_ex, cand_states)
        score = losses + lam * np.asarray(cand_cost)
        owner = np.asarray(owners)
        for row in np.unique(owner):
            at = np.flatnonzero(owner == row)
            j = at[int(np.argmin(score[at]))]
            current[row] = cand_states[j]
            t = traj[row]
            t.states.append(cand_states[j])
            t.losses = np.append(t.losses, losses[j])
            t.costs = np.append(t.costs, ts.cost(cand_states[j]))
    return traj


# ---------------------------------------------------------------------------- one-shot


@dataclass(frozen=True)
class OneShotPolicy:
    """π(X) → S, part by part: the scorer's columns are the subsets of optional templates
    (``subsets``; with one optional template a single logit, > 0: add it).
    ``positive_weight`` > 1 up-weights the parts whose pseudo-label adds a template (the
    paper's Appendix B varies these class weights to reach the higher budgets)."""

    lam: float
    positive_weight: float
    subsets: list[tuple[int, ...]]
    scorer: LinearScorer

    def choose(self, inputs: F32) -> npt.NDArray[np.int64]:
        """The subset index chosen for each part."""
        s = self.scorer.scores(inputs)
        if s.shape[1] == 1:
            return (s[:, 0] > 0).astype(np.int64)
        out: npt.NDArray[np.int64] = s.argmax(axis=1)
        return out

    def state(self, inputs: F32, templates: TemplateSet) -> Bool:
        state = templates.initial(len(inputs))
        for p, label in enumerate(self.choose(inputs)):
            for k in self.subsets[int(label)]:
                state[p, k] = True
        return state


def fit_one_shot(
    problem: StructuredProblem,
    trajectories: Sequence[Trajectory],
    lam: float,
    standardiser: Standardiser,
    *,
    c: float = 1.0,
    positive_weight: float = 1.0,
) -> OneShotPolicy:
    """Thm 2.2: every part of example i is a row labelled with its templates in S*_i and
    weighted by W_i; examples where every state costs the same (W = 0) teach nothing."""
    ts = problem.templates
    subsets = ts.subsets()
    lookup = {s: j for j, s in enumerate(subsets)}
    optional = ts.optional
    xs: list[F32] = []
    ys: list[npt.NDArray[np.int64]] = []
    ws: list[F64] = []
    for i, t in enumerate(trajectories):
        w = t.weight(lam)
        if w <= 0:
            continue
        star = t.states[t.best(lam)]
        labels = [lookup[tuple(k for k in optional if star[p, k])] for p in range(len(star))]
        xs.append(problem.policy_inputs(i))
        ys.append(np.asarray(labels, dtype=np.int64))
        ws.append(np.full(len(star), w))
    d = problem.policy_inputs(0).shape[1]
    if not xs:
        scorer = LinearScorer(standardiser, np.zeros((d, 1)), np.asarray([-CONSTANT_LOGIT]))
        return OneShotPolicy(lam, positive_weight, subsets, scorer)
    x, y, rw = np.concatenate(xs), np.concatenate(ys), np.concatenate(ws)
    z = standardiser(x)
    if len(subsets) == 2:
        return OneShotPolicy(
            lam, positive_weight, subsets, _binary_logit(z, y, rw, standardiser, c, positive_weight)
        )
    present = np.unique(y)
    if len(present) < 2:
        bias = np.full(len(subsets), -CONSTANT_LOGIT)
        bias[present[0]] = CONSTANT_LOGIT
        return OneShotPolicy(
            lam,
            positive_weight,
            subsets,
            LinearScorer(standardiser, np.zeros((d, len(subsets))), bias),
        )
    model = LogisticRegression(C=c, max_iter=300)
    rw = np.where(y > 0, rw * positive_weight, rw)
    model.fit(z, y, sample_weight=rw / rw.mean())
    weight = np.zeros((d, len(subsets)))
    bias = np.full(len(subsets), -CONSTANT_LOGIT)
    weight[:, model.classes_] = model.coef_.T
    bias[model.classes_] = model.intercept_
    return OneShotPolicy(lam, positive_weight, subsets, LinearScorer(standardiser, weight, bias))


# ---------------------------------------------------------------------------- anytime


@dataclass
class AnytimePolicy:
    """π_1 … π_T (Alg. 1). ``scorer`` has T x len(optional) columns: column
    ``t * len(optional) + j`` scores adding optional template ``optional[j]`` to a part at
    step t (steps past T use π_T). π_t adds the unacquired pair of highest score."""

    lam: float
    optional: list[int]
    scorer: LinearScorer
    steps: int
    train_loss: list[float] = field(default_factory=list)
    #: Alg. 2 stops at the first step whose best pair scores below this (None: never).
    stop_below: float | None = None
    #: (tolerance, threshold) pairs (:func:`training.structured.stops.stop_table`).
    stop_table: list[tuple[float, float | None]] = field(default_factory=list)

    def column(self, t: int, j: int) -> int:
        return min(t, self.steps - 1) * len(self.optional) + j

    def stops(self, scores: F64, pair: tuple[int, int], t: int) -> bool:
        """Whether π_t's best pair ``pair`` scores below the stop."""
        if self.stop_below is None:
            return False
        p, k = pair
        return bool(scores[p, self.column(t, self.optional.index(k))] < self.stop_below)

    def order(self, inputs: F32, start: Bool) -> list[tuple[int, int]]:
        """Alg. 2 without a budget: the (part, template) pairs in the order π_1, π_2, …
        add them from ``start``."""
        scores = self.scorer.scores(inputs)
        state = start.copy()
        out: list[tuple[int, int]] = []
        for t in range(int((~state[:, self.optional]).sum())):
            pair = self.next_pair(scores, state, t)
            if pair is None or self.stops(scores, pair, t):
                break
            out.append(pair)
            state[pair] = True
        return out

    def next_pair(self, scores: F64, state: Bool, t: int) -> tuple[int, int] | None:
        best: tuple[int, int] | None = None
        best_score = -np.inf
        for j, k in enumerate(self.optional):
            col = scores[:, self.column(t, j)]
            for p in np.flatnonzero(~state[:, k]):
                if col[p] > best_score:
                    best_score, best = float(col[p]), (int(p), k)
        return best

    def run(self, inputs: F32, start: Bool, templates: TemplateSet, budget: float) -> Bool:
        """Alg. 2: add pairs while c(S) < budget, any is left and π_t's best does not score
        below the stop."""
        state = start.copy()
        scores = self.scorer.scores(inputs)
        t = 0
        while templates.cost(state) < budget:
            pair = self.next_pair(scores, state, t)
            if pair is None or self.stops(scores, pair, t):
                break
            state[pair] = True
            t += 1
        return state


def fit_anytime(
    problem: StructuredProblem,
    standardiser: Standardiser,
    *,
    lam: float = 0.0,
    max_steps: int | None = None,
    c: float = 1.0,
) -> AnytimePolicy:
    """Alg. 1 with the risk of Thm 2.3. At step t every example's candidate additions s get
    C(s) = L(F(X, s), Y) + λ c(s); the per-part scorer of each optional template is a
    weighted logistic regression: the candidates of least C are positives weighted by
    max C − C(s), the others negatives weighted by C(s) − min C (examples whose candidates
    all cost the same are left out). The training states then advance by π_t."""
    ts = problem.templates
    optional = ts.optional
    costs = ts.costs
    n = problem.n_examples
    states = [ts.initial(problem.parts(i)) for i in range(n)]
    inputs = [problem.policy_inputs(i) for i in range(n)]
    z_inputs = [standardiser(x) for x in inputs]
    d = inputs[0].shape[1]
    most = max(problem.parts(i) for i in range(n)) * len(optional)
    steps = most if max_steps is None else min(most, max_steps)
    per_step: list[LinearScorer] = []
    train_loss: list[float] = []
    for _ in range(steps):
        ex: list[int] = []
        cand: list[Bool] = []
        meta: list[tuple[int, int, int]] = []  # (example, part, optional index)
        for i in range(n):
            for p, k in additions(states[i], optional):
                ex.append(i)
                cand.append(with_added(states[i], p, k))
                meta.append((i, p, optional.index(k)))
        if not ex:
            break
        cost_vec = np.asarray([costs[optional[j]] for _, _, j in meta])
        modified = problem.losses(ex, cand) + lam * cost_vec
        owner = np.asarray(ex)
        ys = np.zeros(len(ex), dtype=np.int64)
        ws = np.zeros(len(ex))
        for i in np.unique(owner):
            at = np.flatnonzero(owner == i)
            hi, lo = modified[at].max(), modified[at].min()
            if hi - lo <= 0:
                continue
            best = modified[at] <= lo + 1e-12
            ys[at] = best.astype(np.int64)
            ws[at] = np.where(best, hi - modified[at], modified[at] - lo)
        columns: list[LinearScorer] = []
        for j in range(len(optional)):
            rows = [r for r, m in enumerate(meta) if m[2] == j and ws[r] > 0]
            if rows:
                z = np.stack([z_inputs[meta[r][0]][meta[r][1]] for r in rows])
                columns.append(_binary_logit(z, ys[rows], ws[rows], standardiser, c))
            else:
                columns.append(LinearScorer(standardiser, np.zeros((d, 1)), np.zeros(1)))
        step = LinearScorer.stack(columns)
        per_step.append(step)
        # advance every example by π_t (Alg. 1's state update)
        for i in range(n):
            scores = step.scores(inputs[i])
            best_pair: tuple[int, int] | None = None
            best_score = -np.inf
            for j, k in enumerate(optional):
                for q in np.flatnonzero(~states[i][:, k]):
                    if scores[q, j] > best_score:
                        best_score, best_pair = float(scores[q, j]), (int(q), k)
            if best_pair is not None:
                states[i] = with_added(states[i], *best_pair)
        train_loss.append(float(problem.losses(list(range(n)), states, soft=False).mean()))
    if not per_step:
        per_step.append(
            LinearScorer(standardiser, np.zeros((d, len(optional))), np.zeros(len(optional)))
        )
    return AnytimePolicy(lam, optional, LinearScorer.stack(per_step), len(per_step), train_loss)
