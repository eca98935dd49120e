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
* The anytime policy ranks parts by the same kind of score and upgrades them in that order
  while the budget lasts: one score function shared by every step, a simplification of
  Alg. 1's sequence π_1 … π_T trained step by step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from sklearn.linear_model import LogisticRegression

from service.extractors.parsing import Sentence, policy_features
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
        """Mean (best - second best) head score under all-ψ^POS (the myopic confidence)."""
        matrix = self.scores.matrix(np.zeros(self.n_parts + 1, dtype=bool))
        ordered = np.sort(matrix[:, 1:], axis=0)
        return float(np.mean(ordered[-1] - ordered[-2])) if self.n_parts > 1 else float("inf")


def parse_problems(
    parser: ArcFactoredParser, sentences: Sequence[Sentence], heads: Sequence[IntArray]
) -> list[ParseProblem]:
    out = []
    for sentence, gold in zip(sentences, heads, strict=True):
        x = policy_features(sentence).astype(np.float32).astype(np.float64)
        out.append(ParseProblem(sentence, parser.scores(sentence), gold, x))
    return out


def oneshot_words(problem: ParseProblem, coef: FloatArray) -> list[int]:
    """The words (1-based) the one-shot policy gives ψ^Full, as the service decides."""
    scores = policy_scores(coef, problem.features)
    order = np.argsort(-scores, kind="stable")
    return [int(i) + 1 for i in order if scores[i] > 0]


def anytime_order(problem: ParseProblem, coef: FloatArray) -> list[int]:
    """The order (1-based words) in which the anytime policy upgrades words."""
    scores = policy_scores(coef, problem.features)
    return [int(i) + 1 for i in np.argsort(-scores, kind="stable")]
