"""ASGI middleware of the app: :class:`BodyLimit` (which also stamps each request's receipt:
:func:`received_at`)."""

from __future__ import annotations

import math
import time

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service import errors
from service.http.errors import PREDICT_PATH, domain_response
from service.metrics import UNKNOWN_MODEL, Metrics

RECEIVED_KEY = "budgetserve.received"


def received_at(scope: Scope) -> float | None:
    """The ``perf_counter()`` at which the app first saw this request (None if unstamped)."""
    value = scope.get(RECEIVED_KEY)
    return value if isinstance(value, float) else None


class BodyLimit:
    """Reject request bodies over ``limit`` bytes with 413, whether declared or streamed,
    and bodies that have not arrived in full ``timeout_s`` after the headers with 408 (the
    connection is then closed)."""

    def __init__(
        self, app: ASGIApp, limit: int, metrics: Metrics, timeout_s: float = math.inf
    ) -> None:
        self.app = app
        self.limit = limit
        self.metrics = metrics
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # The receipt a deadline budget counts from: when the protocol got its first bytes
        # (``service.server``), else the app's first sight of it (its head parsed; the body
        # is read below, and charged).
        scope.setdefault(RECEIVED_KEY, time.perf_counter())
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._reject(scope, receive, send, errors.PayloadTooLarge(self.limit))
            return
        # Read the body here (at most ``limit`` bytes), then replay it to the app: a body
        # streamed without Content-Length is cut off as soon as it passes the limit.
        chunks: list[bytes] = []
        seen = 0
        deadline = anyio.current_time() + self.timeout_s
        while True:
            message: Message | None = None
            with anyio.move_on_after(deadline - anyio.current_time()):
                message = await receive()
            if message is None:
                await self._reject(scope, receive, send, errors.BodyTimeout(self.timeout_s))
                return
            if message["type"] != "http.request":
                await self.app(scope, receive, send)  # disconnect: let the app see it
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.limit:
                await self._reject(scope, receive, send, errors.PayloadTooLarge(self.limit))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(
        self, scope: Scope, receive: Receive, send: Send, exc: errors.BudgetServeError
    ) -> None:
        if scope.get("path") == PREDICT_PATH:
            self.metrics.requests.labels(model=UNKNOWN_MODEL, status=exc.code).inc()
        await domain_response(exc)(scope, receive, send)
