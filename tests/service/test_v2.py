"""The Open Inference Protocol routes (``service.http.v2``) through a client nobody here
wrote: Triton's ``tritonclient.http``, against a real uvicorn serving the real app with an
image bundle (digits) and a tabular one (router)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from service.bundle import read_manifest
from service.cache import InProcessCache
from service.http import create_app
from service.settings import Settings
from tests.conftest import digit_image, png_b64
from tests.service.serving import uvicorn_thread


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, digits_bundle_dir: Path, router_bundle_dir: Path
) -> Iterator[str]:
    models = tmp_path_factory.mktemp("v2") / "models"
    models.mkdir()
    (models / "digits").symlink_to(digits_bundle_dir.resolve(), target_is_directory=True)
    (models / "router").symlink_to(router_bundle_dir.resolve(), target_is_directory=True)
    app = create_app(Settings(models_dir=models), cache=InProcessCache(1 << 24))
    with uvicorn_thread(app) as port:
        yield f"127.0.0.1:{port}"


@pytest.fixture
def client(server: str) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(url=server, connection_timeout=60.0, network_timeout=60.0)
    try:
        yield c
    finally:
        c.close()


def png_bytes(index: int, side: int) -> bytes:
    import base64

    return base64.b64decode(png_b64(digit_image(index, side)))


def test_health_and_metadata(client: triton.InferenceServerClient, digits_bundle_dir: Path) -> None:
    version = read_manifest(digits_bundle_dir).version
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["name"] == "budgetserve"
    assert client.is_model_ready("digits")
    assert client.is_model_ready("digits", model_version=version)
    assert not client.is_model_ready("digits", model_version="no-such-version")
    assert not client.is_model_ready("nope")
    meta = client.get_model_metadata("digits")
    assert meta["versions"] == [version]
    assert [i["name"] for i in meta["inputs"]] == ["IMAGE", "ID"]
    assert {o["name"] for o in meta["outputs"]} >= {"PREDICTION", "PROBABILITIES", "RESPONSE"}
    assert meta["parameters"]["cost_unit"] == "ms"
    with pytest.raises(InferenceServerException, match="no version 'v0'"):
        client.get_model_metadata("digits", model_version="v0")
    with pytest.raises(InferenceServerException, match="'nope' is not loaded"):
        client.get_model_metadata("nope")
    tabular = client.get_model_metadata("router")
    assert [i["name"] for i in tabular["inputs"]][:5] == ["r", "a1", "a2", "b1", "b2"]


def test_png_as_binary_bytes_answers_as_predict_does(
    client: triton.InferenceServerClient, server: str
) -> None:
    raw = png_bytes(3, 64)
    image = triton.InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(np.array([raw], dtype=np.object_))  # binary data (the default)
    result = client.infer("digits", [image], parameters={"budget": 1000.0})
    want = httpx.post(
        f"http://{server}/predict",
        json={
            "model": "digits",
            "item": {"png_base64": png_b64(digit_image(3, 64))},
            "budget": 1000.0,
        },
        timeout=60,
    ).json()
    prediction = result.as_numpy("PREDICTION")
    assert prediction is not None and prediction.tolist() == [want["prediction"]]
    probs = result.as_numpy("PROBABILITIES")
    classes = result.as_numpy("CLASSES")
    assert probs is not None and classes is not None and probs.shape == (1, len(classes))
    assert probs.sum() == pytest.approx(1.0, abs=1e-4)
    # JSON outputs: BYTES elements come back as text
    assert classes[int(np.argmax(probs[0]))] == want["prediction"]
    full = result.as_numpy("RESPONSE")
    assert full is not None
    report = json.loads(full[0])
    assert report["answered_by"] == want["answered_by"]
    assert report["cost"]["budget"] == 1000.0 and report["cost"]["unit"] == "ms"
    spent = result.as_numpy("COST_SPENT")
    assert spent is not None and spent[0] == pytest.approx(report["cost"]["spent"], rel=1e-5)
    answer = result.get_response()
    assert answer["model_name"] == "digits" and answer["parameters"]["budget"] == 1000.0


def test_float_images_in_json_as_a_batch_under_a_total_budget(
    client: triton.InferenceServerClient,
) -> None:
    images = np.stack([digit_image(i, 48) for i in (1, 2, 5)]).astype(np.float32)
    tensor = triton.InferInput("IMAGE", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images, binary_data=False)
    ids = triton.InferInput("ID", [3], "BYTES")
    ids.set_data_from_numpy(np.array([b"a", b"b", b"c"], dtype=np.object_), binary_data=False)
    outputs = [triton.InferRequestedOutput(n) for n in ("PREDICTION", "COST_SPENT", "RESPONSE")]
    result = client.infer(
        "digits", [tensor, ids], outputs=outputs, parameters={"total_budget": 15.0}
    )
    answer = result.get_response()
    assert [o["name"] for o in answer["outputs"]] == ["PREDICTION", "COST_SPENT", "RESPONSE"]
    spent = result.as_numpy("COST_SPENT")
    assert spent is not None and spent.shape == (3,)
    assert answer["parameters"]["spent"] == pytest.approx(float(spent.sum()), rel=1e-4)
    assert answer["parameters"]["total_budget"] == 15.0
    reports = [json.loads(r) for r in result.as_numpy("RESPONSE")]
    assert all(r["cost"]["budget"] <= 15.0 for r in reports)
    # the images were decoded as sent: the largest budget buys a model past the prior
    assert any(r["features"] for r in reports)


def column_inputs(rows: dict[str, list[float]], binary: bool) -> list[triton.InferInput]:
    out = []
    for name, values in rows.items():
        tensor = triton.InferInput(name, [len(values)], "FP32")
        tensor.set_data_from_numpy(np.asarray(values, dtype=np.float32), binary_data=binary)
        out.append(tensor)
    return out


def test_tabular_inputs_per_column_and_as_values(
    client: triton.InferenceServerClient, server: str
) -> None:
    rows = {"r": [0.8, -1.1], "a1": [2.0, 0.1], "a2": [0.3, -0.2]}
    by_column = client.infer("router", column_inputs(rows, binary=True), parameters={"budget": 6.0})
    singles = [
        httpx.post(
            f"http://{server}/predict",
            json={
                "model": "router",
                "item": {"values": {k: float(np.float32(v[i])) for k, v in rows.items()}},
                "budget": 6.0,
            },
            timeout=60,
        ).json()
        for i in range(2)
    ]
    got = [json.loads(r) for r in by_column.as_numpy("RESPONSE")]
    assert [g["answered_by"] for g in got] == [s["answered_by"] for s in singles]
    assert [g["prediction"] for g in got] == [s["prediction"] for s in singles]
    assert [g["cost"]["given"] for g in got] == [["a", "r"], ["a", "r"]]
    # VALUES: [B, C] with every column, JSON
    full = np.array([[0.8, 2.0, 0.3, 0.0, 0.1]], dtype=np.float32)
    values = triton.InferInput("VALUES", [1, 5], "FP32")
    values.set_data_from_numpy(full, binary_data=False)
    result = client.infer("router", [values], parameters={"budget": 20.0})
    report = json.loads(result.as_numpy("RESPONSE")[0])
    assert sorted(report["cost"]["given"]) == ["a", "b", "r"] and report["cost"]["spent"] == 0.0


def _named_columns(parameters: dict[str, Any], rows: int = 2) -> dict[str, Any]:
    """A JSON infer body: ``rows`` items of columns r and b1 of the router bundle."""
    return {
        "inputs": [
            {
                "name": "VALUES",
                "shape": [rows, 2],
                "datatype": "FP64",
                "parameters": {"columns": "r, b1"},
                "data": [[-0.5, 1.5], [0.7, 0.0]][:rows],
            }
        ],
        "parameters": parameters,
        "outputs": [{"name": "RESPONSE"}],
    }


def test_values_with_named_columns_over_plain_json(server: str) -> None:
    body = _named_columns({"total_budget": 12.0})
    r = httpx.post(f"http://{server}/v2/models/router/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    reports = [json.loads(x) for x in r.json()["outputs"][0]["data"]]
    assert sum(x["cost"]["spent"] for x in reports) <= 12.0
    assert all("r" in x["cost"]["given"] for x in reports)


def test_a_mean_budget_over_the_protocol(server: str) -> None:
    """parameters.budget_mode and parameters.max_cost reach each item as in POST /predict
    (one item, or a batch of them); with a total_budget they are refused."""
    mean = {"budget": 3.0, "budget_mode": "mean", "max_cost": 5.0}
    for rows in (2, 1):
        body = _named_columns(mean, rows)
        r = httpx.post(f"http://{server}/v2/models/router/infer", json=body, timeout=60)
        assert r.status_code == 200, r.text
        reports = [json.loads(x) for x in r.json()["outputs"][0]["data"]]
        assert len(reports) == rows
        for report in reports:
            cost = report["cost"]
            assert (cost["budget_mode"], cost["budget"], cost["cap"]) == ("mean", 3.0, 5.0)
            assert cost["spent"] <= 5.0
    body["parameters"] = {"total_budget": 6.0, "budget_mode": "mean"}
    r = httpx.post(f"http://{server}/v2/models/router/infer", json=body, timeout=60)
    assert r.status_code in (400, 422) and "go with 'budget'" in r.text, r.text
    body["parameters"] = {"budget": 3.0, "budget_mode": 1}
    r = httpx.post(f"http://{server}/v2/models/router/infer", json=body, timeout=60)
    assert r.status_code == 400 and "budget_mode must be a string" in r.text, r.text


@pytest.mark.parametrize(
    ("model", "inputs", "parameters", "status", "mentions"),
    [
        ("router", {"r": [1.0]}, {}, "400", "exactly one of parameters.budget"),
        ("router", {"r": [1.0]}, {"budget": -1.0}, "400", "must be > 0"),
        ("router", {"zz": [1.0]}, {"budget": 1.0}, "422", "'zz'"),
        ("router", {"r": [1.0], "a1": [1.0, 2.0]}, {"budget": 1.0}, "400", "batch size"),
        ("nope", {"r": [1.0]}, {"budget": 1.0}, "404", "not loaded"),
        ("digits", {"r": [1.0]}, {"budget": 1.0}, "400", "takes the input IMAGE"),
    ],
)
def test_errors_are_the_protocols_with_a_4xx(
    client: triton.InferenceServerClient,
    model: str,
    inputs: dict[str, list[float]],
    parameters: dict[str, Any],
    status: str,
    mentions: str,
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        client.infer(model, column_inputs(inputs, binary=False), parameters=parameters)
    assert caught.value.status() == status
    assert mentions in caught.value.message()


def test_version_path(client: triton.InferenceServerClient, digits_bundle_dir: Path) -> None:
    version = read_manifest(digits_bundle_dir).version
    image = triton.InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(np.array([png_bytes(7, 32)], dtype=np.object_))
    result = client.infer("digits", [image], model_version=version, parameters={"budget": 5.0})
    assert result.get_response()["model_version"] == version
    with pytest.raises(InferenceServerException) as caught:
        client.infer("digits", [image], model_version="0", parameters={"budget": 5.0})
    assert caught.value.status() == "404" and version in caught.value.message()


def test_malformed_bodies_are_400(server: str) -> None:
    url = f"http://{server}/v2/models/router/infer"
    head = b'{"inputs": [{"name": "r", "shape": [1], "datatype": "FP32", "data": [1]}]}'
    for content, headers, mentions in [
        (b"{", {}, "not valid JSON"),
        (b'{"inputs": []}', {}, "inputs"),
        (b'{"inputs": [{"name": "r", "shape": [1], "datatype": "FP32"}]}', {}, "neither data"),
        (head + b"xx", {"Inference-Header-Content-Length": str(len(head))}, "bytes follow"),
        (b"{}", {"Inference-Header-Content-Length": "9"}, "Inference-Header-Content-Length"),
    ]:
        r = httpx.post(url, content=content, headers=headers, timeout=60)
        assert r.status_code == 400, (content, r.text)
        assert set(r.json()) == {"error"} and mentions in r.json()["error"], r.text


def test_uint8_images_and_ids_over_plain_json(server: str) -> None:
    image = np.clip(digit_image(6, 32) * 255.0 + 0.5, 0, 255).astype(np.uint8)
    body: dict[str, Any] = {
        "id": "req-1",
        "inputs": [
            {"name": "IMAGE", "shape": [1, 32, 32], "datatype": "UINT8", "data": image.tolist()},
            {"name": "ID", "shape": [1], "datatype": "BYTES", "data": ["six"]},
        ],
        "parameters": {"budget": 1000.0},
        "outputs": [{"name": "PREDICTION"}],
    }
    r = httpx.post(f"http://{server}/v2/models/digits/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "req-1" and r.json()["outputs"][0]["data"] == ["6"]
    body["inputs"][1] = {"name": "ID", "shape": [1], "datatype": "INT32", "data": [6]}
    r = httpx.post(f"http://{server}/v2/models/digits/infer", json=body, timeout=60)
    assert r.status_code == 400 and "ID must be BYTES" in r.json()["error"]
    body["inputs"] = [
        {"name": "IMAGE", "shape": [1, 2, 2], "datatype": "FP32", "data": [0, 1, 2, 0]}
    ]
    r = httpx.post(f"http://{server}/v2/models/digits/infer", json=body, timeout=60)
    assert r.status_code == 400 and "[0, 1]" in r.json()["error"]
