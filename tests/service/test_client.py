"""``service.client`` (sync and async) against the real app under a real uvicorn, every
route; its retries against a socket that drops connections or answers 503 with
Retry-After."""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from service.cache import InProcessCache
from service.client import (
    AsyncClient,
    BatchPredictResponse,
    Client,
    PredictResponse,
    ServiceError,
    image_item,
    tabular_item,
)
from service.http import create_app
from service.settings import Settings
from tests.conftest import digit_image, free_port, png_b64
from tests.service.serving import uvicorn_thread


@pytest.fixture(scope="module")
def client(
    tmp_path_factory: pytest.TempPathFactory, digits_bundle_dir: Path, router_bundle_dir: Path
) -> Iterator[Client]:
    models = tmp_path_factory.mktemp("client") / "models"
    models.mkdir()
    (models / "digits").symlink_to(digits_bundle_dir.resolve(), target_is_directory=True)
    (models / "router").symlink_to(router_bundle_dir.resolve(), target_is_directory=True)
    settings = Settings(models_dir=models, admin_token=SecretStr(TOKEN))
    app = create_app(settings, cache=InProcessCache(1 << 24))
    with (
        uvicorn_thread(app) as port,
        Client(f"http://127.0.0.1:{port}", timeout=60.0, admin_token=TOKEN) as c,
    ):
        yield c


TOKEN = "client-s3cret"


def png(index: int, side: int) -> bytes:
    return base64.b64decode(png_b64(digit_image(index, side)))


def test_predict_batch_and_models(client: Client) -> None:
    assert client.ready()
    listed = client.models()
    assert sorted(m.name for m in listed.models) == ["digits", "router"]
    assert listed.failed == []
    digits = next(m for m in listed.models if m.name == "digits")
    assert digits.cost_unit == "ms" and "polydom-anytime" in digits.strategies
    item = client.model("router")["item"]
    # the fields of a tabular item only (a table has no max_pixels nor max_tokens)
    assert item["kind"] == "tabular" and item["columns"] and "max_pixels" not in item
    assert set(client.model("digits")["item"]) == {
        "kind",
        "size_unit",
        "max_pixels",
        "min_side",
        "channels",
    }

    answer = client.predict("digits", image_item(png(3, 64), "three"), budget=1000.0)
    assert isinstance(answer, PredictResponse)
    assert answer.prediction in answer.probabilities and answer.cost.unit == "ms"

    batch = client.predict_batch(
        "router",
        [tabular_item({"r": 0.9}), tabular_item({"r": -0.4}, "x")],
        total_budget=7.0,
    )
    assert isinstance(batch, BatchPredictResponse)
    assert len(batch.results) == 2 and batch.cost.total_budget == 7.0
    assert batch.cost.spent == pytest.approx(sum(r.cost.spent for r in batch.results))
    assert batch.cost.spent <= 7.0
    each = client.predict_batch("router", [tabular_item({"r": 0.1})], budget=2.0)
    assert each.cost.budget == 2.0 and each.results[0].cost.budget == 2.0
    with pytest.raises(ValueError, match="exactly one"):
        client.predict_batch("router", [tabular_item({})])


def test_errors_raise_with_the_services_reason(client: Client) -> None:
    with pytest.raises(ServiceError) as caught:
        client.predict("nope", tabular_item({}), budget=1.0)
    assert caught.value.status == 404 and caught.value.type == "model_not_found"
    assert caught.value.details["available"] == ["digits", "router"]
    with pytest.raises(ServiceError) as caught:
        client.predict("router", tabular_item({"zz": 1.0}), budget=1.0, request_id="bad-zz")
    assert caught.value.status == 422 and "'zz'" in caught.value.message
    assert caught.value.request_id == "bad-zz"  # echoed by the service
    with pytest.raises(ServiceError) as caught:
        client.predict("digits", image_item(png(1, 32)), budget=5.0, version="9.9")
    assert caught.value.status == 404 and caught.value.type == "version_not_found"
    with pytest.raises(ServiceError) as caught:
        client.predict("digits", image_item(png(1, 32)), budget=5.0, accounting="later")
    assert caught.value.status == 422 and "accounting" in caught.value.message


def test_version_and_accounting_reach_the_service(client: Client) -> None:
    version = next(m.version for m in client.models().models if m.name == "digits")
    item = image_item(png(5, 32), "versioned")
    answer = client.predict("digits", item, 1000.0, version=version, accounting="work")
    assert answer.model_version == version and answer.cost.accounting == "work"
    default = client.predict("digits", item, 1000.0, request_id="rid-1")
    assert default.cost.accounting == "deadline"
    batch = client.predict_batch("digits", [item], budget=1000.0, version=version)
    assert batch.results[0].model_version == version


def test_every_other_route(client: Client) -> None:
    assert client.healthy() and client.ready()
    assert "budgetserve_requests_total" in client.metrics()
    costs = client.costs("digits")
    assert costs["model"] == "digits" and costs["unit"] == "ms"
    skyline = client.skyline("digits", size=64 * 64)
    assert skyline["size"] == 4096 and skyline["skyline"]
    assert client.skyline("router", 1, strategy="dag")["strategy"] == "dag"
    # the Open Inference Protocol
    assert client.v2_live() and client.v2_ready() and client.v2_model_ready("router")
    assert not client.v2_model_ready("nope")
    assert client.v2_server_metadata()["name"] == "budgetserve"
    assert client.v2_model_metadata("router")["name"] == "router"
    assert client.v2_model_config("router")["platform"] == "budgetserve"
    answer = client.v2_infer(
        "router",
        [{"name": "r", "shape": [1], "datatype": "FP32", "data": [0.5]}],
        {"budget": 3.0},
        outputs=["PREDICTION"],
    )
    assert [o["name"] for o in answer["outputs"]] == ["PREDICTION"]
    stats = {s["name"]: s for s in client.v2_statistics()["model_stats"]}
    assert stats["router"]["execution_count"] >= 1
    assert client.v2_statistics("router")["model_stats"][0]["name"] == "router"
    assert {m["name"] for m in client.v2_repository_index(ready=True)} == {"digits", "router"}
    with pytest.raises(ServiceError) as caught:
        client.v2_model_metadata("nope")
    assert caught.value.status == 404 and "'nope' is not loaded" in caught.value.message


def test_admin_routes_with_the_token(client: Client) -> None:
    assert client.reload("router")["loaded"][0]["name"] == "router"
    assert client.unload("router")["unloaded"] == ["router"]
    assert not client.v2_model_ready("router")
    assert client.v2_load("router") == {"name": "router", "load": True}
    assert client.v2_unload("router") == {"name": "router", "unload": True}
    assert [e["name"] for e in client.reload()["loaded"]] == ["digits", "router"]
    anonymous = Client(client.base_url)
    with pytest.raises(ServiceError) as caught:
        anonymous.reload("router")
    assert caught.value.status == 401 and caught.value.type == "admin_unauthorized"
    anonymous.close()


def test_the_async_client(client: Client) -> None:
    async def run() -> None:
        async with AsyncClient(client.base_url, admin_token=TOKEN) as c:
            assert await c.ready() and await c.healthy() and await c.v2_live()
            answers = await asyncio.gather(
                *(c.predict("router", tabular_item({"r": r}), budget=3.0) for r in (0.1, -0.9))
            )
            assert [a.cost.budget for a in answers] == [3.0, 3.0]
            batch = await c.predict_batch("router", [tabular_item({})], total_budget=4.0)
            assert batch.cost.total_budget == 4.0
            assert [m.name for m in (await c.models()).models] == ["digits", "router"]
            assert (await c.model("router"))["item"]["kind"] == "tabular"
            assert (await c.skyline("router", 1))["unit"] == "units"
            assert (await c.reload("router"))["loaded"]
            assert (
                await c.v2_infer(
                    "router",
                    [{"name": "r", "shape": [1], "datatype": "FP32", "data": [0.5]}],
                    {"budget": 3.0},
                )
            )["model_name"] == "router"
            with pytest.raises(ServiceError) as caught:
                await c.predict("nope", tabular_item({}), budget=1.0)
            assert caught.value.type == "model_not_found"

    asyncio.run(run())


class DroppingServer:
    """A loopback socket that drops the first ``drops`` connections without answering, then
    answers every request with ``status`` and a fixed JSON body; counts connections."""

    def __init__(
        self, drops: int, status: int, body: bytes, retry_after: str | None = None, busy: int = 0
    ) -> None:
        self.retry_after = retry_after
        self.busy = busy  # answers with `status` (and Retry-After) this many times, then 200
        self.stamps: list[float] = []
        self.drops = drops
        self.status = status
        self.body = body
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.connections += 1
                conn.recv(65536)
                self.stamps.append(time.monotonic())
                if self.connections <= self.drops:
                    continue  # closed without an answer
                answered = self.connections - self.drops
                status = self.status if not self.busy or answered <= self.busy else 200
                body = self.body if status != 200 else b'{"models": [], "failed": []}'
                reason = {200: "OK", 503: "Service Unavailable"}[status]
                extra = f"Retry-After: {self.retry_after}\r\n" if self.retry_after else ""
                conn.sendall(
                    f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n{extra}"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                    + body
                )

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=5)


def test_retries_connection_errors_and_overload_only() -> None:
    models = b'{"models": [], "failed": []}'
    server = DroppingServer(drops=2, status=200, body=models)
    try:
        listed = Client(f"http://127.0.0.1:{server.port}", retries=3, backoff_s=0.01).models()
        assert listed.models == [] and server.connections == 3
    finally:
        server.close()
    server = DroppingServer(drops=5, status=200, body=models)
    try:
        with pytest.raises(httpx.RemoteProtocolError):
            Client(f"http://127.0.0.1:{server.port}", retries=2, backoff_s=0.01).models()
        assert server.connections == 3
    finally:
        server.close()
    # a 503 without Retry-After (a model that failed to load) is an answer: not retried
    busy = b'{"error": {"type": "model_not_ready", "message": "failed", "details": {}}}'
    server = DroppingServer(drops=0, status=503, body=busy)
    try:
        with pytest.raises(ServiceError) as caught:
            Client(f"http://127.0.0.1:{server.port}", retries=3, backoff_s=0.01).models()
        assert caught.value.type == "model_not_ready" and server.connections == 1
    finally:
        server.close()
    # nothing listens: refused, retried, then raised
    with pytest.raises(httpx.ConnectError):
        Client(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01).models()


def test_a_503_with_retry_after_is_retried_after_that_wait() -> None:
    """Overloaded: sent again after Retry-After (not the 10 ms back-off), sync and async;
    at most ``retries`` more times, then the 503 is raised with its Retry-After."""
    busy = b'{"error": {"type": "overloaded", "message": "busy", "details": {}}}'
    server = DroppingServer(drops=0, status=503, body=busy, retry_after="1", busy=1)
    try:
        url = f"http://127.0.0.1:{server.port}"
        assert Client(url, retries=2, backoff_s=0.01).models().models == []
        assert server.connections == 2
        assert server.stamps[1] - server.stamps[0] >= 0.9  # waited the 1 s it was told

        async def run() -> None:
            async with AsyncClient(url, retries=2, backoff_s=0.01, max_wait_s=0.05) as c:
                server.busy, server.connections, server.stamps = 1, 0, []
                assert (await c.models()).models == []
                assert server.connections == 2

        asyncio.run(run())
        server.busy, server.connections = 10, 0
        with pytest.raises(ServiceError) as caught:
            Client(url, retries=2, backoff_s=0.01, max_wait_s=0.01).models()
        assert caught.value.status == 503 and caught.value.retry_after_s == 1.0
        assert server.connections == 3
    finally:
        server.close()
