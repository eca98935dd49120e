"""Live cost calibration: make planning use *this* machine's extraction costs.

A bundle ships one cost curve ``c_f(n)`` per extractor (:class:`~service.bundle.CostPolynomial`),
fitted offline to the p95 of timings on the build machine. On another machine (or under a
different load, or with costs deliberately mis-scaled) those curves are off by a factor that
may itself depend on the item size. The service times every extraction; a
:class:`CostCalibrator` turns those timings into a multiplicative correction
``factor_f(n)`` so that planning uses ``c_f(n) * factor_f(n)``.

Estimator
---------
For each measurement we store the *ratio* ``r = measured_ms / max(c_f(n), tiny)`` rather than
raw milliseconds. Ratios make one size bucket usable across all the sizes it spans (the
profiled curve already carries the shape in ``n``) and let an extractor-wide estimate transfer
to sizes that have not been seen yet.

* Ratios are kept per ``(extractor, size bucket)`` with
  ``bucket = floor(log(n) / log(bucket_base))`` (powers of two by default), each in a ring
  buffer holding the last ``window`` ratios, plus one extractor-wide ring buffer of the last
  ``window`` ratios over all sizes.
* ``factor_f(n)`` is the ``quantile`` (default 0.95) of the bucket's ratios when the bucket
  has at least ``min_samples`` samples; else the same quantile over the extractor-wide
  buffer if *that* has at least ``min_samples``; else ``1.0`` (trust the bundle).

Why the p95: bundles are profiled to the p95 of measured times, so calibrating to the p95 of
``measured / profiled`` keeps the calibrated curve the same statistic as the profiled one
(a correct bundle calibrates to ~1.0, not to the ratio of means). The empirical quantile uses
the conservative order statistic of ``np.quantile(..., method="higher")`` -- the sample at
index ``ceil(q * (m - 1))`` of the ``m`` sorted ratios, never an interpolation towards a
smaller one -- so with few samples the estimate errs on the expensive side, which is the
safe side for a budget. It is computed with ``np.partition`` (same value, O(m)).

Why ring buffers: only the last ``window`` samples count, so old behaviour is forgotten
after ``window`` new requests: a machine that becomes slower or faster (thermal throttling,
noisy neighbours, a new instance type) is tracked, and a mis-profiled bundle adapts within
a few hundred requests.

A slow extractor, or a busy machine
-----------------------------------
Under concurrent load an extraction's wall time counts the time its thread waited for a CPU
or for the GIL. Calibrating to that wall time ratchets: the p95 factors of the extractors that
ran during a burst inflate (×17 was seen), the planner stops choosing them, so they are never
timed again, and the service stays degraded after the load is gone. So :meth:`record` takes
the extraction's *thread CPU time* beside its wall time when the caller has it
(``service.execution`` measures both): the per-extractor ratios are formed from the CPU time
(what the extractor costs on this machine, however busy it is), and wall/CPU feeds one
machine-wide *contention* estimate instead: the ratio of running means of wall and CPU time
(weight ``contention_weight`` per extraction, so long extractions count for more than a
20 µs one that lost its CPU for a few ms), at most ``contention_max``, decaying toward 1 with
a half-life of ``contention_half_life_s`` when nothing is extracted. (Time spent waiting
before an extraction, for a thread or for the event loop, is not contention: deadline
accounting charges it directly, ``service.handler``.) Planning multiplies every curve by the
contention: a busy machine makes every extractor dearer alike, so requests buy cheaper plans
while it lasts, and the plans come back as soon as the extractions are quick again (a
uniform factor also keeps the Poly-Dom index usable). An extractor that does its work on
other threads or waits on I/O reports little CPU time: call :meth:`record` without
``cpu_ms`` for such costs (wall time is then the sample). On a virtual machine a thread's
CPU time also counts the time the hypervisor gave its CPU to another guest (steal), so a
loaded host still raises the per-extractor factors somewhat; forgetting (below) bounds that.

Forgetting
----------
A window's factor decays toward the profile (1.0) once the window receives no samples: from
5 s after its last sample, by half every ``half_life_s`` seconds. An extractor the planner stopped
choosing thus becomes affordable again after a while and is timed again (a probe). A sample
arriving ``forget_after_s`` after its window's last one starts the window afresh (the old
samples describe another time); until the fresh window has ``min_samples`` samples its factor
is the largest fresh ratio (the conservative estimate from few samples), so a probe of an
extractor that is still slow prices it right away.

Cost on the request path: quantiles are cached per buffer and recomputed lazily, only when
new samples arrived -- at the latest after ``refresh_every`` new samples (and immediately when
a buffer first reaches ``min_samples``) -- so ``factor`` is normally a couple of dict look-ups.
``record`` is O(1): one polynomial evaluation and one ring-buffer write under a short lock.

The module stays whole (over 450 lines): the rings, the contention factor and the forgetting
are one estimator whose state the planner reads through :class:`CostCalibrator` alone.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from service.bundle import CostPolynomial
from service.types import FloatArray

_TINY_MS = 1e-6
"""Floor for the profiled cost when forming ratios, so an all-zero curve cannot divide by 0."""
_DECAY_AFTER_S = 5.0
"""A window's factor starts decaying this long after its last sample (brief pauses do not)."""
_CONTENTION_FLOOR = 1.02
"""Contention below this counts as none (calibration stays inactive on a quiet machine)."""
_BUCKET_EPS = 1e-9
"""Guards ``floor(log(n)/log(base))`` against rounding just below an exact power of the base."""


class _Ring:
    """The last ``window`` ratios, with a lazily refreshed cached quantile."""

    __slots__ = ("cached", "computed_count", "count", "data", "fresh", "last", "pos", "total")

    def __init__(self, window: int) -> None:
        self.data: FloatArray = np.empty(window, dtype=np.float64)
        self.pos = 0
        self.count = 0  # samples recorded since the window (re)started (not capped)
        self.total = 0  # samples ever recorded
        self.cached = 1.0
        self.computed_count = -1  # ``count`` when ``cached`` was computed; -1: never
        self.last = -math.inf  # clock time of the last sample
        self.fresh = False  # restarted after a silence: few samples count (their max)

    def push(self, value: float, now: float, forget_after_s: float) -> None:
        if self.count and now - self.last > forget_after_s:
            self.pos = 0
            self.count = 0
            self.computed_count = -1
            self.fresh = True
        self.data[self.pos] = value
        self.pos += 1
        if self.pos == self.data.shape[0]:
            self.pos = 0
        self.count += 1
        self.total += 1
        self.last = now

    @property
    def filled(self) -> int:
        return min(self.count, int(self.data.shape[0]))


class _Extractor:
    __slots__ = ("buckets", "coefficients", "curve", "wide")

    def __init__(self, curve: CostPolynomial, window: int) -> None:
        self.curve = curve
        self.coefficients: tuple[float, ...] = tuple(float(c) for c in reversed(curve.coefficients))
        self.wide = _Ring(window)
        self.buckets: dict[int, _Ring] = {}

    def profiled(self, n: float) -> float:
        total = 0.0
        for c in self.coefficients:  # highest degree first (Horner)
            total = total * n + c
        return total


class CostCalibrator:
    """Corrects a bundle's profiled cost curves with this machine's measured timings.

    See the module docstring for the estimator. Thread-safe: :meth:`record` may be called
    from many worker threads while request threads call :meth:`factor` / :meth:`cost`.

    ``refresh_every`` bounds how stale a cached quantile may be (in new samples of that
    buffer); ``1`` recomputes after every new sample.
    """

    def __init__(
        self,
        profiled: Mapping[str, CostPolynomial],
        *,
        quantile: float = 0.95,
        window: int = 256,
        min_samples: int = 30,
        bucket_base: float = 2.0,
        enabled: bool = True,
        refresh_every: int = 8,
        half_life_s: float = 30.0,
        forget_after_s: float = 60.0,
        contention_weight: float = 0.1,
        contention_half_life_s: float = 2.0,
        contention_max: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples must be in [1, window={window}], got {min_samples}")
        if not (math.isfinite(bucket_base) and bucket_base > 1.0):
            raise ValueError(f"bucket_base must be a finite number > 1, got {bucket_base}")
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1, got {refresh_every}")
        for label, value in (
            ("half_life_s", half_life_s),
            ("forget_after_s", forget_after_s),
            ("contention_half_life_s", contention_half_life_s),
        ):
            if not value > 0.0:
                raise ValueError(f"{label} must be > 0 (inf: never), got {value}")
        if not (math.isfinite(contention_max) and contention_max >= 1.0):
            raise ValueError(f"contention_max must be a finite number >= 1, got {contention_max}")
        if not 0.0 < contention_weight <= 1.0:
            raise ValueError(f"contention_weight must be in (0, 1], got {contention_weight}")
        self._curves: dict[str, CostPolynomial] = dict(profiled)
        self._quantile = float(quantile)
        self._window = int(window)
        self._min_samples = int(min_samples)
        self._bucket_base = float(bucket_base)
        self._inv_log_base = 1.0 / math.log(self._bucket_base)
        self._enabled = bool(enabled)
        self._refresh_every = int(refresh_every)
        self._half_life_s = float(half_life_s)
        self._forget_after_s = float(forget_after_s)
        self._contention_weight = float(contention_weight)
        self._contention_half_life_s = float(contention_half_life_s)
        self._clock = clock
        self._contention_max = float(contention_max)
        self._contention = 1.0
        self._contention_at = -math.inf
        self._cpu_mean = 0.0
        self._wall_mean = 0.0
        self._lock = threading.Lock()
        self._states: dict[str, _Extractor] = {}
        self._active = False
        self.reset()

    # -- configuration ---------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def extractors(self) -> list[str]:
        return list(self._curves)

    @property
    def active(self) -> bool:
        """True once some bucket or extractor has ``min_samples`` samples, or while the
        machine is measurably busy (so a factor may differ from 1.0). Always False when
        disabled."""
        return self._enabled and (self._active or self.contention() > _CONTENTION_FLOOR)

    def contention(self) -> float:
        """How much longer than their CPU time extractions take now (>= 1; 1 when quiet or
        when no CPU times are recorded): the running mean of wall/CPU, decayed toward 1
        with the time since the last extraction."""
        excess = self._contention - 1.0
        if excess <= 0.0:
            return 1.0
        age = self._clock() - self._contention_at
        return 1.0 + excess * math.pow(0.5, max(age, 0.0) / self._contention_half_life_s)

    # -- measurements ----------------------------------------------------------------------

    def bucket(self, n: float) -> int | None:
        """The size bucket of ``n``: ``floor(log(n) / log(bucket_base))``; None for n <= 0."""
        if not (n > 0.0 and math.isfinite(n)):
            return None
        return math.floor(math.log(n) * self._inv_log_base + _BUCKET_EPS)

    def record(self, extractor: str, n: int, ms: float, cpu_ms: float | None = None) -> None:
        """Record one extraction of an item of size ``n`` that took ``ms`` milliseconds of wall
        time and, when given, ``cpu_ms`` of its thread's CPU time: the extractor's ratio is
        then formed from the CPU time and wall/CPU feeds :meth:`contention` (module docstring).

        Ignored when disabled, for unknown extractors, for ``n <= 0`` and for non-finite or
        negative ``ms``. O(1); thread-safe.
        """
        self.record_many(n, ((extractor, ms, cpu_ms),))

    def record_many(self, n: int, samples: Iterable[tuple[str, float, float | None]]) -> None:
        """:meth:`record` of several extractions ``(extractor, ms, cpu_ms)`` of one item of
        size ``n`` (one step of the request loop), in order, taking the lock and reading the
        clock once."""
        if not self._enabled:
            return
        try:
            size = float(n)
        except (TypeError, ValueError):
            return
        b = self.bucket(size)
        if b is None:
            return
        rows: list[tuple[str, _Extractor, float, float | None]] = []
        rows_ratio: list[float] = []
        for extractor, ms, cpu_ms in samples:
            state = self._states.get(extractor)
            if state is None:
                continue
            try:
                value = float(ms)
            except (TypeError, ValueError):
                continue
            if not math.isfinite(value) or value < 0.0:
                continue
            sample = value
            cpu: float | None = None
            if cpu_ms is not None and math.isfinite(cpu_ms) and cpu_ms > 0.0:
                sample = cpu = min(float(cpu_ms), value)
            ratio = sample / max(state.profiled(size), _TINY_MS)
            if math.isfinite(ratio):
                rows.append((extractor, state, value, cpu))
                rows_ratio.append(ratio)
        if not rows:
            return
        now = self._clock()
        with self._lock:
            for (extractor, state, value, cpu), ratio in zip(rows, rows_ratio, strict=True):
                if self._states.get(extractor) is not state:  # reset() raced with us
                    continue
                if cpu is not None:
                    self._learn_contention(value, cpu, now)
                ring = state.buckets.get(b)
                if ring is None:
                    ring = state.buckets[b] = _Ring(self._window)
                ring.push(ratio, now, self._forget_after_s)
                state.wide.push(ratio, now, self._forget_after_s)
                if not self._active and state.wide.count >= self._min_samples:
                    self._active = True

    def record_contention(self, ms: float, cpu_ms: float) -> None:
        """Learn only the machine's contention from ``ms`` of wall time that had ``cpu_ms``
        of its thread's CPU (extractions whose CPU time is known together, not one by one:
        no extractor's ratio is recorded)."""
        if not self._enabled or not (math.isfinite(ms) and math.isfinite(cpu_ms)):
            return
        if ms <= 0.0 or cpu_ms <= 0.0:
            return
        now = self._clock()
        with self._lock:
            self._learn_contention(float(ms), min(float(cpu_ms), float(ms)), now)

    def _learn_contention(self, value: float, cpu: float, now: float) -> None:
        # Time-weighted: the share of recent extraction time the threads had a CPU (under
        # the lock).
        w = self._contention_weight
        keep = 1.0 - w
        old_cpu = self._cpu_mean
        old_wall = old_cpu * self.contention()  # decayed with the time since the last
        self._cpu_mean = keep * old_cpu + w * cpu
        self._wall_mean = keep * old_wall + w * value
        self._contention = min(
            max(self._wall_mean / max(self._cpu_mean, _TINY_MS), 1.0), self._contention_max
        )
        self._contention_at = now

    # -- estimates -------------------------------------------------------------------------

    def _usable(self, ring: _Ring) -> bool:
        """Whether ``ring`` gives a factor: ``min_samples`` samples, or any fresh ones."""
        return ring.count >= self._min_samples or (ring.fresh and ring.count > 0)

    def _value(self, ring: _Ring) -> float:
        """``ring``'s factor: its cached quantile (recomputed if stale; the largest sample
        while a restarted window has fewer than ``min_samples``), decayed toward 1.0 with the
        time since its last sample."""
        done = ring.computed_count
        if not (done >= self._min_samples and ring.count - done < self._refresh_every):
            with self._lock:
                m = ring.filled
                if ring.count < self._min_samples:
                    value = float(ring.data[:m].max()) if m else 1.0
                    ring.computed_count = -1
                else:
                    ring.fresh = False
                    k = min(m - 1, math.ceil(self._quantile * (m - 1) - 1e-12))
                    # == np.quantile(data, q, method="higher"), in O(m)
                    value = float(np.partition(ring.data[:m], k)[k])
                    ring.computed_count = ring.count
                ring.cached = value
        value = ring.cached
        idle = self._clock() - ring.last - _DECAY_AFTER_S
        if idle > 0.0 and value != 1.0:
            value = 1.0 + (value - 1.0) * math.pow(0.5, idle / self._half_life_s)
        return value

    def _ring_for(self, state: _Extractor, n: float) -> _Ring | None:
        b = self.bucket(n)
        if b is not None:
            ring = state.buckets.get(b)
            if ring is not None and self._usable(ring):
                return ring
        if self._usable(state.wide):
            return state.wide
        return None

    def factor(self, extractor: str, n: float) -> float:
        """Multiplicative correction of ``extractor``'s profiled curve at size ``n``.

        The ``quantile`` of the ratios in ``n``'s bucket if it has ``min_samples``; else of the
        extractor-wide window if that has ``min_samples``; else the bundle-wide prior (the
        median of the extractor-wide factors that have data: a machine that is faster or
        slower overall shifts every curve, including those of extractors the planner stopped
        choosing, which would otherwise never be timed again); else 1.0. Also 1.0 when
        disabled or for unknown extractors.
        """
        if not self._enabled:
            return 1.0
        state = self._states.get(extractor)
        if state is None:
            return 1.0
        ring = self._ring_for(state, n)
        return self.prior() if ring is None else self._value(ring)

    def prior(self) -> float:
        """The median extractor-wide factor over the extractors with enough samples (1.0 if
        none)."""
        values = sorted(
            self._value(state.wide) for state in self._states.values() if self._usable(state.wide)
        )
        if not values:
            return 1.0
        mid = len(values) // 2
        return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])

    def profiled_cost(self, extractor: str, n: float) -> float:
        """The bundle's curve at ``n``. KeyError for unknown extractors."""
        return self._states[extractor].profiled(n)

    def cost(self, extractor: str, n: float) -> float:
        """Calibrated cost ``profiled(n) * factor(n)``, in ms. KeyError for unknown extractors.

        When a factor applies, the profiled cost is floored at a tiny positive value (the
        same floor used to form the ratios), so an all-zero curve calibrates to the measured
        cost instead of staying 0.
        """
        return self._states[extractor].profiled(n) * self.factor(extractor, n) * self.contention()

    def costs_at(self, n: float) -> dict[str, float]:
        """Every extractor's calibrated cost at size ``n`` (contention included)."""
        return {name: self.cost(name, n) for name in self._curves}

    def factors_at(self, n: float) -> dict[str, float]:
        """Every extractor's calibration factor at size ``n``, times the machine's current
        :meth:`contention` (what planning multiplies the profiled curves by). (As
        :meth:`factor` per extractor, with the bundle-wide prior computed once: this runs
        on every request.)"""
        busy = self.contention()
        if not self._enabled:
            return dict.fromkeys(self._curves, busy)
        prior: float | None = None
        factors = {}
        for name in self._curves:
            state = self._states.get(name)
            ring = None if state is None else self._ring_for(state, n)
            if ring is not None:
                factors[name] = self._value(ring) * busy
            elif state is None:
                factors[name] = busy
            else:
                if prior is None:
                    prior = self.prior()
                factors[name] = prior * busy
        return factors

    # -- reporting -------------------------------------------------------------------------

    def _bucket_range(self, b: int) -> list[float | int]:
        bounds: list[float | int] = []
        for e in (b, b + 1):
            v = self._bucket_base**e
            bounds.append(int(v) if float(v).is_integer() else float(v))
        return bounds

    def snapshot(self, sizes: Sequence[int]) -> dict[str, Any]:
        """JSON-ready state, for ``GET /models/{name}/costs``.

        ``{"quantile", "window", "min_samples", "enabled", "active", "bucket_base",
        "contention" (the machine-wide factor now), "half_life_s", "forget_after_s",
        "extractors": {name: {"profiled": {n: ms}, "calibrated": {n: ms}, "samples": total,
        "factor": extractor-wide factor, "buckets": [{"bucket", "sizes": [lo, hi), "samples",
        "factor", "source"}]}}}``. A bucket's ``factor`` is the one :meth:`factor` applies to
        its sizes; ``source`` says where it comes from: ``"bucket"`` (its own window),
        ``"extractor"`` (the extractor-wide fallback) or ``"none"`` (1.0, too few samples).
        ``samples`` count every recorded sample, not only those still in a window.
        """
        extractors: dict[str, Any] = {}
        for name, state in self._states.items():
            with self._lock:
                bucket_items = sorted(state.buckets.items())
            buckets: list[dict[str, Any]] = []
            for b, ring in bucket_items:
                if not self._enabled:
                    source, f = "none", 1.0
                elif self._usable(ring):
                    source, f = "bucket", self._value(ring)
                elif self._usable(state.wide):
                    source, f = "extractor", self._value(state.wide)
                else:
                    source, f = "none", 1.0
                buckets.append(
                    {
                        "bucket": b,
                        "sizes": self._bucket_range(b),
                        "samples": ring.total,
                        "factor": f,
                        "source": source,
                    }
                )
            wide = self._value(state.wide) if self._enabled and self._usable(state.wide) else 1.0
            extractors[name] = {
                "profiled": {int(n): state.profiled(n) for n in sizes},
                "calibrated": {int(n): self.cost(name, n) for n in sizes},
                "samples": state.wide.total,
                "factor": wide,
                "buckets": buckets,
            }
        return {
            "quantile": self._quantile,
            "window": self._window,
            "min_samples": self._min_samples,
            "bucket_base": self._bucket_base,
            "enabled": self._enabled,
            "active": self.active,
            "contention": self.contention() if self._enabled else 1.0,
            "half_life_s": self._half_life_s,
            "forget_after_s": self._forget_after_s,
            "extractors": extractors,
        }

    def reset(self) -> None:
        """Forget every measurement: all factors go back to 1.0."""
        with self._lock:
            self._states = {
                name: _Extractor(curve, self._window) for name, curve in self._curves.items()
            }
            self._active = False
            self._contention = 1.0
            self._contention_at = -math.inf
            self._cpu_mean = 0.0
            self._wall_mean = 0.0
