"""Adaptive sensor acquisition on a DAG of states (paper 000) as a strategy runtime.

Each state (a set of acquired groups) has a classifier and a policy: a filter tree whose
internal nodes are decisions on the values acquired so far (and, for policies with
``confidence_inputs``, on the state's classifier's top probability and margin, computed here
with the state's model as it would answer). Per request the runtime
picks, by validation accuracy, among the operating points of the trade-off sweep whose
average cost fits the budget and the best fixed sensor subsets that fit
(:mod:`service.strategies.fixed`; within the tolerance, the cheapest). A fixed subset is
served as a plain pipeline; an operating point walks the DAG from the empty state: the
policy chooses to stop and classify or
to acquire a group; groups are acquired through the extractor plugins (cached ones cost
nothing) and the budget is a hard cap — an acquisition that does not fit what is left stops
the walk and the current state's classifier answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from service.bundle import DagPolicy, DagStrategy, FixedPoint
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
from service.strategies.fixed import ChoosesAPoint, FixedPoints, Option, capped_at
from service.types import FloatVector


class _Policy:
    """One operating point: its ONNX logits model and the trees of its states."""

    def __init__(self, spec: DagPolicy, runtime: DagRuntime) -> None:
        self.spec = spec
        self.runtime = runtime
        self.states = {s.groups: s for s in spec.states}
        if runtime.bundle_dir is None:
            raise BundleError("a DAG strategy needs its bundle folder to load its policies")
        self.session = open_onnx(runtime.bundle_dir, spec.file, "DAG policy")
        self.input = self.session.get_inputs()[0].name
        width = self.session.get_inputs()[0].shape[-1]
        takes = runtime.input_width + (len(CONFIDENCE) if spec.confidence_inputs else 0)
        if isinstance(width, int) and width != takes:
            raise BundleError(
                f"DAG policy {spec.file!r} takes {width} inputs; the strategy's inputs "
                f"declare {runtime.input_width}"
                + (
                    f", and its confidence inputs {len(CONFIDENCE)} more"
                    if spec.confidence_inputs
                    else ""
                )
            )
        outputs = self.logits(np.zeros(takes, dtype=np.float32)).shape[0]
        for state in spec.states:
            for node in state.tree:
                if node.logit is not None and node.logit >= outputs:
                    raise BundleError(
                        f"DAG policy {spec.file!r}: state {state.groups} reads logit "
                        f"{node.logit}, the model has {outputs}"
                    )
            expected = set(runtime.state_features(state.groups))
            if set(runtime.model_features.get(state.model, ())) != expected:
                raise BundleError(
                    f"DAG policy {spec.file!r}: state {state.groups} answers with "
                    f"{state.model!r}, whose features are not {sorted(expected)}"
                )

    def logits(self, x: FloatVector) -> FloatVector:
        out = self.session.run(None, {self.input: x.reshape(1, -1)})[0]
        result: FloatVector = np.asarray(out, dtype=np.float32)[0]
        return result

    def action(self, state: int, features: Mapping[str, FloatVector]) -> int:
        """The action of ``state``'s filter tree on the features in hand."""
        tree = self.states[state].tree
        if not tree:
            return 0
        logits = None
        if any(n.logit is not None for n in tree):
            x = self.runtime.input_vector(features)
            if self.spec.confidence_inputs:
                model = Answer(self.states[state].model)
                x = np.concatenate([x, confidence(self.runtime.predict(model, features))])
            logits = self.logits(x)
        node = 0
        while True:
            spec = tree[node]
            if spec.logit is not None:
                assert logits is not None
                right = bool(logits[spec.logit] > 0)
            else:
                right = bool(spec.constant)
            child = spec.right if right else spec.left
            if child < 0:
                return -child - 1
            node = child


#: What :func:`confidence` gives, in order (training's ``CONFIDENCE_COLUMNS``).
CONFIDENCE = ("top1", "margin")


def confidence(probabilities: FloatVector) -> FloatVector:
    """A state classifier's confidence, as its policy learned it: the top class probability
    and its margin over the second (one class: the probability twice)."""
    p = np.asarray(probabilities, dtype=np.float32).reshape(-1)
    if p.shape[0] < 2:
        return np.asarray([p[0], p[0]], dtype=np.float32)
    top2 = -np.sort(-p)[:2]
    return np.asarray([top2[0], top2[0] - top2[1]], dtype=np.float32)


class DagSession(Session):
    def __init__(self, runtime: DagRuntime, policy: _Policy, per_feature: dict[str, float]) -> None:
        self.runtime = runtime
        self.policy = policy
        self.per_feature = per_feature
        self.planned = policy.spec.mean_cost
        self.expected_accuracy = 1.0 - policy.spec.error
        self.state = 0
        self.visited = [0]
        self.pending: list[str] = []
        self.target = 0

    def _answer(self) -> Answer:
        return Answer(self.policy.states[self.state].model)

    def _answer_from(self, obs: Observation) -> Answer:
        """The state's classifier; but when the features in hand go beyond the state's
        (values the client sent, sensors cached by an earlier request), the most accurate
        model they compute, if it is more accurate: a value in hand is never ignored. The
        policy's held-out accuracy then does not apply; the model's own is reported."""
        answer = self._answer()
        in_hand = set(obs.features)
        if in_hand <= set(self.runtime.state_features(self.state)):
            return answer
        best = self.runtime.best_computable(in_hand)
        if self.runtime.accuracy[best] > self.runtime.accuracy[answer.model]:
            self.expected_accuracy = None
            return Answer(best)
        return answer

    def _fits(self, obs: Observation) -> bool:
        cost = sum(self.per_feature[f] for f in self.pending)
        return affordable(cost, obs.remaining, obs.budget)

    def step(self, obs: Observation) -> Step:
        rt = self.runtime
        in_hand = obs.features
        # Transitions lead to strictly larger states (checked at load), so this ends.
        while True:
            if not self.pending:
                action = self.policy.action(self.state, in_hand)
                if action == 0:
                    return self._answer_from(obs)
                self.target = self.policy.states[self.state].transitions[action - 1]
                self.pending = [f for f in rt.state_features(self.target) if f not in in_hand]
            while self.pending and self.pending[0] in in_hand:
                self.pending.pop(0)
            if self.pending:
                # The budget is a hard cap, re-checked before each sensor of a group: if an
                # earlier one ran over its predicted cost, the rest may no longer fit.
                if not self._fits(obs):
                    self.pending = []
                    return self._answer_from(obs)
                return Acquire(self.pending[0])
            self.state = self.target
            self.visited.append(self.state)

    def fallback(self, obs: Observation) -> Answer:
        """The current state's classifier, or a more accurate model computable from the
        features in hand (values the client sent may lie outside the walk's state). The walk
        did not end where the policy would have, so the policy's held-out accuracy does not
        apply: the answering model's own estimate is reported."""
        self.expected_accuracy = None
        answer = self._answer()
        best = self.runtime.best_computable(set(obs.features))
        if self.runtime.accuracy[best] > self.runtime.accuracy[answer.model]:
            return Answer(best)
        return answer

    def path(self) -> list[list[str]]:
        return [self.runtime.state_features(s) for s in self.visited]


@register_strategy
class DagRuntime(ChoosesAPoint, StrategyRuntime[DagStrategy]):
    kind = "dag"

    def setup(self) -> None:
        spec = self.spec
        self.groups = [list(g) for g in spec.groups]
        dims = {e.name: e.dims for e in self.manifest.extractors}
        self.offsets: dict[str, int] = {}
        width = 0
        for name in spec.inputs:
            self.offsets[name] = width
            width += dims[name]
        self.dims = dims
        self.input_width = width
        # Cheapest operating point first; ``choose`` takes the most accurate that fits.
        self.policies = sorted(
            (_Policy(p, self) for p in spec.policies),
            key=lambda p: (p.spec.mean_cost, p.spec.error),
        )
        self.fixed = FixedPoints(self, spec.fixed)
        self.tolerance = float(spec.tolerance)

    def input_vector(self, features: Any) -> FloatVector:
        x = np.zeros(self.input_width, dtype=np.float32)
        for name, offset in self.offsets.items():
            vector = features.get(name)
            if vector is not None:
                x[offset : offset + self.dims[name]] = vector
        return x

    def state_features(self, state: int) -> list[str]:
        out: list[str] = []
        for g, group in enumerate(self.groups):
            if state >> g & 1:
                out.extend(f for f in group if f not in out)
        return out

    def options(
        self, per_feature: dict[str, float], budget: float, in_hand: frozenset[str]
    ) -> list[Option[_Policy | FixedPoint]]:
        """Every operating point whose average cost fits ``budget`` (cached sensors cost
        nothing: a point that would buy them is affordable with that much more budget; the
        walk's hard cap still holds the real budget), with its validation accuracy, and every
        fixed subset whose missing sensors fit. (With a mean budget, :class:`ChoosesAPoint`,
        ``budget`` is the per-item cap and :meth:`ChoosesAPoint.pick` weighs the averages
        against the mean.)"""
        free = sum(per_feature[f] for f in in_hand if f in per_feature)
        out: list[Option[_Policy | FixedPoint]] = []
        for p in self.policies:
            if p.spec.capped:
                # the budget is a per-item hard cap: the point's numbers with every walk
                # stopped there (cached sensors free: that much more cap)
                at = capped_at(p.spec.capped, budget + free)
                if at is not None:
                    out.append(Option(max(at.mean_cost - free, 0.0), at.accuracy, p))
            elif affordable(p.spec.mean_cost, budget + free, budget):
                out.append(Option(max(p.spec.mean_cost - free, 0.0), 1.0 - p.spec.error, p))
        out.extend(self.fixed.options(per_feature, budget, in_hand))
        return out

    def choose(
        self, budget: float, in_hand: frozenset[str] = frozenset(), size: int = 1
    ) -> _Policy | FixedPoint:
        """The point to serve with ``budget``: the most accurate on the validation rows among
        the operating points and fixed subsets that fit (within ``tolerance`` of it, the
        cheapest); the cheapest operating point when none fits."""
        chosen = self.pick(
            self.options(self.costs.at(size), budget, in_hand),
            self.spec.margin,
            self.spec.validation_rows,
        )
        return self.policies[0] if chosen is None else chosen.entry

    def answerable(self) -> list[str]:
        states = {s.model for p in self.policies for s in p.spec.states}
        return sorted(states | set(self.fixed.models()))

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        per_feature = self.costs.at(size)
        chosen = self.pick(
            self.options(per_feature, budget, in_hand), self.spec.margin, self.spec.validation_rows
        )
        if chosen is None:
            return DagSession(self, self.policies[0], per_feature)
        if isinstance(chosen.entry, FixedPoint):
            return self.fixed.session(chosen.entry, per_feature, chosen.cost)
        session = DagSession(self, chosen.entry, per_feature)
        session.planned, session.expected_accuracy = chosen.cost, chosen.accuracy
        return session
