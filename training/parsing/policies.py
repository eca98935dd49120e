"""Template-assignment policies over a generic "parts × templates" state (paper 004, §2).

Everything here but :class:`ParseProblem` and :func:`parse_problems` is written for any
structured task whose example has ``n_parts`` parts, each at a cheap template or upgraded to
an expensive one, and a loss of a state (which parts are upgraded). The OCR task
(letters × {pixels, HOG}) fits the same functions; they are meant to move to a shared
``training/structured`` package once it lands.

* :func:`greedy_trajectory`: the trajectory pseudo-label's search (Eq. 3, "Trajectory
  Search"): from the all-cheap state, upgrade the part whose upgrade lowers the loss most,
  until no single upgrade lowers it (we stop there: every later state costs more and, in
  the runs we made, never lost less). For any λ the pseudo-label is the prefix minimising
  loss_t + λ·t.
* :func:`parsimonious_labels`: the one-stage search ("Parsimonious Search", τ = 0): every
  part whose upgrade alone lowers the loss.
* :func:`fit_word_policy`: the one-shot policy, a linear classifier on the parts' cheap
  features predicting the pseudo-label (a structured SVM on a graph with no edges, as in
  the paper, is a weighted per-part classifier; we use logistic regression), with the
  positive class weighted to move along the budget axis (the paper's Appendix B does the
  same to reach budgets the λ sweep cannot).
* :func:`fit_anytime_steps`: Alg. 1, the anytime policies π_1 … π_T trained greedily in
  sequence: π_t is a weighted linear word scorer learned as Thm 2.3's importance-weighted
  problem on the states π_1 … π_{t-1} reached, then every training state advances by π_t's
  best word (Alg. 2 applies them, the last one for every later step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from sklearn.linear_model import LogisticRegression

from service.extractors.parsing import POLICY_FEATURES as POLICY_DIMS
from service.extractors.parsing import LengthFilter, Sentence, policy_features
from service.strategies.parsing import mean_margin
from training.parsing.parser import ArcFactoredParser, EdgeScores

BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# -- generic: parts × templates -----------------------------------------------------------


@dataclass
class Trajectory:
    """Parts upgraded in order (0-based) and the loss before any and after each upgrade."""

    order: list[int]
    losses: list[float]

    def prefix(self, lam: float) -> list[int]:
        """The pseudo-label for trade-off ``lam``: the prefix minimising loss_t + lam * t."""
        costs = [loss + lam * t for t, loss in enumerate(self.losses)]
        return self.order[: int(np.argmin(costs))]


def greedy_trajectory(
    n_parts: int,
    loss: Callable[[BoolArray], float],
    candidates: Callable[[BoolArray], Iterable[int]] | None = None,
) -> Trajectory:
    """``candidates(state)``, when given, lists the parts worth trying from ``state`` (the
    others are known not to lower the loss, or are skipped to save inference)."""
    state = np.zeros(n_parts, dtype=bool)
    current = loss(state)
    order: list[int] = []
    losses = [current]
    while current > 0 and len(order) < n_parts:
        best, best_loss = -1, current
        tried = np.flatnonzero(~state) if candidates is None else candidates(state)
        for part in tried:
            if state[part]:
                continue
            state[part] = True
            value = loss(state)
            state[part] = False
            if value < best_loss:
                best, best_loss = int(part), value
        if best < 0:
            break
        state[best] = True
        order.append(best)
        losses.append(best_loss)
        current = best_loss
    return Trajectory(order, losses)


def parsimonious_labels(
    n_parts: int,
    loss: Callable[[BoolArray], float],
    candidates: Callable[[BoolArray], Iterable[int]] | None = None,
) -> list[int]:
    state = np.zeros(n_parts, dtype=bool)
    base = loss(state)
    out = []
    for part in range(n_parts) if candidates is None else sorted(candidates(state)):
        state[part] = True
        if loss(state) < base:
            out.append(part)
        state[part] = False
    return out


def fit_word_policy(
    x: FloatArray, y: BoolArray, positive_weight: float, seed: int = 0
) -> FloatArray:
    """A linear policy (coefficients, intercept last) predicting ``y`` from ``x``."""
    if y.all() or not y.any():
        coef = np.zeros(x.shape[1] + 1)
        coef[-1] = 1.0 if y.all() else -1.0
        return coef
    model = LogisticRegression(
        C=1.0, class_weight={False: 1.0, True: positive_weight}, max_iter=2000, random_state=seed
    )
    model.fit(x, y)
    return np.concatenate([model.coef_[0], model.intercept_]).astype(np.float64)


def policy_scores(coef: FloatArray, x: FloatArray) -> FloatArray:
    scores: FloatArray = x @ coef[:-1] + coef[-1]
    return scores


# -- parsing: parts are words, the loss is the Hamming loss of the tree ----------------------


@dataclass
class ParseProblem:
    """One sentence: its edge scores by template, gold heads and policy features (as the
    service computes them: float32, then float64)."""

    sentence: Sentence
    scores: EdgeScores
    gold: IntArray
    features: FloatArray

    @property
    def n_parts(self) -> int:
        return len(self.sentence)

    def full_mask(self, words: Sequence[int] | BoolArray) -> BoolArray:
        """A head mask (root first) from 1-based words or a word-level boolean state."""
        mask = np.zeros(self.n_parts + 1, dtype=bool)
        if isinstance(words, np.ndarray) and words.dtype == bool:
            mask[1:] = words
        else:
            mask[list(words)] = True
        return mask

    def parse(self, words: Sequence[int] | BoolArray) -> IntArray:
        return self.scores.parse(self.full_mask(words))

    def errors(self, state: BoolArray) -> float:
        return float((self.parse(state)[1:] != self.gold[1:]).sum())

    def candidates(self, state: BoolArray) -> list[int]:
        """Words (0-based parts) that head a wrongly attached token in the gold or in the
        current parse: upgrading any other word changes no score of an edge in either tree,
        so we do not try it (it rarely helps and costs one decode each)."""
        pred = self.parse(state)
        wrong = np.flatnonzero(pred[1:] != self.gold[1:]) + 1
        heads = set(pred[wrong].tolist()) | set(self.gold[wrong].tolist())
        return sorted(h - 1 for h in heads if h > 0)

    def margin(self) -> float:
        """Mean (best - second best) head score under all-ψ^POS (the myopic confidence,
        as the service computes it)."""
        return mean_margin(self.scores.matrix(np.zeros(self.n_parts + 1, dtype=bool)))


def parse_problems(
    parser: ArcFactoredParser,
    sentences: Sequence[Sentence],
    heads: Sequence[IntArray],
    length_filter: LengthFilter | None = None,
) -> list[ParseProblem]:
    out = []
    for sentence, gold in zip(sentences, heads, strict=True):
        x = policy_features(sentence).astype(np.float32).astype(np.float64)
        scores = parser.scores(sentence, length_filter)
        out.append(ParseProblem(sentence, scores, gold, x))
    return out


def oneshot_words(problem: ParseProblem, coef: FloatArray) -> list[int]:
    """The words (1-based) the one-shot policy gives ψ^Full, as the service decides."""
    scores = policy_scores(coef, problem.features)
    order = np.argsort(-scores, kind="stable")
    return [int(i) + 1 for i in order if scores[i] > 0]


def anytime_order(problem: ParseProblem, coef: FloatArray) -> list[int]:
    """The order (1-based words) in which the anytime policies upgrade words (Alg. 2):
    ``coef`` (features + 1, T) holds π_1 … π_T; step t takes π_t's best word not yet
    upgraded (π_T for every step past T; the first word on ties)."""
    steps = coef.reshape(coef.shape[0], -1)
    order: list[int] = []
    for t in range(problem.n_parts):
        scores = policy_scores(steps[:, min(t, steps.shape[1] - 1)], problem.features)
        best = max(
            (w for w in range(problem.n_parts) if w + 1 not in order),
            key=lambda w: (scores[w], -w),
        )
        order.append(best + 1)
    return order


def fit_anytime_steps(
    problems: Sequence[ParseProblem],
    steps: int,
    *,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> FloatArray:
    """Alg. 1 with the risk of Thm 2.3 (λ = 0: every word costs the same ψ^Lex, so the
    cost term does not change which upgrade is best). At step t each sentence's candidate
    states are its state with one more word upgraded; C(s) is the parse's Hamming loss in
    s (one decode per word that heads a wrongly attached token in the gold or current
    parse; upgrading any other word is taken to leave the loss as it is, as in
    :meth:`ParseProblem.candidates`). The words of least C are positives weighted by
    max C − C(s), the others negatives weighted by C(s) − min C; sentences whose
    candidates all lose the same teach nothing. π_t is a weighted logistic regression on
    the words' policy features; then every sentence upgrades π_t's best word.

    Returns (features + 1, T) coefficients, step t's policy in column t (intercept last);
    fewer than ``steps`` columns when every word of every sentence is upgraded earlier."""
    states = [np.zeros(p.n_parts, dtype=bool) for p in problems]
    columns: list[FloatArray] = []
    d = problems[0].features.shape[1] if problems else POLICY_DIMS
    for t in range(steps):
        xs: list[FloatArray] = []
        ys: list[BoolArray] = []
        ws: list[FloatArray] = []
        for p, state in zip(problems, states, strict=True):
            left = np.flatnonzero(~state)
            if not len(left):
                continue
            current = p.errors(state)
            loss = np.full(p.n_parts, current)
            for word in p.candidates(state):
                if state[word]:
                    continue
                state[word] = True
                loss[word] = p.errors(state)
                state[word] = False
            c = loss[left]
            hi, lo = float(c.max()), float(c.min())
            if hi - lo <= 0:
                continue
            best = c <= lo + 1e-12
            xs.append(p.features[left])
            ys.append(best)
            ws.append(np.where(best, hi - c, c - lo))
        if not xs and not any((~s).any() for s in states):
            break
        if xs:
            x, y, weight = np.concatenate(xs), np.concatenate(ys), np.concatenate(ws)
            coef = _weighted_logit(x, y, weight, seed)
        else:  # nothing to learn at this step: keep the previous policy
            coef = columns[-1] if columns else np.zeros(d + 1)
        columns.append(coef)
        for p, state in zip(problems, states, strict=True):
            left = np.flatnonzero(~state)
            if len(left):
                scores = policy_scores(coef, p.features[left])
                state[left[int(np.argmax(scores))]] = True
        if log is not None:
            errors = sum(p.errors(s) for p, s in zip(problems, states, strict=True))
            words = sum(p.n_parts for p in problems)
            uas_t = 1 - errors / words
            log(f"  anytime π_{t + 1}: {len(xs)} sentences taught, UAS after it {uas_t:.4f}")
    if not columns:
        columns.append(np.zeros(d + 1))
    return np.stack(columns, axis=1)


def _weighted_logit(x: FloatArray, y: BoolArray, w: FloatArray, seed: int) -> FloatArray:
    if y.all() or not y.any():
        coef = np.zeros(x.shape[1] + 1)
        coef[-1] = 1.0 if y.all() else -1.0
        return coef
    model = LogisticRegression(C=1.0, max_iter=2000, random_state=seed)
    model.fit(x, y, sample_weight=w / w.mean())
    return np.concatenate([model.coef_[0], model.intercept_]).astype(np.float64)


def filter_stats(
    length_filter: LengthFilter | None, problems: Sequence[ParseProblem]
) -> dict[str, float] | None:
    """What the filter prunes on held-out dev sentences: the share of all arcs, and the
    share of gold arcs (each one a token the parser can no longer attach right)."""
    if length_filter is None:
        return None
    arcs = pruned = gold_pruned = 0
    for p in problems:
        kept = np.isfinite(p.scores.pos)  # (n + 1, n): head h, dependent d - 1
        n = p.n_parts
        arcs += n * n  # every head 0 … n of every dependent but itself
        pruned += int((~kept).sum()) - n  # the diagonal was never an arc
        gold_pruned += int((~kept[p.gold[1:], np.arange(n)]).sum())
    words = sum(p.n_parts for p in problems)
    return {"arcs_pruned": pruned / max(arcs, 1), "gold_arcs_pruned": gold_pruned / max(words, 1)}
