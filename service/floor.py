"""The floor: what this process itself costs a request, measured on the machine it runs on.

Every budget in milliseconds pays for the service before it pays for a feature: reading and
parsing the request, decoding the item, the cache read, planning, inference, encoding and
writing the answer. :class:`FloorMeter` measures that cost from the requests it serves (and
from a few in-process requests at start-up, ``service.http.app``), so that the service can

- **reserve exactly it**: features are planned within what is left of a budget once the part
  of the overhead still to come after planning is set aside (:meth:`FloorMeter.reserve_ms`:
  the p95 of the time from the start of the work to the written answer, extraction
  excluded: planning, inference, encoding and writing);
- **charge a worker thread's way back separately**: a plan run on a worker thread is answered
  only once the event loop takes the request up again, which under load waits behind every
  other request ready on the loop (:meth:`FloorMeter.resume_ms`). That wait is load, not the
  service's own cost: left in the tail, a few thread plans' 10 ms waits under overload made
  the p95 reserve of *every* request 4-5 ms, so that 5 ms budgets answered from the prior; it
  is reserved by the thread plans alone;
- **publish it**: ``GET /models/{name}`` and the skyline show the floor at each size, the
  cheapest budget that buys anything at all (:meth:`FloorMeter.floor_ms`);
- **say when a budget is below it**: a response whose budget is under the floor for its item
  (the overhead plus *this* item's decoding, measured) carries ``below_floor: true``.

Three statistics, each the p95 of a ring of the last ``window`` samples (the quantile is
recomputed every ``refresh`` samples, so recording is O(1) on the request path):

- ``overhead``: from the app's first sight of the request to the written answer, less
  decoding, extraction, inference of the answering model and any wait for a worker thread
  (the waits for the event loop and for a thread are load, not floor);
- ``tail``: from the start of the work to the written answer, less extraction and the
  event loop's resumption after a worker thread;
- ``resume``: from a worker thread's plan finishing to the event loop resuming its request
  (0 until a plan ran on a thread);
- ``decode``: milliseconds of decoding, per bundle and size bucket (powers of two), with
  the bucket's mean size, so that sizes between two buckets seen are priced between them.

**Stalls.** On a busy machine a few requests stall: the process loses its CPU to another
one for a scheduler slice, and that request's overhead or tail takes milliseconds where
the others take a few tenths. Once they are more than 5 % of the window, the p95 is a
stall: with two other processes busy 60 % of the time on the 2 cores, the overhead became
1.7-3.0 ms and the reserve up to 1.9 ms while 90 % of the tails took under 0.31 ms, so that
95-98 % of the 1 ms budgets answered from the prior, told they were below the floor
(accuracy 0.12-0.14). A reserve cannot help a stalled request (its prior answer is as late
as a feature's), and it made every other one answer from the prior: so the overhead and
the tail are the p95 of the samples that are not stalls (a stall: over ``STALL_RATIO``
times the window's median and over ``STALL_MIN_MS`` above it), and the share of stalls is
published (``stall_share``). When most samples are slow (overload, a slower machine), the
median moves with them, and so does the reserve.

Until a statistic has ``min_samples`` samples, ``fallback_ms`` stands in for the overhead
and the tail. ``BUDGETSERVE_OVERHEAD_RESERVE_MS``, when set, fixes the reserve instead
(``fixed_reserve_ms``); the floor is still measured and published. A size larger than any
decoded yet is priced by the largest measured, scaled by the pixels; before any item of a
bundle was decoded, its floor is the overhead alone (``decode_ms`` null).
"""

from __future__ import annotations

import bisect
import math
import threading
from typing import Any

#: The reserve and overhead (ms) the service assumes until it has measured its own; offline
#: evaluation (``training.evaluate``) plans with it too.
FALLBACK_RESERVE_MS = 0.5

#: An overhead or tail sample above this many times the window's median, and at least
#: ``STALL_MIN_MS`` above it, is a stall (see the module): on a 2-core machine with two
#: other processes busy 60 % of the time, the tails' median was 0.23-0.24 ms, their p90
#: 0.28-0.31, their p99 3.9-4.7 (a scheduler slice lost).
STALL_RATIO = 4.0
#: ... and a stall is a scheduler slice, not a long tail of tenths of a millisecond.
STALL_MIN_MS = 1.0


class _Ring:
    """The last ``window`` samples and their ``quantile``, recomputed when read after
    ``refresh`` new samples (or when it first has ``min_samples``). With ``stall_ratio``,
    samples above that many times the median (and ``STALL_MIN_MS`` above it) are stalls:
    left out of the quantile and counted (:attr:`stall_share`)."""

    __slots__ = (
        "_stall_share",
        "_value",
        "count",
        "data",
        "min_samples",
        "pos",
        "quantile",
        "refresh",
        "stale",
        "stall_ratio",
    )

    def __init__(
        self,
        window: int,
        quantile: float,
        refresh: int,
        min_samples: int,
        stall_ratio: float | None = None,
    ) -> None:
        self.data: list[float] = []
        self.pos = 0
        self.count = 0  # samples ever pushed
        self.stale = 0  # samples pushed since the quantile was computed
        self.quantile = quantile
        self.refresh = refresh
        self.min_samples = min_samples
        self.stall_ratio = stall_ratio
        self._value = math.nan
        self._stall_share = 0.0

    def push(self, sample: float, window: int) -> None:
        if len(self.data) < window:
            self.data.append(sample)
        else:
            self.data[self.pos] = sample
            self.pos = (self.pos + 1) % window
        self.count += 1
        self.stale += 1

    @property
    def value(self) -> float:
        """The quantile (the conservative order statistic), NaN before ``min_samples``. A
        quantile that is the samples' maximum (a p95 of up to 20) is their median instead:
        one cold first decoding (4.6 ms where the next ones took 0.5) priced its size and
        every size interpolated from it."""
        if self.count < self.min_samples:
            return math.nan
        if math.isnan(self._value) or self.stale >= self.refresh:
            ordered = sorted(self.data)
            if self.stall_ratio is not None:
                median = ordered[len(ordered) // 2]
                limit = max(self.stall_ratio * median, median + STALL_MIN_MS)
                body = bisect.bisect_right(ordered, limit)
                self._stall_share = 1.0 - body / len(ordered)
                ordered = ordered[:body]
            index = math.ceil(self.quantile * (len(ordered) - 1))
            if index == len(ordered) - 1:
                index = (len(ordered) - 1) // 2
            self._value = ordered[index]
            self.stale = 0
        return self._value

    @property
    def stall_share(self) -> float:
        """The share of the samples that were stalls when the quantile was last computed."""
        return self._stall_share

    def mean(self) -> float:
        return sum(self.data) / len(self.data) if self.data else math.nan


class FloorMeter:
    """See the module. Thread-safe (samples come from the event loop and worker threads)."""

    def __init__(
        self,
        fixed_reserve_ms: float | None = None,
        *,
        fallback_ms: float = FALLBACK_RESERVE_MS,
        window: int = 256,
        quantile: float = 0.95,
        min_samples: int = 16,
        refresh: int = 16,
    ) -> None:
        self.fixed_reserve_ms = fixed_reserve_ms
        self.fallback_ms = fallback_ms
        self.window = window
        self.quantile = quantile
        self.min_samples = min_samples
        self.refresh = refresh
        self._lock = threading.Lock()
        self._overhead = self._ring(min_samples, STALL_RATIO)
        self._tail = self._ring(min_samples, STALL_RATIO)
        self._resume = self._ring(1)
        # (bundle, size bucket) → rings of decoding ms and of item sizes
        self._decode: dict[tuple[str, int], tuple[_Ring, _Ring]] = {}

    def _ring(self, min_samples: int, stall_ratio: float | None = None) -> _Ring:
        return _Ring(self.window, self.quantile, self.refresh, min_samples, stall_ratio)

    def _push(self, ring: _Ring, sample: float) -> None:
        ring.push(sample, self.window)

    def record(
        self,
        bundle: str,
        size: int,
        *,
        overhead_ms: float,
        tail_ms: float,
        decode_ms: float,
        resume_ms: float | None = None,
    ) -> None:
        """One answered request's samples (see the module); ``resume_ms`` only for a plan
        that ran on a worker thread."""
        with self._lock:
            self._push(self._overhead, max(overhead_ms, 0.0))
            self._push(self._tail, max(tail_ms, 0.0))
            if resume_ms is not None:
                self._push(self._resume, max(resume_ms, 0.0))
            if size >= 1:
                key = (bundle, _bucket(size))
                rings = self._decode.get(key)
                if rings is None:
                    rings = self._decode[key] = (self._ring(1), self._ring(1))
                self._push(rings[0], max(decode_ms, 0.0))
                self._push(rings[1], float(size))

    def overhead_ms(self) -> float:
        """The p95 overhead of a request that did not stall, decoding excluded
        (``fallback_ms`` until measured)."""
        with self._lock:
            value = self._overhead.value
        return self.fallback_ms if math.isnan(value) else value

    def reserve_ms(self) -> float:
        """What planning sets aside for the work after it: the p95 tail of the requests
        that did not stall (or the fixed reserve the service was given)."""
        if self.fixed_reserve_ms is not None:
            return self.fixed_reserve_ms
        with self._lock:
            value = self._tail.value
        return self.fallback_ms if math.isnan(value) else value

    def resume_ms(self) -> float:
        """The p95 wait for the event loop after a worker thread's plan (0 before any)."""
        with self._lock:
            value = self._resume.value
        return 0.0 if math.isnan(value) else value

    def stall_share(self) -> float:
        """The share of the recent overhead samples that were stalls (see the module)."""
        with self._lock:
            ring = self._overhead
            return 0.0 if math.isnan(ring.value) else ring.stall_share

    def measured(self) -> bool:
        with self._lock:
            return not math.isnan(self._overhead.value)

    def decode_ms(self, bundle: str, size: int) -> float | None:
        """The p95 decoding time of an item of ``size`` for ``bundle``: from its size bucket
        (scaled to ``size`` by the bucket's mean size), interpolated between the nearest
        buckets measured below and above it (a power law through the two), the smallest
        measured for smaller sizes, the largest scaled to ``size`` for larger ones (decoding
        grows with the pixels; a larger size was once priced at the overhead alone, below
        the smallest size's floor); None before any item of ``bundle`` was decoded."""
        with self._lock:
            points = sorted(
                (rings[1].mean(), rings[0].value)
                for (name, _), rings in self._decode.items()
                if name == bundle
            )
        if not points:
            return None
        wanted = _bucket(size)
        for mean_size, ms in points:
            if _bucket(int(mean_size)) == wanted:
                return ms * size / mean_size
        below = [p for p in points if p[0] < size]
        above = [p for p in points if p[0] > size]
        if not above:
            mean_size, ms = points[-1]
            return ms * size / mean_size
        if not below:
            return above[0][1]
        (n0, t0), (n1, t1) = below[-1], above[0]
        if t0 <= 0 or t1 <= 0:
            return max(t0, t1)
        slope = math.log(t1 / t0) / math.log(n1 / n0)
        return float(t0 * (size / n0) ** slope)

    def floor_ms(self, bundle: str, size: int) -> float:
        """The cheapest budget that buys anything for an item of ``size``: the overhead
        plus its decoding (the overhead alone before any item of the bundle was decoded)."""
        decode = self.decode_ms(bundle, size)
        return self.overhead_ms() + (decode or 0.0)

    def snapshot(self, bundle: str, sizes: list[int]) -> dict[str, Any]:
        """What ``GET /models/{name}`` shows (milliseconds)."""
        return {
            "measured": self.measured(),
            "samples": self._overhead.count,
            "overhead_ms": round(self.overhead_ms(), 4),
            "reserve_ms": round(self.reserve_ms(), 4),
            "resume_ms": round(self.resume_ms(), 4),
            "stall_share": round(self.stall_share(), 4),
            "by_size": [
                {
                    "size": n,
                    "decode_ms": None if (d := self.decode_ms(bundle, n)) is None else round(d, 4),
                    "floor_ms": round(self.floor_ms(bundle, n), 4),
                }
                for n in sizes
            ],
        }


def _bucket(size: int) -> int:
    return max(int(size).bit_length() - 1, 0)
