"""Batches under one budget: share a total budget across the items of a batch.

Paper 002 plans one request under its own budget and leaves a page of items under one budget
to future work. Here a batch of items of one bundle shares ``total`` (in the bundle's cost
unit), planned in two layers:

* :func:`item_options` gives, per item, what each affordable budget buys: the strategy's
  skyline at the item's size, with the features already in hand (sent, cached, or computed
  earlier in the batch for an identical item) free, plus the best model computable from
  them at cost 0. Costs are the strategy's predicted ones (calibrated when calibration is
  in force); accuracies are the models' held-out estimates.
* :func:`allocate` spends ``total`` where the marginal accuracy per cost is highest: every
  item starts at its cheapest option, then the steepest step of the items' upper concave
  hulls is bought while it fits (so cheap upgrades come first), and finally any other
  upgrade that still fits. This is the greedy of the multiple-choice knapsack: its summed
  accuracy is at least the optimum minus the largest single step (checked against brute
  force in ``tests/service/test_batch.py``).
* :func:`run_batch` runs the items one at a time, cheapest allotment first. Before each
  item it re-plans the items left with what is left of ``total`` (so what an item did not
  spend flows to the next ones, and an overrun is taken from them), and gives the item its
  allotment and a share of what the allotments leave (at most its allotment again), never
  more than what is left. A strategy that overruns a budget by at most
  one extraction's misprediction therefore overruns ``total`` by at most the largest such
  misprediction over the batch (an item whose allotment is 0 extracts nothing).

Memory: items are decoded one at a time up front (a bad item fails the batch before anything
is spent), and only what the plan needs of each is kept (its size, cache key and the sensors
it sent), never its pixels: the batch holds at most one decoded item outside the predict
handler, whose admission counts each item's decoded bytes (``BUDGETSERVE_MAX_QUEUED_BYTES``)
as it does a single request's. A budget per item is capped like a total: ``budget`` times the
number of items may not pass ``BUDGETSERVE_MAX_BUDGET_MS`` (measured costs).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from service.cache import CacheBypassed, CacheDeadline, CacheUnavailable, feature_key
from service.errors import BatchBudgetTooLarge, BudgetServeError, BudgetTooLarge, InvalidRequest
from service.handler import PredictHandler
from service.registry import Bundle
from service.schemas import PredictResponse
from service.strategies.base import StrategyRuntime, pareto

#: Most items one batch may hold.
MAX_BATCH_ITEMS = 128


@dataclass(frozen=True, slots=True)
class Option:
    """What one item may buy: ``cost`` (predicted, in the bundle's unit) for ``accuracy``."""

    cost: float
    accuracy: float


def item_options(
    runtime: StrategyRuntime,
    size: int,
    in_hand: Collection[str],
    overhead: float = 0.0,
) -> list[Option]:
    """The options of one item of ``size`` under ``runtime``: cost-sorted, accuracy strictly
    rising, the first at cost ``overhead`` (the best model computable from ``in_hand``).

    A skyline entry's cost is its predicted cost less the predicted cost of its features in
    hand (exact for model entries; for entries whose cost is an expectation, e.g. a gating
    point, a lower bound floored at 0). ``overhead`` (the per-request reserve of bundles with
    measured costs) is added to every option."""
    per_feature = runtime.costs.at(size)
    hand = set(in_hand)
    points: list[tuple[float, float, str]] = []
    try:
        best = runtime.best_computable(hand)
        points.append((0.0, runtime.accuracy[best], best))
    except LookupError:
        pass
    for cost, accuracy, entry in runtime.skyline(size):
        saved = sum(per_feature.get(f, 0.0) for f in runtime.skyline_features(entry) if f in hand)
        points.append((max(cost - saved, 0.0), accuracy, entry))
    return [Option(cost + overhead, acc) for cost, acc, _ in pareto(points)]


def _hull(options: Sequence[Option]) -> list[int]:
    """Indices of the upper concave hull of ``options`` (cost-sorted, accuracy rising),
    from the first option: along it, accuracy per cost falls step by step."""
    hull: list[int] = []
    for i, option in enumerate(options):
        while len(hull) >= 2:
            a, b = options[hull[-2]], options[hull[-1]]
            # b lies on or under the segment a → option: drop it
            if (b.accuracy - a.accuracy) * (option.cost - a.cost) <= (
                option.accuracy - a.accuracy
            ) * (b.cost - a.cost):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def _slope(lo: Option, hi: Option) -> float:
    gain = hi.accuracy - lo.accuracy
    step = hi.cost - lo.cost
    return float("inf") if step <= 0 else gain / step


def allocate(options: Sequence[Sequence[Option]], total: float) -> list[int]:
    """The option chosen for each item (an index into its ``options``) within ``total``.

    Every item starts at its cheapest option (if those alone exceed ``total``, that is the
    answer). Then, steepest first, each item's next hull step is bought while it fits;
    a step that does not fit ends that item's climb along its hull. Last, the leftover buys,
    item by item in order of accuracy gained, the most accurate option that fits."""
    chosen = [0] * len(options)
    spent = sum(opts[0].cost for opts in options)
    hulls = [_hull(opts) for opts in options]
    position = [0] * len(options)  # index into the item's hull
    heap: list[tuple[float, int]] = []
    for i, hull in enumerate(hulls):
        if len(hull) > 1:
            heapq.heappush(heap, (-_slope(options[i][hull[0]], options[i][hull[1]]), i))
    while heap:
        _, i = heapq.heappop(heap)
        opts, hull = options[i], hulls[i]
        current, nxt = opts[hull[position[i]]], opts[hull[position[i] + 1]]
        extra = nxt.cost - current.cost
        if spent + extra > total:
            continue
        spent += extra
        position[i] += 1
        chosen[i] = hull[position[i]]
        if position[i] + 1 < len(hull):
            following = opts[hull[position[i] + 1]]
            heapq.heappush(heap, (-_slope(nxt, following), i))
    # Fill: what is left may still buy an option off the hull (or past a step that did not
    # fit); take the largest gains first.
    improved = True
    while improved:
        improved = False
        best: tuple[float, int, int] | None = None
        for i, opts in enumerate(options):
            here = opts[chosen[i]]
            for j in range(chosen[i] + 1, len(opts)):
                if spent + opts[j].cost - here.cost <= total:
                    gain = opts[j].accuracy - here.accuracy
                    if best is None or gain > best[0]:
                        best = (gain, i, j)
        if best is not None and best[0] > 0:
            _, i, j = best
            spent += options[i][j].cost - options[i][chosen[i]].cost
            chosen[i] = j
            improved = True
    return chosen


def planned_accuracy(options: Sequence[Sequence[Option]], chosen: Sequence[int]) -> float:
    """Summed accuracy of a choice (one option per item)."""
    return sum(opts[c].accuracy for opts, c in zip(options, chosen, strict=True))


@dataclass(frozen=True)
class BatchPlan:
    """What :func:`run_batch` did: per item, the budget it was given, what it spent and the
    cost of the option planned for it when it ran; in the items' order."""

    budgets: list[float]
    spent: list[float]
    planned: list[float]
    order: list[int]

    @property
    def total_spent(self) -> float:
        return sum(self.spent)


def _no_overhead() -> float:
    return 0.0


async def run_batch(
    options: Callable[[int], Sequence[Option]],
    n_items: int,
    total: float,
    run_item: Callable[[int, float], Awaitable[float]],
    overhead: Callable[[], float] = _no_overhead,
) -> BatchPlan:
    """Run ``n_items`` items under ``total``: re-plan the items left before each one, run the
    one with the smallest allotment (``run_item(index, budget)`` returns what it spent),
    with its share of the slack (the module).

    ``options(i)`` is asked again at each re-plan, so it may change as the batch goes (an
    item identical to one already run gets that item's features free). ``overhead()`` is
    added to every option at each re-plan: what an item costs beyond its extractions, as
    measured so far (see :class:`OverheadTracker`)."""
    budgets = [0.0] * n_items
    spent = [0.0] * n_items
    planned = [0.0] * n_items
    order: list[int] = []
    left_items = list(range(n_items))
    used = 0.0
    while left_items:
        extra = overhead()
        opts = [[Option(o.cost + extra, o.accuracy) for o in options(i)] for i in left_items]
        left = max(total - used, 0.0)
        chosen = allocate(opts, left)
        # What the allotments leave of the total, shared out evenly, up to the item's own
        # allotment again: an item's predicted costs leave out the time it plans before its
        # first feature, and an allotment cut to the cost of its option bought the option
        # below it (docs/benchmarks/batch.md, measured: 0.92 against the even split's 0.95
        # at 8 ms per item); with the whole slack the last items bought dear features for
        # nothing (3.97 ms an item against 1.32).
        slack = max(left - sum(o[c].cost for o, c in zip(opts, chosen, strict=True)), 0.0)
        k = min(range(len(left_items)), key=lambda k: (opts[k][chosen[k]].cost, left_items[k]))
        i = left_items.pop(k)
        planned[i] = opts[k][chosen[k]].cost
        budgets[i] = min(planned[i] + min(slack / len(opts), planned[i]), left)
        spent[i] = await run_item(i, budgets[i])
        used += spent[i]
        order.append(i)
    return BatchPlan(budgets=budgets, spent=spent, planned=planned, order=order)


class OverheadTracker:
    """What the items of a batch spent beyond their extractions (planning, inference, cache
    read: measured costs only), at least ``floor``: the median of those seen so far (a
    single item stalled by the machine does not make every later item look expensive). An
    overhead the plan did not foresee would otherwise come out of the items after it."""

    def __init__(self, floor: float) -> None:
        self.floor = floor
        self.seen: list[float] = []

    def record(self, spent: float, charged: float) -> None:
        bisect.insort(self.seen, spent - charged)

    def __call__(self) -> float:
        if not self.seen:
            return self.floor
        mid = len(self.seen) // 2
        median = self.seen[mid] if len(self.seen) % 2 else (self.seen[mid - 1] + self.seen[mid]) / 2
        return max(self.floor, median)


# --- the batch request, on the predict handler -------------------------------------------

#: Budget given to an item whose allotment is 0: it answers from the features in hand (the
#: handler refuses budgets <= 0).
EMPTY_BUDGET = 1e-6


@dataclass
class BatchOutcome:
    """The responses of a batch in the items' order, with the plan (``total`` mode)."""

    responses: list[PredictResponse]
    plan: BatchPlan | None


async def predict_batch(
    handler: PredictHandler,
    model: str,
    items: Sequence[Any],
    strategy: str | None,
    *,
    budget: float | None = None,
    total_budget: float | None = None,
    version: str | None = None,
    tolerance: float | None = None,
    budget_mode: str | None = None,
    max_cost: float | None = None,
) -> BatchOutcome:
    """Answer ``items`` of ``model``: each with ``budget``, or all of them under
    ``total_budget`` (see the module). Items run one after the other; each is an ordinary
    prediction (``PredictHandler.predict``), whose features are written to the cache before
    the next item runs, so an identical item later in the batch gets them free. Every item
    runs on ``version`` of ``model`` (its newest if None), with ``tolerance`` (each item's, as
    for one request). ``budget_mode`` and ``max_cost``
    go with ``budget``: each item's, as for one request (a mean budget then holds on average
    over the items)."""
    if (budget is None) == (total_budget is None):
        raise InvalidRequest("send exactly one of 'budget' (each item's) and 'total_budget'")
    if total_budget is not None and (budget_mode is not None or max_cost is not None):
        raise InvalidRequest(
            "'budget_mode' and 'max_cost' go with 'budget' (each item's); a 'total_budget' is "
            "already shared over the batch's items: send one of them"
        )
    if not items:
        raise InvalidRequest("'items' is empty; send at least one item")
    if len(items) > MAX_BATCH_ITEMS:
        raise InvalidRequest(
            f"'items' holds {len(items)} items; a batch may hold at most {MAX_BATCH_ITEMS}: "
            "split it",
            items=len(items),
            max_items=MAX_BATCH_ITEMS,
        )
    responses: list[PredictResponse | None] = [None] * len(items)

    async def run(i: int, item_budget: float) -> float:
        # Work accounting: the batch's own plan keeps its total (it measures what each item
        # spent); counted from each call, deadline accounting would also charge the item's
        # decoding, which the plan's allotments do not foresee.
        response, item_writes = await handler.predict(
            model,
            items[i],
            None,
            max(item_budget, EMPTY_BUDGET),
            strategy,
            version=version,
            accounting="work",
            tolerance=tolerance,
            budget_mode=budget_mode,
            max_cost=max_cost,
        )
        await handler.write_back(item_writes)
        responses[i] = response
        return response.cost.spent

    bundle = handler.registry.get(model, version)
    bundle.strategy(strategy)  # an unknown strategy fails before anything is decoded
    measured = bundle.manifest.cost_basis == "measured"
    if budget is not None and measured and budget * len(items) > handler.limits.max_budget_ms:
        # Each item's budget is the batch's too: together they may not pass the cap.
        raise BatchBudgetTooLarge(float(budget), len(items), handler.limits.max_budget_ms)
    decoded = await _decode_all(handler, bundle, items)
    plan: BatchPlan | None = None
    if budget is not None:
        for i in range(len(items)):
            await run(i, budget)
    else:
        assert total_budget is not None
        charged: dict[int, dict[str, float]] = {}

        async def run_charged(i: int, item_budget: float) -> float:
            spent = await run(i, item_budget)
            response = responses[i]
            assert response is not None
            charged[i] = response.cost.charged
            return spent

        plan = await _run_total(
            handler, bundle, decoded, strategy, total_budget, run_charged, charged
        )
    done = [r for r in responses if r is not None]
    assert len(done) == len(items)
    return BatchOutcome(responses=done, plan=plan)


async def _run_total(
    handler: PredictHandler,
    bundle: Bundle,
    decoded: Sequence[Planned],
    strategy: str | None,
    total: float,
    run: Callable[[int, float], Awaitable[float]],
    charged: Mapping[int, Mapping[str, float]],
) -> BatchPlan:
    if not (isinstance(total, float | int) and math.isfinite(total) and total > 0):
        raise InvalidRequest(f"'total_budget' must be a finite number > 0, got {total!r}")
    runtime = bundle.strategy(strategy)
    measured = bundle.manifest.cost_basis == "measured"
    if measured and total > handler.limits.max_budget_ms:
        raise BudgetTooLarge(float(total), handler.limits.max_budget_ms)
    in_hand = [set(d.given) for d in decoded]
    for names, found in zip(in_hand, await _cached(handler, bundle, decoded), strict=True):
        names.update(found)
    overhead = OverheadTracker(handler.reserve_ms if measured else 0.0)
    memo: dict[int, list[Option]] = {}

    def options(i: int) -> list[Option]:
        if i not in memo:
            memo[i] = item_options(runtime, decoded[i].size, in_hand[i])
        return memo[i]

    async def run_shared(i: int, item_budget: float) -> float:
        spent = await run(i, item_budget)
        if measured:
            overhead.record(spent, sum(charged[i].values()))
        # Identical items later in the batch now have this item's features (cache written).
        for j, d in enumerate(decoded):
            if j != i and d.key == decoded[i].key:
                in_hand[j].update(in_hand[i], charged[i])
                memo.pop(j, None)
        return spent

    return await run_batch(options, len(decoded), float(total), run_shared, overhead)


@dataclass(frozen=True, slots=True)
class Planned:
    """What the batch plan needs of a decoded item: its size, cache key and the sensors its
    values hold (tabular), not the decoded data itself."""

    size: int
    key: str
    given: frozenset[str]


async def _decode_all(
    handler: PredictHandler, bundle: Bundle, items: Sequence[Any]
) -> list[Planned]:
    """Every item decoded, one at a time, so that a bad item fails the batch before anything
    is spent (its error names its index); of each, only what the plan needs is kept."""
    planned: list[Planned] = []
    for i, item in enumerate(items):
        try:
            if bundle.decoder.heavy(item):
                decoded = await handler._in_thread(partial(bundle.decoder.decode, item))
            else:
                decoded = bundle.decoder.decode(item)
        except BudgetServeError as exc:
            exc.details.setdefault("item", i)
            exc.message = f"items[{i}]: {exc.message}"
            raise
        given = frozenset(handler._given(bundle, decoded))
        planned.append(Planned(size=decoded.size, key=decoded.key, given=given))
        del decoded  # the next item's decoding must not find this one still held
    return planned


async def _cached(
    handler: PredictHandler, bundle: Bundle, items: Sequence[Planned]
) -> list[set[str]]:
    """Which features of each item the cache holds now (one read for the batch; a failing or
    bypassed cache holds nothing). For planning only: each item reads its own when it runs."""
    names = list(bundle.extractors)
    keys = [feature_key(d.key, bundle.tags[n]) for d in items for n in names]
    found: list[set[str]] = [set() for _ in items]
    if not keys:
        return found
    try:
        values = await handler.cache.get_many(keys, timeout_s=None)
    except (CacheBypassed, CacheDeadline, CacheUnavailable):
        return found
    for k, raw in enumerate(values):
        i, n = divmod(k, len(names))
        if raw is not None and len(raw) == 4 * bundle.extractors[names[n]].dims:
            found[i].add(names[n])
    return found
