"""The one request loop (``service.execution.run_session``) holds strategies to their contract.

A strategy that acquires a feature twice, asks for one already in hand or one the bundle has
no extractor for, returns something that is not a step, falls back without answering, or
never answers is stopped with a ``StrategyFault`` naming it — in ``execute`` (the handler's
and offline evaluation's loop) and through the handler — instead of re-extracting, looping
forever or failing with a ``KeyError``. The misbehaving strategies are scripted runtimes
(tests/support/scripted_strategy.py) over a real bundle: the router DAG bundle (tabular,
declared costs r = 1, a = 5, b = 5) and the tiny digits bundle (measured costs).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from service.cache import InProcessCache
from service.execution import (
    DeclaredCost,
    ExtractorSource,
    MeasuredCost,
    StrategyFault,
    execute,
    run_session,
)
from service.extractors.base import FeatureUnavailable
from service.handler import PredictHandler
from service.items import DecodedItem
from service.metrics import Metrics
from service.registry import Bundle, Registry, load_bundle
from service.strategies.base import Acquire, Answer, Observation
from tests.conftest import digit_image
from tests.support.scripted_strategy import ScriptedRuntime

ROW = {"values": {"r": 0.5, "a1": 0.1, "a2": 0.2, "b1": 0.3, "b2": 0.4}}


@pytest.fixture(scope="module")
def router(router_bundle_dir: Path) -> Bundle:
    return load_bundle(router_bundle_dir, 1)


@pytest.fixture(scope="module")
def tiny(tiny_bundle_dir: Path) -> Bundle:
    return load_bundle(tiny_bundle_dir, 1 << 24)


def _item(bundle: Bundle) -> DecodedItem:
    return bundle.decoder.decode(ROW)


def _best_in_hand(runtime: ScriptedRuntime, obs: Observation) -> Answer:
    return Answer(runtime.best_computable(set(obs.features)))


def _execute(router: Bundle, runtime: ScriptedRuntime, seen: Extractions) -> None:
    """``runtime`` on the router's row, 100 to spend, nothing in hand."""
    execute(
        router, _item(router), 100.0, {}, time.perf_counter(), runtime=runtime, on_extraction=seen
    )


class Extractions:
    """Records ``on_extraction`` calls: which extractors really ran."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __call__(self, name: str, seconds: float) -> None:
        self.names.append(name)


def test_a_well_behaved_script_runs_to_its_answer(router: Bundle) -> None:
    # The double itself behaves when told to: acquire r then b, answer from what is in hand.
    order = ["r", "b"]

    def script(obs: Observation, i: int) -> Any:
        return Acquire(order[i]) if i < len(order) else _best_in_hand(runtime, obs)

    runtime = ScriptedRuntime(router.runtime, script)
    seen = Extractions()
    run = execute(
        router, _item(router), 100.0, {}, time.perf_counter(), runtime=runtime, on_extraction=seen
    )
    assert seen.names == order == list(run.extracted)
    assert run.spent == 6.0, "declared costs: r (1) + b (5)"
    assert not run.stopped_early
    assert set(router.manifest.model(run.answer).features) <= {"r", "b"}
    assert [sorted(obs.features) for obs in runtime.steps] == [[], ["r"], ["b", "r"]]
    assert [obs.spent for obs in runtime.steps] == [0.0, 1.0, 6.0]


def test_acquiring_a_feature_twice_is_stopped_before_extracting_it_again(
    router: Bundle,
) -> None:
    runtime = ScriptedRuntime(router.runtime, lambda obs, i: Acquire("r"))
    seen = Extractions()
    with pytest.raises(
        StrategyFault,
        match=r"'scripted' asked to acquire 'r', which it "
        r"already has \(acquired earlier in this request\)",
    ) as caught:
        _execute(router, runtime, seen)
    assert caught.value.strategy == "scripted"
    assert seen.names == ["r"], "the extractor ran once"
    assert len(runtime.steps) == 2


def test_acquiring_a_feature_in_hand_is_stopped(router: Bundle) -> None:
    # A cached feature is in hand from the start: asking for it again is a contract breach.
    cached = {"a": np.zeros(router.extractors["a"].dims, dtype=np.float32)}
    runtime = ScriptedRuntime(router.runtime, lambda obs, i: Acquire("a"))
    seen = Extractions()
    with pytest.raises(StrategyFault, match=r"'a', which it already has \(given in hand\)"):
        execute(
            router,
            _item(router),
            100.0,
            cached,
            time.perf_counter(),
            runtime=runtime,
            on_extraction=seen,
        )
    assert seen.names == []


def test_acquiring_a_feature_without_an_extractor_is_stopped(router: Bundle) -> None:
    runtime = ScriptedRuntime(router.runtime, lambda obs, i: Acquire("zz"))
    with pytest.raises(
        StrategyFault,
        match=r"'zz', which is not one of the features it can "
        r"acquire \(\['a', 'b', 'r'\]\)",
    ):
        execute(router, _item(router), 100.0, {}, time.perf_counter(), runtime=runtime)


@pytest.mark.parametrize("step", [None, "r", Answer, ("acquire", "r")])
def test_a_step_that_is_not_a_step_is_stopped(router: Bundle, step: object) -> None:
    runtime = ScriptedRuntime(router.runtime, lambda obs, i: step)
    with pytest.raises(StrategyFault, match=r"as a step; required: an Acquire or an Answer"):
        execute(router, _item(router), 100.0, {}, time.perf_counter(), runtime=runtime)


def test_a_fallback_that_does_not_answer_is_stopped(router: Bundle) -> None:
    # Budget 0.5: once r (cost 1) is in, the budget is spent and the fallback must answer.
    runtime = ScriptedRuntime(
        router.runtime, lambda obs, i: Acquire("r"), fallback=lambda obs, i: Acquire("a")
    )
    with pytest.raises(
        StrategyFault,
        match=r"fell back with Acquire\(feature='a'\); a "
        r"fallback must return an Answer",
    ):
        execute(router, _item(router), 0.5, {}, time.perf_counter(), runtime=runtime)
    assert len(runtime.fallbacks) == 1 and runtime.fallbacks[0].spent == 1.0


def test_the_fallback_answers_once_the_budget_is_spent(router: Bundle) -> None:
    runtime = ScriptedRuntime(router.runtime, lambda obs, i: Acquire(["r", "a", "b"][i]))
    run = execute(router, _item(router), 0.5, {}, time.perf_counter(), runtime=runtime)
    assert run.stopped_early and list(run.extracted) == ["r"]
    assert run.answer == router.runtime.best_computable({"r"})


def test_a_strategy_that_never_answers_is_stopped_within_one_step_per_extractor(
    router: Bundle,
) -> None:
    # Acquires every extractor in turn, forever: stopped at the first repeat, after
    # len(extractors) + 1 steps, with every extractor run once.
    names = sorted(router.extractors)
    runtime = ScriptedRuntime(router.runtime, lambda obs, i: Acquire(names[i % len(names)]))
    seen = Extractions()
    with pytest.raises(StrategyFault):
        execute(
            router, _item(router), 1e9, {}, time.perf_counter(), runtime=runtime, on_extraction=seen
        )
    assert len(runtime.steps) == len(names) + 1
    assert seen.names == names


def test_measured_costs_are_held_to_the_same_contract(tiny: Bundle) -> None:
    item = DecodedItem(data=digit_image(0, 32), size=32 * 32, key="loop:0")
    first = sorted(tiny.extractors)[0]
    runtime = ScriptedRuntime(tiny.runtime, lambda obs, i: Acquire(first))
    seen = Extractions()
    with pytest.raises(StrategyFault, match=f"{first!r}, which it already has"):
        execute(tiny, item, 1e6, {}, time.perf_counter(), runtime=runtime, on_extraction=seen)
    assert seen.names == [first]
    assert runtime.steps[1].spent > 0.0, "measured: the wall time of the extraction"


def test_the_handler_reports_a_faulty_strategy_instead_of_looping(router: Bundle) -> None:
    # Through the handler (the HTTP layer maps an unexpected error to a 500): the request
    # ends with the fault, and its thread and queued bytes are given back.
    names = sorted(router.extractors)
    runtime = ScriptedRuntime(router.runtime, lambda obs, i: Acquire(names[i % len(names)]))
    bundle = load_bundle(router.path, 1)
    bundle.runtimes["scripted"] = runtime
    handler = PredictHandler(
        Registry(bundles={bundle.name: bundle}),
        InProcessCache(1 << 20),
        Metrics(),
        reserve_ms=0.0,
        threads=1,
    )

    async def predict(strategy: str | None) -> Any:
        return await handler.predict(bundle.name, ROW, None, 100.0, strategy)

    with pytest.raises(StrategyFault, match="'scripted'"):
        anyio.run(predict, "scripted")
    assert handler.held_bytes == 0 and handler.gate.free == 1
    response, _ = anyio.run(predict, None)
    assert response.strategy == router.manifest.default_strategy


# -- one step, several features (Acquire.then)


def test_a_steps_then_features_are_bought_in_order_while_they_fit(router: Bundle) -> None:
    """Declared costs r = 1, a = 5, b = 5 and a budget of 8: after r, ``a`` fits (1 + 5 ≤ 8)
    and ``b`` does not (6 + 5 > 8), so the loop stops there and asks the session again,
    which sees r and a in hand."""

    def script(obs: Observation, i: int) -> Any:
        if i == 0:
            return Acquire("r", (("a", 5.0), ("b", 5.0)))
        return _best_in_hand(runtime, obs)

    runtime = ScriptedRuntime(router.runtime, script)
    seen = Extractions()
    run = execute(
        router, _item(router), 8.0, {}, time.perf_counter(), runtime=runtime, on_extraction=seen
    )
    assert seen.names == ["r", "a"] == list(run.extracted)
    assert run.charged == {"r": 1.0, "a": 5.0}
    assert [sorted(obs.features) for obs in runtime.steps] == [[], ["a", "r"]]
    assert not run.stopped_early


def test_a_steps_then_features_leave_its_reserve(router: Bundle) -> None:
    """The same step with a reserve of 3 of the 8: after r (1), a's 5 no longer fits in
    8 - 1 - 3, so only r is bought; without the reserve, all three fit in 11."""

    def plan(reserve: float) -> Any:
        def script(obs: Observation, i: int) -> Any:
            if i == 0:
                return Acquire("r", (("a", 5.0), ("b", 5.0)), reserve)
            return _best_in_hand(runtimes[-1], obs)

        return script

    runtimes = [ScriptedRuntime(router.runtime, plan(3.0))]
    run = execute(router, _item(router), 8.0, {}, time.perf_counter(), runtime=runtimes[-1])
    assert list(run.extracted) == ["r"]
    runtimes.append(ScriptedRuntime(router.runtime, plan(0.0)))
    run = execute(router, _item(router), 11.0, {}, time.perf_counter(), runtime=runtimes[-1])
    assert list(run.extracted) == ["r", "a", "b"]


@pytest.mark.parametrize(
    ("then", "match"),
    [
        ((("r", 1.0),), r"'r', which it already has \(acquired earlier in this request\)"),
        ((("zz", 1.0),), r"'zz', which is not one of the features it can acquire"),
    ],
)
def test_a_then_feature_in_hand_or_unknown_is_stopped_like_a_step(
    router: Bundle, then: tuple[tuple[str, float], ...], match: str
) -> None:
    def script(obs: Observation, i: int) -> Any:
        return Acquire("r", then)

    runtime = ScriptedRuntime(router.runtime, script)
    seen = Extractions()
    with pytest.raises(StrategyFault, match=match):
        _execute(router, runtime, seen)
    assert seen.names == ["r"], "r ran once; the bad one never"


class _SlowFirst(ExtractorSource):
    """The bundle's extractors, the first acquisition made to take 30 ms (a slow sensor)."""

    def acquire(self, feature: str) -> Any:
        if not getattr(self, "slept", False):
            self.slept = True
            time.sleep(0.03)
        return super().acquire(feature)


def test_a_then_feature_past_the_measured_budget_is_not_started(tiny: Bundle) -> None:
    """Measured costs: once a step's first feature has spent the 10 ms budget, the loop
    starts none of the rest (all declared free); the fallback answers from what is in hand
    (stopped early), and the time of the extraction that ran is charged."""
    names = sorted(tiny.extractors)
    item = DecodedItem(data=digit_image(0, 32), size=32 * 32, key="loop:then")

    def script(obs: Observation, i: int) -> Any:
        return Acquire(names[0], tuple((n, 0.0) for n in names[1:]))

    runtime = ScriptedRuntime(tiny.runtime, script)
    start = time.perf_counter()
    run = run_session(
        runtime,
        item.size,
        10.0,
        {},
        _SlowFirst(tiny.extractors, item.data),
        MeasuredCost(start, tiny.calibrator, item.size),
    )
    assert list(run.acquired) == [names[0]]
    assert run.charged[names[0]] >= 30.0
    assert run.stopped_early
    assert len(runtime.fallbacks) == 1


def test_a_cap_counts_from_the_sessions_start_not_from_the_receipt(tiny: Bundle) -> None:
    """``cap``: the plan may spend at most that from when the session begins, whatever was
    spent before it (here 5 ms of a 100 ms budget); the budget still bounds it. (Computed
    from an earlier instant, a 0.024 ms cap was eaten by the microseconds before the session
    began, and a request behind a standing queue answered from the prior.)"""
    item = DecodedItem(data=digit_image(0, 32), size=32 * 32, key="loop:cap")
    runtime = ScriptedRuntime(tiny.runtime, lambda obs, i: _best_in_hand(runtime, obs))
    begun: list[float] = []
    begin = runtime.begin

    def spy(size: int, budget: float, in_hand: frozenset[str]) -> Any:
        begun.append(budget)
        return begin(size, budget, in_hand)

    runtime.begin = spy  # type: ignore[method-assign]
    for cap, budget, bound in ((0.024, 100.0, 0.024), (50.0, 20.0, 15.0)):
        start = time.perf_counter() - 0.005  # 5 ms spent before the session
        meter = MeasuredCost(start, tiny.calibrator, item.size)
        run_session(
            runtime,
            item.size,
            budget,
            {},
            ExtractorSource(tiny.extractors, item.data),
            meter,
            cap=cap,
        )
        # what the session was given to plan with: the cap, or what the budget leaves
        assert bound - 0.5 < begun[-1] <= bound + 1e-9, (cap, budget, begun[-1])
        obs = runtime.steps[-1]
        assert obs.budget - obs.spent <= bound + 1e-9


class _Unavailable(ExtractorSource):
    """The router's extractors, with ``a`` a sensor that cannot be had now."""

    def acquire(self, feature: str) -> Any:
        if feature == "a":
            raise FeatureUnavailable("sensor a: no value for this id (the store had none)")
        return super().acquire(feature)


def test_a_then_feature_that_is_unavailable_ends_the_step_like_a_step(router: Bundle) -> None:
    """r, then a (unavailable), then b: the loop keeps r, charges nothing for a, never
    starts b, and the fallback answers from r, naming a as the feature to collect next."""
    item = _item(router)

    def script(obs: Observation, i: int) -> Any:
        return Acquire("r", (("a", 5.0), ("b", 5.0)))

    runtime = ScriptedRuntime(router.runtime, script)
    run = run_session(
        runtime,
        item.size,
        100.0,
        {},
        _Unavailable(router.extractors, item.data),
        DeclaredCost(router.costs.profiled_at(item.size)),
    )
    assert list(run.acquired) == ["r"]
    assert run.charged == {"r": 1.0}
    assert run.next_feature == "a" and "no value" in run.unavailable["a"]
    assert len(runtime.fallbacks) == 1 and sorted(runtime.fallbacks[0].features) == ["r"]
