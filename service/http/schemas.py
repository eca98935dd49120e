"""Bodies only the HTTP layer uses: the predict request, error bodies, readiness.

(The predict *response* is the handler's output and lives in ``service.schemas``.)
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, JsonValue, model_validator

from service.batch import MAX_BATCH_ITEMS
from service.items import ImageItem, TabularItem

# A 16 x 16 PNG of a 3 (digits bundle): the example request of the OpenAPI schema.
EXAMPLE_PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAABAAAAAQCAAAAAA6mKC9AAABDElEQVR4nAXBT0vCYBwH8O/2/LbMbYhiUIJsHSJD"
    "S+ifFF06ePHSoTfQ6+jcO6kX0LXwFpRiEQlBUCxb4MGtooZz/549fT4AqsfnrhD2aREMCqi42tkx+9hf2lr+ZTxh"
    "xK2q7vYm+U1R0gKAk+Y99A2/tTJxnn2AMaC8iOaZK+5PgByRSswDlHoZzicQ5tJE5gB0AiKzDISpTIAknIvvjTqb"
    "744iNSZAjUa2fdRpV4JxFEukZBEyDKZhW951b6YpibkAgPRy6R+U1v1eSiLWKsbPu/iQCjXxykAcC9vWUPLWmqYh"
    "MwYCqNCw9jK9wR/7dwkICO1W7RCZ+nTVdfIgYPZ1689yf2/D6zG4/A++rmtHsrmgQgAAAABJRU5ErkJggg=="
)


def _whole_number(value: Any) -> Any:
    """JSON Schema counts 245148.0 as an integer: take integral floats as ints; refuse other
    floats here with a message that says so (strings and booleans fail the strict int)."""
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"must be a whole number, got {value!r}")
        return int(value)
    return value


#: How a request's budget binds (single requests, and each item of a batch with ``budget``).
BudgetMode = Annotated[
    Literal["cap", "mean"] | None,
    Field(
        description="'cap' (the default): the budget caps each item's spend. 'mean' (tabular "
        "adaptive strategies with declared costs): the budget is the average spend wanted "
        "over the client's requests; the service serves the best average the bundle's points "
        "deliver there on validation (one point, or two shared out over the items), so an "
        "easy item may spend less and a hard one more, up to `max_cost`. In a batch, only "
        "with `budget`"
    ),
]
#: A per-request tolerance (single requests and batch items): tabular adaptive strategies and
#: the structured anytime one.
Tolerance = Annotated[
    float | None,
    Field(
        ge=0,
        le=1,
        allow_inf_nan=False,
        strict=True,
        description="tabular adaptive strategies (dag, gating, cstc): serve the cheapest "
        "point whose validation accuracy is within this much of the best the budget affords "
        "(0: the most accurate); structured-anytime: stop buying templates where training "
        "lost at most this much accuracy by stopping (0: the top; its bundle's stop table). "
        "Absent: the bundle's; other strategies refuse it (422). In a batch, each item's",
    ),
]
MaxCost = Annotated[
    float | None,
    Field(
        gt=0,
        allow_inf_nan=False,
        strict=True,
        description="with budget_mode 'mean': the most each item may spend (at least the "
        "budget). Absent: no cap but the cost of every sensor",
    ),
]


class PredictRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"model": "digits", "item": {"png_base64": EXAMPLE_PNG}, "budget": 5.0},
            ]
        },
    )

    model: str = Field(min_length=1, max_length=128, description="bundle name")
    item: Any = Field(
        description="the item, in the bundle's item format (GET /models/{name}: item.kind): "
        "an image bundle takes {'png_base64', 'id'?}, a tabular one {'values', 'id'?} with "
        "exactly its columns. The cache key is a digest of the content; an 'id' is folded "
        "into it, so it can only separate cache entries, never merge two different items",
        json_schema_extra={
            "anyOf": [
                ImageItem.model_json_schema(),
                TabularItem.model_json_schema(),
            ]
        },
    )
    size: Annotated[int | None, BeforeValidator(_whole_number)] = Field(
        default=None,
        gt=0,
        strict=True,
        description="item size n; measured from the item when absent (an integral number "
        "such as 1024.0 counts as 1024)",
    )
    budget: float = Field(
        gt=0, allow_inf_nan=False, strict=True, description="in the bundle's cost unit"
    )
    strategy: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="one of the bundle's strategies (GET /models/{name}); its default if absent",
    )
    version: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="one of the model's versions (GET /models/{name}: versions); the newest "
        "if absent",
    )
    accounting: Literal["deadline", "work"] | None = Field(
        default=None,
        description="how a budget in ms is counted: 'deadline' from the moment the service "
        "received the request (reading, decoding, cache, waiting for a thread all charged; "
        "under load the answer gets cheaper, not later), 'work' only the work done for it. "
        "Absent: the service's default (BUDGETSERVE_ACCOUNTING, 'deadline')",
    )
    tolerance: Tolerance = None
    budget_mode: BudgetMode = None
    max_cost: MaxCost = None


class ErrorBody(BaseModel):
    type: str
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class ErrorResponse(BaseModel):
    error: ErrorBody


class CacheStatus(BaseModel):
    backend: str | None = Field(description="'memory' (in-process LRU) or 'redis'")
    reachable: bool


class Readiness(BaseModel):
    ready: bool = Field(description="at least one bundle is loaded")
    models: list[str]
    failed: list[str] = Field(description="names of bundles that failed to load")
    cache: CacheStatus


# "Exactly one of budget and total_budget", as JSON Schema says it: the branch that sends
# one requires it as a number (null counts as not sent, as the model reads it).
_ONE_BUDGET: dict[str, JsonValue] = {
    "oneOf": [
        {"required": [field], "properties": {field: {"type": "number"}}}
        for field in ("budget", "total_budget")
    ]
}


class BatchPredictRequest(BaseModel):
    """Several items of one bundle: each with ``budget``, or all under ``total_budget``
    (exactly one of them)."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            **_ONE_BUDGET,
            "examples": [
                {
                    "model": "digits",
                    "items": [{"png_base64": EXAMPLE_PNG}, {"png_base64": EXAMPLE_PNG}],
                    "total_budget": 5.0,
                },
            ],
        },
    )

    model: str = Field(min_length=1, max_length=128, description="bundle name")
    items: list[Any] = Field(
        min_length=1,
        max_length=MAX_BATCH_ITEMS,
        description="the items, each in the bundle's item format (as 'item' of a single request)",
        json_schema_extra={
            "items": {"anyOf": [ImageItem.model_json_schema(), TabularItem.model_json_schema()]}
        },
    )
    budget: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        strict=True,
        description="each item's budget, in the bundle's cost unit (or send total_budget)",
    )
    total_budget: float | None = Field(
        default=None,
        gt=0,
        allow_inf_nan=False,
        strict=True,
        description="one budget for the whole batch, planned across its items: spent where "
        "the expected accuracy gained per cost is highest (or send budget)",
    )
    tolerance: Tolerance = None
    budget_mode: BudgetMode = None
    max_cost: MaxCost = None
    strategy: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        description="one of the bundle's strategies (GET /models/{name}); its default if absent",
    )
    version: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="one of the model's versions (GET /models/{name}: versions), for every "
        "item; the newest if absent",
    )

    @model_validator(mode="after")
    def _one_budget(self) -> BatchPredictRequest:
        if (self.budget is None) == (self.total_budget is None):
            raise ValueError("send exactly one of 'budget' (each item's) and 'total_budget'")
        return self
