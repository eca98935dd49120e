"""Bodies the predict handler returns (``PredictResponse`` with its ``CostReport`` and
``Timings``).

The HTTP-only bodies (the request, errors, readiness) are in ``service.http.schemas``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, PrivateAttr


class SharedPoints(BaseModel):
    """Two points shared out over the items so that their average cost is a mean budget."""

    share: float = Field(description="the share of items given the cheaper point")
    cheaper: float = Field(description="the cheaper point's average cost, in the cost unit")
    dearer: float = Field(description="the dearer point's average cost, in the cost unit")


class CostReport(BaseModel):
    """What the request cost, all in the bundle's cost unit ``unit`` (``ms`` for bundles
    with measured costs, e.g. ``units`` for tabular bundles with declared sensor costs)."""

    unit: str = Field(description="the unit of budget, planned, spent and charged")
    budget: float = Field(description="the request's budget, in `unit`")
    planned: float = Field(description="predicted cost of the plan made at the start, in `unit`")
    spent: float = Field(
        description="cost spent, in `unit`: for bundles with measured costs (unit ms), the time "
        "since the request was received (`accounting` 'deadline') or of the work done for it "
        "(`accounting` 'work'); otherwise the declared cost of the features acquired"
    )
    accounting: Literal["deadline", "work"] = Field(
        default="work",
        description="how `spent` was counted: 'deadline' from the request's receipt (reading, "
        "decoding, cache and the wait for a thread charged), 'work' only the work done for it "
        "(always 'work' for bundles with declared costs)",
    )
    charged: dict[str, float] = Field(
        default_factory=dict,
        description="what each feature acquired for this request was charged, in `unit`, in "
        "acquisition order",
    )
    cached: list[str] = Field(description="features served from the cache (free)")
    given: list[str] = Field(
        default_factory=list,
        description="sensors whose values the request sent (tabular bundles; free)",
    )
    extracted: list[str] = Field(
        description="features computed or acquired for this request, in order"
    )
    budget_mode: Literal["cap", "mean"] = Field(
        default="cap",
        description="'cap': `budget` capped this item's spend; 'mean': `budget` is the average "
        "spend asked for, and this item's spend was capped by `cap`",
    )
    cap: float | None = Field(
        default=None,
        description="with budget_mode 'mean': the most this item could spend, in `unit` (the "
        "request's max_cost, else the cost of every sensor)",
    )
    shared: SharedPoints | None = Field(
        default=None,
        description="with budget_mode 'mean', when the budget is kept by two points shared out "
        "over the items: which share gets the cheaper one, and their average costs (this item "
        "got the one whose cost `planned` shows)",
    )


class Timings(BaseModel):
    """Where the request's time went, always in milliseconds whatever the cost unit."""

    extraction: float = Field(description="milliseconds spent extracting or acquiring features")
    inference: float = Field(description="milliseconds spent in model inference")
    queued: float = Field(
        description="milliseconds waiting for a worker thread (charged to the budget with "
        "`cost.accounting` 'deadline', not with 'work')"
    )
    decode: float = Field(default=0.0, description="milliseconds decoding and validating the item")
    since_received: float | None = Field(
        default=None,
        description="milliseconds from the request's receipt by the app to its answer (before "
        "the response is serialized): reading the body, decoding, cache, waiting and work",
    )


class PredictResponse(BaseModel):
    model: str
    prediction: str
    probabilities: dict[str, float]
    features: list[str] = Field(description="features the answering model used")
    expected_accuracy: float
    strategy: str = Field(description="name of the strategy that planned the request")
    model_version: str = Field(description="the version its manifest gives")
    version: str | None = Field(
        default=None,
        description="the version label that answered: its version folder's name "
        "(models/<name>/<version>/), or the manifest's version in the flat layout; a request "
        "naming a version gets that one",
    )
    answered_by: str = Field(description="id of the model that answered")
    path: list[list[str]] | None = Field(
        default=None, description="states visited (features acquired) by graph strategies"
    )
    decision: dict[str, Any] | None = Field(
        default=None,
        description="the strategy's account of its decisions, for strategies that give one "
        "(null otherwise). Gating: {'kind': 'gating', 'point': operating point id, 'method': "
        "how it was trained, 'score': the gate's score or null when no gate ran, "
        "'sent_to_high': the gate sent the item to the high-cost model, 'answered_by': "
        "'low' | 'high' | 'fallback' (a model computable from the features in hand, when the "
        "budget ran out before the gate could run)}",
    )
    deadline_exceeded: bool = Field(
        description="the cost spent passed the budget (extraction stopped as soon as it did); "
        "under deadline accounting, counted from the receipt to the moment the answer was "
        "made"
    )
    floor_ms: float | None = Field(
        default=None,
        description="the service's own cost for this item, in ms: its measured overhead "
        "(parsing, cache, planning, encoding, writing: p95 on this machine) plus this item's "
        "decoding. A budget below it buys no feature as a rule (a p95: a request whose own "
        "overhead was short may still buy one). Null for bundles with declared costs",
    )
    below_floor: bool = Field(
        default=False,
        description="the budget was below `floor_ms` and the answer comes from what was in "
        "hand (cached or sent features, else the prior): a larger budget is needed to buy "
        "features for this item",
    )
    next_sensor: str | None = Field(
        default=None,
        description="the sensor the strategy would acquire next but could not (not sent, and "
        "no acquirer had it): the answer is from the features in hand; collect this sensor's "
        "values and ask again. Null when nothing was missing",
    )
    unavailable: dict[str, str] = Field(
        default_factory=dict,
        description="sensor → why it could not be acquired (no acquirer configured, store "
        "down, no entry for the id, HTTP error or timeout)",
    )
    cost: CostReport
    timings_ms: Timings

    #: (receipt, start of the work as ``perf_counter()`` times, item size, seconds the event
    #: loop took to resume the request after its plan on a worker thread, None without one):
    #: what the handler measures the service's own cost from once the response is written.
    _clock: tuple[float, float, int, float | None] | None = PrivateAttr(default=None)


class BatchCost(BaseModel):
    """What a batch cost, in the bundle's cost unit ``unit``; each item's own report is in
    its result's ``cost``."""

    unit: str = Field(description="the unit of every cost of the batch")
    total_budget: float | None = Field(
        description="the batch's total budget (null when each item had 'budget')"
    )
    budget: float | None = Field(description="each item's budget (null under a total budget)")
    spent: float = Field(description="cost spent by all items together, in `unit`")
    order: list[int] = Field(description="the items' indices in the order they ran")


class BatchPredictResponse(BaseModel):
    model: str
    results: list[PredictResponse] = Field(description="one answer per item, in request order")
    cost: BatchCost
