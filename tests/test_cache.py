"""Feature caches: the in-process LRU, and Redis against a real redis-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import redis
from fastapi.testclient import TestClient

from service.api import create_app
from service.cache import CacheUnavailable, InProcessCache, RedisCache, feature_key
from service.settings import Settings
from tests.conftest import digit_image, free_port, png_b64


def test_lru_evicts_least_recently_used_by_bytes() -> None:
    cache = InProcessCache(max_bytes=30)

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


def test_key_separates_versions_and_extractors() -> None:
    keys = {feature_key("id:1", "hog", "1"), feature_key("id:1", "hog", "2"),
            feature_key("id:1", "lbp", "1"), feature_key("id:2", "hog", "1")}
    assert len(keys) == 4


@pytest.mark.redis
def test_redis_round_trip_one_mget_and_pipelined_write(redis_url: str) -> None:
    cache = RedisCache(redis_url, ttl_s=60, timeout_ms=500)
    vec = np.arange(5, dtype=np.float32)

    async def run() -> list[bytes | None]:
        await cache.put_many({"t:k1": vec.tobytes(), "t:k2": b"\x00" * 4})
        got = await cache.get_many(["t:k1", "t:missing", "t:k2"])
        await cache.close()
        return got

    got = asyncio.run(run())
    assert got[1] is None
    assert got[0] is not None and np.array_equal(np.frombuffer(got[0], np.float32), vec)
    ttl = redis.Redis.from_url(redis_url).ttl("t:k1")
    assert 0 < ttl <= 60


def test_redis_down_raises_cache_unavailable() -> None:
    cache = RedisCache(f"redis://127.0.0.1:{free_port()}/0", ttl_s=60, timeout_ms=100)

    async def run() -> None:
        try:
            with pytest.raises(CacheUnavailable):
                await cache.get_many(["k"])
            with pytest.raises(CacheUnavailable):
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
    app = create_app(Settings(models_dir=digits_bundle_dir.parent, redis_url=dead,
                              redis_timeout_ms=100))
    item = {"png_base64": png_b64(digit_image(12, 32))}
    with TestClient(app) as client:
        ready = client.get("/readyz")
        r = client.post("/predict", json={"model": "digits", "item": item, "budget": 100})
        metrics = client.get("/metrics").text
    assert ready.status_code == 200 and ready.json()["cache"]["reachable"] is False
    assert r.status_code == 200
    assert r.json()["cost"]["cached"] == []
    assert 'budgetserve_cache_requests_total{result="error"} 1.0' in metrics
    assert 'budgetserve_cache_requests_total{result="write_error"} 1.0' in metrics
