"""ASGI middleware of the app and what the lean ``/predict`` endpoint shares with it:
:func:`read_body` (bounded in size and time), :class:`Admission` (load shedding),
:class:`BodyLimit` (both, for every other route; it also stamps a request's receipt when
nothing before it did: :func:`received_at`)."""

from __future__ import annotations

import asyncio
import math
import time

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import errors
from service.http.errors import PREDICT_PATH, domain_response, headers_of, status_of
from service.metrics import UNKNOWN_MODEL, Metrics

RECEIVED_KEY = "budgetserve.received"
#: How long a shed request is told to wait before retrying (Retry-After, seconds).
SHED_RETRY_AFTER_S = 1


def predicts(scope: Scope) -> bool:
    """Whether the request asks for a prediction (the work that shedding protects)."""
    path = scope.get("path", "")
    return scope.get("method") == "POST" and (
        path == PREDICT_PATH or (path.startswith("/v2/models/") and path.endswith("/infer"))
    )


def received_at(scope: Scope) -> float | None:
    """The ``perf_counter()`` at which the app first saw this request (None if unstamped)."""
    value = scope.get(RECEIVED_KEY)
    return value if isinstance(value, float) else None


async def read_body(scope: Scope, receive: Receive, limit: int, timeout_s: float) -> bytes | None:
    """The request's body, read in full: at most ``limit`` bytes (a declared Content-Length
    over it is refused before reading, a body streamed without one as soon as it passes it:
    :class:`~service.errors.PayloadTooLarge`), within ``timeout_s`` of the call
    (:class:`~service.errors.BodyTimeout`). None: the client disconnected first."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            if value.isdigit() and int(value) > limit:
                raise errors.PayloadTooLarge(limit)
            break
    chunks: list[bytes] = []
    seen = 0
    try:
        async with asyncio.timeout(timeout_s if math.isfinite(timeout_s) else None):
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return None
                chunk: bytes = message.get("body", b"")
                seen += len(chunk)
                if seen > limit:
                    raise errors.PayloadTooLarge(limit)
                if not message.get("more_body", False):
                    if not chunks:
                        return chunk  # the usual case: the body came in one piece
                    chunks.append(chunk)
                    return b"".join(chunks)
                chunks.append(chunk)
    except TimeoutError:
        raise errors.BodyTimeout(timeout_s) from None


class Admission:
    """Load shedding of prediction requests (:func:`predicts`), shared by the lean
    ``/predict`` endpoint and :class:`BodyLimit` (which admits v2 infer): one that finds
    ``max_in_flight`` predictions already in this process (body read, not yet answered), or
    that reaches the app more than ``max_delay_s`` after its receipt (the event loop is that
    far behind), is refused with 503 and Retry-After before it is parsed, decoded or
    planned. A refusal costs a small fraction of an answer, so under an arrival rate above
    capacity the backlog, and with it every answer's latency (Little's law: in flight /
    throughput), stays bounded instead of growing without limit. Both are counted in
    ``budgetserve_admission_total`` (``in_flight``, ``queue_delay``)."""

    def __init__(
        self, metrics: Metrics, max_delay_s: float = math.inf, max_in_flight: int = 0
    ) -> None:
        self.metrics = metrics
        self.max_delay_s = max_delay_s
        self.max_in_flight = max_in_flight or math.inf  # 0: no limit
        self.in_flight = 0  # prediction requests past their body, not yet answered

    def shed(self, late_s: float) -> errors.Overloaded | None:
        """Why a prediction request is refused now (counted), or None to serve it (the
        caller then counts it in ``in_flight`` until it is answered)."""
        if self.in_flight >= self.max_in_flight:
            self.metrics.admission.labels(result="in_flight").inc()
            return errors.Overloaded(
                f"{self.in_flight} predictions in flight in this process, the most "
                f"BUDGETSERVE_MAX_IN_FLIGHT allows",
                SHED_RETRY_AFTER_S,
                in_flight=self.in_flight,
            )
        if late_s > self.max_delay_s:
            self.metrics.admission.labels(result="queue_delay").inc()
            return errors.Overloaded(
                f"reached {late_s * 1e3:.0f} ms after its receipt, over "
                f"BUDGETSERVE_MAX_QUEUE_DELAY_MS={self.max_delay_s * 1e3:g}",
                SHED_RETRY_AFTER_S,
                queue_delay_ms=round(late_s * 1e3, 3),
            )
        return None


class BodyLimit:
    """Reject request bodies over ``limit`` bytes with 413, whether declared or streamed,
    and bodies that have not arrived in full ``timeout_s`` after the headers with 408 (the
    connection is then closed); shed prediction requests by ``admission``
    (:class:`Admission`; none: no shedding)."""

    def __init__(
        self,
        app: ASGIApp,
        limit: int,
        metrics: Metrics,
        timeout_s: float = math.inf,
        admission: Admission | None = None,
    ) -> None:
        self.app = app
        self.limit = limit
        self.metrics = metrics
        self.timeout_s = timeout_s
        self.admission = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # The receipt a deadline budget counts from: when the protocol got its first bytes
        # (``service.server``), else the app's first sight of it (its head parsed; the body
        # is read below, and charged).
        scope.setdefault(RECEIVED_KEY, time.perf_counter())
        # How far behind the event loop is: from the first bytes to this task's first step.
        # (Measured before the body is read: a slow upload is not a busy server. The body is
        # still read before a refusal, so the connection stays usable.)
        late_s = time.perf_counter() - scope[RECEIVED_KEY]
        try:
            body = await read_body(scope, receive, self.limit, self.timeout_s)
        except (errors.PayloadTooLarge, errors.BodyTimeout) as exc:
            await self._reject(scope, receive, send, exc)
            return
        if body is None:
            await self.app(scope, receive, send)  # disconnect: let the app see it
            return
        admission = self.admission if predicts(scope) else None
        if admission is not None:
            shed = admission.shed(late_s)
            if shed is not None:
                await self._reject(scope, receive, send, shed)
                return
            admission.in_flight += 1
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            if admission is not None:
                admission.in_flight -= 1

    async def _reject(
        self, scope: Scope, receive: Receive, send: Send, exc: errors.BudgetServeError
    ) -> None:
        if predicts(scope):
            self.metrics.requests.labels(model=UNKNOWN_MODEL, status=exc.code).inc()
        if str(scope.get("path", "")).startswith("/v2/"):
            # The Open Inference Protocol's error shape, which its clients read.
            v2 = JSONResponse({"error": exc.message}, status_of(exc), headers_of(exc))
            await v2(scope, receive, send)
            return
        await domain_response(exc)(scope, receive, send)
