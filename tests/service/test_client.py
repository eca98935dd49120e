"""``service.client`` against the real app under a real uvicorn; its retries against a
socket that drops connections."""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.cache import InProcessCache
from service.client import (
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
    app = create_app(Settings(models_dir=models), cache=InProcessCache(1 << 24))
    with uvicorn_thread(app) as port:
        yield Client(f"http://127.0.0.1:{port}", timeout=60.0)


def png(index: int, side: int) -> bytes:
    return base64.b64decode(png_b64(digit_image(index, side)))


def test_predict_batch_and_models(client: Client) -> None:
    assert client.ready()
    listed = client.models()
    assert sorted(m.name for m in listed.models) == ["digits", "router"]
    assert listed.failed == []
    digits = next(m for m in listed.models if m.name == "digits")
    assert digits.cost_unit == "ms" and "polydom-anytime" in digits.strategies
    assert client.model("router")["item"]["kind"] == "tabular"

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


class DroppingServer:
    """A loopback socket that drops the first ``drops`` connections without answering, then
    answers every request with ``status`` and a fixed JSON body; counts connections."""

    def __init__(self, drops: int, status: int, body: bytes) -> None:
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
                if self.connections <= self.drops:
                    continue  # closed without an answer
                reason = {200: "OK", 503: "Service Unavailable"}[self.status]
                conn.sendall(
                    f"HTTP/1.1 {self.status} {reason}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(self.body)}\r\nConnection: close\r\n\r\n".encode()
                    + self.body
                )

    def close(self) -> None:
        self.sock.close()
        self.thread.join(timeout=5)


def test_retries_connection_errors_only() -> None:
    models = b'{"models": [], "failed": []}'
    server = DroppingServer(drops=2, status=200, body=models)
    try:
        listed = Client(f"http://127.0.0.1:{server.port}", retries=3, backoff_s=0.01).models()
        assert listed.models == [] and server.connections == 3
    finally:
        server.close()
    server = DroppingServer(drops=5, status=200, body=models)
    try:
        with pytest.raises(ConnectionError):
            Client(f"http://127.0.0.1:{server.port}", retries=2, backoff_s=0.01).models()
        assert server.connections == 3
    finally:
        server.close()
    busy = b'{"error": {"type": "overloaded", "message": "busy", "details": {}}}'
    server = DroppingServer(drops=0, status=503, body=busy)
    try:
        with pytest.raises(ServiceError) as caught:
            Client(f"http://127.0.0.1:{server.port}", retries=3, backoff_s=0.01).models()
        assert caught.value.type == "overloaded" and server.connections == 1
    finally:
        server.close()
    # nothing listens: refused, retried, then raised
    with pytest.raises(OSError):
        Client(f"http://127.0.0.1:{free_port()}", retries=1, backoff_s=0.01).models()
