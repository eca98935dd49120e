"""Budgeted structured prediction (paper 004) as strategy runtimes: ``structured-oneshot``
and ``structured-anytime``.

An item has parts (a word's letters); a bundle declares one extractor per (template, part),
``pixels@3``, ``hog@3``, so the request loop acquires, caches and charges templates part by
part (a cached template is free). Per request the session

1. acquires the base templates of every part (the initial state S0), while they fit in what
   is left of the budget after the decoding reserve (``decode_cost`` per part): one step of
   the request loop for all of them (``Acquire.then``);
2. runs the policy once on S0 (its inputs, recipe ``letters-v1``, from the base features and
   one forward-backward of the chain; its scores from one product), but only when the
   cheapest missing pair still fits after both the decoding and the policy reserve
   (``policy_cost`` per part); otherwise it answers from the base templates;
3. acquires (part, template) pairs: the one-shot policy's chosen pairs (the operating point
   is the most expensive one whose expected cost fits the budget), or, anytime (Alg. 2),
   π_t's best pair at step t, until the policy stops or the next pair's predicted cost no
   longer fits what is left of the budget after the decoding reserve (the policy's time is
   in the measured spending by then). The scores come from S0 and do not change as pairs
   are bought, so the whole sequence is known at once and the loop buys it in one step,
   stopping where the next pair no longer fits;
4. answers; ``decode`` then scores every part from the templates in hand (one product per
   template not already scored for the policy), decodes the word exactly (Viterbi) and
   computes per-part marginals (those of S0 again when nothing was added).

Anytime, a word ends early when π_t's best pair scores below the strategy's threshold
(``stop_below``, chosen in training for the bundle's tolerance); a request that sends its own
``tolerance`` (the accuracy with every budget it accepts to lose for time; 0: the top) gets
the threshold of the strategy's stop table for it (``StructuredAnytimeRuntime.stop_below``).

The chain's passes (Viterbi, forward-backward, the policy's inputs) run as compiled kernels
(:mod:`service.strategies.chain_kernels`, loaded with the first structured bundle): on a
word's few letters numpy's per-call cost made policy and decoding half a HOG template.

The budget is a hard cap up to prediction error: a pair is acquired only when its predicted
cost fits, so the spent cost exceeds the budget by at most the misprediction of the last
template acquired (plus that of decoding).

The module stays whole (over 450 lines): the two runtimes share a runtime and a session base,
whose steps above hand each other the S0 emissions and marginals that keep the per-letter
overhead low.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, ClassVar, Generic

import numpy as np
import numpy.typing as npt
import onnxruntime as ort
from typing_extensions import TypeVar

from service.bundle import (
    StructuredAnytimeStrategy,
    StructuredOneShotStrategy,
    StructuredOperatingPoint,
    _StructuredStrategy,
)
from service.errors import BundleError
from service.inference import open_onnx
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
from service.strategies.chain import ChainParams
from service.types import FloatVector

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]

StructT = TypeVar("StructT", bound=_StructuredStrategy, default=_StructuredStrategy)


# The affine map of a linear scorer is read off its ONNX graph with the unit rows and then
# checked on these many rows of random inputs (see :class:`_Scorer`).
_CHECK_ROWS = 16
# How far (relative to the largest score of the check) numpy's scores of the map read off
# may stray from the graph's float32 scores; float32 rounding is ~1e-6 of that.
_AFFINE_TOLERANCE = 1e-4


class _Scorer:
    """An ONNX model (n, d) -> (n, c) run on a batch of parts.

    Every scorer the OCR builder writes is affine (``x @ W + b``, standardisation folded
    in or not), and an ONNX call costs more than the product itself on a word's few parts.
    So at load the scorer evaluates the graph once on the zero row and the d unit rows,
    which gives ``b`` and ``W`` exactly up to float32 rounding, and checks the map on random
    rows against the graph: when it agrees (to 1e-4 of the scores' scale), parts are scored
    by ``x @ W + b`` in numpy; a graph that is not affine keeps being run through ONNX
    Runtime. The graph stays the bundle's truth either way."""

    def __init__(self, session: ort.InferenceSession, what: str, dims: int) -> None:
        self.session = session
        self.input = session.get_inputs()[0].name
        self.outputs = [session.get_outputs()[0].name]
        self.dims = dims
        self.what = what
        self.affine = self._read_affine()

    def run_graph(self, x: F32) -> F64:
        feed = {self.input: np.ascontiguousarray(x, dtype=np.float32)}
        out = self.session.run(self.outputs, feed)[0]
        return np.asarray(out, dtype=np.float64)

    def _read_affine(self) -> tuple[F32, F64] | None:
        d = self.dims
        probe = np.zeros((d + 1, d), dtype=np.float32)
        probe[1:] = np.eye(d, dtype=np.float32)
        out = self.run_graph(probe)
        if out.ndim != 2 or out.shape[0] != d + 1:
            return None
        bias = out[0]
        # float32 weights, as the graph's: a float32 product is the graph's own arithmetic,
        # and cheaper than casting the parts to float64 first
        weight = np.ascontiguousarray(out[1:] - bias, dtype=np.float32)
        check = np.random.default_rng(0).random((_CHECK_ROWS, d)).astype(np.float32)
        check[: _CHECK_ROWS // 2] = check[: _CHECK_ROWS // 2] > 0.5  # binary rows as well
        truth = self.run_graph(check)
        scale = max(1.0, float(np.abs(truth).max()))
        if float(np.abs(np.add(check @ weight, bias) - truth).max()) > _AFFINE_TOLERANCE * scale:
            return None
        return weight, bias

    def __call__(self, x: F32) -> F64:
        if self.affine is None:
            return self.run_graph(x)
        weight, bias = self.affine
        out: F64 = np.add(x @ weight, bias)  # float32 product, float64 scores
        return out


class _StructuredRuntime(StrategyRuntime[StructT], Generic[StructT]):
    def setup(self) -> None:
        spec = self.spec
        if self.bundle_dir is None:
            raise BundleError(f"strategy {spec.name!r} needs its bundle folder for its models")
        self.names = [t.name for t in spec.templates]
        self.base_k = [k for k, t in enumerate(spec.templates) if t.base]
        self.optional_k = [k for k, t in enumerate(spec.templates) if not t.base]
        self.chain = ChainParams(
            np.asarray(spec.transition, dtype=np.float64),
            np.asarray(spec.start, dtype=np.float64),
            np.asarray(spec.end, dtype=np.float64),
        )
        self.base = np.asarray(spec.base, dtype=np.float64)
        if len(self.base) != len(self.manifest.classes):
            raise BundleError(
                f"strategy {spec.name!r}: {len(self.base)} label scores for "
                f"{len(self.manifest.classes)} classes"
            )
        self.scorers: list[_Scorer] = []
        for t in spec.templates:
            model = self.manifest.model(t.model)
            if model.file is None:
                raise BundleError(f"strategy {spec.name!r}: template {t.name!r} has no scorer")
            session = open_onnx(self.bundle_dir, model.file, f"emission scorer {t.model!r}")
            self.scorers.append(_Scorer(session, t.model, model.input_dims))
        self.policy = _Scorer(
            open_onnx(self.bundle_dir, spec.policy_file, f"policy of {spec.name!r}", "policy_file"),
            f"policy of {spec.name!r}",
            spec.policy_input_dims,
        )
        width = self.policy(np.zeros((1, spec.policy_input_dims), dtype=np.float32)).shape[1]
        self.policy_columns = width
        # feature names once: names_at[k][p] is template k of part p
        self.names_at = [[f"{n}@{p}" for p in range(spec.max_parts)] for n in self.names]
        self.base_order = [self.names_at[k][p] for p in range(spec.max_parts) for k in self.base_k]
        # optional_names[size]: the optional templates of parts 0 … size-1
        self.optional_names = [
            [self.names_at[k][p] for p in range(size) for k in self.optional_k]
            for size in range(spec.max_parts + 1)
        ]
        self.check_policy(width)
        # the chain's passes, compiled (numba is loaded only by structured bundles)
        from service.strategies import chain_kernels

        self.kernels = chain_kernels
        chain_kernels.compile_kernels(self.chain, self.scorers[self.base_k[0]].dims)
        self._warm_up()

    def _warm_up(self) -> None:
        """Run the policy and the decoder once on a blank word, so that the first request
        does not pay their one-off costs (the chain's cached factors, numpy's first calls)
        against its budget (the bundle's warm-up runs extractors and models, not these)."""
        size = min(3, self.spec.max_parts)
        blank = {
            self.names_at[k][p]: np.zeros(scorer.dims, dtype=np.float32)
            for k, scorer in enumerate(self.scorers)
            for p in range(size)
        }
        _, em0, marg0 = self.policy_view(blank, size)
        self.decode_word(blank, size, (em0, marg0))
        self.decode_word(blank, size)

    def check_policy(self, width: int) -> None:
        """Raise ``BundleError`` when the policy's output does not fit the spec."""

    def feature(self, part: int, k: int) -> str:
        return self.names_at[k][part]

    # -- what both sessions share

    def gather(self, features: Mapping[str, FloatVector], k: int, size: int) -> F32:
        """Template ``k`` of parts 0 … size-1 as one (size, dims) array."""
        names = self.names_at[k]
        return np.array([features[names[p]] for p in range(size)], dtype=np.float32)

    def s0_emission(
        self, features: Mapping[str, FloatVector], size: int, first: F32 | None = None
    ) -> F64:
        """The word's emission scores (size, Y) in S0, one scorer call per base template
        over the whole word; ``first``: the first base template's gathered features."""
        em = self.base + self.scorers[self.base_k[0]](
            self.gather(features, self.base_k[0], size) if first is None else first
        )
        for k in self.base_k[1:]:
            em += self.scorers[k](self.gather(features, k, size))
        return em

    def policy_view(self, features: Mapping[str, FloatVector], size: int) -> tuple[F64, F64, F64]:
        """The policy's scores (parts, columns) from S0, with the S0 emission and its chain
        marginals (which decoding reuses): the whole word at once, a fixed number of array
        operations besides the chain's passes."""
        base_x = self.gather(features, self.base_k[0], size)
        em0 = self.s0_emission(features, size, base_x)
        marg0, inputs = self.kernels.s0_pass(base_x, em0, self.chain)
        return self.policy(inputs), em0, marg0

    def policy_scores(self, features: Mapping[str, FloatVector], size: int) -> F64:
        """The policy's scores (parts, columns) from S0."""
        return self.policy_view(features, size)[0]

    def decode_word(
        self,
        features: Mapping[str, FloatVector],
        size: int,
        s0: tuple[F64, F64] | None = None,
    ) -> tuple[npt.NDArray[np.int64], F64, list[list[str]]]:
        """Labels, marginals (parts, Y) and templates of each part, from the features in
        hand. ``s0``: the S0 emission and marginals (every part's base templates in hand),
        when the session computed them for its policy: only the other templates are scored
        then, and the marginals are reused when no template was added."""
        names_at = self.names_at
        if s0 is None:
            em = np.repeat(self.base[None, :], size, axis=0)
            ks: list[int] = list(range(len(self.scorers)))
        else:
            em = s0[0].copy()
            ks = self.optional_k
        added = False
        for k in ks:
            names = names_at[k]
            parts = [p for p in range(size) if names[p] in features]
            if not parts:
                continue
            x = np.array([features[names[p]] for p in parts], dtype=np.float32)
            if len(parts) == size:
                em += self.scorers[k](x)
            else:
                em[parts] += self.scorers[k](x)
            added = True
        if s0 is not None and not added:
            labels, marg = self.kernels.viterbi(em, self.chain), s0[1]
        else:
            labels, marg = self.kernels.decode(em, self.chain)
        had = [
            [self.names[k] for k in range(len(names_at)) if names_at[k][p] in features]
            for p in range(size)
        ]
        return labels, marg, had

    def answerable(self) -> list[str]:
        return [self.spec.answer_model]

    def skyline(self, size: int) -> list[tuple[float, float, str]]:
        """One point: every template of every one of ``size`` parts, decoded (the chain's
        accuracy with all templates); cheaper answers are the policies' business."""
        spec = self.spec
        per_part = sum(t.cost for t in spec.templates) + spec.decode_cost + spec.policy_cost
        model = spec.answer_model
        return [(size * per_part, self.accuracy[model], model)]

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        return self.session(size, budget)

    def session(self, size: int, budget: float) -> StructuredSession:
        raise NotImplementedError


class StructuredSession(Session):
    """Base templates first, then the policy's pairs while they fit (see the module)."""

    def __init__(self, runtime: _StructuredRuntime[Any], size: int, budget: float) -> None:
        self.runtime = runtime
        self.size = size
        if size > runtime.spec.max_parts:
            raise BundleError(
                f"strategy {runtime.name!r} serves at most {runtime.spec.max_parts} parts"
            )
        self.per_feature = runtime.costs.at(size)
        # what is still ahead: decoding always, the policy until it has run (its time is in
        # the measured spending afterwards)
        self.reserve = runtime.spec.decode_cost * size
        self.policy_reserve = runtime.spec.policy_cost * size
        self.base_queue = runtime.base_order[: size * len(runtime.base_k)]
        self.base_at = 0
        self.scores: F64 | None = None
        self.s0: tuple[F64, F64] | None = None
        self.policy_ms = 0.0
        self.steps = 0
        self.result: dict[str, Any] | None = None
        self.stopped = "policy"
        # the plan's features not in hand when it was made, and those still to buy
        self.to_buy: list[str] = []
        self.pending: list[str] | None = None

    def _fits(self, name: str, obs: Observation) -> bool:
        return affordable(self.per_feature[name], obs.remaining - self.reserve, obs.budget)

    def _answer(self) -> Answer:
        return Answer(self.runtime.spec.answer_model)

    def step(self, obs: Observation) -> Step:
        rt = self.runtime
        features = obs.features
        queue = self.base_queue
        while self.base_at < len(queue) and queue[self.base_at] in features:
            self.base_at += 1
        if self.base_at < len(queue):
            # every missing base template, in one step of the request loop, while they fit
            name = queue[self.base_at]
            if not self._fits(name, obs):
                self.stopped = "budget"
                return self._answer()
            per_feature = self.per_feature
            rest = tuple(
                (n, per_feature[n]) for n in queue[self.base_at + 1 :] if n not in features
            )
            return Acquire(name, rest, self.reserve)
        if self.pending is None:
            if self.scores is None:
                per_feature = self.per_feature
                missing = [
                    per_feature[n] for n in rt.optional_names[self.size] if n not in features
                ]
                if not missing:
                    return self._answer()
                # the policy runs only when, once paid, some pair could still be bought
                cheapest = min(missing)
                available = obs.remaining - self.reserve - self.policy_reserve
                if not affordable(cheapest, available, obs.budget):
                    self.stopped = "budget"
                    return self._answer()
                t0 = time.perf_counter()
                self.scores, em0, marg0 = rt.policy_view(features, self.size)
                self.s0 = (em0, marg0)
                self.policy_ms = (time.perf_counter() - t0) * 1000.0
            # the policy's pairs do not depend on the templates they buy: the whole plan is
            # known now, and the request loop buys it in one step while it fits
            names_at = rt.names_at
            self.pending = self.to_buy = [
                name for p, k in self.plan_pairs(obs) if (name := names_at[k][p]) not in features
            ]
        pending = self.pending
        if pending and pending[0] in features:  # bought by the loop since the last step
            self.pending = pending = [n for n in pending if n not in features]
        if not pending:
            return self._answer()
        name = pending[0]
        if not self._fits(name, obs):
            self.stopped = "budget"
            return self._answer()
        per_feature = self.per_feature
        return Acquire(name, tuple((n, per_feature[n]) for n in pending[1:]), self.reserve)

    def plan_pairs(self, obs: Observation) -> list[tuple[int, int]]:
        """The (part, template) pairs to acquire, in order, once the policy's scores are
        known (a pair in hand is skipped)."""
        raise NotImplementedError

    def fallback(self, obs: Observation) -> Answer:
        self.stopped = "budget"
        return self._answer()

    def decode(self, features: Mapping[str, FloatVector]) -> FloatVector:
        rt = self.runtime
        self.steps = sum(1 for n in self.to_buy if n in features)
        found, marg, had = rt.decode_word(features, self.size, self.s0)
        summary: tuple[F64, FloatVector] = rt.kernels.summary(marg, found)
        confidence, mean = summary
        labels: list[int] = found.tolist()
        conf: list[float] = confidence.tolist()
        classes = rt.manifest.classes
        word = "".join([classes[y] for y in labels])
        self.prediction = word
        self.expected_accuracy = sum(conf) / len(conf)
        self.result = {
            "kind": "structured",
            "word": word,
            "letters": [
                {"label": classes[y], "confidence": c, "templates": t}
                for y, c, t in zip(labels, conf, had, strict=True)
            ],
            "stopped_by": self.stopped,
            **self.extra(),
        }
        return mean

    def extra(self) -> dict[str, Any]:
        return {}

    def report(self) -> dict[str, Any] | None:
        return self.result


# ---------------------------------------------------------------------------- one-shot


class OneShotSession(StructuredSession):
    def __init__(self, runtime: StructuredOneShotRuntime, size: int, budget: float) -> None:
        super().__init__(runtime, size, budget)
        self.point = runtime.point_for(size, budget)
        self.planned = runtime.expected_cost(self.point, size)
        self.oneshot = runtime

    def plan_pairs(self, obs: Observation) -> list[tuple[int, int]]:
        assert self.scores is not None
        return self.oneshot.chosen_pairs(self.scores, self.point)

    def extra(self) -> dict[str, Any]:
        return {
            "policy": "one-shot",
            "lam": self.point.lam,
            "positive_weight": self.point.positive_weight,
        }


@register_strategy
class StructuredOneShotRuntime(
    _StructuredRuntime[StructuredOneShotStrategy], StrategyRuntime[StructuredOneShotStrategy]
):
    kind = "structured-oneshot"

    def check_policy(self, width: int) -> None:
        spec = self.spec
        self.subsets = [sorted({self.names.index(n) for n in s}) for s in spec.subsets]
        cols = 1 if len(spec.subsets) == 2 else len(spec.subsets)
        for point in spec.points:
            if point.column + cols > width:
                raise BundleError(
                    f"strategy {spec.name!r}: point λ={point.lam} reads policy columns "
                    f"{point.column}..{point.column + cols - 1}, the policy has {width}"
                )
        self.columns_per_point = cols
        self.points = sorted(spec.points, key=lambda p: p.mean_cost)
        base = sum(spec.templates[k].cost for k in self.base_k)
        # each point's expected cost per part, once (a request multiplies by its size)
        self.per_part = [
            base + p.mean_cost + spec.decode_cost + spec.policy_cost for p in self.points
        ]

    def expected_cost(self, point: StructuredOperatingPoint, size: int) -> float:
        spec = self.spec
        base = sum(spec.templates[k].cost for k in self.base_k)
        return size * (base + point.mean_cost + spec.decode_cost + spec.policy_cost)

    def point_for(self, size: int, budget: float) -> StructuredOperatingPoint:
        """The most expensive point whose expected cost for ``size`` parts fits (the
        cheapest when none does)."""
        best = self.points[0]
        for point, per_part in zip(self.points, self.per_part, strict=True):
            if size * per_part > budget:  # points by rising cost: none further fits
                break
            best = point
        return best

    def chosen_pairs(self, scores: F64, point: StructuredOperatingPoint) -> list[tuple[int, int]]:
        """The (part, template) pairs the point's classifier adds, most confident first."""
        cols = scores[:, point.column : point.column + self.columns_per_point]
        if self.columns_per_point == 1:
            chosen = (cols[:, 0] > 0).astype(int)
            strength = cols[:, 0]
        else:
            chosen = cols.argmax(axis=1)
            strength = cols.max(axis=1)
        # most confident part first, ties to the first part; each part's templates in order
        order = np.argsort(-strength, kind="stable").tolist()
        subsets = self.subsets
        picked = chosen.tolist()
        return [(p, k) for p in order for k in subsets[picked[p]]]

    def session(self, size: int, budget: float) -> StructuredSession:
        return OneShotSession(self, size, budget)


# ---------------------------------------------------------------------------- anytime


class AnytimeSession(StructuredSession):
    def __init__(self, runtime: StructuredAnytimeRuntime, size: int, budget: float) -> None:
        super().__init__(runtime, size, budget)
        self.anytime = runtime
        self.planned = budget

    def plan_pairs(self, obs: Observation) -> list[tuple[int, int]]:
        """Alg. 2's whole sequence: at step t (t = optional pairs in hand), π_t's best pair
        not in hand; ties go to the first template, then the first part; it ends at the
        first step whose best pair scores below the runtime's threshold (``stop_below``). The scores
        come from S0 and do not change as pairs are bought, so the sequence is known before
        the first of them (the request loop stops it where the budget runs out). Plain
        lists: a word has at most a few dozen pairs, where loops beat array calls."""
        assert self.scores is not None
        rt = self.anytime
        threshold = rt.stop_below()
        stop = -np.inf if threshold is None else threshold
        have = [
            [rt.names_at[k][p] in obs.features for p in range(self.size)] for k in rt.optional_k
        ]
        t = sum(sum(row) for row in have)
        columns = self.scores.T.tolist()
        order: list[tuple[int, int]] = []
        while True:
            first = rt.column(t, 0)
            best: tuple[int, int] | None = None
            best_score = -np.inf
            for j, held in enumerate(have):
                col = columns[first + j]
                for p in range(self.size):
                    if not held[p] and col[p] > best_score:
                        best_score, best = col[p], (j, p)
            if best is None or best_score < stop:
                break
            j, p = best
            have[j][p] = True
            t += 1
            order.append((p, rt.optional_k[j]))
        return order

    def extra(self) -> dict[str, Any]:
        return {"policy": "anytime", "steps": self.steps}


@register_strategy
class StructuredAnytimeRuntime(
    _StructuredRuntime[StructuredAnytimeStrategy], StrategyRuntime[StructuredAnytimeStrategy]
):
    kind = "structured-anytime"
    #: A request's tolerance picks its stop from the strategy's stop table.
    request_options: ClassVar[frozenset[str]] = frozenset({"tolerance"})
    tolerance: float | None = None

    def with_options(self, **options: Any) -> StrategyRuntime[StructuredAnytimeStrategy]:
        if "tolerance" in options and not self.spec.stops:
            raise ValueError(
                f"strategy {self.name!r} has no stop table (a bundle built before it had "
                "one): a request cannot set its tolerance; rebuild the bundle, or send none"
            )
        return super().with_options(**options)

    def stop_below(self) -> float | None:
        """Alg. 2's stop for this request: the bundle's (``spec.stop_below``) without a
        tolerance; with one, the threshold of the largest tolerance of the stop table at
        most it (None, no stop, when even the smallest is above it)."""
        if self.tolerance is None:
            return self.spec.stop_below
        fits = [p for p in self.spec.stops if p.tolerance <= self.tolerance + 1e-12]
        return fits[-1].stop_below if fits else None

    def check_policy(self, width: int) -> None:
        spec = self.spec
        if [self.names[k] for k in self.optional_k] != spec.optional:
            raise BundleError(
                f"strategy {spec.name!r}: optional templates {spec.optional} are not the "
                f"non-base templates {[self.names[k] for k in self.optional_k]} in order"
            )
        if width != spec.steps * len(self.optional_k):
            raise BundleError(
                f"strategy {spec.name!r}: the policy has {width} columns; {spec.steps} steps x "
                f"{len(self.optional_k)} optional templates are declared"
            )

    def column(self, t: int, j: int) -> int:
        return min(t, self.spec.steps - 1) * len(self.optional_k) + j

    def session(self, size: int, budget: float) -> StructuredSession:
        return AnytimeSession(self, size, budget)
