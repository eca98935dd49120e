"""The error taxonomy. Core modules raise these; ``service.http.errors`` maps them to HTTP once."""

from __future__ import annotations

from typing import Any


class BudgetServeError(Exception):
    """Root of every error the service reports to a client."""

    code = "error"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidRequest(BudgetServeError):
    code = "invalid_request"


class InvalidItem(BudgetServeError):
    code = "invalid_item"


class BudgetTooLarge(InvalidRequest):
    def __init__(self, budget: float, limit: float) -> None:
        super().__init__(
            f"'budget' is {budget:g} ms but this service grants at most {limit:g} ms per "
            f"request; send a budget <= {limit:g}, or raise BUDGETSERVE_MAX_BUDGET_MS on the "
            "server",
            budget=budget,
            max_budget=limit,
        )


class BatchBudgetTooLarge(InvalidRequest):
    def __init__(self, budget: float, items: int, limit: float) -> None:
        super().__init__(
            f"'budget' is {budget:g} ms for each of {items} items, {budget * items:g} ms in all, "
            f"but this service grants a batch at most {limit:g} ms in all (the same cap as one "
            f"request's budget); send a budget <= {limit / items:g} ms per item, fewer items, "
            "or a 'total_budget' to share, or raise BUDGETSERVE_MAX_BUDGET_MS on the server",
            budget=budget,
            items=items,
            total=budget * items,
            max_budget=limit,
        )


class ItemTooLarge(BudgetServeError):
    code = "item_too_large"


class SizeMismatch(BudgetServeError):
    code = "size_mismatch"

    def __init__(self, given: int, measured: int) -> None:
        super().__init__(
            f"'size' is {given} but the decoded item has size {measured}; "
            "omit 'size' to have it measured, or send the matching value",
            given=given,
            measured=measured,
        )


class ExtractionFailed(BudgetServeError):
    code = "extraction_failed"

    def __init__(self, extractor: str, reason: str) -> None:
        super().__init__(
            f"extractor {extractor!r} could not process this item: {reason}",
            extractor=extractor,
        )


class ServiceNotReady(BudgetServeError):
    code = "not_ready"

    def __init__(self) -> None:
        super().__init__("the service is still starting; retry shortly")


class PayloadTooLarge(BudgetServeError):
    code = "payload_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body exceeds {limit} bytes", limit=limit)


class UnsupportedMediaType(BudgetServeError):
    code = "unsupported_media_type"

    def __init__(self, content_type: str | None) -> None:
        given = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        super().__init__(
            f"the request body must be JSON sent with Content-Type: application/json; got {given}",
            content_type=content_type,
        )


class BodyTimeout(BudgetServeError):
    code = "body_timeout"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the request body did not arrive in full within {timeout_s:g} s; send it at once "
            "(the server's limit is BUDGETSERVE_BODY_TIMEOUT_S)",
            timeout_s=timeout_s,
        )


class Overloaded(BudgetServeError):
    """Too much work is queued in this process; the client should retry after a while."""

    code = "overloaded"

    def __init__(self, reason: str, retry_after_s: int, **details: Any) -> None:
        super().__init__(
            f"the service is busy ({reason}); retry after {retry_after_s} s",
            retry_after_s=retry_after_s,
            **details,
        )
        self.retry_after_s = retry_after_s


class ModelNotFound(BudgetServeError):
    code = "model_not_found"

    def __init__(self, name: str, available: list[str]) -> None:
        super().__init__(
            f"model {name!r} is not loaded; available: {', '.join(available) or 'none'}",
            model=name,
            available=available,
        )


class StrategyNotFound(BudgetServeError):
    code = "strategy_not_found"

    def __init__(self, model: str, strategy: str, available: list[str]) -> None:
        super().__init__(
            f"model {model!r} has no strategy {strategy!r}; available: {', '.join(available)}",
            model=model,
            strategy=strategy,
            available=available,
        )


class ModelNotReady(BudgetServeError):
    code = "model_not_ready"

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"model {name!r} failed to load: {reason}", model=name)


class BundleError(Exception):
    """A bundle on disk cannot be loaded (raised at load time, never to a client).

    ``bundle`` is the name its manifest gives, once the manifest parsed: the registry
    reports the failure under that name too, so requests for it get 503, not 404."""

    def __init__(self, message: str, *, bundle: str | None = None) -> None:
        super().__init__(message)
        self.bundle = bundle


class VersionNotFound(BudgetServeError):
    code = "version_not_found"

    def __init__(self, model: str, version: str, available: list[str]) -> None:
        super().__init__(
            f"model {model!r} has no version {version!r}; available: "
            f"{', '.join(available) or 'none'} (omit 'version' for the newest)",
            model=model,
            version=version,
            available=available,
        )


class AdminDisabled(BudgetServeError):
    code = "admin_disabled"

    def __init__(self) -> None:
        super().__init__(
            "model management endpoints are disabled on this server; set "
            "BUDGETSERVE_ADMIN_TOKEN and send it as 'Authorization: Bearer <token>'"
        )


class AdminUnauthorized(BudgetServeError):
    code = "admin_unauthorized"

    def __init__(self, enabled: bool = True) -> None:
        super().__init__(
            "missing or wrong admin token: send 'Authorization: Bearer <token>' with the "
            "value of the server's BUDGETSERVE_ADMIN_TOKEN"
            + ("" if enabled else " (unset on this server: model management is disabled)")
        )
