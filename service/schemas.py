"""Bodies the predict handler returns (``PredictResponse`` with its ``CostReport``).

The HTTP-only bodies (the request, errors, readiness) are in ``service.http.schemas``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class CostReport(BaseModel):
    unit: str
    budget: float
    planned: float = Field(description="predicted cost of the features planned at the start")
    spent: float = Field(
        description="cost spent, in `unit`: the measured time of the work done for this request "
        "(bundles with measured costs, unit ms) or the declared cost of the features acquired"
    )
    extraction: float = Field(description="milliseconds spent in extractors (always ms)")
    inference: float = Field(description="milliseconds spent in model inference (always ms)")
    queued: float = Field(
        description="milliseconds waiting for a worker thread (not charged to the budget)"
    )
    cached: list[str] = Field(description="features served from the cache")
    extracted: list[str] = Field(description="features computed for this request, in order")


class PredictResponse(BaseModel):
    model: str
    prediction: str
    probabilities: dict[str, float]
    features: list[str] = Field(description="features the answering model used")
    expected_accuracy: float
    strategy: str = Field(description="name of the strategy that planned the request")
    model_version: str
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
        description="the measured cost passed the budget (extraction stopped as soon as it did)"
    )
    cost: CostReport
