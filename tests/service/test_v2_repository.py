"""The Open Inference Protocol's REST extensions (model repository, configuration,
statistics) and its error shape, through Triton's own REST client (``tritonclient.http``),
against a real uvicorn serving the real app; and ``/readyz`` once a failed folder is gone."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from pydantic import SecretStr
from tritonclient.utils import InferenceServerException

from service.cache import InProcessCache
from service.http import create_app
from service.settings import Settings
from tests.service.serving import uvicorn_thread

TOKEN = "rest-s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, router_bundle_dir: Path) -> Iterator[str]:
    models = tmp_path_factory.mktemp("v2repo") / "models"
    (models / "router").mkdir(parents=True)
    for version in ("1", "2"):
        (models / "router" / version).symlink_to(router_bundle_dir.resolve(), True)
    (models / "broken").mkdir()
    (models / "broken" / "manifest.json").write_text('{"name": "broken"}')
    settings = Settings(models_dir=models, admin_token=SecretStr(TOKEN))
    app = create_app(settings, cache=InProcessCache(1 << 20))
    with uvicorn_thread(app) as port:
        yield f"127.0.0.1:{port}"


@pytest.fixture
def client(server: str) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(url=server)
    try:
        yield c
    finally:
        c.close()


def test_config_statistics_and_index(client: triton.InferenceServerClient, server: str) -> None:
    config = client.get_model_config("router")
    assert config["name"] == "router" and config["version_policy"] == {"all": {}}
    assert config["parameters"]["version"] == {"string_value": "2"}  # the newest folder
    assert client.get_model_config("router", "1")["parameters"]["version"]["string_value"] == "1"
    assert config["input"][0]["data_type"] == "TYPE_FP32"

    r = triton.InferInput("r", [1], "FP32")
    r.set_data_from_numpy(np.array([0.5], dtype=np.float32))
    first = client.infer("router", [r], parameters={"budget": 3.0}, model_version="1")
    assert first.get_response()["model_version"] == "1"
    newest = client.infer("router", [r], parameters={"budget": 3.0})
    assert newest.get_response()["model_version"] == "2"
    # POST /predict says which version folder answered too (model_version: the manifest's)
    for asked, answered in ((None, "2"), ("1", "1")):
        body = {"model": "router", "item": {"values": {"r": 0.5}}, "budget": 3.0}
        if asked is not None:
            body["version"] = asked
        reply = httpx.post(f"http://{server}/predict", json=body).json()
        assert reply["version"] == answered
    stats = client.get_inference_statistics("router")["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("router", "2")]
    assert stats[0]["execution_count"] == 4 and stats[0]["inference_count"] == 4
    assert stats[0]["inference_stats"]["success"]["count"] == 4
    assert stats[0]["inference_stats"]["success"]["ns"] > 0
    every = client.get_inference_statistics()["model_stats"]
    assert [s["name"] for s in every] == ["router"]

    index = client.get_model_repository_index()
    assert [(m["name"], m["version"], m["state"]) for m in index] == [
        ("router", "1", "READY"),
        ("router", "2", "READY"),
        ("broken", "", "UNAVAILABLE"),
    ]
    assert "manifest" in index[2]["reason"]


def test_load_and_unload_map_to_reload_and_unload(client: triton.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="missing or wrong admin token"):
        client.unload_model("router")
    client.unload_model("router", headers=AUTH)
    assert not client.is_model_ready("router")
    client.load_model("router", headers=AUTH)
    assert client.is_model_ready("router", "2")
    with pytest.raises(InferenceServerException, match="failed to load 'broken'"):
        client.load_model("broken", headers=AUTH)


def test_every_v2_error_is_in_the_protocols_shape(
    client: triton.InferenceServerClient, server: str
) -> None:
    # Routes, methods and bodies FastAPI itself refuses, as well as the protocol's own.
    for method, path, status in [
        ("GET", "/v2/no/such/route", 404),
        ("DELETE", "/v2/models/router", 405),
        ("POST", "/v2/repository/index", 400),
        ("GET", "/v2/models/router/versions/9/config", 404),
        ("POST", "/v2/repository/models/router/load", 401),
    ]:
        content = b"{not json" if path.endswith("index") else None
        r = httpx.request(method, f"http://{server}{path}", content=content, timeout=30)
        assert r.status_code == status, (path, r.text)
        body = r.json()
        assert list(body) == ["error"] and isinstance(body["error"], str), body
    # tritonclient reads them (it crashed on the app's own error shape)
    with pytest.raises(InferenceServerException, match="no version '9'"):
        client.get_model_config("router", "9")
    assert httpx.get(f"http://{server}/nope", timeout=30).json()["error"]["type"] == "http_error"


def test_readyz_forgets_a_failed_folder_once_removed(
    tmp_path: Path, router_bundle_dir: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "router").symlink_to(router_bundle_dir.resolve(), True)
    (models / "bad").mkdir()
    (models / "bad" / "manifest.json").write_text("{")
    app = create_app(
        Settings(models_dir=models, admin_token=SecretStr(TOKEN)), cache=InProcessCache(1 << 20)
    )
    with uvicorn_thread(app) as port:
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/readyz").json()["failed"] == ["bad"]
        shutil.rmtree(models / "bad")
        assert httpx.post(f"{base}/-/reload", headers=AUTH).status_code == 200
        ready = httpx.get(f"{base}/readyz").json()
        assert ready["failed"] == [] and ready["models"] == ["router"]
        assert httpx.get(f"{base}/models").json()["failed"] == []
