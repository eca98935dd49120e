"""A Poly-Dom index that stays valid under live cost calibration (issue 17).

Once calibration corrects the extractors by different factors, the bundle's index (built
for the profiled curves) no longer orders the models, and planning fell back to scanning
every model per request. This module builds, in the service, a *calibrated* index from a
snapshot of the calibration factors and keeps it exact for every factor vector close to
that snapshot, so most requests plan from a short list and a rebuild is needed only when
the factors moved materially.

Ranges: the size domain is split at the calibration's buckets (powers of two, where a
factor can change) and each bucket into a few geometric pieces. Per range the snapshot
holds every extractor's factor ``F_f`` (at the bucket's start: factors are constant
across a bucket at any instant, and the contention factor scales them all alike).

Per range the index keeps the models not *robustly dominated*: model ``j`` is dropped when
some model ``i`` ranks higher (more accurate; on equal accuracy, earlier in the bundle:
the scan's own tie-break) and costs no more than ``j`` for every size in the range and
every factor vector ``g`` with ``g_f / s`` in ``[F_f (1 - t), F_f (1 + t)]`` for one
common ``s > 0`` (``t``: the tolerance). Cost curves with non-negative coefficients are
non-decreasing in the size, so with ``D = i \\ j`` and ``E = j \\ i`` the condition is::

    (1 + t) sum_{f in D} F_f c_f(hi) + margin  <=  (1 - t) sum_{f in E} F_f c_f(lo)

where ``margin = 1e-9 (1 + t) (total_i(hi) + total_j(hi))`` covers floating-point
rounding of the sums (a few ulps), so the inequality holds for the float sums the scan
compares too; models with the very same feature tuple cost exactly the same and the lower
ranked one is dropped. Domination is transitive, so the scan's answer (the highest ranked
model whose cost fits) is never dropped, and the lookup, a walk down the kept list by
rank that stops at the first model whose cost (summed exactly as the scan sums it) fits,
returns the scan's plan exactly. A lookup first checks that the factors now at the
request's size lie in the range's box (max/min of ``g_f / F_f`` at most
``(1 + t) / (1 - t)``); if not, it returns None, the caller scans and asks for a rebuild.

:class:`IndexKeeper` rebuilds off the request path: a request whose lookup fails asks for
a rebuild, which runs on a short-lived daemon thread, at most one at a time and at most
once per ``min_interval_s``; the new index replaces the old one by one attribute store.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from service.types import FloatArray, horner

log = logging.getLogger(__name__)

_ROUNDING_MARGIN = 1e-9
"""Relative margin in the domination test covering the rounding of the float cost sums."""


def _ranges(low: float, high: float, pieces: int) -> list[tuple[float, float, float]]:
    """``(start, end, bucket_start)`` covering ``[low, high]``: split at powers of two
    (the calibration's size buckets), each bucket into ``pieces`` geometric pieces."""
    out: list[tuple[float, float, float]] = []
    k = math.floor(math.log2(low) + 1e-12)
    while 2.0**k <= high:
        b_lo, b_hi = 2.0**k, 2.0 ** (k + 1)
        start, end = max(low, b_lo), min(b_hi, max(high, low))
        if start <= high:
            edges = np.geomspace(start, end, pieces + 1) if end > start else np.array([start])
            ends = [*edges[1:-1].tolist(), end] if end > start else [end]
            begin = start
            for stop in ends:
                out.append((begin, float(stop), b_lo))
                begin = float(stop)
        k += 1
    return out


class CalibratedIndex:
    """Per size range, the models that can answer under factors near a snapshot (see
    the module docstring); ``lookup`` returns the scan's plan or None (factors moved)."""

    __slots__ = ("_factors", "_lists", "_names", "_starts", "_tolerance", "built_at", "size")

    def __init__(
        self,
        model_ids: Sequence[str],
        model_features: Mapping[str, tuple[str, ...]],
        accuracy: Mapping[str, float],
        names: Sequence[str],
        coefficients: FloatArray,
        ranges: Sequence[tuple[float, float]],
        factors: Sequence[Mapping[str, float]],
        tolerance: float,
    ) -> None:
        if not 0.0 <= tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1), got {tolerance}")
        if len(ranges) != len(factors) or not ranges:
            raise ValueError("one factor snapshot per range, at least one range, is required")
        if np.any(np.asarray(coefficients) < 0.0):
            raise ValueError("a calibrated index needs cost curves with coefficients >= 0")
        self._names = list(names)
        self._tolerance = float(tolerance)
        self._starts = [float(r[0]) for r in ranges]
        self._factors = [[float(f[name]) for name in self._names] for f in factors]
        # Rank: accuracy falling, bundle order on ties (the scan keeps the first it meets).
        order = sorted(range(len(model_ids)), key=lambda i: -accuracy[model_ids[i]])
        ids = [model_ids[i] for i in order]
        tuples = [model_features[m] for m in ids]
        column = {name: k for k, name in enumerate(self._names)}
        member = np.zeros((len(ids), len(self._names)), dtype=np.float64)
        for i, features in enumerate(tuples):
            for f in features:
                member[i, column[f]] = 1.0
        outside = 1.0 - member
        same = np.array([[a == b for b in tuples] for a in tuples], dtype=bool)
        higher = np.triu(np.ones((len(ids), len(ids)), dtype=bool), k=1)  # [i, j]: i ranks above j
        t = self._tolerance
        self._lists: list[list[tuple[str, tuple[str, ...]]]] = []
        for (start, end), snapshot in zip(ranges, self._factors, strict=True):
            scale = np.asarray(snapshot, dtype=np.float64)
            w_lo = scale * np.asarray(horner(coefficients, float(start)), dtype=np.float64)
            w_hi = scale * np.asarray(horner(coefficients, float(end)), dtype=np.float64)
            extra_i = (1.0 + t) * ((member * w_hi) @ outside.T)  # [i, j]: i's features j lacks
            extra_j = (1.0 - t) * (outside * w_lo) @ member.T  # [i, j]: j's features i lacks
            total = member @ w_hi
            margin = _ROUNDING_MARGIN * (1.0 + t) * (total[:, None] + total[None, :])
            dominated = higher & ((extra_i + margin <= extra_j) | same)
            kept = ~dominated.any(axis=0)
            self._lists.append([(ids[j], tuples[j]) for j in np.flatnonzero(kept)])
        self.size = sum(len(entries) for entries in self._lists)
        self.built_at = time.monotonic()

    @property
    def n_ranges(self) -> int:
        return len(self._starts)

    def kept(self, n: float) -> list[str]:
        """The models kept for the range holding ``n``, highest ranked first."""
        i = bisect_right(self._starts, n) - 1
        return [m for m, _ in self._lists[max(i, 0)]]

    def valid_for(self, n: float, factors: Mapping[str, float]) -> bool:
        """Whether ``factors`` (at size ``n``) lie in the box its range was built for."""
        i = bisect_right(self._starts, n) - 1
        if i < 0:
            return False
        low, high = math.inf, 0.0
        for name, base in zip(self._names, self._factors[i], strict=True):
            r = factors[name] / base if base > 0.0 else math.inf
            if r < low:
                low = r
            if r > high:
                high = r
        t = self._tolerance
        return low > 0.0 and high * (1.0 - t) <= low * (1.0 + t)

    def lookup(
        self, n: float, factors: Mapping[str, float], per_feature: Mapping[str, float], limit: float
    ) -> tuple[str, float] | None:
        """The highest ranked model whose cost (its features' ``per_feature`` summed in the
        bundle's order) is at most ``limit`` and that cost, ``("", 0.0)`` when none fits,
        or None when ``factors`` moved out of the range's box (scan instead)."""
        if not self.valid_for(n, factors):
            return None
        i = bisect_right(self._starts, n) - 1
        for model, features in self._lists[i]:
            cost = sum(per_feature[f] for f in features)
            if cost <= limit:
                return model, cost
        return "", 0.0


class IndexKeeper:
    """Holds the current :class:`CalibratedIndex` and rebuilds it off the request path.

    ``build`` makes a new index from the factors at that moment; ``request_rebuild``
    starts it on a daemon thread unless one is running or the last started less than
    ``min_interval_s`` ago (so a request never waits for it); ``rebuild_now`` builds on the
    calling thread (tests, benchmarks, start-up)."""

    def __init__(
        self, build: Callable[[], CalibratedIndex | None], min_interval_s: float = 1.0
    ) -> None:
        self._build = build
        self._min_interval_s = float(min_interval_s)
        self._lock = threading.Lock()
        self._running = False
        self._last_start = -math.inf
        self.index: CalibratedIndex | None = None
        self.builds = 0

    def rebuild_now(self) -> CalibratedIndex | None:
        index = self._build()
        self.index = index  # one attribute store: readers see the old or the new index
        self.builds += 1
        return index

    def request_rebuild(self) -> bool:
        """Start a background rebuild if none is running and the interval has passed;
        True if one was started."""
        now = time.monotonic()
        with self._lock:
            if self._running or now - self._last_start < self._min_interval_s:
                return False
            self._running = True
            self._last_start = now
        threading.Thread(target=self._run, name="polydom-index-rebuild", daemon=True).start()
        return True

    def _run(self) -> None:
        try:
            self.rebuild_now()
        except Exception:  # a failed rebuild leaves the scan in use; never kills a worker
            log.exception("rebuilding the calibrated Poly-Dom index failed")
        finally:
            with self._lock:
                self._running = False

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Wait until no rebuild runs (tests); True if none does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._running:
                    return True
            time.sleep(0.001)
        return False


def ranges_for(domain: tuple[float, float], pieces: int = 4) -> list[tuple[float, float, float]]:
    """The index's ranges over a size ``domain``: ``(start, end, bucket_start)``."""
    low, high = float(domain[0]), float(domain[1])
    if not (0.0 < low <= high and math.isfinite(high)):
        raise ValueError(f"size domain must satisfy 0 < low <= high < inf, got {domain}")
    return _ranges(low, high, pieces)
