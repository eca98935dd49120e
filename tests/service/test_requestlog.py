"""Request ids (``x-request-id``) and the one log line per request, through the real app."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.cache import InProcessCache
from service.http import create_app
from service.http.requestlog import JsonFormatter, RefusalLines, RequestIdFilter
from service.settings import Settings
from tests.conftest import png_b64

ITEM = {"png_base64": png_b64(np.linspace(0, 1, 32 * 32, dtype=np.float32).reshape(32, 32))}
GENERATED = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def client(tiny_bundle_dir: Path) -> Iterator[TestClient]:
    app = create_app(
        Settings(models_dir=tiny_bundle_dir.parent, max_body_bytes=4096),
        cache=InProcessCache(1 << 20),
    )
    with TestClient(app) as c:
        yield c


def request_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "budgetserve.request"]


def test_a_given_request_id_is_echoed_on_success_and_errors(client: TestClient) -> None:
    ok = client.post(
        "/predict",
        json={"model": "tiny", "item": ITEM, "budget": 1000},
        headers={"x-request-id": "order-42/a"},
    )
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "order-42/a"
    missing = client.post(
        "/predict",
        json={"model": "nope", "item": ITEM, "budget": 1},
        headers={"X-Request-ID": "r-404"},
    )
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "r-404"
    too_big = client.post(  # refused by the body-limit middleware, before any route
        "/predict", content=b"{" + b" " * 5000 + b"}", headers={"x-request-id": "r-413"}
    )
    assert too_big.status_code == 413 and too_big.headers["x-request-id"] == "r-413"
    assert client.get("/healthz", headers={"x-request-id": "probe"}).headers["x-request-id"] == (
        "probe"
    )


@pytest.mark.parametrize("given", [None, "", "has space", "x" * 129, "naïve"])
def test_a_missing_or_unusable_request_id_is_replaced(
    client: TestClient, given: str | None
) -> None:
    headers = {} if given is None else {b"x-request-id": given.encode()}
    r = client.get("/models", headers=headers)
    assert GENERATED.fullmatch(r.headers["x-request-id"]), r.headers["x-request-id"]
    second = client.get("/models").headers["x-request-id"]
    assert second != r.headers["x-request-id"]


def test_one_log_line_per_request_with_what_it_spent(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="budgetserve.request")
    body = {"model": "tiny", "item": {**ITEM, "id": "log-test"}, "budget": 1000}
    first = client.post("/predict", json=body, headers={"x-request-id": "first"}).json()
    client.post("/predict", json=body, headers={"x-request-id": "second"})
    client.post("/predict", json={**body, "strategy": "nope"}, headers={"x-request-id": "third"})
    client.get("/healthz")  # probes log at DEBUG only
    lines = request_lines(caplog)
    assert [r.fields["request_id"] for r in lines] == ["first", "second", "third"]  # type: ignore[attr-defined]
    one, two, three = (r.fields for r in lines)  # type: ignore[attr-defined]
    assert one["status"] == 200 and one["outcome"] == "ok" and one["model"] == "tiny"
    assert one["strategy"] == first["strategy"] and one["budget"] == 1000
    assert one["spent"] == first["cost"]["spent"] and one["cached"] == []
    assert one["extracted"] == first["cost"]["extracted"] != []
    assert two["cached"] == sorted(first["cost"]["extracted"])  # the same item: cached
    assert three["status"] == 404 and three["outcome"] == "strategy_not_found"
    assert three["strategy"] == "nope" and "spent" not in three
    formatted = json.loads(JsonFormatter().format(lines[0]))
    assert formatted["request_id"] == "first" and formatted["message"] == "POST /predict 200"
    assert formatted["spent"] == first["cost"]["spent"] and formatted["level"] == "INFO"


def test_records_logged_while_serving_carry_the_request_id(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(RequestIdFilter())
    client.get("/models/tiny", headers={"x-request-id": "inspect-1"})
    line = request_lines(caplog)[-1]
    assert line.request_id == "inspect-1"  # type: ignore[attr-defined]
    outside = logging.LogRecord("x", logging.INFO, __file__, 1, "m", None, None)
    RequestIdFilter().filter(outside)
    assert outside.request_id == "-"  # type: ignore[attr-defined]


def test_v2_infer_logs_what_it_spent_and_counts_from_the_receipt(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="budgetserve.request")
    png = ITEM["png_base64"]
    body = {
        "inputs": [
            {"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [png]},
            {"name": "ID", "datatype": "BYTES", "shape": [1], "data": ["v2-log"]},
        ],
        "parameters": {"budget": 1000},
    }
    ok = client.post("/v2/models/tiny/infer", json=body, headers={"x-request-id": "v2-a"})
    assert ok.status_code == 200, ok.text
    answer = json.loads(next(o for o in ok.json()["outputs"] if o["name"] == "RESPONSE")["data"][0])
    work = {**body, "parameters": {"budget": 1000, "accounting": "work"}}
    second = client.post("/v2/models/tiny/infer", json=work, headers={"x-request-id": "v2-b"})
    assert second.status_code == 200, second.text
    again = json.loads(
        next(o for o in second.json()["outputs"] if o["name"] == "RESPONSE")["data"][0]
    )
    bad = {**body, "parameters": {"budget": 1000, "accounting": "later"}}
    refused = client.post("/v2/models/tiny/infer", json=bad, headers={"x-request-id": "v2-c"})
    assert refused.status_code == 422 and "accounting" in refused.json()["error"]
    one, two, three = (r.fields for r in request_lines(caplog))  # type: ignore[attr-defined]
    assert one["request_id"] == "v2-a" and one["model"] == "tiny" and one["outcome"] == "ok"
    assert one["budget"] == 1000 and one["spent"] == answer["cost"]["spent"]
    assert one["strategy"] == answer["strategy"] and one["cached"] == []
    assert one["extracted"] == answer["cost"]["extracted"] != []
    # The deadline of a single v2 item counts from the receipt, as /predict's does.
    assert answer["cost"]["accounting"] == "deadline"
    assert answer["timings_ms"]["since_received"] >= answer["cost"]["spent"]
    assert again["cost"]["accounting"] == "work"
    assert two["cached"] == sorted(answer["cost"]["extracted"])  # the same item: cached
    assert three["status"] == 422 and three["outcome"] == "invalid_request"


def test_refusal_lines_follow_a_token_bucket_and_count_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The limiter alone (the server's path: tests/service/test_limits.py): a burst of as
    many lines as the rate, then one a second; what is held back is said in one line once
    its window is over, and a rate of 0 logs every refusal."""
    limiter = RefusalLines(per_s=2)
    caplog.set_level(logging.INFO, logger="budgetserve.request")
    admitted = [limiter.admit() for _ in range(7)]
    assert admitted == [True, True, False, False, False, False, False]
    limiter.flush()  # the window is not over: nothing yet
    assert not [r for r in request_lines(caplog) if "more overload" in r.getMessage()]
    limiter.flush(force=True)
    said = [r.getMessage() for r in request_lines(caplog)]
    assert len(said) == 1 and said[0].startswith("5 more overload refusals"), said
    limiter.flush(force=True)  # nothing held: nothing said again
    assert len(request_lines(caplog)) == 1
    unlimited = RefusalLines(per_s=0)
    assert all(unlimited.admit() for _ in range(100))
