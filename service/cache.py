"""The feature cache: (item key, extractor name, version, params) → float32 bytes.

In-process LRU by default; Redis when ``REDIS_URL`` is set: one ``MGET`` reads every key a
request may need, one pipelined write stores what it computed. A failing Redis raises
:class:`CacheUnavailable`; the request handler counts it and carries on uncached.

Two clocks bound a Redis read. Redis itself is judged by ``timeout_ms``: an error, or no
answer within it, is a *failure*, and ``failures`` consecutive failures open a
:class:`CircuitBreaker` (Redis bypassed, :class:`CacheBypassed`, for ``retry_s``; then one
probe goes through, whose success closes it). A request may wait less than that — a share of
its own budget: when that share runs out the request goes on without the cache
(:class:`CacheDeadline`) while the read itself runs on to ``timeout_ms`` in the background and
is judged there. A request giving up on its own deadline says nothing about Redis, so it
never opens the breaker for everyone.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

KEY_PREFIX = "bs:f1:"

T = TypeVar("T")


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


class CacheDeadline(CacheUnavailable):
    """The request's own wait limit passed before the backend answered (``skipped``: the
    limit was too small to try at all). Not a backend failure."""

    def __init__(self, message: str, *, skipped: bool = False) -> None:
        super().__init__(message)
        self.skipped = skipped


# A read whose wait limit is below this is not attempted: no Redis round trip fits in it.
READ_FLOOR_S = 0.0002


class CircuitBreaker:
    # Ours, not a library's: in half-open exactly one probe goes to Redis (purgatory lets
    # every concurrent request through, each paying Redis' timeout from its budget;
    # pybreaker wraps synchronous calls; aiobreaker is unmaintained since 2021).
    """Closed until ``failures`` consecutive failures; then open (calls refused) for
    ``retry_s``; then half-open: one probe call is let through — its success closes the
    breaker, its failure opens it for another ``retry_s``. Used from one event loop."""

    def __init__(
        self,
        failures: int,
        retry_s: float,
        on_trip: Callable[[], None] | None = None,
    ) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        self.failures = failures
        self.retry_s = retry_s
        self.on_trip = on_trip
        self.trips = 0
        self._consecutive = 0
        self._open_until: float | None = None
        self._probing = False

    @property
    def state(self) -> str:
        if self._open_until is None:
            return "closed"
        return "open" if time.monotonic() < self._open_until or self._probing else "half_open"

    def allow(self) -> bool:
        """Whether a call may go to the backend now (taking the probe when half-open)."""
        if self._open_until is None:
            return True
        if self._probing or time.monotonic() < self._open_until:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self._consecutive = 0
        self._open_until = None
        self._probing = False

    def failure(self) -> None:
        self._consecutive += 1
        if self._probing or (self._open_until is None and self._consecutive >= self.failures):
            self._open_until = time.monotonic() + self.retry_s
            self._probing = False
            self.trips += 1
            if self.on_trip is not None:
                self.on_trip()


class FeatureCache(Protocol):
    backend: str

    async def get_many(
        self, keys: Sequence[str], timeout_s: float | None = None
    ) -> list[bytes | None]: ...

    async def put_many(self, values: Mapping[str, bytes]) -> None: ...

    async def ping(self) -> bool: ...

    async def close(self) -> None: ...


# Bytes one entry of the LRU holds beyond its key and value objects: its slot in the
# OrderedDict's hash table and its node in the doubly linked list (measured with tracemalloc
# on CPython 3.11: ~100 B; rounded up).
_ENTRY_OVERHEAD = 112


def entry_bytes(key: str, value: bytes) -> int:
    """What one cache entry really holds: the key and value objects (headers included, not
    only the value's bytes) and the LRU's own bookkeeping."""
    return sys.getsizeof(key) + sys.getsizeof(value) + _ENTRY_OVERHEAD


class InProcessCache:
    # Ours, not cachetools.LRUCache(getsizeof=...): 1.3-1.7x faster per lookup (budget path)
    # and 2.9x less bookkeeping per entry (docs/benchmarks/libraries.md).
    """A byte-bounded LRU, shared by the requests of one process. ``max_bytes`` bounds what
    the entries really hold (:func:`entry_bytes`: keys, value objects, the LRU's nodes), not
    only the values' bytes: with ~100-byte keys and 256-byte feature vectors, counting the
    values alone let the process hold ~1.6x the cap."""

    backend = "memory"

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    @property
    def held_bytes(self) -> int:
        """What the entries hold now, as counted against ``max_bytes``."""
        return self._bytes

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
                size = entry_bytes(key, value)
                if size > self.max_bytes:
                    continue
                old = self._data.pop(key, None)
                if old is not None:
                    self._bytes -= entry_bytes(key, old)
                self._data[key] = value
                self._bytes += size
            while self._bytes > self.max_bytes and self._data:
                evicted_key, evicted = self._data.popitem(last=False)
                self._bytes -= entry_bytes(evicted_key, evicted)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0


class RedisCache:
    backend = "redis"

    def __init__(
        self,
        url: str,
        ttl_s: int,
        timeout_ms: float,
        retry_s: float = 5.0,
        failures: int = 3,
        on_trip: Callable[[], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_ms / 1000.0
        self.on_failure = on_failure
        self.ttl_s = ttl_s
        self.breaker = CircuitBreaker(failures, retry_s, on_trip)
        self._running: set[asyncio.Task[Any]] = set()
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry_on_timeout=False,
        )

    async def _judged(self, call: Callable[[], Awaitable[T]], kind: str) -> T:
        """Run one Redis call to its end (or ``timeout_s``) and tell the breaker how it went;
        a failure is also reported to ``on_failure(kind)``, whether or not anyone waits."""
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await call()
        except (RedisError, OSError, TimeoutError) as exc:
            trips = self.breaker.trips
            self.breaker.failure()
            if self.breaker.trips != trips:
                self._drop_idle_connections()
            if self.on_failure is not None:
                self.on_failure(kind)
            raise CacheUnavailable(f"{type(exc).__name__}: {exc}") from exc
        self.breaker.success()
        return result

    def _drop_idle_connections(self) -> None:
        """When the breaker opens, close the pool's idle connections: after a Redis restart
        they are dead sockets, and the first calls after recovery would each fail on one
        (enough of them in a row open the breaker again on a healthy Redis)."""
        task = asyncio.ensure_future(
            self._client.connection_pool.disconnect(inuse_connections=False)
        )
        self._running.add(task)
        task.add_done_callback(self._finished)

    def _start(self, call: Callable[[], Awaitable[T]], kind: str) -> asyncio.Task[T]:
        if not self.breaker.allow():
            raise CacheBypassed("redis failed recently; bypassed until its retry window ends")
        task = asyncio.ensure_future(self._judged(call, kind))
        self._running.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._running.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: an abandoned read's failure is the breaker's business

    async def get_many(
        self, keys: Sequence[str], timeout_s: float | None = None
    ) -> list[bytes | None]:
        """``timeout_s`` is the caller's own wait limit: past it the caller goes on without
        the values (:class:`CacheDeadline`) and the read finishes in the background."""
        if not keys:
            return []
        if timeout_s is not None and timeout_s < READ_FLOOR_S:
            raise CacheDeadline(
                f"a read limit of {timeout_s * 1e3:.3f} ms is too small to try", skipped=True
            )
        started = time.perf_counter()
        task = self._start(lambda: self._client.mget(list(keys)), "read")
        if timeout_s is None or timeout_s >= self.timeout_s:
            values = await asyncio.shield(task)
        else:
            left = timeout_s - (time.perf_counter() - started)
            done, _ = await asyncio.wait({task}, timeout=max(left, 0.0))
            if not done:
                raise CacheDeadline(f"no answer within the request's {timeout_s * 1e3:.2f} ms")
            values = task.result()
        return [v if isinstance(v, bytes) else None for v in values]

    async def put_many(self, values: Mapping[str, bytes]) -> None:
        if not values:
            return

        async def write() -> None:
            async with self._client.pipeline(transaction=False) as pipe:
                for key, value in values.items():
                    pipe.set(key, value, ex=self.ttl_s)
                await pipe.execute()

        await asyncio.shield(self._start(write, "write"))

    async def ping(self) -> bool:
        try:
            async with asyncio.timeout(self.timeout_s):
                return bool(await self._client.ping())
        except (RedisError, OSError, TimeoutError):
            return False

    async def close(self) -> None:
        for task in list(self._running):
            task.cancel()
        await self._client.aclose()


def make_cache(
    redis_url: str | None,
    *,
    max_bytes: int,
    ttl_s: int,
    timeout_ms: float,
    retry_s: float = 5.0,
    failures: int = 3,
    on_trip: Callable[[], None] | None = None,
    on_failure: Callable[[str], None] | None = None,
) -> FeatureCache:
    if redis_url:
        return RedisCache(
            redis_url,
            ttl_s=ttl_s,
            timeout_ms=timeout_ms,
            retry_s=retry_s,
            failures=failures,
            on_trip=on_trip,
            on_failure=on_failure,
        )
    return InProcessCache(max_bytes)
