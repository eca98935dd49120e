"""Dependency parsing under a time budget (paper 004) as a strategy runtime.

The parts are the words of a sentence, the templates ψ^POS and ψ^Full; a state says which
words have ψ^Full (every edge a word heads uses its template). The session acquires
extractors through the serving loop, so each (word, template) pair is charged its measured
time: ``pos@i`` for every head i = 0 … n (the root included), then ``words`` (the
policies' per-word features) and ``lex@i`` for the words given ψ^Full. Then it scores the
edges with the bundle's hashed weights and decodes the tree with Chu–Liu–Edmonds.

Policies (``ParserStrategy.policy``), each over the same generic "parts × templates" state:

* ``oneshot``: a linear policy on each word's features picks the ψ^Full words before any
  ψ^Lex is computed (the paper's one-shot policy, trained on pseudo-labels);
* ``anytime``: all words start at ψ^POS, then Alg. 2: at step t, the step's policy π_t
  (trained in sequence by Alg. 1, one linear scorer per step, the last one for every
  later step) upgrades its best word not yet upgraded, while the measured budget lasts;
* ``myopic``: parse with ψ^POS everywhere; when the mean margin of the heads is below the
  point's threshold, ψ^Full for every word and parse again (two decodes);
* ``uniform-word`` / ``uniform-sentence``: ψ^Full per word / per sentence with the point's
  probability (seeded by the sentence's content, so a sentence always gets the same draw).

Budgets are hard caps as in the other runtimes: no acquisition starts (the policy's
``words``, a ψ^POS or a ψ^Lex) whose predicted cost, with the decode still to pay, no longer
fits what is left; the session then decodes from what is in hand (a head with no template
scores every arc 0). The policy's inputs are bought only when its own CPU time (recent most,
``ParserRuntime.decide``) and a ψ^Lex fit after them (else: no upgrade, an overrun). So
a request overruns its budget by at most the misprediction of its last acquisition and of
the decode. Arcs pruned by the length filter (ψ^POS ids -1) score -inf, never chosen.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from service.bundle import ParserPoint, ParserStrategy
from service.errors import BundleError
from service.extractors.parsing import POLICY_FEATURES
from service.inference import bundle_file
from service.strategies.base import (
    Acquire,
    Answer,
    Observation,
    Session,
    Step,
    StrategyRuntime,
    affordable,
    register_strategy,
)
from service.strategies.chu_liu_edmonds import chu_liu_edmonds
from service.strategies.recent import RecentMost
from service.types import FloatVector

FloatArray = npt.NDArray[np.float64]
WORDS = "words"
#: The most a request's measured slowdown may inflate its remaining predictions (one stall,
#: e.g. a garbage collection, should not stop a request that has time left).
MAX_SLOWDOWN = 4.0
#: Acquisitions predicted cheaper than this (ms) teach no slowdown: their measured time is
#: mostly the loop's own overhead.
MIN_PREDICTED_MS = 0.02


def pos_name(word: int) -> str:
    return f"pos@{word}"


def lex_name(word: int) -> str:
    return f"lex@{word}"


def mean_margin(matrix: FloatArray) -> float:
    """The myopic policy's confidence: the mean over tokens of (best − second best) head
    score. A token whose other heads were all pruned (length filter) is as sure as the
    surest token of the sentence; a one-token sentence is sure."""
    n = matrix.shape[0] - 1
    if n < 2:
        return float("inf")
    ordered = np.sort(matrix[:, 1:], axis=0)
    margins = ordered[-1] - ordered[-2]
    finite = np.isfinite(margins)
    if not finite.all():
        margins[~finite] = margins[finite].max() if finite.any() else 0.0
    return float(margins.mean())


@dataclass(frozen=True, slots=True)
class ParseAnswer(Answer):
    """The answer of a parser session: the tree and how it was reached."""

    heads: tuple[int, ...] = ()
    scores: tuple[float, ...] = ()
    templates: tuple[str, ...] = ()


@dataclass
class _Plan:
    """What a session has decided so far."""

    chosen: list[int] = field(default_factory=list)  # words the policy gave ψ^Full
    queue: list[str] = field(default_factory=list)  # acquisitions left, in order
    decided: bool = False


class ParserSession(Session):
    def __init__(
        self, runtime: ParserRuntime, point: ParserPoint, n: int, per_feature: dict[str, float]
    ) -> None:
        self.rt = runtime
        self.point = point
        self.n = n
        self.per_feature = per_feature
        self.stopped_by_budget = False
        self.lex_cost = per_feature.get(lex_name(1), 0.0)
        self.decode_cost = runtime.spec.decode_cost(n)
        self.plan = _Plan()
        self.expected_accuracy = point.uas
        self.planned = runtime.base_cost(n, per_feature) + point.full_fraction * n * self.lex_cost
        self.myopic_margin: float | None = None
        self.drawn = runtime.spec.policy not in ("uniform-word", "uniform-sentence")
        self.result: ParseAnswer | None = None
        self.decode_ms = 0.0
        # How much dearer than predicted this request's acquisitions have come out (at
        # least 1, at most MAX_SLOWDOWN): the machine's load now, applied to what is left.
        self.slowdown = 1.0
        self._pending: tuple[str, float] | None = None  # (acquired, spent when asked)
        self._base = 0  # the first word whose ψ^POS may not be in hand yet
        self._stale_ms = 0.0  # ms spent in this step since its observation

    # -- the plan -------------------------------------------------------------------------
    def _decide(self, features: Mapping[str, FloatVector]) -> None:
        """Fill the queue once the policy's inputs are in hand."""
        rt, n, policy = self.rt, self.n, self.rt.spec.policy
        pos = [pos_name(i) for i in range(n + 1)]
        if policy == "oneshot":
            scores = rt.word_scores(self.point, features[WORDS], n)
            order = [int(i) + 1 for i in np.argsort(-scores, kind="stable")]
            self.plan.chosen = [w for w in order if scores[w - 1] > 0]
        elif policy == "anytime":
            self.plan.chosen = rt.anytime_order(rt.word_scores(self.point, features[WORDS], n))
        self.plan.queue = pos + [lex_name(w) for w in self.plan.chosen]
        self.plan.decided = True

    def _draw(self, features: Mapping[str, FloatVector]) -> None:
        """The uniform baselines' draw, seeded by the sentence's content (its ψ^POS ids)."""
        n = self.n
        rng = np.random.default_rng(zlib.crc32(features[pos_name(1)].tobytes()) + n)
        if self.rt.spec.policy == "uniform-word":
            picked = rng.random(n) < self.point.threshold
        else:
            picked = np.full(n, bool(rng.random() < self.point.threshold))
        self.plan.chosen = [int(i) + 1 for i in np.flatnonzero(picked)]
        self.plan.queue = [lex_name(w) for w in self.plan.chosen]

    def _fits(self, name: str, obs: Observation, then: float = 0.0) -> bool:
        """Whether acquiring ``name``, ``then`` ms of work after it and the decode fit in what
        is left, all priced at this request's ``slowdown`` so far: the session never starts
        an acquisition that cannot, so a request overruns its budget by at most the
        misprediction of its last acquisition and of the decode beyond the slowdown its
        earlier steps showed."""
        cost = self.per_feature.get(name, 0.0) + then
        left = obs.remaining - self._stale_ms
        return affordable((cost + self.decode_cost) * self.slowdown, left, obs.budget)

    def _measure(self, obs: Observation) -> None:
        """Learn from the last acquisition how much dearer than predicted this request's
        work is running (its measured spend over its predicted cost)."""
        if self._pending is None:
            return
        name, spent_before = self._pending
        self._pending = None
        predicted = self.per_feature.get(name, 0.0)
        if predicted > MIN_PREDICTED_MS:
            ratio = (obs.spent - spent_before) / predicted
            self.slowdown = min(max(self.slowdown, ratio), MAX_SLOWDOWN)

    def _acquire(self, name: str, obs: Observation) -> Acquire:
        self._pending = (name, obs.spent)
        return Acquire(name)

    def _heads_nothing(self, features: Mapping[str, FloatVector], word: int) -> bool:
        """Whether ``word``'s ψ^POS is in hand and the length filter kept none of its arcs
        (all ids -1): its ψ^Lex would score nothing."""
        pos = features.get(pos_name(word))
        if pos is None:
            return False
        width = len(pos) // (self.rt.spec.max_tokens + 1)
        return bool((pos[width : (self.n + 1) * width : width] < 0).all())

    def step(self, obs: Observation) -> Step:
        self._measure(obs)
        self._stale_ms = 0.0
        features = obs.features
        policy = self.rt.spec.policy
        if not self.plan.decided:
            if policy in ("oneshot", "anytime"):
                # Every word's ψ^POS before the policy's inputs: a word without it scores
                # every arc 0, while the inputs only choose the upgrades (bought first, they
                # left the last words of a tight budget without ψ^POS: anytime at
                # t_POS + 0.25 (t_Full - t_POS) parsed 51 % UAS against all-ψ^POS's 81 %).
                while self._base <= self.n and pos_name(self._base) in features:
                    self._base += 1
                name = pos_name(self._base) if self._base <= self.n else WORDS
                # the policy's inputs are worth buying only if its time and an upgrade follow
                then = self.rt.decide.at(self.n) + self.lex_cost if name == WORDS else 0.0
                if name not in features:
                    if not self._fits(name, obs, then):
                        self.stopped_by_budget = True
                        return self._answer(features)
                    return self._acquire(name, obs)
            started, cpu = time.perf_counter(), time.thread_time()
            self._decide(features)
            # the policy's own time, spent since ``obs`` was measured, is not left either
            self._stale_ms = (time.perf_counter() - started) * 1e3
            self.rt.decide.note(self.n, (time.thread_time() - cpu) * 1e3)
        while True:
            queue = self.plan.queue
            while queue and queue[0] in features:
                queue.pop(0)
            if queue:
                name = queue[0]
                if name.startswith("lex@") and self._heads_nothing(features, int(name[4:])):
                    queue.pop(0)  # the length filter left this word no arc: nothing to upgrade
                    continue
                if not self._fits(name, obs):
                    # the budget no longer covers this template and the decode: answer
                    # from what is in hand (heads without ψ^POS score every arc 0)
                    queue.clear()
                    self.stopped_by_budget = True
                    if name.startswith("pos@"):
                        return self._answer(features)
                    continue
                return self._acquire(name, obs)
            if not self.drawn and pos_name(1) in features:
                self.drawn = True
                self._draw(features)
                continue
            if policy == "myopic" and self.myopic_margin is None:
                self.myopic_margin = self._margin(features)
                if self.myopic_margin < self.point.threshold:
                    self.plan.chosen = list(range(1, self.n + 1))
                    self.plan.queue = [lex_name(w) for w in self.plan.chosen]
                    continue
            return self._answer(features)

    def fallback(self, obs: Observation) -> Answer:
        return self._answer(obs.features)

    # -- decoding -------------------------------------------------------------------------
    def _margin(self, features: Mapping[str, FloatVector]) -> float:
        """Mean over words of (best - second best) head score with the templates in hand."""
        t0 = time.perf_counter()
        matrix, _ = self.rt.score_matrix(features, self.n)
        margin = mean_margin(matrix)
        self.decode_ms += (time.perf_counter() - t0) * 1000.0
        return margin

    def _answer(self, features: Mapping[str, FloatVector]) -> ParseAnswer:
        t0 = time.perf_counter()
        matrix, templates = self.rt.score_matrix(features, self.n)
        heads = chu_liu_edmonds(matrix)
        scores = matrix[heads[1:], np.arange(1, self.n + 1)]
        self.decode_ms += (time.perf_counter() - t0) * 1000.0
        self.result = ParseAnswer(
            model=self.point.id,
            heads=tuple(int(h) for h in heads[1:]),
            scores=tuple(float(s) for s in scores),
            templates=tuple(templates[1:]),
        )
        return self.result

    def report(self) -> dict[str, Any] | None:
        r = self.result
        if r is None:
            return None
        return {
            "kind": "parser",
            "policy": self.rt.spec.policy,
            "point": self.point.id,
            "heads": list(r.heads),
            "tokens": [
                {"head": h, "score": s, "template": t}
                for h, s, t in zip(r.heads, r.scores, r.templates, strict=True)
            ],
            "policy_full": sorted(self.plan.chosen),
            "root_template": "pos",
            "myopic_margin": self.myopic_margin,
            "stopped_by_budget": self.stopped_by_budget,
            "slowdown": self.slowdown,
            "decode_ms": self.decode_ms,
        }


@register_strategy
class ParserRuntime(StrategyRuntime[ParserStrategy]):
    kind = "parser"

    def setup(self) -> None:
        spec = self.spec
        if self.bundle_dir is None:
            raise BundleError("a parser strategy needs its bundle folder to load its weights")
        self.weights = self._load(spec.weights, "parser weights", (spec.buckets,)).astype(
            np.float64
        )
        if spec.policy_features != POLICY_FEATURES:
            raise BundleError(
                f"parser strategy {spec.name!r}: policy_features is {spec.policy_features}, "
                f"this service computes {POLICY_FEATURES}; rebuild the bundle"
            )
        self.policies: dict[str, FloatArray] = {}
        for point in spec.points:
            if spec.policy in ("oneshot", "anytime"):
                if point.policy_file is None:
                    raise BundleError(
                        f"parser strategy {spec.name!r}: point {point.id!r} has no policy_file"
                    )
                self.policies[point.id] = self._load(
                    point.policy_file,
                    f"policy of {point.id!r}",
                    (POLICY_FEATURES + 1,) if spec.policy == "oneshot" else None,
                )
        # Most accurate first; ``choose`` takes the first whose expected cost fits.
        self.points = sorted(spec.points, key=lambda p: (-p.uas, p.full_fraction))
        #: The policy's own CPU time (ms: scoring its inputs, ordering the upgrades) of late,
        #: per sentence length: priced, like a template, at the request's slowdown.
        self.decide = RecentMost()

    def forget_timings(self) -> None:
        self.decide.clear()

    def _load(self, file: str, what: str, shape: tuple[int, ...] | None) -> FloatArray:
        """A float .npy of the bundle; ``shape`` None: an anytime policy, (features + 1,) or
        (features + 1, T) for Alg. 1's T per-step policies."""
        assert self.bundle_dir is not None
        path = bundle_file(self.bundle_dir, file, f"parser strategy {self.spec.name!r}: {what}")
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise BundleError(f"{what}: cannot read {file!r}: {exc}") from exc
        if shape is None:
            if array.ndim == 1:
                array = array[:, None]
            ok = array.ndim == 2 and array.shape[0] == POLICY_FEATURES + 1 and array.shape[1] > 0
            expected = f"({POLICY_FEATURES + 1},) or ({POLICY_FEATURES + 1}, steps)"
        else:
            ok = array.shape == shape
            expected = str(shape)
        if not ok or not np.all(np.isfinite(array)):
            raise BundleError(f"{what}: {file!r} has shape {array.shape}, expected {expected}")
        return np.asarray(array, dtype=np.float64)

    def word_scores(self, point: ParserPoint, words: FloatVector, n: int) -> FloatArray:
        """The policy's scores of the n words: (n,) one-shot, (n, T) anytime (step t's
        policy in column t)."""
        coef = self.policies[point.id]
        x = words.reshape(-1, POLICY_FEATURES)[:n].astype(np.float64)
        scores: FloatArray = x @ coef[:-1] + coef[-1]
        return scores

    @staticmethod
    def anytime_order(scores: FloatArray) -> list[int]:
        """Alg. 2's order (1-based words): at step t, π_t's best word not yet upgraded
        (the last policy for every step past T); ties go to the first word."""
        n, steps = scores.shape
        left = np.ones(n, dtype=bool)
        order = []
        for t in range(n):
            col = np.where(left, scores[:, min(t, steps - 1)], -np.inf)
            w = int(np.argmax(col))
            left[w] = False
            order.append(w + 1)
        return order

    def score_matrix(
        self, features: Mapping[str, FloatVector], n: int
    ) -> tuple[FloatArray, list[str]]:
        """Edge scores from the templates in hand, and each head's template. An arc whose
        ψ^POS ids are -1 was pruned by the bundle's length filter: -inf (never chosen)."""
        m = self.spec.max_tokens + 1
        matrix = np.full((n + 1, n + 1), -np.inf)
        templates = []
        weights = self.weights
        for h in range(n + 1):
            pos = features.get(pos_name(h))
            lex = features.get(lex_name(h)) if h else None
            if pos is None:
                matrix[h, 1:] = 0.0
                templates.append("none")
                continue
            ids = pos.reshape(m, -1)[1 : n + 1].astype(np.int64)
            row = weights[ids].sum(axis=-1)
            if lex is not None:
                row += weights[lex.reshape(m, -1)[1 : n + 1].astype(np.int64)].sum(axis=-1)
            kept = ids[:, 0] >= 0
            matrix[h, 1:] = np.where(kept, row, -np.inf) if not kept.all() else row
            templates.append("full" if lex is not None else "pos")
        return matrix, templates

    def base_cost(self, n: int, per_feature: dict[str, float]) -> float:
        """What every point pays at ``n`` tokens: ψ^POS for every head, decoding, and the
        policy's ``words`` features when the policy reads them (one-shot and anytime)."""
        base = sum(per_feature.get(pos_name(i), 0.0) for i in range(n + 1))
        if self.spec.policy in ("oneshot", "anytime"):
            base += per_feature.get(WORDS, 0.0)
        return base + self.spec.decode_cost(n)

    def choose(self, n: int, budget: float, per_feature: dict[str, float]) -> ParserPoint:
        """The most accurate point whose expected cost at ``n`` tokens fits ``budget``."""
        base = self.base_cost(n, per_feature)
        lex = per_feature.get(lex_name(1), 0.0)
        for point in self.points:
            if base + point.full_fraction * n * lex <= budget:
                return point
        return min(self.points, key=lambda p: p.full_fraction)

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        per_feature = self.costs.at(size)
        return ParserSession(self, self.choose(size, budget, per_feature), size, per_feature)

    def predict(self, answer: Answer, features: Mapping[str, FloatVector]) -> FloatVector:
        """The heads of the parse (the session decoded it), as float32."""
        if not isinstance(answer, ParseAnswer):
            raise TypeError(f"a parser answers with a ParseAnswer, got {answer!r}")
        return np.asarray(answer.heads, dtype=np.float32)

    def skyline(self, size: int) -> list[tuple[float, float, str]]:
        per_feature = self.costs.at(size)
        base = self.base_cost(size, per_feature)
        lex = per_feature.get(lex_name(1), 0.0)
        out: list[tuple[float, float, str]] = []
        for cost, uas, pid in sorted(
            (base + p.full_fraction * size * lex, p.uas, p.id) for p in self.points
        ):
            if not out or uas > out[-1][1]:
                out.append((cost, uas, pid))
        return out

    def skyline_features(self, entry: str) -> list[str]:
        return []

    def answerable(self) -> list[str]:
        return [p.id for p in self.points]
