"""The budget as a deadline (counted from the receipt), and calibration under load.

Through the real handler on the real digits bundle (and the real app for the HTTP fields).
A busy machine is made by extractors that sleep after computing: their wall time grows while
their thread CPU time does not, which is what being descheduled looks like to a thread.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.cache import InProcessCache
from service.errors import InvalidRequest, Overloaded
from service.handler import (
    CONTENDED_MIN_MS,
    QUEUE_INTERVAL_S,
    PredictHandler,
    contended_share,
)
from service.http import create_app
from service.metrics import Metrics
from service.registry import Bundle, Registry, load_bundle
from service.schemas import PredictResponse
from service.settings import Settings
from service.types import FloatVector
from tests.conftest import digit_image, png_b64


@pytest.fixture(scope="module")
def digits_bundle(digits_bundle_dir: Path) -> Bundle:
    return load_bundle(digits_bundle_dir, 1 << 20)


@pytest.fixture(scope="module")
def pngs() -> list[str]:
    return [png_b64(digit_image(i, 128)) for i in range(20)]


def make_handler(bundle: Bundle, **kwargs: Any) -> PredictHandler:
    return PredictHandler(
        Registry(bundles={bundle.name: bundle}),
        InProcessCache(64 << 20),
        Metrics(),
        reserve_ms=0.5,
        **kwargs,
    )


def ask_all(handler: PredictHandler, requests: list[dict[str, Any]]) -> list[PredictResponse]:
    """Each request (``png``, ``budget``, ``id``, and ``predict``'s keyword arguments, with
    ``received_ago_s``) in turn, on one event loop (its worker threads are reused, as in the
    server), writing features back as the HTTP layer does."""

    async def run() -> list[PredictResponse]:
        out = []
        for r in requests:
            extra = {k: v for k, v in r.items() if k not in ("png", "budget", "id")}
            ago = extra.pop("received_ago_s", None)
            if ago is not None:
                extra["received"] = time.perf_counter() - ago
            response, writes = await handler.predict(
                "digits", {"png_base64": r["png"], "id": r["id"]}, None, r["budget"], **extra
            )
            await handler.write_back(writes)
            out.append(response)
        return out

    return anyio.run(run)


def test_a_lone_late_request_is_no_standing_queue(digits_bundle: Bundle, pngs: list[str]) -> None:
    """CoDel's standing queue is one that every request of a whole interval waited behind. A
    fresh process (nothing seen yet) has none, and one late request alone in an interval
    (a sparse client, a cold first request) shows none: the next request, late too, is
    answered from what it has (not refused), and one on time plans its whole budget."""
    digits_bundle.calibrator.reset()
    handler = make_handler(digits_bundle)
    time.sleep(QUEUE_INTERVAL_S * 1.2)  # a fresh process, idle for an interval
    late = {"png": pngs[0], "budget": 5.0, "received_ago_s": 0.0046}
    (first,) = ask_all(handler, [{**late, "id": "lone0"}])
    assert first.answered_by == "prior" and not handler._standing
    time.sleep(QUEUE_INTERVAL_S * 1.2)  # an interval whose one request came late
    (second,) = ask_all(handler, [{**late, "id": "lone1"}])
    assert second.answered_by == "prior" and not handler._standing
    (on_time,) = ask_all(handler, [{"png": pngs[1], "budget": 20.0, "id": "lone2"}])
    assert on_time.cost.planned > handler.inline_ms, on_time.cost.planned


def test_a_deadline_counts_from_the_receipt(digits_bundle: Bundle, pngs: list[str]) -> None:
    """The same request, received 4.6 ms before the handler sees it, with a 5 ms budget:
    counted as a deadline, what is left cannot pay for the reserve of an answer (0.5 ms
    here). In a burst it is answered at once from the prior, on the event loop; behind a
    standing queue (the requests of a whole interval came late) it is refused before any
    work (503). Counting the work only, it buys features. A budget below the overhead from
    the start is answered at once from the prior, and says so."""
    digits_bundle.calibrator.reset()
    handler = make_handler(digits_bundle)
    late = {"png": pngs[0], "budget": 5.0, "received_ago_s": 0.0046}
    burst = ask_all(handler, [{**late, "id": "d0"}, {**late, "id": "d0a"}])
    for answer in burst:
        assert answer.answered_by == "prior" and answer.cost.extracted == []
        assert answer.timings_ms.queued == 0.0 and answer.cost.spent >= 4.6
        assert answer.deadline_exceeded == (answer.cost.spent > 5.0)
    time.sleep(QUEUE_INTERVAL_S * 1.2)  # every request of an interval came late: standing
    with pytest.raises(Overloaded, match="standing queue") as refused:
        ask_all(handler, [{**late, "id": "d0b"}])
    assert refused.value.details["late_ms"] >= 4.6
    assert handler.held_bytes == 0 and handler.gate.free == handler.gate.threads
    _warm, tiny, work, fresh = ask_all(
        handler,
        [
            {"png": pngs[3], "budget": 5.0, "id": "warm-up"},  # starts the worker thread
            {"png": pngs[0], "budget": 0.3, "id": "d0"},
            {
                "png": pngs[0],
                "budget": 5.0,
                "id": "d1",
                "received_ago_s": 0.0045,
                "accounting": "work",
            },
            {"png": pngs[0], "budget": 50.0, "id": "d2"},
        ],
    )
    assert tiny.cost.accounting == "deadline"
    assert tiny.cost.extracted == [] and tiny.features == []
    assert tiny.answered_by == "prior"
    assert tiny.timings_ms.queued == 0.0
    assert tiny.below_floor and tiny.floor_ms is not None and tiny.floor_ms > 0.3
    assert tiny.timings_ms.since_received is not None
    assert tiny.timings_ms.since_received >= tiny.cost.spent
    assert tiny.deadline_exceeded == (tiny.cost.spent > 0.3)

    assert work.cost.accounting == "work"
    assert work.cost.extracted, "work accounting: the 4.5 ms before the work are not charged"
    assert work.timings_ms.since_received is not None
    assert work.timings_ms.since_received >= 4.5 + work.cost.spent - 0.5

    # The default is the handler's; a fresh request with the whole budget left buys features.
    assert fresh.cost.accounting == "deadline" and fresh.cost.extracted, fresh
    assert not fresh.below_floor
    assert fresh.timings_ms.since_received is not None
    assert fresh.cost.spent <= fresh.timings_ms.since_received
    assert fresh.timings_ms.decode > 0.0
    assert fresh.cost.spent >= fresh.timings_ms.decode + fresh.timings_ms.extraction


def test_cached_features_answer_without_a_thread(digits_bundle: Bundle, pngs: list[str]) -> None:
    """Every feature it could use in hand: answered on the loop, with the real budget (the
    strategy's own answer, not a fallback), nothing extracted."""
    digits_bundle.calibrator.reset()
    handler = make_handler(digits_bundle)
    full = len(digits_bundle.extractors)
    first, second = ask_all(
        handler, [{"png": pngs[1], "budget": 1000.0, "id": "c", "accounting": "work"}] * 2
    )
    assert first.cost.extracted and second.cost.extracted == []
    assert sorted(second.cost.cached) == sorted(first.cost.extracted)
    assert second.answered_by == first.answered_by
    if len(first.cost.extracted) == full:  # every feature in hand: no thread at all
        assert second.timings_ms.queued == 0.0


def test_accounting_over_http(digits_bundle_dir: Path, pngs: list[str]) -> None:
    app = create_app(Settings(models_dir=digits_bundle_dir.parent), cache=InProcessCache(1 << 20))
    with TestClient(app) as client:
        body = {"model": "digits", "item": {"png_base64": pngs[2]}, "budget": 5.0}
        default = client.post("/predict", json=body).json()
        assert default["cost"]["accounting"] == "deadline"
        assert default["timings_ms"]["since_received"] >= default["cost"]["spent"] > 0
        work = client.post("/predict", json={**body, "accounting": "work"}).json()
        assert work["cost"]["accounting"] == "work"
        bad = client.post("/predict", json={**body, "accounting": "eventually"})
        assert bad.status_code == 422, bad.text
        assert "accounting" in bad.text
    work_app = create_app(
        Settings(models_dir=digits_bundle_dir.parent, accounting="work"),
        cache=InProcessCache(1 << 20),
    )
    with TestClient(work_app) as client:
        answer = client.post("/predict", json=body).json()
        assert answer["cost"]["accounting"] == "work"


class Busy:
    """An extractor that computes, then sleeps ``delay_s`` while ``on`` is set (a thread that
    waited for a CPU: wall time grows, its CPU time does not)."""

    def __init__(self, inner: Any, delay_s: float, switch: dict[str, bool]) -> None:
        self.inner = inner
        self.delay_s = delay_s
        self.switch = switch
        self.name = inner.name
        self.version = inner.version
        self.item_kind = inner.item_kind

    @property
    def dims(self) -> int:
        return int(self.inner.dims)

    def extract(self, item: Any) -> FloatVector:
        vector: FloatVector = self.inner.extract(item)
        if self.switch["on"]:
            time.sleep(self.delay_s)
        return vector


@pytest.fixture
def busy_bundle(digits_bundle_dir: Path) -> Iterator[tuple[Bundle, dict[str, bool]]]:
    bundle = load_bundle(digits_bundle_dir, 1 << 20)
    switch = {"on": False}
    for name, extractor in list(bundle.extractors.items()):
        bundle.extractors[name] = Busy(extractor, 0.004, switch)  # type: ignore[assignment]
    yield bundle, switch


def test_a_burst_degrades_then_the_plans_come_back(
    busy_bundle: tuple[Bundle, dict[str, bool]], digits_bundle_dir: Path, pngs: list[str]
) -> None:
    """The ratchet of issue 17: under load the p95 factors of the extractors that ran
    inflated (x17), they were never planned again, and 5 ms requests stayed on cheap features
    until restart. Now: quiet, a burst (every extraction 4 ms late), quiet again. The burst is
    seen as contention (planning multiplies every curve by it); within 60 quiet requests the
    plans are as good as those of a control instance that saw no burst (same requests,
    interleaved in chunks of 5, so both see the same shared machine), and no extractor's own
    factor kept the burst."""
    bundle, switch = busy_bundle
    handler = make_handler(bundle)
    control_bundle = load_bundle(digits_bundle_dir, 1 << 20)
    control = make_handler(control_bundle)
    counter = iter(range(10**6))

    def run(target: PredictHandler, count: int) -> list[PredictResponse]:
        return ask_all(
            target,
            [
                {
                    "png": pngs[i % len(pngs)],
                    "budget": 5.0,
                    "id": f"r{next(counter)}",
                    "accounting": "work",
                }
                for i in range(count)
            ],
        )

    def quiet(count: int) -> tuple[list[PredictResponse], list[PredictResponse]]:
        mine: list[PredictResponse] = []
        theirs: list[PredictResponse] = []
        for _ in range(count // 5):
            mine += run(handler, 5)
            theirs += run(control, 5)
        return mine, theirs

    quiet(80)
    size = 128 * 128
    factors_before = {n: bundle.calibrator.factor(n, size) for n in bundle.extractors}
    switch["on"] = True
    burst = run(handler, 60)
    switch["on"] = False
    assert len(burst) == 60
    during = bundle.calibrator.contention()
    assert during > 3.5, "the burst was seen as a busy machine (at most x4 by default)"
    mine, theirs = quiet(60)
    # The old calibrator (wall time only, no forgetting), fed these wall times, priced every
    # extractor at x10-x100 for good (a 0.05 ms thumbnail 4 ms late): these 60 requests all
    # answered from the prior (0.108 measured, 0.979 before the burst). The margin is for
    # the shared machine's load, which moves between chunks.
    recovered = float(np.mean([r.expected_accuracy for r in mine[-30:]]))
    reference = float(np.mean([r.expected_accuracy for r in theirs[-30:]]))
    assert recovered >= reference - 0.05, (
        recovered,
        reference,
        bundle.calibrator.contention(),
        control_bundle.calibrator.contention(),
        bundle.calibrator.factors_at(size),
        control_bundle.calibrator.factors_at(size),
    )
    # (the shared test machine's own load shows as some contention: x2-3 was seen)
    assert bundle.calibrator.contention() < during
    factors = {n: bundle.calibrator.factor(n, size) for n in bundle.extractors}
    grown = {n: factors[n] / factors_before[n] for n in factors}
    # (CPU time on a shared VM counts the hypervisor's steal, and a 0.05 ms extractor's
    # ratio moves with it: x2.2, x3.1, x3.5 and, in a fresh-clone CI run on 2026-11-28,
    # x5.5 (`projection`) were seen for one extractor; the wall-time estimator gave x10-x100)
    assert max(grown.values()) < 8.0, (factors_before, factors)


def test_a_plan_is_priced_by_the_requests_it_would_delay() -> None:
    """``contended_share``: nothing found in the process (one client at a time) or weight 0
    leaves a plan alone; else what is left over 1 + weight x others, never below 0.5 ms or
    twice the cheapest feature (what is left, if less)."""
    assert contended_share(4.0, 0.0, 12.0, 0.06) == math.inf
    assert contended_share(4.0, 2.0, 0.0, 0.06) == math.inf
    assert contended_share(4.0, 0.5, 12.0, 0.06) == pytest.approx(4.0 / 7.0)
    assert contended_share(4.0, 10.0, 12.0, 0.06) == CONTENDED_MIN_MS
    assert contended_share(4.0, 10.0, 12.0, 0.4) == pytest.approx(0.8)
    assert contended_share(0.3, 10.0, 12.0, 0.06) == 0.3


def test_requests_found_in_the_process_make_plans_cheaper(
    digits_bundle: Bundle, pngs: list[str]
) -> None:
    """One request at a time finds no other: ``others_seen`` stays 0 and plans keep their
    budget. Requests sent together find each other (a failing one is counted out too). A
    process whose arrivals found four other requests on average plans a 30 ms request within
    30 / (1 + 12 x 4) ms, where the same process with weight 0 plans more (a 256 px digit:
    the best candidate, ``fft_bands+hog+thumbnail``, is profiled at ~1.2 ms there; at 128 px,
    since the thumbnail got 5x cheaper, it is 0.6 ms, too close to the 0.63 ms bound for a
    calibrated plan to clear it on a shared machine)."""
    digits_bundle.calibrator.reset()
    handler = make_handler(digits_bundle, contention_weight=12.0)
    ask_all(handler, [{"png": pngs[i], "budget": 5.0, "id": f"s{i}"} for i in range(4)])
    assert handler.others_seen == 0.0

    async def together() -> None:
        async def one(i: int) -> None:
            budget = 20.0 if i else -1.0  # the first fails (422) while the others run
            with contextlib.suppress(InvalidRequest):
                await handler.predict(
                    "digits", {"png_base64": pngs[i], "id": f"t{i}"}, None, budget
                )

        async with anyio.create_task_group() as group:
            for i in range(8):
                group.start_soon(one, i)

    anyio.run(together)
    assert handler.others_seen > 0.0
    assert handler._in_process == 0

    large = png_b64(digit_image(9, 256))

    def planned(weight: float) -> tuple[float, float]:
        handler.contention_weight = weight
        handler.others_seen = 4.0
        (r,) = ask_all(handler, [{"png": large, "budget": 30.0, "id": f"w{weight}"}])
        return r.cost.planned, 30.0 / (1.0 + weight * handler.others_seen)

    cut, bound = planned(12.0)
    assert 0.0 < cut <= bound
    free, _ = planned(0.0)
    assert free > bound, (free, bound)
