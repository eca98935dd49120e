"""OpenTelemetry tracing, optional (the ``otel`` extra) and off by default.

With ``BUDGETSERVE_TRACING=true`` the app adds :class:`TracingMiddleware`: one server span
per request (parent taken from the request's ``traceparent`` header, W3C trace context),
with the request id, the HTTP status and, for ``/predict``, the model, strategy, budget,
spent and cached features as attributes; and under it one child span for the feature-cache
read (``cache.read``), one per extraction (``extract <name>``) and one for inference
(``inference``). The handler reports those through :func:`span` and :func:`record`, which
read one context variable: while tracing is off it is always None, they return at once, and
nothing imports ``opentelemetry`` (this module imports it only in :func:`make_tracer`).

Spans go to the tracer provider given to ``create_app`` (tests), else to the global one if
the process already has one (e.g. set by ``opentelemetry-instrument``), else to an SDK
provider made here exporting by ``OTEL_TRACES_EXPORTER`` (``otlp``, the default: OTLP over
HTTP to ``OTEL_EXPORTER_OTLP_ENDPOINT``; ``console``; ``none``), with ``OTEL_SERVICE_NAME``
(default ``budgetserve``).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MISSING_EXTRA = (
    "BUDGETSERVE_TRACING is on but OpenTelemetry is not installed: pip install "
    "'budgetserve[otel]' (in a checkout: .venv/bin/pip install -e '.[otel]'), or set "
    "BUDGETSERVE_TRACING=false"
)
EXPORTERS = ("otlp", "console", "none")


def unavailable() -> str | None:
    """Why tracing cannot start in this process (one line), or None when it can: checked
    before the server starts, so a missing SDK or exporter is a readable error, not a
    traceback from every worker. Mirrors what :func:`make_tracer` will import."""
    try:
        from opentelemetry import trace
    except ImportError:
        return MISSING_EXTRA
    if type(trace.get_tracer_provider()).__name__ not in (
        "ProxyTracerProvider",
        "NoOpTracerProvider",
    ):
        return None  # a provider set up by the process (opentelemetry-instrument)
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if kind not in EXPORTERS:
        return (
            f"OTEL_TRACES_EXPORTER={kind!r} is not supported here; use one of "
            f"{', '.join(EXPORTERS)}"
        )
    modules = ["opentelemetry.sdk.trace"]
    if kind == "otlp":
        modules.append("opentelemetry.exporter.otlp.proto.http.trace_exporter")
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError:
            return f"{MISSING_EXTRA} ({module} is missing)"
    return None


class RequestTrace:
    """The span of one request, and the tracer to open its children with."""

    def __init__(self, tracer: Any, span: Any, context: Any) -> None:
        self.tracer = tracer
        self.span = span
        self.context = context

    def child(self, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any]) -> None:
        child = self.tracer.start_span(
            name, context=self.context, start_time=start_ns, attributes=attributes
        )
        child.end(end_time=end_ns)

    @contextlib.contextmanager
    def timed(self, name: str, attributes: dict[str, Any]) -> Iterator[None]:
        start = time.time_ns()
        try:
            yield
        finally:
            self.child(name, start, time.time_ns(), attributes)


_current: ContextVar[RequestTrace | None] = ContextVar("budgetserve_trace", default=None)
_OFF: AbstractContextManager[None] = contextlib.nullcontext()


def span(name: str, **attributes: Any) -> AbstractContextManager[None]:
    """A child span of the current request around a block (nothing while tracing is off)."""
    trace = _current.get()
    return _OFF if trace is None else trace.timed(name, _attrs(attributes))


def record(name: str, seconds: float, **attributes: Any) -> None:
    """A child span of the current request that ended now and lasted ``seconds`` (for work
    timed elsewhere, e.g. in an extraction thread); nothing while tracing is off."""
    trace = _current.get()
    if trace is None:
        return
    end = time.time_ns()
    trace.child(name, end - int(seconds * 1e9), end, _attrs(attributes))


def extraction(name: str, seconds: float) -> None:
    """:func:`record` of an ``extract <name>`` span (its name is built only when tracing)."""
    if _current.get() is not None:
        record(f"extract {name}", seconds, extractor=name)


def _attrs(attributes: dict[str, Any]) -> dict[str, Any]:
    return {f"budgetserve.{k}": v for k, v in attributes.items()}


def make_tracer(provider: Any = None) -> tuple[Any, Callable[[], None]]:
    """The tracer of ``provider`` (see the module for the default) and the function that
    flushes and shuts down a provider made here (a no-op otherwise)."""
    try:
        from opentelemetry import trace
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(MISSING_EXTRA) from exc
    shutdown: Callable[[], None] = lambda: None  # noqa: E731
    if provider is None:
        current = trace.get_tracer_provider()
        if type(current).__name__ not in ("ProxyTracerProvider", "NoOpTracerProvider"):
            provider = current
        else:
            provider = _sdk_provider()
            shutdown = provider.shutdown
    return provider.get_tracer("budgetserve"), shutdown


def _sdk_provider() -> Any:
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(MISSING_EXTRA) from exc
    name = os.environ.get("OTEL_SERVICE_NAME", "budgetserve")
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if kind == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif kind == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(MISSING_EXTRA) from exc
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif kind != "none":
        raise RuntimeError(
            f"OTEL_TRACES_EXPORTER={kind!r} is not supported here; use one of "
            f"{', '.join(EXPORTERS)}"
        )
    return provider


# Fields of the request's log summary (service.http.requestlog) put on its span.
_SUMMARY = ("model", "version", "strategy", "budget", "spent", "unit", "cached", "outcome")


class TracingMiddleware:
    """One server span per HTTP request (see the module)."""

    def __init__(self, app: ASGIApp, tracer: Any) -> None:
        from opentelemetry import propagate, trace

        self.app = app
        self.tracer = tracer
        self.trace = trace
        self.propagate = propagate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", [])}
        parent = self.propagate.extract(carrier)
        method, path = scope.get("method", ""), scope.get("path", "")
        status = 500
        with self.tracer.start_as_current_span(
            f"{method} {path}",
            context=parent,
            kind=self.trace.SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        ) as server_span:
            token = _current.set(
                RequestTrace(self.tracer, server_span, self.trace.set_span_in_context(server_span))
            )

            async def send_status(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = int(message["status"])
                await send(message)

            try:
                await self.app(scope, receive, send_status)
            finally:
                _current.reset(token)
                state = scope.get("state", {})
                server_span.set_attribute("http.response.status_code", status)
                if "request_id" in state:
                    server_span.set_attribute("budgetserve.request_id", state["request_id"])
                summary = state.get("summary", {})
                for key in _SUMMARY:
                    if summary.get(key) is not None:
                        server_span.set_attribute(f"budgetserve.{key}", summary[key])
                if status >= 500:
                    server_span.set_status(self.trace.Status(self.trace.StatusCode.ERROR))
