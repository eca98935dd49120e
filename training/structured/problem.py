"""What the policy learners need from a structured task, and its linear-chain version.

The policy machinery (:mod:`training.structured.policies`) sees a task only through
:class:`StructuredProblem`: the templates and their costs, how many parts each example has,
the per-part inputs of a policy, and the loss L(F(X, S), Y) of any batch of states. A
dependency parser implements the same protocol over words x edge templates; the OCR task
implements it with :class:`ChainProblem`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from training.structured.chain import ChainParams, emissions, marginals, pad, viterbi
from training.structured.state import TemplateSet

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bool = npt.NDArray[np.bool_]

# Weight of the soft tie-breaker added to the Hamming loss in the policy searches (see
# ChainProblem.losses): far below one letter, so it only orders states of equal Hamming loss.
TIE_BREAK = 1e-3


class StructuredProblem(Protocol):
    """A set of examples whose predictions can be evaluated in any parts x templates state."""

    @property
    def templates(self) -> TemplateSet: ...

    @property
    def n_examples(self) -> int: ...

    def parts(self, i: int) -> int:
        """Number of parts of example ``i``."""
        ...

    def policy_inputs(self, i: int) -> F32:
        """Per-part inputs (parts, d) of a policy for example ``i``: computable from the
        initial state S0 (its base templates) alone."""
        ...

    def losses(self, indices: Sequence[int], states: Sequence[Bool], *, soft: bool = True) -> F64:
        """L(F(X_i, S), Y_i) for each (i, S) pair: Hamming errors, plus (``soft``) a small
        tie-breaker that orders states of equal Hamming error."""
        ...

    def confidence(self, indices: Sequence[int], states: Sequence[Bool]) -> F64:
        """The predictor's confidence in each prediction, normalised by size (mean over
        parts of the top marginal): the myopic baseline's signal."""
        ...


@dataclass
class ChainProblem:
    """A linear-chain task whose emissions are additive over templates.

    ``contributions[i]`` (L_i, K, Y): what each template adds to part p's label scores of
    example i (cross-fitted: computed by a model that did not train on example i);
    ``base`` (Y,): the score of a part with no template; ``labels[i]`` (L_i,) the truth.
    """

    template_set: TemplateSet
    chain: ChainParams
    base: F64
    contributions: list[F64]
    labels: list[I64]
    inputs: list[F32]
    chunk: int = 4096

    @property
    def templates(self) -> TemplateSet:
        return self.template_set

    @property
    def n_examples(self) -> int:
        return len(self.labels)

    def parts(self, i: int) -> int:
        return len(self.labels[i])

    def policy_inputs(self, i: int) -> F32:
        return self.inputs[i]

    def _batch(self, indices: Sequence[int], states: Sequence[Bool]) -> tuple[F64, Bool, I64]:
        contrib, mask = pad([self.contributions[i] for i in indices])
        st, _ = pad([s.astype(np.float64) for s in states], width=contrib.shape[1])
        labels = np.full(mask.shape, -1, dtype=np.int64)
        for row, i in enumerate(indices):
            labels[row, : len(self.labels[i])] = self.labels[i]
        return emissions(self.base, contrib, st > 0.5), mask, labels

    def predict(self, indices: Sequence[int], states: Sequence[Bool]) -> list[I64]:
        out: list[I64] = []
        for lo in range(0, len(indices), self.chunk):
            em, mask, _ = self._batch(indices[lo : lo + self.chunk], states[lo : lo + self.chunk])
            pred = viterbi(em, mask, self.chain)
            out.extend(pred[r, : int(mask[r].sum())] for r in range(len(pred)))
        return out

    def losses(self, indices: Sequence[int], states: Sequence[Bool], *, soft: bool = True) -> F64:
        out = np.zeros(len(indices))
        for lo in range(0, len(indices), self.chunk):
            idx, sts = indices[lo : lo + self.chunk], states[lo : lo + self.chunk]
            em, mask, labels = self._batch(idx, sts)
            pred = viterbi(em, mask, self.chain)
            loss = ((pred != labels) & mask).sum(axis=1).astype(np.float64)
            if soft:
                # 1 - p(true label) under each part's own emission softmax (no inference)
                z = em - em.max(axis=2, keepdims=True)
                p = np.exp(z) / np.exp(z).sum(axis=2, keepdims=True)
                truth = np.take_along_axis(p, np.maximum(labels, 0)[:, :, None], axis=2)[:, :, 0]
                loss += TIE_BREAK * ((1.0 - truth) * mask).sum(axis=1)
            out[lo : lo + len(idx)] = loss
        return out

    def confidence(self, indices: Sequence[int], states: Sequence[Bool]) -> F64:
        out = np.zeros(len(indices))
        for lo in range(0, len(indices), self.chunk):
            em, mask, _ = self._batch(indices[lo : lo + self.chunk], states[lo : lo + self.chunk])
            marg = marginals(em, mask, self.chain)
            top = marg.max(axis=2)
            out[lo : lo + len(em)] = (top * mask).sum(axis=1) / mask.sum(axis=1)
        return out
