"""The HTTP contract through the real app: what the OpenAPI schema promises is what the
routes return, and odd but plausible requests get a 4xx that says what is wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.cache import InProcessCache
from service.http import create_app
from service.settings import Settings
from tests.conftest import digit_image, png_b64

ITEM = {"png_base64": png_b64(digit_image(4, 16))}


@pytest.fixture(scope="module")
def client(digits_bundle_dir: Path) -> Iterator[TestClient]:
    app = create_app(Settings(models_dir=digits_bundle_dir.parent), cache=InProcessCache(1 << 20))
    with TestClient(app) as c:
        yield c


def _error(r: Any, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["type"] == kind, body
    message: str = body["message"]
    return message


# ------------------------------------------------------------------------------ /readyz


@pytest.mark.parametrize("max_bytes", [0, 1 << 20])
def test_readyz_reports_an_empty_in_process_cache(digits_bundle_dir: Path, max_bytes: int) -> None:
    # No cache handed in: the app makes its own, as in production (no REDIS_URL: in-process).
    app = create_app(
        Settings(models_dir=digits_bundle_dir.parent, cache_max_bytes=max_bytes, redis_url=None)
    )
    with TestClient(app) as c:
        before = c.get("/readyz").json()
        assert c.post("/predict", json={"model": "digits", "item": ITEM, "budget": 5}).is_success
        after = c.get("/readyz").json()
    for ready in (before, after):
        assert ready["cache"] == {"backend": "memory", "reachable": True}, ready


# ------------------------------------------------------------------------ request bodies


@pytest.mark.parametrize("size", [256.0, 256, 2.56e2])
def test_integral_size_is_an_integer(client: TestClient, size: float) -> None:
    r = client.post("/predict", json={"model": "digits", "item": ITEM, "budget": 5, "size": size})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("size", "mentions"),
    [(256.5, "whole number"), (True, "integer"), ("256", "integer"), (-256.0, "greater than")],
)
def test_other_sizes_are_refused(client: TestClient, size: object, mentions: str) -> None:
    r = client.post("/predict", json={"model": "digits", "item": ITEM, "budget": 5, "size": size})
    assert mentions in _error(r, 422, "invalid_request")


def test_integral_size_that_disagrees_is_a_size_mismatch(client: TestClient) -> None:
    r = client.post(
        "/predict", json={"model": "digits", "item": ITEM, "budget": 5, "size": 245148.0}
    )
    _error(r, 422, "size_mismatch")
    assert r.json()["error"]["details"] == {"given": 245148, "measured": 256}


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deeply_nested_json_says_so(client: TestClient, depth: int) -> None:
    raw = '{"model": "digits", "budget": 5, "item": ' + "[" * depth + "]" * depth + "}"
    r = client.post("/predict", content=raw, headers={"content-type": "application/json"})
    assert "too deeply" in _error(r, 422, "invalid_request")


def test_huge_integer_says_so(client: TestClient) -> None:
    raw = '{"model": "digits", "item": {}, "budget": ' + "7" * 5_000 + "}"
    r = client.post("/predict", content=raw, headers={"content-type": "application/json"})
    assert "more than 4300 digits" in _error(r, 422, "invalid_request")


def test_huge_decimal_is_just_a_number(client: TestClient) -> None:
    raw = (
        '{"model": "digits", "item": '
        + f'{{"png_base64": "{ITEM["png_base64"]}"}}'
        + ', "budget": 5.'
        + "1" * 5_000
        + "}"
    )
    r = client.post("/predict", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_invalid_utf8_is_named(client: TestClient) -> None:
    raw = b'{"model": "digits\xff", "item": {}, "budget": 5}'
    r = client.post("/predict", content=raw, headers={"content-type": "application/json"})
    message = _error(r, 422, "invalid_request")
    assert "not valid UTF-8 JSON: invalid start byte at byte 17" in message


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "application/xml", None],
)
def test_non_json_body_is_a_415(client: TestClient, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    r = client.post(
        "/predict", content=b'{"model": "digits", "item": {}, "budget": 5}', headers=headers
    )
    message = _error(r, 415, "unsupported_media_type")
    assert "application/json" in message
    assert (content_type or "no Content-Type") in message
    metrics = client.get("/metrics").text
    assert 'status="unsupported_media_type"' in metrics


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "application/problem+json"]
)
def test_json_content_types_are_read(client: TestClient, content_type: str) -> None:
    import json

    r = client.post(
        "/predict",
        content=json.dumps({"model": "digits", "item": ITEM, "budget": 5}),
        headers={"content-type": content_type},
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("PUT", "/predict", "POST"),
        ("GET", "/predict", "POST"),
        ("DELETE", "/models", "GET"),
        ("POST", "/models/digits", "DELETE, GET"),  # GET and DELETE /models/{name}: both
        ("PATCH", "/metrics", "GET"),
    ],
)
def test_405_says_what_is_allowed(client: TestClient, method: str, path: str, allowed: str) -> None:
    r = client.request(method, path)
    _error(r, 405, "http_error")
    assert r.headers["allow"] == allowed


# ------------------------------------------------------------------------ OpenAPI schema


def _responses(schema: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    responses: dict[str, Any] = schema["paths"][path][method]["responses"]
    return responses


def test_openapi_documents_the_errors_each_route_returns(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    expected = {
        ("post", "/predict"): {"404", "408", "413", "415", "422", "503"},
        ("get", "/models"): {"503"},
        ("get", "/models/{name}"): {"404", "422", "503"},
        ("get", "/models/{name}/costs"): {"404", "422", "503"},
        ("get", "/models/{name}/skyline"): {"404", "422", "503"},
        ("post", "/-/reload"): {"401", "403", "503"},
        ("post", "/models/{name}/reload"): {"401", "403", "404", "422", "503"},
        ("delete", "/models/{name}"): {"401", "403", "404", "422", "503"},
    }
    for (method, path), statuses in expected.items():
        responses = _responses(schema, method, path)
        assert set(responses) == {"200", *statuses}, (path, set(responses))
        for status in statuses:
            assert responses[status]["content"]["application/json"]["schema"] == error_ref
    assert "HTTPValidationError" not in schema["components"]["schemas"], (
        "422s are ErrorResponse bodies, not FastAPI's default"
    )
    ready = _responses(schema, "get", "/readyz")
    assert ready["503"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Readiness"
    }
    metrics = _responses(schema, "get", "/metrics")["200"]["content"]
    assert set(metrics) == {"text/plain"}


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    found: dict[str, Any] = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return found


def test_openapi_separates_cost_units_from_milliseconds(client: TestClient) -> None:
    """Costs (in the bundle's unit) and timings (ms) are separate objects, named as such; a
    tabular answer can name the sensor to collect next; a tabular item may be just an id."""
    schema = client.get("/openapi.json").json()
    ok = _responses(schema, "post", "/predict")["200"]["content"]["application/json"]["schema"]
    # one item's answer (the other choice is a batch's, whose results are these)
    single = next(s for s in ok["anyOf"] if s["$ref"].endswith("/PredictResponse"))
    response = _resolve(schema, single)
    props = response["properties"]
    assert {"cost", "timings_ms", "next_sensor", "unavailable"} <= set(props)
    cost = _resolve(schema, props["cost"])
    assert {"unit", "budget", "planned", "spent", "charged", "given"} <= set(cost["properties"])
    assert not {"extraction", "inference", "queued"} & set(cost["properties"])
    timings = _resolve(schema, props["timings_ms"])
    assert set(timings["properties"]) == {
        "extraction",
        "inference",
        "queued",
        "decode",
        "since_received",
    }
    assert all("milliseconds" in v["description"] for v in timings["properties"].values())
    request = schema["components"]["schemas"]["PredictRequest"]["properties"]["item"]
    tabular = next(s for s in request["anyOf"] if "values" in s["properties"])
    assert tabular.get("required", []) == [], "id and values are both optional"


def test_documented_statuses_are_what_the_routes_return(client: TestClient, tmp_path: Path) -> None:
    assert _error(client.get("/models/nope"), 404, "model_not_found")
    assert _error(client.get("/models/nope/costs"), 404, "model_not_found")
    assert _error(client.get("/models/digits/skyline?size=0"), 422, "invalid_request")
    assert _error(
        client.get("/models/digits/skyline?size=64&strategy=nope"), 404, "strategy_not_found"
    )
    assert client.get("/metrics").headers["content-type"].startswith("text/plain")
    # No bundle at all: not ready (503), nothing listed, every model unknown (404).
    with TestClient(
        create_app(Settings(models_dir=tmp_path), cache=InProcessCache(1 << 10))
    ) as empty:
        ready = empty.get("/readyz")
        assert ready.status_code == 503 and ready.json()["ready"] is False
        assert empty.get("/models").status_code == 200
        _error(
            empty.post("/predict", json={"model": "digits", "item": ITEM, "budget": 5}),
            404,
            "model_not_found",
        )
