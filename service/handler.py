"""The predict handler: plan, extract lazily, infer, account. Knows nothing of HTTP.

The module stays whole (over 450 lines): admission, the choice between the event loop and a
thread, planning and accounting all read one request's timeline (receipt, decoding, the
wait, the work, the answer), which splitting would pass around piece by piece.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import logging
import math
import os
import time
from collections.abc import Callable, Collection, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from service import tracing
from service.cache import (
    CacheBypassed,
    CacheDeadline,
    CacheUnavailable,
    FeatureCache,
    feature_key,
)
from service.errors import BudgetTooLarge, InvalidRequest, Overloaded, SizeMismatch
from service.execution import Execution, execute
from service.extractors.sensor import given_vector
from service.floor import FloorMeter
from service.gate import ThreadGate
from service.items import DecodedItem
from service.metrics import Metrics
from service.registry import Bundle, Registry
from service.schemas import CostReport, PredictResponse, SharedPoints, Timings
from service.strategies.base import StrategyRuntime
from service.types import FloatVector

log = logging.getLogger("budgetserve.handler")

# A Redis read may use at most this share of the request's budget.
CACHE_READ_SHARE = 0.2
# Retry-After of a 503 for a full queue: the queue turns over within about a budget.
RETRY_AFTER_S = 1
# A standing queue (``PredictHandler._admit_by_deadline``): the smallest lateness (receipt to
# the start of the work) over an interval above the target, as CoDel's defaults scaled to
# budgets of milliseconds.
QUEUE_INTERVAL_S = 0.1
QUEUE_TARGET_MS = 2.0
# ... and at least this share of an interval's requests later than the target. (CoDel takes
# the interval's smallest lateness; ours is dated back by an estimate of the loop's lag, and
# under overload a few requests of nearly every interval were measured on time, so the
# queue was seen standing in 0-13 % of the intervals of the open loop at 150 % of capacity.)
STANDING_SHARE = 0.5
# ... or, within the interval, once this many of its requests show it (the interval's
# verdict came one interval late: under overload the queue came and went faster).
QUEUE_EARLY_SEEN = 8
# Weight of the latest wait in the running estimate of the wait for a thread.
WAIT_EWMA = 0.2
# Weight of each arrival in the running mean of the requests it finds in the process (about
# the last 32 arrivals count).
SEEN_EWMA = 1.0 / 32.0
#: A plan predicted to cost at most ``inline_ms`` runs on the event loop only while arrivals
#: find the process empty (:attr:`PredictHandler.others_seen` below this) and no other
#: request is in it: one client at a time. Under load the loop must keep reading and
#: shedding, and plans measured on the loop price the features lower than plans measured on
#: threads, which changed what loaded workers bought: with 0.25 here, one worker at 900
#: requests/s had 92-95 % of its answers within budget + 1 ms against 99 % (70 %: 0.95 ->
#: 0.97 accuracy in one run, no change in another).
ALONE_SEEN = 0.05
#: ... and only with a plannable budget of at most this many ``inline_ms``: the hand-off's
#: ~0.3 ms of CPU is a large part of a budget of a few ms, and the plan on the loop is cut to
#: ``inline_ms`` (an extraction running over its price gives up features); a budget of
#: hundreds of ms affords the hand-off and keeps its whole plan.
SMALL_PLAN_BUDGETS = 5.0
# Under contention a plan still gets at least this (ms), or twice the cheapest feature's
# cost if dearer (see ``contended_share``).
CONTENDED_MIN_MS = 0.5
# How a measured budget is counted (``PredictHandler``): from the request's receipt, or the
# work done for it only.
ACCOUNTINGS = ("deadline", "work")

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


@dataclass(frozen=True)
class Limits:
    """Admission limits of one process (see ``service.settings``)."""

    max_budget_ms: float = float("inf")
    max_queued: int = 1 << 30
    max_queued_bytes: int = 1 << 62
    #: Longest wait for a thread of a request whose budget is not in ms (declared costs).
    max_wait_s: float = 1.0


def contended_share(left_ms: float, others: float, weight: float, cheapest_ms: float) -> float:
    """What a plan of ``left_ms`` may spend while arriving requests find ``others`` other
    requests in the process on average: ``left_ms / (1 + weight * others)``, as each
    millisecond a plan spends delays those others (they share the process's CPU and its
    GIL) and its deadline is theirs too; infinite when nothing is shared (``others`` or
    ``weight`` 0). Never below what is left or ``max(CONTENDED_MIN_MS, 2 * cheapest_ms)``,
    whichever is less: a request that can pay for a feature buys one (with the floor at the
    cheapest feature alone, 60 of 1,239 answers at 413 requests/s were the prior, against 2
    at 0.5 ms, the cheapest cost being raised under load by calibration)."""
    if weight <= 0.0 or others <= 0.0:
        return math.inf
    floor = min(left_ms, max(CONTENDED_MIN_MS, 2.0 * cheapest_ms))
    return max(left_ms / (1.0 + weight * others), floor)


def _counted(
    method: Callable[Concatenate[PredictHandler, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[PredictHandler, P], Coroutine[Any, Any, R]]:
    """``PredictHandler.predict``, counted among the requests in the process while it runs
    (:attr:`PredictHandler.others_seen`)."""

    async def counted(self: PredictHandler, /, *args: P.args, **kwargs: P.kwargs) -> R:
        self.others_seen += SEEN_EWMA * (self._in_process - self.others_seen)
        self._in_process += 1
        try:
            return await method(self, *args, **kwargs)
        finally:
            self._in_process -= 1

    functools.update_wrapper(counted, method)
    return counted


def uniform_of(key: str) -> float:
    """A number in [0, 1) fixed by an item's key, uniform over keys: which of two points
    shared out under a mean budget this item gets (the same item, the same point)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def _unobserved(_name: str, _seconds: float) -> None:
    """The timing callback of work the metrics do not count (the start-up floor probes)."""


class PredictHandler:
    """Answers predictions. CPU-bound work (decoding large items, extraction, inference)
    runs on worker threads, at most ``threads`` requests at once, or on the event loop when
    it is small (below).

    Admission, when every thread is busy: at most ``limits.max_queued`` requests wait, and
    the decoded items of the requests admitted (waiting or working) hold at most
    ``limits.max_queued_bytes``; beyond that a request is refused with :class:`Overloaded`
    (503). A free thread goes to the waiting request whose deadline comes first
    (:class:`ThreadGate`). A request with measured (ms) costs waits at most until what would
    be left of its budget could no longer pay for a plan on the event loop (``inline_ms``,
    or the cheapest feature it lacks if dearer; under ``"work"`` accounting, its budget),
    and not at all when the expected wait is longer: it then runs that plan there, or
    answers at once from what it has (cached features, or the prior), so small requests
    never wait behind big ones. The wait is reported as ``timings_ms.queued``.

    Inline work: a request whose plannable budget is at most ``inline_ms`` runs its plan on
    the event loop, without the hand-off to a thread and back, which costs more than a
    plan that small (and a request that can buy nothing, or has every feature in hand, is
    always answered there); so does one whose plan the strategy predicts to cost at most
    ``inline_ms`` (:meth:`~service.strategies.base.StrategyRuntime.planned_ms`) with a
    plannable budget of at most ``SMALL_PLAN_BUDGETS`` times it, while no other request is in
    the process and arrivals have been finding it empty (under load the loop must stay free
    to read, refuse and answer others).

    Accounting of a measured (ms) budget, per request (``accounting``; ``default_accounting``
    when the request names none):

    - ``"deadline"``: the budget counts from the request's receipt (``received``, a
      ``perf_counter()`` taken when its first bytes arrived; now when not given) to the
      moment the answer is made, on the event loop, after any worker thread: reading the
      body, decoding, the cache read, the wait for a thread and the way back are charged,
      and features are planned with what is left when work starts, less the measured
      reserve for the work after planning (``service.floor``) and, for a plan on a worker
      thread, the measured wait for the event loop to take the request back
      (:meth:`~service.floor.FloorMeter.resume_ms`). Under load the service thus degrades
      accuracy, not latency; behind a standing queue it refuses what can no longer buy an
      answer (:meth:`_admit_by_deadline`) and plans the rest on the event loop within
      twice the cheapest feature they lack (the queue's time is the other requests').
    - ``"work"``: only the work is charged (the cache read, then the plan / extract / infer
      loop); the wait is reported, not charged.

    Plans under contention: the requests of a process share its CPU and its GIL, so the
    features one buys delay the others. Each arrival counts the requests already in the
    process (a running mean over about 32 arrivals, :attr:`others_seen`), and under deadline
    accounting a plan spends at most :func:`contended_share` of what is left
    (``contention_weight``; 0 turns it off). One client at a time is never found by another:
    its plans are untouched. (What it buys, measured side by side: ``docs/operating.md``,
    "Plans under contention".)

    The service's own cost is measured (:class:`~service.floor.FloorMeter`, ``floor``): a
    response whose budget is below the floor for its item says so (``below_floor``)."""

    def __init__(
        self,
        registry: Registry,
        cache: FeatureCache,
        metrics: Metrics,
        reserve_ms: float | None = None,
        threads: int = 0,
        limits: Limits | None = None,
        default_accounting: str = "deadline",
        inline_ms: float = 0.0,
        contention_weight: float = 0.0,
    ) -> None:
        if default_accounting not in ACCOUNTINGS:
            raise ValueError(
                f"default_accounting must be one of {ACCOUNTINGS}, got {default_accounting!r}"
            )
        self.default_accounting = default_accounting
        self.registry = registry
        self.cache = cache
        self.metrics = metrics
        self.floor = FloorMeter(reserve_ms)  # None: the reserve is measured
        self.limits = limits or Limits()
        self.inline_ms = inline_ms
        self.contention_weight = contention_weight
        #: The mean number of other requests in this process that arriving requests found.
        self.others_seen = 0.0
        self._in_process = 0
        threads = threads or os.cpu_count() or 1
        self.gate = ThreadGate(threads)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="budgetserve-extract")
        self.waiting: dict[object, float] = {}  # waiting requests → when they began, in order
        self.held_bytes = 0
        self.wait_estimate_s = 0.0
        # The standing-queue detector of ``_admit_by_deadline``.
        self._interval_start = time.perf_counter()
        self._interval_seen = 0
        self._interval_late = 0
        self._standing = False

    @property
    def reserve_ms(self) -> float:
        """What planning sets aside for the work after it (measured: ``service.floor``)."""
        return self.floor.reserve_ms()

    def close(self) -> None:
        """Stop the worker threads (once the requests in flight have finished)."""
        self.pool.shutdown(wait=False, cancel_futures=True)

    def expected_wait_s(self) -> float:
        """How long a request arriving now should expect to wait for a thread."""
        if self.gate.available() and not self.waiting:
            return 0.0
        oldest = next(iter(self.waiting.values()), None)
        age = 0.0 if oldest is None else time.perf_counter() - oldest
        return max(age, self.wait_estimate_s)

    def _refuse(self, reason: str, **details: Any) -> Overloaded:
        self.metrics.admission.labels(result=reason).inc()
        return Overloaded(reason.replace("_", " "), RETRY_AFTER_S, **details)

    async def _acquire(
        self, wait_limit_s: float | None, nbytes: int, deadline: float = math.inf
    ) -> float | None:
        """Take a thread for this task and hold ``nbytes`` in ``held_bytes`` (the caller
        releases both): the seconds waited, or None — nothing taken — when the request should
        not wait (its ``wait_limit_s`` is below the expected wait, or ran out). Waiters are
        served by ``deadline`` (a ``perf_counter()``), earliest first."""
        if not self.waiting and self.gate.try_acquire():
            self.held_bytes += nbytes
            self.wait_estimate_s *= 1.0 - WAIT_EWMA
            return 0.0
        if wait_limit_s is not None and wait_limit_s < self.expected_wait_s():
            self.metrics.admission.labels(result="answered_unqueued").inc()
            return None
        if len(self.waiting) >= self.limits.max_queued:
            raise self._refuse("queue_full", max_queued=self.limits.max_queued)
        if self.held_bytes > 0 and self.held_bytes + nbytes > self.limits.max_queued_bytes:
            raise self._refuse("queue_bytes", max_queued_bytes=self.limits.max_queued_bytes)
        token = object()
        started = time.perf_counter()
        self.waiting[token] = started
        self.held_bytes += nbytes
        acquired = False
        try:
            acquired = await self.gate.acquire(deadline, wait_limit_s)
        finally:
            del self.waiting[token]
            if not acquired:
                self.held_bytes -= nbytes
        waited = time.perf_counter() - started
        self.wait_estimate_s += WAIT_EWMA * (waited - self.wait_estimate_s)
        if not acquired:
            self.metrics.admission.labels(result="wait_expired").inc()
            return None
        return waited

    async def _on_thread(self, func: Callable[[], T]) -> T:
        """Run ``func`` on a worker thread (a thread of the gate must be held), in this
        task's context (its trace span)."""
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self.pool, context.run, func)

    async def _in_thread(self, func: Callable[[], T], deadline: float = math.inf) -> T:
        """Run ``func`` on an extraction thread, waiting without a time limit (count-bounded)
        among the other waiters by ``deadline``."""
        if await self._acquire(None, 0, deadline) is None:  # pragma: no cover - always granted
            raise RuntimeError("no thread granted")
        try:
            return await self._on_thread(func)
        finally:
            self.gate.release()

    @_counted
    async def predict(
        self,
        model: str,
        item: Any,
        size: int | None,
        budget: float,
        strategy: str | None = None,
        *,
        version: str | None = None,
        accounting: str | None = None,
        tolerance: float | None = None,
        budget_mode: str | None = None,
        max_cost: float | None = None,
        received: float | None = None,
        observe: bool = True,
    ) -> tuple[PredictResponse, dict[str, bytes]]:
        """Answer one request (on ``version`` of ``model``, its newest if None); also
        returns the features to write back to the cache. ``accounting``: ``"deadline"`` or
        ``"work"`` (class docstring; None: the default); ``received``: the
        ``perf_counter()`` at which the request arrived (None: now); ``tolerance``: the
        strategy's per-request tolerance (tabular adaptive strategies, structured anytime; None:
        the bundle's);
        ``budget_mode``: ``"cap"`` (None: the default) or ``"mean"`` (the budget an average,
        this item capped by ``max_cost`` or every sensor's cost; see :meth:`_mean_mode`);
        ``observe``: count it in the metrics and read the cache (not for the service's own
        start-up measurement)."""
        received = time.perf_counter() if received is None else received
        if not (isinstance(budget, float | int) and math.isfinite(budget) and budget > 0):
            raise InvalidRequest(f"'budget' must be a finite number > 0, got {budget!r}")
        accounting = self.default_accounting if accounting is None else accounting
        if accounting not in ACCOUNTINGS:
            raise InvalidRequest(
                f"'accounting' must be one of {list(ACCOUNTINGS)}, got {accounting!r}"
            )
        bundle = self.registry.get(model, version)
        runtime = bundle.strategy(strategy)
        if tolerance is not None:
            if not (isinstance(tolerance, float | int) and 0 <= tolerance <= 1):
                raise InvalidRequest(f"'tolerance' must be a number in [0, 1], got {tolerance!r}")
            try:
                runtime = runtime.with_options(tolerance=float(tolerance))
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
        measured = bundle.manifest.cost_basis == "measured"
        mean = self._mean_mode(bundle, runtime, budget, budget_mode, max_cost)
        if mean:
            runtime = runtime.with_options(mean_budget=float(budget))
        if measured and budget > self.limits.max_budget_ms:
            raise BudgetTooLarge(float(budget), self.limits.max_budget_ms)
        # Only a budget in milliseconds can count from the receipt.
        deadline = measured and accounting == "deadline"
        if deadline:
            self._admit_by_deadline(budget, received, bundle, size, item)
        decode_start = time.perf_counter()
        due = received + budget / 1e3 if measured else math.inf  # for the order of waiters
        if bundle.decoder.heavy(item):
            decoded = await self._in_thread(lambda: bundle.decoder.decode(item), due)
        else:
            decoded = bundle.decoder.decode(item)
        decode_s = time.perf_counter() - decode_start
        if size is not None and size != decoded.size:
            raise SizeMismatch(size, decoded.size)
        # The hard cap of this item's spend: the budget, or with a mean budget max_cost (else
        # every sensor's cost: nothing can cost more).
        cap = float(budget)
        if mean:
            every = sum(bundle.costs.at(decoded.size).values())
            cap = float(max_cost) if max_cost is not None else every
            runtime = runtime.with_options(mean_draw=uniform_of(decoded.key))
        nbytes = int(getattr(decoded.data, "nbytes", 0))

        # ``spent`` counts from ``start``: the receipt (deadline), or the cache read (work:
        # the cache read, then the plan / extract / infer loop timed from its start).
        given = self._given(bundle, decoded)
        read_start = time.perf_counter()
        left_ms = budget - (read_start - received) * 1e3 if deadline else float(budget)
        cached: dict[str, FloatVector] = {}
        if observe:  # the start-up measurement of the floor reads no cache (see _read_cache)
            with tracing.span("cache.read"):
                cached = await self._read_cache(bundle, decoded, left_ms, skip=given.keys())
        cache_s = time.perf_counter() - read_start
        in_hand = {**cached, **given}
        reserve_ms = self.floor.reserve_ms() if measured else 0.0
        on_extraction = self._observe_extraction if observe else _unobserved
        on_inference = self._observe_inference if observe else _unobserved

        def start(now: float) -> float:
            """Where ``spent`` counts from, for work that starts ``now``."""
            return received if deadline else now - cache_s

        def work(cap_ms: float = math.inf, resume_ms: float = 0.0) -> tuple[float, Execution]:
            """Plan, extract and infer from now on; ``resume_ms``: what the way back to
            the event loop will take after this work (on a worker thread), set aside too."""
            started = time.perf_counter()
            # Others waiting for a thread: plan within a share of their time, not all of ours.
            left = budget - reserve_ms - resume_ms - (started - start(started)) * 1e3
            share = min(self._share_ms(started), cap_ms)
            # Plans running now, this one among them, share the CPUs and the GIL: each gets
            # its part of the time (with 2 threads, at 430 and 550 requests/s in the open
            # loop, answers within budget + 1 ms went from 93-94 % to 95-97 %).
            busy = self.gate.threads - self.gate.free
            if busy > 1:
                share = min(share, left / busy)
            if self._standing:
                # Behind a standing queue each millisecond a plan spends is taken from every
                # request queued behind it: it buys the cheapest answer's worth (twice the
                # cheapest feature it lacks, at most half of what is left), which is most of
                # the accuracy (the prior to one feature) for a small part of the time.
                share = min(share, left / 2.0, 2.0 * cheapest)
            if deadline:  # the others in the process wait while this plan runs
                contended = contended_share(
                    left, self.others_seen, self.contention_weight, cheapest
                )
                share = min(share, contended)
            # The share caps the plan from when it begins (the few tens of microseconds
            # until then are not taken from it: behind a standing queue, twice a 0.012 ms
            # thumbnail was spent before the plan began, and the request got the prior).
            return started, execute(
                bundle,
                decoded,
                cap,
                in_hand,
                start(started),
                reserve_ms=reserve_ms + resume_ms,  # both 0 unless measured
                cap_ms=share if measured and share < left else math.inf,
                runtime=runtime,
                on_extraction=on_extraction,
                on_inference=on_inference,
            )

        # What the cheapest feature not in hand would cost, and how long this request may
        # wait for a thread: with no feature it could pay for, it does not wait at all.
        queued_at = time.perf_counter()
        resume_ms = self.floor.resume_ms() if deadline else 0.0
        resume_s: float | None = None
        inline = affordable = False
        wait_limit: float | None = None
        cheapest = math.inf
        if measured:
            missing = [c for f, c in bundle.costs.at(decoded.size).items() if f not in in_hand]
            cheapest = min(missing, default=math.inf)
            left_ms = budget - reserve_ms
            if deadline:
                left_ms -= (queued_at - received) * 1e3
            # Under a deadline, wait only while what would be left could still pay for a
            # plan on this loop (``inline_ms``, or the cheapest feature if dearer): a wait
            # that ran until only the cheapest feature was left answered from the prior
            # whenever the loop resumed it late. (In the open loop at 660 requests/s, 10
            # rounds each: prior answers 8.8 % → 6.7 %, within the rounds' noise.)
            keep_ms = max(cheapest, min(self.inline_ms, left_ms))
            wait_limit = (left_ms - keep_ms) / 1e3 if deadline else budget / 1e3
            affordable = left_ms >= cheapest
            # Small plans run on this loop; so do all plans, made small, behind a standing
            # queue (a thread's answer would wait for the congested loop to take it back).
            # So do plans whose way back from a thread would leave no feature affordable,
            # and, in a process that arrivals find empty (``ALONE_SEEN``), with a
            # budget of a few ms (``SMALL_PLAN_BUDGETS``), plans the strategy predicts to
            # cost at most ``inline_ms``: the hand-off to a thread and back costs more CPU
            # than such a plan (one client, 128 px, the same `thumbnail` answers: 1.04-1.12
            # ms of CPU each through a thread, 0.80 on the loop; at a 5 ms budget, the same
            # plan: p50 1.36 -> 1.16-1.20 ms, CPU 1.51 -> 1.38-1.49 ms).
            inline = affordable and (
                left_ms <= self.inline_ms
                or (self.inline_ms > 0 and (self._standing or left_ms - resume_ms < cheapest))
            )
            if inline and left_ms > self.inline_ms:
                self.metrics.admission.labels(result="inline_behind").inc()
            alone = self._in_process <= 1 and self.others_seen < ALONE_SEEN
            tight = left_ms <= SMALL_PLAN_BUDGETS * self.inline_ms
            if affordable and not inline and tight and alone:
                planned = runtime.planned_ms(decoded.size, left_ms, frozenset(in_hand))
                inline = planned is not None and planned <= self.inline_ms
        else:  # a budget that is not time: wait at most max_wait_s, then answer from what it has
            wait_limit = self.limits.max_wait_s
        queued_s = 0.0
        if measured and not affordable:
            # Answer from what is in hand, on this loop: with a budget of 0 the strategy's
            # fallback answers from the features in hand (with every feature in hand the
            # strategy answers within the real budget: it has nothing left to acquire).
            started = time.perf_counter()
            hand_budget = budget if cheapest == math.inf else 0.0
            run = self._from_hand(
                bundle, decoded, hand_budget, in_hand, runtime, start(started), on_inference
            )
        elif inline:
            started, run = work(cap_ms=self.inline_ms)
        elif await self._acquire(wait_limit, nbytes, due) is None:
            # No thread in time: a small plan on this loop if one is still affordable (a
            # cheap feature beats the prior), else the answer from what is in hand.
            started = time.perf_counter()
            queued_s = started - queued_at
            left_ms = budget - reserve_ms - (started - start(started)) * 1e3
            if measured and left_ms >= cheapest:
                started, run = work(cap_ms=self.inline_ms)
            else:
                run = self._from_hand(
                    bundle, decoded, 0.0, in_hand, runtime, start(started), on_inference
                )
        else:
            finished: list[float] = []

            def on_thread() -> tuple[float, Execution]:
                try:
                    return work(resume_ms=resume_ms)
                finally:
                    finished.append(time.perf_counter())

            try:
                started, run = await self._on_thread(on_thread)
            finally:
                self.held_bytes -= nbytes
                self.gate.release()
            resume_s = time.perf_counter() - finished[0]
            queued_s = started - queued_at
        response = self._response(
            bundle, runtime.name, cap, run, sorted(cached), sorted(given), queued_s
        )
        if bundle.manifest.task == "parsing" and response.decision is not None:
            # The tags the tree was parsed with: as sent, or as the bundle's tagger predicted.
            response.decision["upos"] = list(decoded.data.upos)
        if mean:
            response.cost.budget, response.cost.budget_mode, response.cost.cap = budget, "mean", cap
            shared = getattr(runtime, "shared", None)
            if shared is not None and shared.high is not None:
                response.cost.shared = SharedPoints(
                    share=shared.share, cheaper=shared.low.cost, dearer=shared.high.cost
                )
        # The answer is made now, on the event loop: under deadline accounting every
        # millisecond since the receipt is spent (the way back from a worker thread too).
        now = time.perf_counter()
        if deadline:
            response.cost.spent = max(run.spent, (now - received) * 1e3)
            response.deadline_exceeded = response.cost.spent > budget
        response.cost.accounting = "deadline" if deadline else "work"
        response.timings_ms.decode = decode_s * 1000.0
        response.timings_ms.since_received = (now - received) * 1000.0
        if measured:
            floor = self.floor.overhead_ms() + decode_s * 1000.0
            response.floor_ms = floor
            # below it the answer is from what was in hand (a p95 floor: a request may still
            # have bought a feature, and then it says so by what it extracted, not this flag)
            response.below_floor = budget < floor and not run.extracted
        response._clock = (received, started, decoded.size, resume_s)
        if observe:
            self._observe(response)
        writes = {
            feature_key(decoded.key, bundle.tags[name]): vec.tobytes()
            for name, vec in run.extracted.items()
        }
        return response, writes

    @staticmethod
    def _mean_mode(
        bundle: Bundle,
        runtime: StrategyRuntime[Any],
        budget: float,
        budget_mode: str | None,
        max_cost: float | None,
    ) -> bool:
        """Whether the request asks for a mean budget, checked (``InvalidRequest``, 422): only
        a strategy that chooses its point by validation numbers can keep an average (the
        tabular adaptive ones), only in a declared cost unit (a budget in ms is a deadline,
        which no average keeps), and ``max_cost`` only with it, at least the budget."""
        if budget_mode not in (None, "cap", "mean"):
            raise InvalidRequest(f"'budget_mode' must be 'cap' or 'mean', got {budget_mode!r}")
        if budget_mode != "mean":
            if max_cost is not None:
                raise InvalidRequest(
                    "'max_cost' caps an item under budget_mode 'mean'; with budget_mode 'cap' "
                    "(the default) the budget is the cap: send one of them"
                )
            return False
        if "mean_budget" not in runtime.request_options:
            raise InvalidRequest(
                f"budget_mode 'mean' needs a tabular adaptive strategy (dag, gating, cstc); "
                f"strategy {runtime.name!r} is of kind {runtime.kind!r}: send budget_mode 'cap' "
                "(the default)"
            )
        if bundle.manifest.cost_basis == "measured":
            raise InvalidRequest(
                f"budget_mode 'mean' needs declared costs; bundle {bundle.manifest.name!r} "
                "measures them in ms, where a budget is a deadline that no average keeps: send "
                "budget_mode 'cap' (the default)"
            )
        if max_cost is not None:
            if not (isinstance(max_cost, float | int) and math.isfinite(max_cost)):
                raise InvalidRequest(f"'max_cost' must be a finite number, got {max_cost!r}")
            if max_cost < budget:
                raise InvalidRequest(
                    f"'max_cost' ({max_cost:g}) is below the budget ({budget:g}): no item may "
                    "spend more than max_cost, so the average cannot reach the budget; send "
                    "max_cost >= budget"
                )
        return True

    def _share_ms(self, now: float) -> float:
        """What a request starting its work ``now`` may plan while others wait for a thread
        (ms; infinite when none waits): an equal share, among the waiters and the threads,
        of the time the most urgent waiter has left before its deadline (less the service's
        overhead). So under load each plan gets cheaper, and the queue drains before the
        deadlines in it pass, instead of the first requests buying rich plans and the ones
        behind them answering from the prior."""
        deadlines = self.gate.waiting_deadlines()
        if not deadlines:
            return math.inf
        slack = (min(deadlines) - now) * 1e3 - self.floor.overhead_ms()
        threads = self.gate.threads
        return max(slack, 0.0) * threads / (len(deadlines) + threads)

    def _admit_by_deadline(
        self,
        budget: float,
        received: float,
        bundle: Bundle,
        size: int | None,
        item: Any = None,
    ) -> None:
        """Refuse (503, before any work) a request whose deadline can no longer buy an answer
        while this process has a standing queue, CoDel-style: what is left of its budget
        cannot pay for the reserve of the work after planning plus the cheapest answer from
        a feature (decoding and the cheapest feature, :meth:`_cheapest_answer_ms`), though
        its whole budget could; and at least ``STANDING_SHARE`` of the requests (more than
        one) over the last ``QUEUE_INTERVAL_S`` reached the service later than
        ``QUEUE_TARGET_MS`` (they wait for the event loop: the process is behind, and
        answering them would keep it behind), or of the current interval's once it has seen
        ``QUEUE_EARLY_SEEN``. Answered instead, such a request came from the
        prior at the cost of its decoding and answer, the CPU the requests behind it needed:
        in the open loop at 150 % of capacity, 75-83 % of the answers were the prior. In a
        burst, such a request is answered at once from what it has. A budget that could not
        buy a feature from the start is refused only when it cannot pay even the reserve,
        and one below the overhead is never refused: it is answered, and says so
        (``below_floor``). The item's size is the request's ``size``, else what its decoder
        reads from the item's header (``size_hint``: a PNG's IHDR), else unknown."""
        now = time.perf_counter()
        late_ms = (now - received) * 1e3  # the receipt is dated back by the loop's lag
        late = late_ms > QUEUE_TARGET_MS
        if now - self._interval_start > QUEUE_INTERVAL_S:
            # One request alone in an interval shows no queue (a sparse client, a fresh
            # process's cold first request, whose lateness is its own slow path): without
            # this a single client's next requests were planned within 1 ms and a small
            # budget was refused, on an idle server.
            seen = self._interval_seen
            self._standing = seen > 1 and self._interval_late >= STANDING_SHARE * seen
            self._interval_start, self._interval_seen, self._interval_late = now, 1, int(late)
        else:
            self._interval_seen += 1
            self._interval_late += late
            if (
                not self._standing
                and self._interval_seen >= QUEUE_EARLY_SEEN
                and self._interval_late >= STANDING_SHARE * self._interval_seen
            ):
                self._standing = True
        if not self._standing or budget < self.floor.overhead_ms():
            return
        if size is None:
            size = bundle.decoder.size_hint(item)
        need = self.floor.reserve_ms()
        useful = need + self._cheapest_answer_ms(bundle, size)
        if budget >= useful:
            need = useful
        if late_ms + need <= budget:
            return
        self.metrics.admission.labels(result="deadline").inc()
        raise Overloaded(
            f"the request reached the service's work {late_ms:.1f} ms after its receipt, "
            f"behind a standing queue; what is left of its {budget:g} ms budget cannot pay "
            f"for the {need:.2f} ms an answer takes: retry (or send a larger budget)",
            RETRY_AFTER_S,
            late_ms=round(late_ms, 3),
            reserve_ms=round(need, 3),
        )

    def _cheapest_answer_ms(self, bundle: Bundle, size: int | None) -> float:
        """What the cheapest answer from a feature costs beyond the reserve: decoding the
        item and its cheapest feature, at ``size`` (the request's or its header's; unknown:
        the smallest item, so only a request that no item could serve is refused)."""
        at = 1 if size is None else size
        decode = self.floor.decode_ms(bundle.name, at) or 0.0
        return decode + min(bundle.costs.at(at).values(), default=0.0)

    def _from_hand(
        self,
        bundle: Bundle,
        decoded: DecodedItem,
        budget: float,
        in_hand: dict[str, FloatVector],
        runtime: StrategyRuntime,
        start: float,
        on_inference: Callable[[str, float], None],
    ) -> Execution:
        """The strategy's answer from the features in hand, on the event loop."""
        return execute(
            bundle,
            decoded,
            budget,
            in_hand,
            start,
            runtime=runtime,
            on_inference=on_inference,
        )

    def encode(self, response: PredictResponse) -> bytes:
        """The response's JSON, encoded once."""
        return response.__pydantic_serializer__.to_json(response)

    def answered(
        self, response: PredictResponse, written_at: float, seen: float | None = None
    ) -> None:
        """The response was written at ``written_at`` (a ``perf_counter()``): record what
        the service itself cost it (``service.floor``). ``seen``: when the app's task first
        ran for it (the wait before, for the event loop, is load, not the service's own
        cost; the receipt when not given)."""
        clock = response._clock
        if clock is None or response.cost.unit != "ms":
            return
        received, started, size, resume_s = clock
        t = response.timings_ms
        resume_ms = 0.0 if resume_s is None else resume_s * 1e3
        self.floor.record(
            response.model,
            size,
            overhead_ms=(written_at - (received if seen is None else seen)) * 1e3
            - t.decode
            - t.extraction
            - t.inference
            - t.queued
            - resume_ms,
            tail_ms=(written_at - started) * 1e3 - t.extraction - resume_ms,
            decode_ms=t.decode,
            resume_ms=None if resume_s is None else resume_ms,
        )

    async def write_back(self, writes: Mapping[str, bytes]) -> None:
        """Store freshly computed features; a failing cache is counted, never raised."""
        if not writes:
            return
        try:
            await self.cache.put_many(writes)
        except CacheBypassed:
            self.metrics.cache.labels(result="bypass").inc()
        except CacheUnavailable as exc:  # counted by the cache as it failed
            log.warning("feature cache write failed: %s", exc)

    @staticmethod
    def _given(bundle: Bundle, item: DecodedItem) -> dict[str, FloatVector]:
        """The sensors whose values the request sent (tabular items): in hand, free."""
        if bundle.manifest.item.kind != "tabular":
            return {}
        given: dict[str, FloatVector] = {}
        for name, extractor in bundle.extractors.items():
            columns = getattr(extractor, "columns", None)
            if columns:
                vector = given_vector(columns, item.data)
                if vector is not None:
                    given[name] = vector
        return given

    async def _read_cache(
        self,
        bundle: Bundle,
        item: DecodedItem,
        budget: float,
        skip: Collection[str] = (),
    ) -> dict[str, FloatVector]:
        """The features of ``item`` in the cache, counted in the cache metrics. Only client
        requests read it: the service's start-up measurement of its floor does not (a dead
        or slow Redis would slow the start-up and trip its circuit before any client asked
        anything, and no client reads its blank items' features)."""
        names = [n for n in bundle.extractors if n not in skip]
        if not names:
            return {}
        keys = [feature_key(item.key, bundle.tags[n]) for n in names]
        # A read may take a share of a budget in milliseconds; budgets in other units get the
        # cache's own timeout.
        timeout = (
            CACHE_READ_SHARE * budget / 1e3 if bundle.manifest.cost_basis == "measured" else None
        )
        try:
            values = await self.cache.get_many(keys, timeout_s=timeout)
        except CacheBypassed:
            self.metrics.cache.labels(result="bypass").inc()
            return {}
        except CacheDeadline as exc:
            # The request's own share of its budget ran out: not a cache failure.
            self.metrics.cache.labels(result="skipped" if exc.skipped else "deadline").inc()
            return {}
        except CacheUnavailable as exc:  # counted by the cache as it failed
            log.warning("feature cache read failed, going on uncached: %s", exc)
            return {}
        found: dict[str, FloatVector] = {}
        for name, raw in zip(names, values, strict=True):
            dims = bundle.extractors[name].dims
            if raw is not None and len(raw) == 4 * dims:
                found[name] = np.frombuffer(raw, dtype=np.float32)
        hits = len(found)
        self.metrics.child(self.metrics.cache, result="hit").inc(hits)
        self.metrics.child(self.metrics.cache, result="miss").inc(len(names) - hits)
        return found

    @staticmethod
    def _response(
        bundle: Bundle,
        strategy: str,
        budget: float,
        run: Execution,
        cached: list[str],
        given: list[str],
        queued_s: float,
    ) -> PredictResponse:
        manifest = bundle.manifest
        labels = manifest.classes
        probs = run.probabilities
        if manifest.task == "parsing":
            # A tree, not a class: the heads (CoNLL-U HEAD column) as the prediction; each
            # token's head, score and template are in ``decision``.
            prediction = " ".join(str(int(h)) for h in probs.tolist())
            probabilities: dict[str, float] = {}
            features = sorted(run.extracted)
            accuracy = run.expected_accuracy or 0.0
        else:
            answer = manifest.model(run.answer)
            prediction = labels[int(np.argmax(probs))] if run.prediction is None else run.prediction
            probabilities = {c: float(p) for c, p in zip(labels, probs.tolist(), strict=True)}
            features = list(answer.features)
            accuracy = answer.accuracy if run.expected_accuracy is None else run.expected_accuracy
        return PredictResponse(
            model=manifest.name,
            prediction=prediction,
            probabilities=probabilities,
            features=features,
            expected_accuracy=accuracy,
            strategy=strategy,
            model_version=manifest.version,
            version=bundle.label or manifest.version,
            answered_by=run.answer,
            path=run.path,
            decision=run.report,
            deadline_exceeded=run.over_budget(budget),
            next_sensor=run.next_feature,
            unavailable=run.unavailable,
            cost=CostReport(
                unit=manifest.cost_unit,
                budget=float(budget),
                planned=run.planned,
                spent=run.spent,
                charged=run.charged,
                cached=cached,
                given=given,
                extracted=list(run.extracted),
            ),
            timings_ms=Timings(
                extraction=sum(run.extraction_ms.values()),
                inference=run.inference_ms,
                queued=queued_s * 1000.0,
            ),
        )

    def _observe_extraction(self, name: str, seconds: float) -> None:
        self.metrics.child(self.metrics.extraction, extractor=name).observe(seconds)
        tracing.extraction(name, seconds)

    def _observe_inference(self, bundle: str, seconds: float) -> None:
        self.metrics.child(self.metrics.inference, model=bundle).observe(seconds)
        tracing.record("inference", seconds, model=bundle)

    def _observe(self, response: PredictResponse) -> None:
        m = self.metrics
        cost = response.cost
        m.observe_cost(response.model, cost.unit, cost.spent, cost.budget)
        if response.deadline_exceeded:
            m.child(m.budget_exceeded, model=response.model).inc()
        for sensor in response.unavailable:
            m.sensor_unavailable.labels(model=response.model, sensor=sensor).inc()
