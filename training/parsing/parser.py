"""The first-order arc-factored parser, trained by the averaged structured perceptron over
random template states (paper 004, Appendix B: "we generate data with random edge features
and train the model to minimize the joint loss over all states").

One weight vector scores every edge whatever its head's template: an edge headed by a
ψ^POS word scores ``w · ψ^POS``, one headed by a ψ^Full word ``w · ψ^POS + w · ψ^Lex``
(``service.extractors.parsing``). Trained on sentences whose words get ψ^Full at random
(a quarter all ψ^POS, a quarter all ψ^Full, half a random mix), the one model parses under
any state a policy picks. Decoding is Chu–Liu–Edmonds with one root child
(``service.strategies.chu_liu_edmonds``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from service.extractors.parsing import (
    DEFAULT_BUCKETS,
    LengthFilter,
    Sentence,
    lex_features,
    pos_features,
)
from service.strategies.chu_liu_edmonds import chu_liu_edmonds
from training.parsing.data import Treebank

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


@dataclass
class EdgeScores:
    """A sentence's edge scores split by template: ``pos[h, d - 1]`` = w · ψ^POS(h → d) and
    ``lex[h, d - 1]`` = w · ψ^Lex(h → d), h = 0 … n (0: root), d = 1 … n."""

    pos: FloatArray
    lex: FloatArray

    @property
    def n(self) -> int:
        return int(self.pos.shape[1])

    def matrix(self, full: BoolArray) -> FloatArray:
        """The (n+1) × (n+1) score matrix for the state ``full`` (length n+1: which heads
        use ψ^Full; the root never does)."""
        n = self.n
        s = np.full((n + 1, n + 1), -np.inf)
        s[:, 1:] = self.pos + np.where(full[:, None], self.lex, 0.0)
        return s

    def parse(self, full: BoolArray) -> IntArray:
        return chu_liu_edmonds(self.matrix(full))


def sentence_features(sentence: Sentence, buckets: int) -> tuple[IntArray, IntArray]:
    n = len(sentence)
    heads = np.arange(0, n + 1)
    deps = np.arange(1, n + 1)
    return pos_features(sentence, heads, deps, buckets), lex_features(
        sentence, heads, deps, buckets
    )


def random_state(n: int, rng: np.random.Generator) -> BoolArray:
    """Which of heads 0 … n use ψ^Full: none (¼), all (¼) or each with a random p (½)."""
    draw = rng.random()
    if draw < 0.25:
        p = 0.0
    elif draw < 0.5:
        p = 1.0
    else:
        p = rng.random()
    full = rng.random(n + 1) < p
    full[0] = False
    return full


class ArcFactoredParser:
    """Estimator: ``fit(treebank)`` learns ``coef_`` (float32, ``buckets`` long)."""

    def __init__(
        self,
        *,
        buckets: int = DEFAULT_BUCKETS,
        epochs: int = 5,
        seed: int = 0,
        verbose: bool = False,
    ) -> None:
        self.buckets = buckets
        self.epochs = epochs
        self.seed = seed
        self.verbose = verbose

    def fit(self, treebank: Treebank) -> ArcFactoredParser:
        if self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        rng = np.random.default_rng(self.seed)
        w = np.zeros(self.buckets)
        u = np.zeros(self.buckets)  # sum of c * update: averaged w = w - u / c
        c = 1.0
        self.history_: list[dict[str, float]] = []
        for epoch in range(self.epochs):
            t0 = time.perf_counter()
            wrong = 0
            total = 0
            for i in rng.permutation(len(treebank)):
                sentence, gold = treebank.sentences[i], treebank.heads[i]
                n = len(sentence)
                pos, lex = sentence_features(sentence, self.buckets)
                full = random_state(n, rng)
                scores = EdgeScores(w[pos].sum(-1), w[lex].sum(-1))
                pred = scores.parse(full)
                bad = np.flatnonzero(pred[1:] != gold[1:])  # dependent d = bad + 1
                total += n
                wrong += len(bad)
                if len(bad):
                    g = gold[bad + 1]
                    p = pred[bad + 1]
                    ids = [pos[g, bad].ravel(), pos[p, bad].ravel()]
                    signs = [1.0, -1.0]
                    if full[g].any():
                        ids.append(lex[g[full[g]], bad[full[g]]].ravel())
                        signs.append(1.0)
                    if full[p].any():
                        ids.append(lex[p[full[p]], bad[full[p]]].ravel())
                        signs.append(-1.0)
                    for idx, sign in zip(ids, signs, strict=True):
                        np.add.at(w, idx, sign)
                        np.add.at(u, idx, sign * c)
                c += 1.0
            self.history_.append(
                {
                    "epoch": epoch + 1,
                    "train_uas": 1.0 - wrong / max(total, 1),
                    "seconds": time.perf_counter() - t0,
                }
            )
            if self.verbose:
                print(self.history_[-1], flush=True)
        self.coef_ = (w - u / c).astype(np.float32)
        return self

    def scores(self, sentence: Sentence, length_filter: LengthFilter | None = None) -> EdgeScores:
        """The sentence's edge scores; with ``length_filter``, the arcs it prunes score -inf
        (as the serving plugins leave them uncomputed)."""
        pos, lex = sentence_features(sentence, self.buckets)
        w = self.coef_.astype(np.float64)
        out = EdgeScores(w[pos].sum(-1), w[lex].sum(-1))
        if length_filter is not None:
            deps = np.arange(1, len(sentence) + 1)
            for h in range(len(sentence) + 1):
                out.pos[h, ~length_filter.kept(sentence, h, deps)] = -np.inf
        return out

    def parse(self, sentence: Sentence, full: BoolArray) -> IntArray:
        return self.scores(sentence).parse(full)
