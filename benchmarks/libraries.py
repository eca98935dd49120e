"""Our byte-bounded LRU (``service.cache.InProcessCache``) against what a user would use
instead: ``cachetools.LRUCache`` with ``getsizeof``, wrapped to the same interface (and the
same lock). Both count what an entry holds (its key and value objects and the LRU's
bookkeeping), so both hold the same features under one cap only if their bookkeeping costs
the same: we measure it (tracemalloc) as well as the time of one request's lookup and
write-back (7 features, the digits bundle's extractors), interleaved, medians of 7 rounds.

``python -m benchmarks.libraries`` → docs/benchmarks/libraries.md.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import cachetools

from service.cache import _ENTRY_OVERHEAD, InProcessCache

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "libraries.md"
ENTRIES = 20_000
PER_REQUEST = 7
VALUE = 256  # bytes of one feature vector (64 float32)


class CachetoolsCache:
    """The feature cache on ``cachetools.LRUCache``: its ``getsizeof`` sees the value only,
    so each value is stored with its key's size to count both, as ours does."""

    backend = "memory"

    def __init__(self, max_bytes: int) -> None:
        self._data: cachetools.LRUCache[str, tuple[int, bytes]] = cachetools.LRUCache(
            max_bytes, getsizeof=lambda e: e[0] + sys.getsizeof(e[1]) + _ENTRY_OVERHEAD
        )
        self._lock = threading.Lock()

    async def get_many(
        self, keys: Sequence[str], timeout_s: float | None = None
    ) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                entry = self._data.get(key)
                out.append(None if entry is None else entry[1])
        return out

    async def put_many(self, values: Mapping[str, bytes]) -> None:
        with self._lock:
            for key, value in values.items():
                with contextlib.suppress(ValueError):  # larger than the cap
                    self._data[key] = (sys.getsizeof(key), value)


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never awaits, without an event loop's own overhead."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the cache awaited")


def _keys() -> list[str]:
    return [f"bs:f1:hog:1:{i:064x}" for i in range(ENTRIES)]


def _time(cache: Any, keys: list[str], value: bytes) -> tuple[float, float]:
    """Microseconds per request: write-back of 7 features, then lookup of 7 (all hits)."""
    t0 = time.perf_counter()
    for i in range(0, len(keys), PER_REQUEST):
        _run(cache.put_many({k: value for k in keys[i : i + PER_REQUEST]}))
    t1 = time.perf_counter()
    for i in range(0, len(keys), PER_REQUEST):
        _run(cache.get_many(keys[i : i + PER_REQUEST]))
    t2 = time.perf_counter()
    requests = len(keys) / PER_REQUEST
    return (t1 - t0) / requests * 1e6, (t2 - t1) / requests * 1e6


def _bookkeeping(make: Any) -> float:
    """Bytes per entry the LRU itself holds, beyond the key and value objects."""
    keys = _keys()
    values = [os.urandom(VALUE) for _ in keys]
    tracemalloc.start()
    cache = make(1 << 40)
    base = tracemalloc.get_traced_memory()[0]
    for i in range(0, ENTRIES, 100):
        _run(cache.put_many(dict(zip(keys[i : i + 100], values[i : i + 100], strict=True))))
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return held / ENTRIES


def main() -> None:
    keys = _keys()
    value = os.urandom(VALUE)
    makers = {"ours (OrderedDict)": InProcessCache, "cachetools.LRUCache": CachetoolsCache}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in makers}
    for _ in range(7):  # interleaved
        for name, make in makers.items():
            times[name].append(_time(make(64 << 20), keys, value))
    load = os.getloadavg()[0]
    rows = []
    for name, make in makers.items():
        put = statistics.median(t[0] for t in times[name])
        get = statistics.median(t[1] for t in times[name])
        rows.append((name, get, put, _bookkeeping(make)))
    ours, theirs = rows
    lines = [
        "# The in-process feature cache: ours against cachetools",
        "",
        f"`python -m benchmarks.libraries`, {time.strftime('%Y-%m-%d')}, "
        f"load average {load:.1f} on a shared 2-core machine; {ENTRIES} keys of "
        f"{len(keys[0])} characters, {VALUE}-byte values, {PER_REQUEST} features per request, "
        "medians of 7 interleaved rounds.",
        "",
        "| LRU | lookup of 7 (µs) | write-back of 7 (µs) | bookkeeping per entry (B) |",
        "|---|---|---|---|",
        *(f"| {n} | {g:.2f} | {p:.2f} | {b:.0f} |" for n, g, p, b in rows),
        "",
        f"cachetools takes {theirs[1] / ours[1]:.2f}x the time per lookup (on every request's "
        f"budget path) and {theirs[2] / ours[2]:.2f}x per write-back, and its three "
        f"dictionaries hold {theirs[3] / ours[3]:.1f}x the bytes per entry ({theirs[3]:.0f} B "
        f"against the {_ENTRY_OVERHEAD} B each entry is charged): under the same cap it would "
        "hold more memory than the cap says, or, charged what it holds, fewer features. So "
        "`service/cache.py` keeps its own LRU.",
        "",
    ]
    OUT.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
