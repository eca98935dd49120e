"""The Redis circuit breaker judges Redis, not requests: a request that gives up on its own
budget never opens it; a stopped or killed Redis does, and it closes again once Redis is
back. Against a real redis-server of each test's own (stopped with SIGSTOP, killed with
SIGKILL, restarted on the same port)."""

from __future__ import annotations

import gc
import json
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.cache import CircuitBreaker, RedisCache
from service.http import create_app
from service.settings import Settings
from tests.conftest import digit_image, png_b64
from tests.service.serving import RedisProcess, metric, post_json, uvicorn_thread

pytestmark = pytest.mark.redis


def test_breaker_opens_after_consecutive_failures_and_probes_once() -> None:
    trips: list[int] = []
    breaker = CircuitBreaker(failures=3, retry_s=0.2, on_trip=lambda: trips.append(1))
    breaker.failure()
    breaker.failure()
    breaker.success()  # a success in between: the count starts again
    breaker.failure()
    breaker.failure()
    assert breaker.state == "closed" and breaker.allow()
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow() and trips == [1]
    time.sleep(0.25)
    assert breaker.state == "half_open"
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one
    breaker.failure()  # the probe failed: open again at once
    assert breaker.state == "open" and breaker.trips == 2
    time.sleep(0.25)
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()
    with pytest.raises(ValueError, match="failures must be >= 1"):
        CircuitBreaker(failures=0, retry_s=1)


def redis_app(bundles: Path, url: str, **settings: Any) -> FastAPI:
    values: dict[str, Any] = {
        "redis_timeout_ms": 250.0,
        "redis_retry_s": 0.3,
        "redis_failures": 3,
        **settings,
    }
    return create_app(Settings(models_dir=bundles, redis_url=url, **values))


def breaker_of(app: FastAPI) -> CircuitBreaker:
    cache = app.state.core.cache
    assert isinstance(cache, RedisCache)
    return cache.breaker


ITEMS = [{"png_base64": png_b64(digit_image(i, 32))} for i in range(8)]


def predict(
    client: TestClient, budget: float, index: int = 0, accounting: str = "deadline"
) -> dict[str, Any]:
    request = {"model": "digits", "item": ITEMS[index % len(ITEMS)], "budget": budget}
    r = client.post("/predict", json={**request, "accounting": accounting})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def test_small_budgets_on_a_healthy_redis_never_open_the_breaker(
    digits_bundle_dir: Path, own_redis: RedisProcess
) -> None:
    # Budget 2 ms: each read may wait 0.4 ms, which a busy machine often misses (the issue:
    # one such request opened the breaker in 6 of 8 tries). Redis's own timeout is 250 ms
    # here, so that a pause of this test process (a garbage collection) is not a Redis fault.
    # Work accounting: counted from receipt, a loaded machine's 2 ms are often gone before the
    # read, which is then skipped, not tried (the reads are what this test is about).
    app = redis_app(digits_bundle_dir.parent, own_redis.url)
    with TestClient(app) as client:
        for i in range(300):
            predict(client, 2.0 if i % 3 else 0.5, i, accounting="work")
        metrics = client.get("/metrics").text
        assert breaker_of(app).trips == 0
    assert metric(metrics, "budgetserve_cache_circuit_trips_total") == 0
    for result in ("error", "write_error", "bypass"):
        assert metric(metrics, f'budgetserve_cache_requests_total{{result="{result}"}}') == 0
    tried = {
        r: metric(metrics, f'budgetserve_cache_requests_total{{result="{r}"}}')
        for r in ("hit", "miss", "deadline")
    }
    assert tried["hit"] + tried["miss"] > 0, tried  # reads were really made


def run_until(client: TestClient, done: Any, budget: float = 20.0, limit: int = 2000) -> int:
    """Send requests (each must succeed) until ``done()``; bounded."""
    for i in range(limit):
        predict(client, budget, i)
        if done():
            return i + 1
        time.sleep(0.002)
    pytest.fail(f"not the case after {limit} requests")


@pytest.mark.parametrize("fault", ["stopped", "killed"])
def test_a_failed_redis_opens_the_breaker_which_recovers(
    digits_bundle_dir: Path, own_redis: RedisProcess, fault: str
) -> None:
    app = redis_app(digits_bundle_dir.parent, own_redis.url)
    with TestClient(app) as client:
        breaker = breaker_of(app)
        run_until(client, lambda: client.get("/metrics").text.count("hit") > 0, limit=20)
        assert breaker.trips == 0
        if fault == "stopped":
            own_redis.signal(signal.SIGSTOP)
        else:
            own_redis.kill()
        run_until(client, lambda: breaker.trips >= 1)
        assert breaker.state in ("open", "half_open")
        if fault == "stopped":
            own_redis.signal(signal.SIGCONT)
        else:
            own_redis.start()
        run_until(client, lambda: breaker.state == "closed")
        trips = breaker.trips
        hits = [predict(client, 50.0, 0)["cost"]["cached"] for _ in range(5)]
        assert any(hits), "Redis is back but no feature came from it"
        assert breaker.trips == trips and breaker.state == "closed"


def test_tiny_budgets_with_redis_stopped_wait_at_most_their_read_cap(
    digits_bundle_dir: Path, own_redis: RedisProcess
) -> None:
    """With Redis stopped and a long Redis timeout (and a breaker that never opens), what a
    request spends is bounded by its own read cap (20 % of the budget), not by Redis."""
    app = redis_app(
        digits_bundle_dir.parent, own_redis.url, redis_timeout_ms=2000.0, redis_failures=10_000
    )
    with TestClient(app) as client:
        predict(client, 5.0)  # warm: connections in the pool
        own_redis.signal(signal.SIGSTOP)
        try:
            gc.collect()
            tiny = [predict(client, 0.001, i) for i in range(10)]
            small = [predict(client, 5.0, i) for i in range(10)]
            metrics = client.get("/metrics").text
        finally:
            own_redis.signal(signal.SIGCONT)
        assert breaker_of(app).trips == 0
    # The service's own accounting: the prior's answer at budget 0.001 spends the skipped read
    # and the inference only (it spent 25.95 ms, the Redis timeout, before the cap held).
    tiny_spent = sorted(b["cost"]["spent"] for b in tiny)
    assert tiny_spent[len(tiny_spent) // 2] < 5.0, tiny_spent
    small_spent = sorted(b["cost"]["spent"] for b in small)
    assert small_spent[len(small_spent) // 2] < 50.0, small_spent  # not Redis's 2,000 ms
    assert metric(metrics, 'budgetserve_cache_requests_total{result="skipped"}') >= 10
    assert metric(metrics, 'budgetserve_cache_requests_total{result="deadline"}') >= 5


def test_killing_and_restarting_redis_under_load_fails_no_request(
    digits_bundle_dir: Path, own_redis: RedisProcess
) -> None:
    """The issue's fault test: 4 clients at budgets 2, 5 and 20 ms against a real uvicorn;
    Redis healthy, killed, restarted. Every request is answered; the breaker opens only
    while Redis is down."""
    app = redis_app(
        digits_bundle_dir.parent, own_redis.url, redis_timeout_ms=250.0, redis_retry_s=0.3
    )
    statuses: list[int] = []
    refusals: list[tuple[str, int, str]] = []  # (phase, status, what the body said)
    phase_name = ["healthy"]
    per_phase: Counter[str] = Counter()  # requests answered in each phase
    stop = threading.Event()

    with uvicorn_thread(app) as port:
        breaker = breaker_of(app)

        def client(seed: int) -> None:
            i = seed
            while not stop.is_set():
                budget = (2.0, 5.0, 20.0)[i % 3]
                body: dict[str, Any] = {}
                try:
                    status, _, body = post_json(
                        port,
                        "/predict",
                        {"model": "digits", "item": ITEMS[i % len(ITEMS)], "budget": budget},
                    )
                except OSError:
                    status = 0
                statuses.append(status)
                per_phase[phase_name[0]] += 1
                if status != 200:
                    refusals.append((phase_name[0], status, json.dumps(body)))
                i += 1

        def phase(seconds: float) -> None:
            time.sleep(seconds)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        try:
            phase(2.0)
            healthy = len(statuses)
            assert breaker.trips == 0, "the breaker opened on a healthy Redis"
            phase_name[0] = "killed"
            own_redis.kill()
            deadline = time.monotonic() + 30
            while breaker.trips == 0 and time.monotonic() < deadline:
                phase(0.05)
            assert breaker.trips >= 1, "a killed Redis did not open the breaker"
            phase(1.0)
            phase_name[0] = "restarted"
            own_redis.start()
            deadline = time.monotonic() + 30
            while breaker.state != "closed" and time.monotonic() < deadline:
                phase(0.05)
            assert breaker.state == "closed", "the breaker did not close once Redis was back"
            trips = breaker.trips
            phase_name[0] = "healthy again"
            phase(2.0)
            assert breaker.trips == trips, "the breaker opened again on a healthy Redis"
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
    assert healthy > 0 and len(statuses) > healthy
    # Every request is answered: a 200, or (4 closed-loop clients at 2 ms on a busy 2-core CI
    # machine form a standing queue now and then, Redis up or down) admission's deliberate
    # "retry" for a request that reached its work too late to pay for an answer — never an
    # error, and never more than a sliver of the requests in any phase.
    for phase_at, status, said in refusals:
        error = json.loads(said).get("error", {})  # {} for a dropped connection (status 0)
        assert status == 503 and error.get("type") == "overloaded", (phase_at, status, said)
        assert "late_ms" in error.get("details", {}), (phase_at, said)
    refused = Counter(phase_at for phase_at, _, _ in refusals)
    for phase_at, n in refused.items():
        assert n <= max(2, 0.02 * per_phase[phase_at]), (phase_at, per_phase, refusals)
