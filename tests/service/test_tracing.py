"""OpenTelemetry tracing through the real app, checked with the SDK's in-memory exporter; and
that with tracing off (the default) nothing imports OpenTelemetry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.cache import InProcessCache
from service.http import create_app
from service.settings import Settings
from tests.conftest import ROOT, png_b64

pytest.importorskip(
    "opentelemetry.sdk", reason="the OpenTelemetry SDK is not installed (pip install -e '.[dev]')"
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def test_a_request_span_with_cache_read_extraction_and_inference_children(
    tiny_bundle_dir: Path,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(
        Settings(models_dir=tiny_bundle_dir.parent, tracing=True),
        cache=InProcessCache(1 << 20),
        tracer_provider=provider,
    )
    item = {"png_base64": png_b64(np.full((32, 32), 0.4, dtype=np.float32))}
    with TestClient(app) as client:
        r = client.post(
            "/predict",
            json={"model": "tiny", "item": item, "budget": 1000},
            headers={
                "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
                "x-request-id": "traced-1",
            },
        )
        assert r.status_code == 200, r.text
        exporter.clear()
        again = client.post("/predict", json={"model": "tiny", "item": item, "budget": 1000})
        assert again.status_code == 200
        second = list(exporter.get_finished_spans())
    # the first request's spans were cleared; the second read everything from the cache
    names = sorted(s.name for s in second)
    assert names == ["POST /predict", "cache.read", "inference"], names
    provider.shutdown()


def spans_by_name(spans: list[ReadableSpan]) -> dict[str, ReadableSpan]:
    return {s.name: s for s in spans}


def test_span_tree_and_attributes(tiny_bundle_dir: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(
        Settings(models_dir=tiny_bundle_dir.parent, tracing=True),
        cache=InProcessCache(1 << 20),
        tracer_provider=provider,
    )
    item = {"png_base64": png_b64(np.full((32, 32), 0.6, dtype=np.float32))}
    with TestClient(app) as client:
        body = client.post(
            "/predict",
            json={"model": "tiny", "item": item, "budget": 1000},
            headers={
                "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
                "x-request-id": "traced-2",
            },
        ).json()
        client.get("/models/nope")
    spans = list(exporter.get_finished_spans())
    request = [s for s in spans if s.name == "POST /predict"]
    assert len(request) == 1
    server = request[0]
    ctx = server.get_span_context()
    assert ctx is not None and format(ctx.trace_id, "032x") == TRACE_ID  # joined the caller's
    assert server.parent is not None and format(server.parent.span_id, "016x") == PARENT_ID
    attrs = dict(server.attributes or {})
    assert attrs["http.response.status_code"] == 200
    assert attrs["budgetserve.request_id"] == "traced-2"
    assert attrs["budgetserve.model"] == "tiny" and attrs["budgetserve.budget"] == 1000
    assert attrs["budgetserve.spent"] == body["cost"]["spent"]
    assert attrs["budgetserve.strategy"] == body["strategy"]
    children = [s for s in spans if s.parent is not None and s.parent.span_id == ctx.span_id]
    expected = ["cache.read", "inference", *(f"extract {f}" for f in body["cost"]["extracted"])]
    assert sorted(s.name for s in children) == sorted(expected)
    assert body["cost"]["extracted"], "the first request extracts something"
    for child in children:
        assert child.start_time is not None and child.end_time is not None
        assert server.start_time is not None and server.end_time is not None
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time
        assert child.get_span_context().trace_id == ctx.trace_id  # type: ignore[union-attr]
    extraction = spans_by_name(children)[f"extract {body['cost']['extracted'][0]}"]
    assert extraction.attributes is not None
    assert extraction.attributes["budgetserve.extractor"] == body["cost"]["extracted"][0]
    timed = extraction.end_time - extraction.start_time  # type: ignore[operator]
    charged = body["cost"]["charged"][body["cost"]["extracted"][0]]
    assert abs(timed / 1e6 - charged) < 0.05 + 0.05 * charged  # the span is the time charged
    missing = [s for s in spans if s.name == "GET /models/nope"]
    assert missing and dict(missing[0].attributes or {})["http.response.status_code"] == 404
    provider.shutdown()


def test_tracing_off_makes_no_spans_even_with_a_global_provider(tiny_bundle_dir: Path) -> None:
    """Off (the default): no span at all, although the process has a global SDK provider
    (FastAPI's own tracing, which would use it, is off too), and no tracing middleware."""
    script = f"""
import numpy as np
from fastapi.testclient import TestClient
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from service import tracing
from service.http import create_app
from service.settings import Settings
from tests.conftest import png_b64
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
app = create_app(Settings(models_dir={str(tiny_bundle_dir.parent)!r}))
assert not any(m.cls is tracing.TracingMiddleware for m in app.user_middleware)
item = {{"png_base64": png_b64(np.full((32, 32), 0.5, dtype=np.float32))}}
with TestClient(app) as client:
    r = client.post("/predict", json={{"model": "tiny", "item": item, "budget": 100}})
    assert r.status_code == 200, r.text
    assert r.json()["cost"]["extracted"]
spans = exporter.get_finished_spans()
assert not spans, [s.name for s in spans]
print("no spans")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no spans"
