"""A strategy runtime that plays a script: the test double for the loop's contract checks.

``service.execution.run_session`` is the thing under test; its collaborator is a strategy
runtime, and the point is to feed it one that breaks the session contract (acquires a
feature twice, asks for one it does not have, never answers, falls back with an
``Acquire``). Real runtimes never do (``tests/test_strategy_contract.py`` checks them), so a
runtime that does is written here: a real :class:`StrategyRuntime` subclass over a real
bundle's manifest, models and costs whose sessions return what the script says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from service.inference import LoadedModel
from service.strategies.base import (
    Answer,
    CostModel,
    Observation,
    Session,
    StrategyRuntime,
)

#: Step ``i`` of a session given what it observes (anything, to break the contract).
Script = Callable[[Observation, int], Any]


def _snapshot(obs: Observation) -> Observation:
    """``obs`` with its own copy of the features (the loop's dict grows as it goes)."""
    return replace(obs, features=dict(obs.features))


class ScriptedSession(Session):
    def __init__(self, runtime: ScriptedRuntime) -> None:
        self.runtime = runtime

    def step(self, obs: Observation) -> Any:
        self.runtime.steps.append(_snapshot(obs))
        return self.runtime.script(obs, len(self.runtime.steps) - 1)

    def fallback(self, obs: Observation) -> Any:
        self.runtime.fallbacks.append(_snapshot(obs))
        if self.runtime.fallback_script is not None:
            return self.runtime.fallback_script(obs, len(self.runtime.fallbacks) - 1)
        return Answer(self.runtime.best_computable(set(obs.features)))


class ScriptedRuntime(StrategyRuntime):
    """Sessions answer ``script(obs, i)`` at their i-th step and ``fallback(obs, i)`` (the
    best model in hand when None) at their i-th fallback; a snapshot of every observation
    is kept in ``steps`` / ``fallbacks`` (of all sessions begun, in order)."""

    kind = "scripted"

    def __init__(
        self,
        template: StrategyRuntime,
        script: Script,
        fallback: Script | None = None,
        models: dict[str, LoadedModel] | None = None,
        costs: CostModel | None = None,
    ) -> None:
        # The double plays the template's own spec, whatever its kind: the base class checks
        # ``self.kind`` against the spec, so this instance takes the template's kind.
        vars(self)["kind"] = template.spec.kind
        super().__init__(
            template.manifest,
            template.spec,
            template.models if models is None else models,
            template.costs if costs is None else costs,
        )
        self.name = "scripted"
        self.script = script
        self.fallback_script = fallback
        self.steps: list[Observation] = []
        self.fallbacks: list[Observation] = []

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        return ScriptedSession(self)
