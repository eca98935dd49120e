"""The feature cache: (item key, extractor name, extractor version) → float32 bytes.

In-process LRU by default; Redis when ``REDIS_URL`` is set: one ``MGET`` reads every key a
request may need, one pipelined write stores what it computed. A failing Redis raises
:class:`CacheUnavailable`; the request handler counts it and carries on uncached.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

KEY_PREFIX = "bs:f1:"


def feature_key(item_key: str, extractor: str, version: str) -> str:
    return f"{KEY_PREFIX}{extractor}:{version}:{item_key}"


class CacheUnavailable(Exception):
    """The cache backend failed (down, timed out); the request goes on without it."""


class FeatureCache(Protocol):
    backend: str

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

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

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
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

    def __init__(self, url: str, ttl_s: int, timeout_ms: float) -> None:
        timeout = timeout_ms / 1000.0
        self.ttl_s = ttl_s
        self._client = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry_on_timeout=False
        )

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        try:
            values = await self._client.mget(list(keys))
        except (RedisError, OSError) as exc:
            raise CacheUnavailable(str(exc)) from exc
        return [v if isinstance(v, bytes) else None for v in values]

    async def put_many(self, values: Mapping[str, bytes]) -> None:
        if not values:
            return
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for key, value in values.items():
                    pipe.set(key, value, ex=self.ttl_s)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise CacheUnavailable(str(exc)) from exc

    async def ping(self) -> bool:
        try:
            return bool(await self._client.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self._client.aclose()


def make_cache(
    redis_url: str | None, *, max_bytes: int, ttl_s: int, timeout_ms: float
) -> FeatureCache:
    if redis_url:
        return RedisCache(redis_url, ttl_s=ttl_s, timeout_ms=timeout_ms)
    return InProcessCache(max_bytes)
