"""Service settings, from environment variables (``BUDGETSERVE_*``) and mounted secret files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BeforeValidator,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.allocator import DEFAULT_KEEP_MIB
from service.sources import SensorSources

#: Mounted secrets (a compose secret volume, a Kubernetes Secret): a file named as a setting's
#: variable, in lower case (``budgetserve_admin_token``), holds its value; a variable that is
#: set wins. Read only where the folder exists (pydantic-settings warns about a missing one).
SECRETS_DIR = Path("/run/secrets")

#: What a feature cache URL may start with (redis-py's schemes).
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def _json_object(value: Any) -> Any:
    """A setting given as JSON text (an environment variable), parsed here so that invalid
    JSON is a validation error naming the setting and where the text breaks, not a
    traceback from the settings source."""
    if not isinstance(value, str | bytes):
        return value
    try:
        return json.loads(value) if value.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); give a JSON "
            'object such as {"pima": {"*": {"plugin": "redis_hash", ...}}}'
        ) from None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="BUDGETSERVE_",
        extra="ignore",
        secrets_dir=SECRETS_DIR if SECRETS_DIR.is_dir() else None,
    )

    models_dir: Path = Field(default=Path("models"), description="folder of bundles to load")
    host: str = Field(default="127.0.0.1", description="address `budgetserve-serve` binds")
    port: int = Field(
        default=8000, ge=0, le=65535, description="TCP port `budgetserve-serve` binds"
    )
    workers: int = Field(
        default=1,
        ge=0,
        description="uvicorn worker processes (0: one per CPU this process may use, counting a "
        "container's CPU quota). Each process holds its own bundles, floor and calibration, "
        "and an admin reload reaches one of them (BUDGETSERVE_WATCH_INTERVAL_S reloads all)",
    )
    grpc_port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="TCP port of the Open Inference Protocol over gRPC (KServe v2 / Triton "
        "clients), served beside HTTP on BUDGETSERVE_HOST by every worker (unset: no gRPC)",
    )
    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", "BUDGETSERVE_REDIS_URL"),
        description="feature cache in Redis when set (e.g. redis://127.0.0.1:6379/0); "
        "otherwise an in-process LRU",
    )
    redis_timeout_ms: float = Field(
        # Measured on the event loop, so it includes this process's own stalls on a busy
        # machine; requests wait at most 20 % of their budget whatever it is.
        default=100.0,
        gt=0,
        description="longest wait for Redis (a read also waits at most 20 % of the request's "
        "budget); a slower Redis counts as down",
    )
    redis_retry_s: float = Field(
        default=5.0,
        ge=0,
        description="once the circuit breaker opens, bypass Redis for this long, then let one "
        "probe through (half-open)",
    )
    redis_failures: int = Field(
        default=3,
        ge=1,
        description="consecutive Redis failures (errors, or no answer within "
        "BUDGETSERVE_REDIS_TIMEOUT_MS) that open the circuit breaker; a request giving up on "
        "its own budget is not a failure",
    )
    cache_max_bytes: int = Field(
        default=64 << 20, ge=0, description="in-process feature cache capacity in bytes"
    )
    cache_ttl_s: int = Field(default=3600, ge=1, description="expiry of features stored in Redis")
    max_body_bytes: int = Field(default=8 << 20, ge=1024, description="largest request body")
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a request's head (request line and headers) must arrive in full within "
        "this many seconds of the connection opening or the previous response; otherwise the "
        "connection is closed (budgetserve-serve)",
    )
    body_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a request body must arrive in full within this many seconds of the "
        "request's headers; otherwise 408 and the connection is closed",
    )
    max_budget_ms: float = Field(
        default=10_000.0,
        gt=0,
        description="largest budget a request may ask of a bundle with measured (ms) costs; "
        "larger budgets are refused with 422",
    )
    max_queued: int = Field(
        default=32,
        ge=0,
        description="requests per process that may wait for an extraction thread; more are "
        "refused with 503 and Retry-After",
    )
    max_in_flight: int = Field(
        default=128,
        ge=0,
        description="prediction requests (POST /predict, v2 infer) per process between their "
        "body read and their answer; one more is refused at once with 503 and Retry-After "
        "before any of its work, which bounds the backlog and so the latency under an "
        "arrival rate above capacity (0: no limit)",
    )
    max_queue_delay_ms: float = Field(
        default=1000.0,
        ge=0,
        description="a prediction request (POST /predict, v2 infer) that reaches the app more "
        "than this many ms after its first bytes arrived, because the process's event loop "
        "is behind, is refused at once with 503 and Retry-After before any of its work, so "
        "an overload cannot build an unbounded backlog (0: never)",
    )
    max_queued_bytes: int = Field(
        default=256 << 20,
        ge=0,
        description="bytes of decoded items per process held by requests admitted and not yet "
        "answered (waiting or extracting); a request that would pass it is refused with 503 "
        "and Retry-After (one request is always admitted)",
    )
    max_manifest_bytes: int = Field(
        default=16 << 20,
        ge=1024,
        description="largest manifest.json a bundle may have; a larger one keeps the bundle out "
        "of service (the reason in GET /models) without being read",
    )
    max_wait_ms: float = Field(
        default=1000.0,
        gt=0,
        description="a request to a bundle whose costs are declared (not ms) waits at most this "
        "long for an extraction thread; then it is answered at once from what it has (values "
        "sent, cached sensors), naming no sensor acquired",
    )
    max_pixels: int = Field(
        default=4096 * 4096,
        ge=1,
        le=1 << 26,
        description="largest image accepted (also capped by the bundle)",
    )
    extraction_threads: int = Field(
        default=0,
        ge=0,
        description="requests extracting at once per process (0: the CPUs this process may use "
        "divided among the workers, at least one); others queue "
        "(at most BUDGETSERVE_MAX_QUEUED, each for at most its budget), and the wait is "
        "reported as timings_ms.queued, not charged to the budget",
    )
    calibration: bool = Field(
        default=True,
        description="plan with cost curves corrected by this machine's measured extraction "
        "times (per extractor and size bucket, p95 of measured/profiled ratios)",
    )
    calibration_window: int = Field(
        default=256, ge=8, description="recent samples kept per extractor and size bucket"
    )
    calibration_min_samples: int = Field(
        default=30, ge=1, description="samples a bucket needs before its correction is used"
    )

    sensor_sources: Annotated[SensorSources, NoDecode, BeforeValidator(_json_object)] = Field(
        default_factory=dict,
        description="JSON: per bundle, per sensor ('*': every sensor), the acquirer that "
        'fetches the values a request did not send, e.g. {"pima": {"*": {"plugin": '
        '"redis_hash", "url": "redis://127.0.0.1:6379/0", "key": "patient:{id}"}}} '
        "(docs/operating.md#sensor-sources)",
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(REDIS_SCHEMES):
            raise ValueError(
                f"must be a Redis URL starting with {', '.join(REDIS_SCHEMES)} (e.g. "
                "redis://127.0.0.1:6379/0), or unset for the in-process cache"
            )
        return value

    @field_validator("admin_token")
    @classmethod
    def _admin_token(cls, value: SecretStr | None) -> SecretStr | None:
        # A blank token would enable the endpoints with a token nobody can send (an empty
        # bearer is no bearer): admin locked for good. Unset it to disable them instead.
        if value is not None and not value.get_secret_value().strip():
            raise ValueError(
                "is blank; set a token (e.g. `openssl rand -hex 32`), or unset the variable to "
                "disable the model management endpoints"
            )
        return value

    @model_validator(mode="after")
    def _calibration_window(self) -> Settings:
        if self.calibration_min_samples > self.calibration_window:
            raise ValueError(
                f"BUDGETSERVE_CALIBRATION_MIN_SAMPLES ({self.calibration_min_samples}) must not "
                f"exceed BUDGETSERVE_CALIBRATION_WINDOW ({self.calibration_window})"
            )
        return self

    accounting: Literal["deadline", "work"] = Field(
        default="deadline",
        description="how a measured (ms) budget is counted when a request does not say: "
        "'deadline' from the request's receipt (decoding, cache and the wait for a thread "
        "charged; under load answers get cheaper, not later), 'work' only the work done for it",
    )

    overhead_reserve_ms: float | None = Field(
        default=None,
        ge=0,
        description="part of each budget kept for the work after planning (inference, "
        "encoding, writing): features are planned within what is left of the budget less "
        "the reserve. Unset: the service measures it on this machine (the p95 at start-up, "
        "then over recent answers; GET /models/{name} shows it with the floor); a number "
        "fixes it",
    )
    inline_ms: float = Field(
        default=1.0,
        ge=0,
        description="a request whose plannable budget is at most this many ms (or at most 5 "
        "times it, with a plan predicted to cost at most this while the process is otherwise "
        "idle) runs its plan on the event loop, without the hand-off to a worker thread and "
        "back (which costs more than such a plan); 0: always on a thread",
    )

    allocator_keep_mb: int = Field(
        default=DEFAULT_KEEP_MIB,
        ge=0,
        le=4096,
        description="MiB of freed memory the C allocator (glibc) keeps per arena for reuse, "
        "and the largest block it serves from its heaps (at most 32): a large image's arrays "
        "then reuse pages instead of faulting in fresh ones on every request (hog, lbp and "
        "histogram at 512 px 2-5x faster); each arena (the event loop's, one per extraction "
        "thread) may hold that much; 0: glibc's defaults",
    )

    contention_weight: float = Field(
        default=12.0,
        ge=0,
        description="how dear a plan's features are while other requests share the process: "
        "under deadline accounting a plan spends at most what is left / (1 + weight x the "
        "mean number of other requests that arriving requests find in the process), never "
        "below 0.5 ms (or twice the cheapest feature); one client at a time is untouched; 0: "
        "off",
    )

    admin_token: SecretStr | None = Field(
        default=None,
        description="enables the model management endpoints (POST /-/reload, POST "
        "/models/{name}/reload, DELETE /models/{name}), which then require "
        "'Authorization: Bearer <token>' (else 401); unset: disabled (403 to a bearer token); "
        "blank: refused at start",
    )
    watch_interval_s: float = Field(
        default=0.0,
        ge=0,
        description="every this many seconds, each worker reloads the bundle folders whose "
        "files changed (0: off); the way to reload every worker when there are several",
    )
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="'json': one JSON object per log line, and one line per request with its "
        "request id, model, strategy, budget, spent, cached features and status",
    )
    log_refusals_per_s: float = Field(
        default=10.0,
        ge=0,
        description="overload refusals (503 with Retry-After) logged one line each, at most "
        "this many a second per process; the rest are counted in one line a second, so that "
        "an overload does not spend on log lines the CPU its answers need (0: every refusal "
        "its line)",
    )
    tracing: bool = Field(
        default=False,
        description="OpenTelemetry spans per request (cache read, each extraction, "
        "inference); needs the 'otel' extra; configure the exporter with the standard "
        "OTEL_* variables (docs/operating.md#tracing)",
    )
