"""Request ids and the one log line per request.

:class:`RequestLog` (ASGI middleware, outermost) takes the request's ``x-request-id`` when it
is a sensible id (1-128 visible ASCII characters), else makes one (32 hex digits); puts it
in every response's ``x-request-id`` header, in :data:`request_id` (so every log record of
the request carries it: :class:`RequestIdFilter`, uvicorn's access line too) and in
``request.state.request_id``; and when the response is sent, logs one line on
``budgetserve.request``: client, method, path, status, duration, and what the endpoint put
in ``request.state.summary`` (``/predict``: model, version, strategy, budget, spent, cached,
outcome). Probes (``/healthz``, ``/readyz``, ``/metrics``) log at DEBUG, every other request
at INFO.

Overload refusals (503 with Retry-After: admission's ``in_flight``, ``queue_delay`` and
``deadline``) are the one exception: each gets its line up to ``BUDGETSERVE_LOG_REFUSALS_PER_S``
a second per process (:class:`RefusalLines`), and the rest are counted in one line a second.
A refusal exists to spend almost nothing on a request that cannot be served; its line was a
third of that (in a worker refusing every request, 168 µs of CPU each with their lines, 110
without), and under an arrival rate twice the capacity that CPU was taken from the answers
(goodput 0.7 of what it was without the lines). ``budgetserve_admission_total`` counts every
refusal.

:func:`configure_logging`: the process's log format, ``text`` or ``json``
(``BUDGETSERVE_LOG_FORMAT``); in ``json`` every record is one JSON object per line, with the
fields of a request line at the top level. uvicorn's access line is off in both: the request
line replaces it (one line per request).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import threading
import time
import uuid
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
_VALID = re.compile(r"[!-~]{1,128}")  # visible ASCII, no spaces, at most 128
PROBES = frozenset(
    {"/healthz", "/readyz", "/metrics"}
    | {
        f"/inference.GRPCInferenceService/{rpc}"
        for rpc in ("ServerLive", "ServerReady", "ModelReady")
    }
)

request_id: ContextVar[str | None] = ContextVar("budgetserve_request_id", default=None)
log = logging.getLogger("budgetserve.request")


def accept_id(raw: bytes | None) -> str:
    """The client's id when it is 1-128 visible ASCII characters, else a new one."""
    if raw is not None:
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            text = ""
        if _VALID.fullmatch(text):
            return text
    return uuid.uuid4().hex


class RequestLog:
    """See the module."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = accept_id(dict(scope.get("headers", [])).get(HEADER.encode()))
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        token = request_id.set(rid)
        started = time.perf_counter()
        status = 500  # unless a response starts
        overloaded = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, overloaded
            if message["type"] == "http.response.start":
                status = int(message["status"])
                # An overload refusal: 503 with Retry-After (``service.http.errors.headers_of``).
                overloaded = status == 503 and any(
                    k.lower() == b"retry-after" for k, _ in message.get("headers", [])
                )
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != HEADER.encode()
                ]
                headers.append((HEADER.encode(), rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            log_request(scope, rid, status, started, state.get("summary"), overloaded=overloaded)
            request_id.reset(token)


class RefusalLines:
    """How many overload refusals get a log line of their own: a token bucket of ``per_s``
    lines a second (a burst of as many, at least one); the refusals past it are counted and
    said in one line once their second is over (at the next request's line, or by the event
    loop's timer when no request follows). ``per_s`` 0: every refusal has its line."""

    WINDOW_S = 1.0

    def __init__(self, per_s: float = 10.0) -> None:
        self.per_s = per_s
        self._lock = threading.Lock()
        self._tokens = max(per_s, 1.0)
        self._refilled = time.monotonic()
        self._held = 0  # refusals of the current window without a line
        self._held_since = 0.0
        self._timer: Any = None

    def admit(self) -> bool:
        """Whether this refusal gets its line (else it is counted)."""
        if self.per_s <= 0:
            return True
        now = time.monotonic()
        with self._lock:
            self._tokens = min(
                max(self.per_s, 1.0), self._tokens + (now - self._refilled) * self.per_s
            )
            self._refilled = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            if not self._held:
                self._held_since = now
                self._arm()
            self._held += 1
        return False

    def flush(self, force: bool = False) -> None:
        """Say the refusals counted in a window that is over (any, when ``force``)."""
        if not self._held:  # the usual case, without the lock
            return
        with self._lock:
            if not self._held:
                return
            now = time.monotonic()
            if not force and now - self._held_since < self.WINDOW_S:
                return
            held, span, self._held = self._held, now - self._held_since, 0
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
        log.info(
            "%d more overload refusals (503, Retry-After) in the last %.1f s without a line "
            "each: BUDGETSERVE_LOG_REFUSALS_PER_S=%g; budgetserve_admission_total counts them all",
            held,
            span,
            self.per_s,
        )

    def _arm(self) -> None:
        """The window's count is said when it ends even if no request comes after it."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a thread without a loop (gRPC's): the next line says it
            return
        self._timer = loop.call_later(self.WINDOW_S, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self.flush(force=True)


#: The process's limiter (``configure_logging`` sets its rate from the settings).
REFUSALS = RefusalLines()


def log_request(
    scope: Scope | dict[str, Any],
    rid: str,
    status: int | str,
    started: float,
    summary: dict[str, Any] | None,
    *,
    overloaded: bool = False,
) -> None:
    """The request's one log line: client, method, path, status (HTTP's number, or a gRPC
    code's name), duration (from ``started``, a ``perf_counter()``) and the endpoint's
    ``summary``; probes at DEBUG. ``overloaded``: the request was refused for overload, and
    has its line only within :data:`REFUSALS`'s rate."""
    path = scope.get("path", "")
    level = logging.DEBUG if path in PROBES else logging.INFO
    if not log.isEnabledFor(level):
        return
    REFUSALS.flush()
    if overloaded and not REFUSALS.admit():
        return
    client = scope.get("client")
    fields: dict[str, Any] = {
        "request_id": rid,
        "client": f"{client[0]}:{client[1]}" if client else None,
        "method": scope.get("method"),
        "path": path,
        "status": status,
        "duration_ms": round((time.perf_counter() - started) * 1000.0, 3),
        **(summary or {}),
    }
    text = " ".join(f"{k}={_text(v)}" for k, v in fields.items() if k != "request_id")
    log.log(level, "%s", text, extra={"fields": fields, "request_id": rid})


def escape_controls(text: str) -> str:
    """``text`` with every character that is not printable (control characters, line and
    paragraph separators, C1 controls such as NEL) written as a Python escape (``\\n``,
    ``\\x00``, ``\\u2028``): a client's string can then never start a log line of its own."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# A value that needs no quotes in a text request line: visible ASCII but '"', '=' and '\\'.
_PLAIN = re.compile(r"[!#-<>-\[\]-~]+")


def _text(value: Any) -> str:
    """A value of the text request line (``key=value`` pairs): numbers as they are, strings
    quoted and escaped (a client's path or model name can hold spaces, ``=`` or line breaks,
    which would otherwise forge fields or whole lines)."""
    if isinstance(value, list):
        return ",".join(_text(v) for v in value) or "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "-"
    text = str(value)
    if _PLAIN.fullmatch(text):
        return text
    return '"' + escape_controls(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id``: the id of the request being served, or ``-``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = request_id.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, request
    id, the record's ``fields`` (a request line's) and the exception, if any."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None) or request_id.get(),
        }
        fields = getattr(record, "fields", None)
        if fields:  # a request line: its fields, not their text again
            body["message"] = f"{fields.get('method')} {fields.get('path')} {fields.get('status')}"
            body.update(fields)
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


class TextFormatter(logging.Formatter):
    """The text format, with the message's control characters escaped (:func:`escape_controls`):
    whatever a record carries (a client's id, path or model name), it is one line. (JSON
    lines are escaped by the JSON encoder. A traceback keeps its line breaks.)"""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def configure_logging(
    fmt: str, level: int = logging.INFO, refusals_per_s: float | None = None
) -> None:
    """Send every log record of this process (uvicorn's too) to stderr in ``fmt`` (``text``
    or ``json``), replacing the root logger's handlers; ``refusals_per_s``: the overload
    refusals with a line of their own a second (:class:`RefusalLines`; None: unchanged)."""
    global REFUSALS
    if refusals_per_s is not None:  # a fresh bucket: full at the new rate
        REFUSALS = RefusalLines(refusals_per_s)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error"):
        uv = logging.getLogger(name)
        uv.handlers.clear()
        uv.propagate = True
    # uvicorn's access line: off, the request's own line replaces it. (uvicorn's protocols
    # log it when the logger has a handler, its parents' included.)
    access = logging.getLogger("uvicorn.access")
    access.handlers.clear()
    access.propagate = False
