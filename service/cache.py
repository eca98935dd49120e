"""The feature cache: (item key, extractor name, version, params) → float32 bytes.

In-process LRU by default; Redis when ``REDIS_URL`` is set: one ``MGET`` reads every key a
request may need, one pipelined write stores what it computed. A failing Redis raises
:class:`CacheUnavailable`; the request handler counts it and carries on uncached. After a
failure the Redis cache stays *open* (bypassed, :class:`CacheBypassed`) for ``retry_s``, so
a hung Redis costs one timeout per window rather than one per request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

KEY_PREFIX = "bs:f1:"


def extractor_tag(name: str, version: str, params: Mapping[str, Any]) -> str:
    """Identity of an extractor's output: name, version and (hashed) parameters."""
    if not params:
        return f"{name}:{version}"
    digest = hashlib.blake2b(
        json.dumps(params, sort_keys=True, default=str).encode(), digest_size=6
    ).hexdigest()
    return f"{name}:{version}:{digest}"


def feature_key(item_key: str, tag: str) -> str:
    return f"{KEY_PREFIX}{tag}:{item_key}"


class CacheUnavailable(Exception):
    """The cache backend failed (down, timed out); the request goes on without it."""


class CacheBypassed(CacheUnavailable):
    """The backend failed recently and is skipped until its retry window ends."""


class FeatureCache(Protocol):
    backend: str

    async def get_many(
        self, keys: Sequence[str], timeout_s: float | None = None
    ) -> list[bytes | None]: ...

    async def put_many(self, values: Mapping[str, bytes]) -> None: ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


class InProcessCache:
    """A byte-bounded LRU, shared by the requests of one process."""

    backend = "memory"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    async def get_many(
        self, keys: Sequence[str], timeout_s: float | None = None
    ) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                value = self._data.get(key)
                if value is not None:
                    self._data.move_to_end(key)
                out.append(value)
        return out

    async def put_many(self, values: Mapping[str, bytes]) -> None:
        with self._lock:
            for key, value in values.items():
                if len(value) > self.max_bytes:
                    continue
                old = self._data.pop(key, None)
                if old is not None:
                    self._bytes -= len(old)
                self._data[key] = value
                self._bytes += len(value)
            while self._bytes > self.max_bytes and self._data:
                _, evicted = self._data.popitem(last=False)
                self._bytes -= len(evicted)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0


class RedisCache:
    backend = "redis"

    def __init__(self, url: str, ttl_s: int, timeout_ms: float, retry_s: float = 5.0) -> None:
        self.timeout_s = timeout_ms / 1000.0
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self._open_until = 0.0
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry_on_timeout=False,
        )

    def _check_closed_circuit(self) -> None:
        if time.monotonic() < self._open_until:
            raise CacheBypassed("redis failed recently; bypassed until its retry window ends")

    def _trip(self, exc: BaseException) -> CacheUnavailable:
        self._open_until = time.monotonic() + self.retry_s
        return CacheUnavailable(f"{type(exc).__name__}: {exc}")

    async def get_many(
        self, keys: Sequence[str], timeout_s: float | None = None
    ) -> list[bytes | None]:
        if not keys:
            return []
        self._check_closed_circuit()
        limit = self.timeout_s if timeout_s is None else min(timeout_s, self.timeout_s)
        try:
            async with asyncio.timeout(limit):
                values = await self._client.mget(list(keys))
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._trip(exc) from exc
        return [v if isinstance(v, bytes) else None for v in values]

    async def put_many(self, values: Mapping[str, bytes]) -> None:
        if not values:
            return
        self._check_closed_circuit()
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._client.pipeline(transaction=False) as pipe:
                    for key, value in values.items():
                        pipe.set(key, value, ex=self.ttl_s)
                    await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._trip(exc) from exc

    async def ping(self) -> bool:
        try:
            async with asyncio.timeout(self.timeout_s):
                return bool(await self._client.ping())
        except (RedisError, OSError, TimeoutError):
            return False

    async def close(self) -> None:
        await self._client.aclose()


def make_cache(
    redis_url: str | None,
    *,
    max_bytes: int,
    ttl_s: int,
    timeout_ms: float,
    retry_s: float = 5.0,
) -> FeatureCache:
    if redis_url:
        return RedisCache(redis_url, ttl_s=ttl_s, timeout_ms=timeout_ms, retry_s=retry_s)
    return InProcessCache(max_bytes)
