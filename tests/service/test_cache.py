"""Feature caches: the in-process LRU, and Redis against a real redis-server."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient

from service.cache import (
    CacheBypassed,
    CacheUnavailable,
    InProcessCache,
    RedisCache,
    entry_bytes,
    extractor_tag,
    feature_key,
)
from service.http import create_app
from service.settings import Settings
from tests.conftest import digit_image, free_port, png_b64


def test_lru_evicts_least_recently_used_by_bytes() -> None:
    cache = InProcessCache(max_bytes=3 * entry_bytes("a", b"x" * 10))

    async def run() -> list[bytes | None]:
        await cache.put_many({"a": b"x" * 10, "b": b"y" * 10, "c": b"z" * 10})
        await cache.get_many(["a"])  # a is now most recent
        await cache.put_many({"d": b"w" * 10})  # evicts b
        return await cache.get_many(["a", "b", "c", "d"])

    assert asyncio.run(run()) == [b"x" * 10, None, b"z" * 10, b"w" * 10]


def test_lru_skips_values_larger_than_capacity() -> None:
    cache = InProcessCache(max_bytes=4)
    asyncio.run(cache.put_many({"big": b"12345"}))
    assert len(cache) == 0


def test_the_cap_bounds_what_the_cache_really_holds() -> None:
    """Filled far past its cap with realistic entries (a feature key of ~90 characters, a
    64-float vector), the cache's memory as tracemalloc counts it stays within 10 % of the
    cap, and is not far below it (the count is not merely conservative)."""
    cap = 4 << 20
    cache = InProcessCache(max_bytes=cap)
    tag = extractor_tag("hog", "1", {"cells": 4})

    async def fill() -> None:
        for i in range(40_000):
            key = feature_key(f"{i:064x}", tag)
            await cache.put_many({key: np.full(64, i, dtype=np.float32).tobytes()})

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        asyncio.run(fill())
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(cache) < 40_000, "the cap evicted nothing"
    assert cache.held_bytes <= cap
    assert 0.8 * cap <= held <= 1.1 * cap, (held, cap, len(cache))


def test_key_separates_versions_params_and_extractors() -> None:
    tags = [
        extractor_tag("hog", "1", {}),
        extractor_tag("hog", "2", {}),
        extractor_tag("lbp", "1", {}),
        extractor_tag("hog", "1", {"cells": 3}),
        extractor_tag("hog", "1", {"cells": 4}),
    ]
    keys = {feature_key(item, tag) for tag in tags for item in ("id:1", "id:2")}
    assert len(keys) == 10
    same = extractor_tag("hog", "1", {"b": 2, "a": 1})
    assert extractor_tag("hog", "1", {"a": 1, "b": 2}) == same


def _command_calls(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


@pytest.mark.redis
def test_redis_round_trip_one_mget_and_pipelined_write(redis_url: str) -> None:
    cache = RedisCache(redis_url, ttl_s=60, timeout_ms=500)
    vec = np.arange(5, dtype=np.float32)
    admin = redis.Redis.from_url(redis_url)
    admin.config_resetstat()

    async def run() -> list[bytes | None]:
        await cache.put_many({"t:k1": vec.tobytes(), "t:k2": b"\x00" * 4})
        got = await cache.get_many(["t:k1", "t:missing", "t:k2"])
        await cache.close()
        return got

    got = asyncio.run(run())
    calls = _command_calls(admin)
    assert calls.get("mget") == 1 and "get" not in calls, calls
    assert calls.get("set") == 2, calls
    assert got[1] is None
    assert got[0] is not None and np.array_equal(np.frombuffer(got[0], np.float32), vec)
    ttl = redis.Redis.from_url(redis_url).ttl("t:k1")
    assert 0 < ttl <= 60


def test_redis_down_raises_cache_unavailable_then_bypasses() -> None:
    cache = RedisCache(f"redis://127.0.0.1:{free_port()}/0", ttl_s=60, timeout_ms=100, failures=2)

    async def run() -> None:
        try:
            for _ in range(2):  # two consecutive failures open the circuit
                with pytest.raises(CacheUnavailable) as failed:
                    await cache.get_many(["k"])
                assert not isinstance(failed.value, CacheBypassed)
            assert cache.breaker.trips == 1
            with pytest.raises(CacheBypassed):  # the circuit is open: no new attempt
                await cache.put_many({"k": b"v"})
            assert await cache.ping() is False
        finally:
            await cache.close()

    asyncio.run(run())


@pytest.mark.redis
def test_service_with_redis_serves_second_request_from_cache(
    redis_url: str, digits_bundle_dir: Path
) -> None:
    redis.Redis.from_url(redis_url).flushdb()
    app = create_app(Settings(models_dir=digits_bundle_dir.parent, redis_url=redis_url))
    item = {"png_base64": png_b64(digit_image(11, 80))}
    with TestClient(app) as client:
        assert client.get("/readyz").json()["cache"] == {"backend": "redis", "reachable": True}
        first = client.post("/predict", json={"model": "digits", "item": item, "budget": 200})
        second = client.post("/predict", json={"model": "digits", "item": item, "budget": 200})
        metrics = client.get("/metrics").text
    assert first.status_code == second.status_code == 200
    extracted = first.json()["cost"]["extracted"]
    assert extracted and set(extracted) <= set(second.json()["cost"]["cached"])
    stored = redis.Redis.from_url(redis_url).keys("bs:*")
    assert len(stored) == len(extracted)
    assert 'budgetserve_cache_requests_total{result="hit"}' in metrics


def test_service_survives_redis_down_and_counts_it(digits_bundle_dir: Path) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    app = create_app(
        Settings(
            models_dir=digits_bundle_dir.parent,
            redis_url=dead,
            redis_timeout_ms=100,
            redis_failures=1,
        )
    )
    item = {"png_base64": png_b64(digit_image(12, 32))}
    with TestClient(app) as client:
        ready = client.get("/readyz")
        r = client.post("/predict", json={"model": "digits", "item": item, "budget": 100})
        metrics = client.get("/metrics").text
    assert ready.status_code == 200 and ready.json()["cache"]["reachable"] is False
    assert r.status_code == 200
    assert r.json()["cost"]["cached"] == []
    assert 'budgetserve_cache_requests_total{result="error"} 1.0' in metrics
    # the failed read opened the circuit, so the write-back skipped Redis instead of waiting
    assert 'budgetserve_cache_requests_total{result="bypass"} 1.0' in metrics
    assert "budgetserve_cache_circuit_trips_total 1.0" in metrics


class SilentPeer:
    """A real TCP listener on loopback that accepts connections and never answers: a hung
    Redis, as a firewall black-holing replies or a stuck server looks to a client."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self.sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.accepted.append(conn)
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for conn in self.accepted:
            conn.close()
        self.sock.close()


def test_hung_redis_is_judged_by_its_timeout_and_then_bypassed(
    digits_bundle_dir: Path,
) -> None:
    peer = SilentPeer()
    try:
        app = create_app(
            Settings(
                models_dir=digits_bundle_dir.parent,
                redis_url=f"redis://127.0.0.1:{peer.port}/0",
                redis_timeout_ms=250,
                redis_failures=3,
                redis_retry_s=60,
            )
        )
        item = {"png_base64": png_b64(digit_image(13, 64))}
        with TestClient(app) as client:
            gc.collect()
            bodies = []
            for _ in range(400):  # bounded: the breaker opens once 3 reads have timed out
                bodies.append(
                    client.post(
                        "/predict", json={"model": "digits", "item": item, "budget": 20}
                    ).json()
                )
                if app.state.core.cache.breaker.trips:
                    break
            bodies += [
                client.post("/predict", json={"model": "digits", "item": item, "budget": 20}).json()
                for _ in range(3)
            ]
            metrics = client.get("/metrics").text
    finally:
        peer.close()
    # Each request waits at most 20 % of its 20 ms budget (4 ms) for the read, never Redis's
    # 250 ms: the reads time out in the background, where they open the circuit. (The median:
    # a garbage collection of this test process's heap can stall any one request.)
    spent = sorted(b["cost"]["spent"] for b in bodies)
    assert spent[len(spent) // 2] < 50, spent
    assert sum(1 for b in bodies if b["features"]) >= len(bodies) // 2
    failed = cache_count(metrics, "error") + cache_count(metrics, "write_error")
    assert failed >= 3, metrics  # reads and write-backs, judged at Redis's own timeout
    assert "budgetserve_cache_circuit_trips_total 1.0" in metrics
    assert cache_count(metrics, "deadline") >= 1
    assert cache_count(metrics, "bypass") >= 3


def cache_count(metrics: str, result: str) -> float:
    prefix = f'budgetserve_cache_requests_total{{result="{result}"}} '
    (line,) = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(line.removeprefix(prefix))
