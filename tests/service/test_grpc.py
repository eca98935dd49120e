"""The Open Inference Protocol over gRPC (``service.grpc_api``) through clients nobody here
wrote: Triton's ``tritonclient.grpc`` in this process, and KServe's ``InferenceGRPCClient``
with KServe's own generated stubs in a child process (their ``inference.*`` protobuf
definitions and tritonclient's cannot both be imported into one process), against a real
uvicorn serving the real app with gRPC beside it on one event loop.

The models folder has a versioned digits bundle (``digits/1``) and a flat tabular one
(``router``); the admin token is set, so the repository RPCs load and unload."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from pydantic import SecretStr
from tritonclient.utils import InferenceServerException

from service.cache import InProcessCache
from service.http import create_app
from service.settings import Settings
from tests.conftest import digit_image, free_port, png_b64
from tests.service.serving import uvicorn_thread

TOKEN = "grpc-s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


class Ports:
    def __init__(self, http: int, grpc_port: int, models: Path) -> None:
        self.http = http
        self.grpc = grpc_port
        self.models = models


@pytest.fixture(scope="module")
def ports(
    tmp_path_factory: pytest.TempPathFactory, digits_bundle_dir: Path, router_bundle_dir: Path
) -> Iterator[Ports]:
    models = tmp_path_factory.mktemp("grpc") / "models"
    (models / "digits").mkdir(parents=True)
    (models / "digits" / "1").symlink_to(digits_bundle_dir.resolve(), target_is_directory=True)
    (models / "router").symlink_to(router_bundle_dir.resolve(), target_is_directory=True)
    grpc_port = free_port()
    settings = Settings(models_dir=models, grpc_port=grpc_port, admin_token=SecretStr(TOKEN))
    app = create_app(settings, cache=InProcessCache(1 << 24))
    with uvicorn_thread(app) as http_port:
        yield Ports(http_port, grpc_port, models)


@pytest.fixture
def client(ports: Ports) -> Iterator[tgrpc.InferenceServerClient]:
    c = tgrpc.InferenceServerClient(url=f"127.0.0.1:{ports.grpc}")
    try:
        yield c
    finally:
        c.close()


def png_bytes(index: int, side: int) -> bytes:
    return base64.b64decode(png_b64(digit_image(index, side)))


def test_health_metadata_config_and_statistics(client: tgrpc.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    server = client.get_server_metadata(as_json=True)
    assert server["name"] == "budgetserve" and "model_repository" in server["extensions"]
    assert client.is_model_ready("digits") and client.is_model_ready("digits", "1")
    assert not client.is_model_ready("digits", "2") and not client.is_model_ready("nope")
    meta = client.get_model_metadata("digits", as_json=True)
    assert meta["versions"] == ["1"] and meta["platform"] == "budgetserve"
    assert [i["name"] for i in meta["inputs"]] == ["IMAGE", "ID"]
    config = client.get_model_config("router", as_json=True)["config"]
    assert config["name"] == "router" and config["version_policy"] == {"all": {}}
    assert config["parameters"]["cost_unit"]["string_value"] == "units"
    assert {i["name"] for i in config["input"]} >= {"r", "a1", "VALUES", "ID"}
    assert config["output"][0] == {"name": "PREDICTION", "data_type": "TYPE_STRING", "dims": ["-1"]}
    with pytest.raises(InferenceServerException) as caught:
        client.get_model_metadata("nope")
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert "'nope' is not loaded" in caught.value.message()


def test_infer_with_a_budget_answers_as_rest_does(
    client: tgrpc.InferenceServerClient, ports: Ports
) -> None:
    before = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
    image = tgrpc.InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(np.array([png_bytes(3, 64)], dtype=np.object_))
    result = client.infer("digits", [image], parameters={"budget": 1000.0})
    response = result.get_response(as_json=True)
    assert response["model_version"] == "1"  # the version folder that answered
    assert response["parameters"]["cost_unit"]["string_param"] == "ms"
    report = json.loads(result.as_numpy("RESPONSE")[0])
    assert result.as_numpy("PREDICTION")[0].decode() == report["prediction"]
    classes = [c.decode() for c in result.as_numpy("CLASSES")]
    probabilities = result.as_numpy("PROBABILITIES")
    assert probabilities.shape == (1, len(classes)) and probabilities.dtype == np.float32
    assert classes[int(np.argmax(probabilities[0]))] == report["prediction"]
    assert result.as_numpy("COST_BUDGET")[0] == 1000.0 and report["cost"]["budget"] == 1000.0
    assert report["cost"]["accounting"] == "deadline"  # counted from the message's receipt
    # the same PNG through REST: the same answer, now from the feature cache
    body = {
        "inputs": [
            {
                "name": "IMAGE",
                "shape": [1],
                "datatype": "BYTES",
                "data": [png_b64(digit_image(3, 64))],
            }
        ],
        "parameters": {"budget": 1000.0},
        "outputs": [{"name": "RESPONSE"}],
    }
    rest = thttp.InferenceServerClient(url=f"127.0.0.1:{ports.http}")
    try:
        again = json.loads(
            rest.infer(
                "digits",
                [_rest_image(png_bytes(3, 64))],
                parameters=body["parameters"],
            ).as_numpy("RESPONSE")[0]
        )
    finally:
        rest.close()
    assert again["prediction"] == report["prediction"]
    assert set(again["cost"]["cached"]) >= set(report["cost"]["extracted"])
    after = client.get_inference_statistics("digits", as_json=True)["model_stats"][0]
    assert int(after["execution_count"]) == int(before.get("execution_count", 0)) + 2
    assert int(after["inference_count"]) == int(before.get("inference_count", 0)) + 2


def _rest_image(png: bytes) -> thttp.InferInput:
    image = thttp.InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(np.array([png], dtype=np.object_))
    return image


def test_tabular_batch_and_errors(client: tgrpc.InferenceServerClient) -> None:
    # every column in order (r, a1, a2, b1, b2); NaN: a value not sent
    values = tgrpc.InferInput("VALUES", [2, 5], "FP64")
    nan = float("nan")
    values.set_data_from_numpy(np.array([[0.8, 2.0, 0.3, nan, nan], [-1.1, 0.1, -0.2, nan, nan]]))
    result = client.infer("router", [values], parameters={"total_budget": 12})
    reports = [json.loads(r) for r in result.as_numpy("RESPONSE")]
    assert len(reports) == 2 and sum(r["cost"]["spent"] for r in reports) <= 12.0
    assert all(sorted(r["cost"]["given"]) == ["a", "r"] for r in reports)
    r = tgrpc.InferInput("r", [1], "FP32")
    r.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    cases: list[tuple[str, dict[str, Any], str, str]] = [
        ("router", {}, "INVALID_ARGUMENT", "exactly one of parameters.budget"),
        ("router", {"budget": -1}, "INVALID_ARGUMENT", "must be > 0"),
        ("nope", {"budget": 1}, "NOT_FOUND", "'nope' is not loaded"),
    ]
    for model, parameters, code, message in cases:
        with pytest.raises(InferenceServerException) as caught:
            client.infer(model, [r], parameters=parameters)
        assert caught.value.status() == f"StatusCode.{code}"
        assert message in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        client.infer("digits", [r], parameters={"budget": 1.0}, model_version="7")
    assert caught.value.status() == "StatusCode.NOT_FOUND" and "no version '7'" in str(caught.value)


def test_repository_index_load_and_unload(
    client: tgrpc.InferenceServerClient, ports: Ports
) -> None:
    index = client.get_model_repository_index(as_json=True)["models"]
    assert {(m["name"], m.get("version"), m["state"]) for m in index} == {
        ("digits", "1", "READY"),
        ("router", _router_version(client), "READY"),
    }
    with pytest.raises(InferenceServerException) as caught:
        client.unload_model("router")
    assert caught.value.status() == "StatusCode.UNAUTHENTICATED"
    client.unload_model("router", headers=AUTH)
    assert not client.is_model_ready("router")
    states = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert states["router"]["state"] == "UNAVAILABLE" and states["router"]["reason"] == "unloaded"
    ready = client.get_model_repository_index(as_json=True, headers=None)
    assert "router" in {m["name"] for m in ready["models"]}
    client.load_model("router", headers=AUTH)
    assert client.is_model_ready("router")
    with pytest.raises(InferenceServerException) as caught:
        client.load_model("no-such-folder", headers=AUTH)
    assert caught.value.status() == "StatusCode.NOT_FOUND"


def _router_version(client: tgrpc.InferenceServerClient) -> str:
    versions: list[str] = client.get_model_metadata("router", as_json=True)["versions"]
    return versions[0]


KSERVE_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import grpc
    import numpy as np
    from kserve.inference_client import InferenceGRPCClient
    from kserve.protocol.infer_type import InferInput, InferRequest
    from kserve.protocol.grpc import grpc_predict_v2_pb2 as pb
    from kserve.protocol.grpc.grpc_predict_v2_pb2_grpc import GRPCInferenceServiceStub

    URL, TOKEN = sys.argv[1], sys.argv[2]
    AUTH = (("authorization", "Bearer " + TOKEN),)

    async def main():
        out = {}
        async with InferenceGRPCClient(URL, channel_args=[("grpc.enable_retries", 0)]) as c:
            out["live"] = await c.is_server_live()
            out["ready"] = await c.is_server_ready()
            out["model_ready"] = await c.is_model_ready("router")
            values = InferInput("VALUES", [1, 3], "FP32")
            row = np.array([[0.8, 2.0, 0.3]], dtype=np.float32)
            values.set_data_from_numpy(row, binary_data=False)
            values.parameters = {"columns": "r,a1,a2"}
            request = InferRequest("router", [values], parameters={"budget": 6})
            response = await c.infer(request)
            by_name = {o.name: o for o in response.outputs}
            out["model_version"] = response.model_version
            out["prediction"] = by_name["PREDICTION"].as_numpy()[0].decode()
            out["report"] = json.loads(by_name["RESPONSE"].as_numpy()[0])
        async with grpc.aio.insecure_channel(URL) as channel:
            stub = GRPCInferenceServiceStub(channel)
            meta = await stub.ServerMetadata(pb.ServerMetadataRequest())
            out["server"] = [meta.name, list(meta.extensions)]
            model = await stub.ModelMetadata(pb.ModelMetadataRequest(name="digits"))
            out["versions"] = list(model.versions)
            try:
                await stub.RepositoryModelUnload(
                    pb.RepositoryModelUnloadRequest(model_name="router")
                )
            except grpc.aio.AioRpcError as exc:
                out["unauthenticated"] = exc.code().name
            unloaded = await stub.RepositoryModelUnload(
                pb.RepositoryModelUnloadRequest(model_name="router"), metadata=AUTH
            )
            out["unloaded"] = [unloaded.model_name, unloaded.isUnloaded]
            out["ready_after_unload"] = (
                await stub.ModelReady(pb.ModelReadyRequest(name="router"))
            ).ready
            loaded = await stub.RepositoryModelLoad(
                pb.RepositoryModelLoadRequest(model_name="router"), metadata=AUTH
            )
            out["loaded"] = [loaded.model_name, loaded.isLoaded]
            out["ready_after_load"] = (
                await stub.ModelReady(pb.ModelReadyRequest(name="router"))
            ).ready
        print(json.dumps(out))

    asyncio.run(main())
    """
)


def test_kserve_grpc_client(ports: Ports, tmp_path: Path) -> None:
    script = tmp_path / "kserve_client.py"
    script.write_text(KSERVE_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.endswith("_PROXY") and k != "no_proxy"}
    done = subprocess.run(
        [sys.executable, str(script), f"127.0.0.1:{ports.grpc}", TOKEN],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["live"] and out["ready"] and out["model_ready"]
    assert out["report"]["cost"]["budget"] == 6 and out["report"]["cost"]["spent"] <= 6
    assert out["prediction"] == out["report"]["prediction"]
    assert sorted(out["report"]["cost"]["given"]) == ["a", "r"]
    assert out["server"][0] == "budgetserve" and "model_repository" in out["server"][1]
    assert out["versions"] == ["1"]
    assert out["unauthenticated"] == "UNAUTHENTICATED"
    assert out["unloaded"] == ["router", True] and out["ready_after_unload"] is False
    assert out["loaded"] == ["router", True] and out["ready_after_load"] is True


def test_a_port_in_use_fails_the_start() -> None:
    from service.grpc_api import start_grpc
    from service.http.state import AppState
    from service.metrics import Metrics

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        state = AppState(settings=Settings(grpc_port=port), metrics=Metrics())
        with pytest.raises(OSError, match="BUDGETSERVE_GRPC_PORT"):
            asyncio.run(start_grpc(state))


def test_shipped_stubs_match_the_proto(tmp_path: Path) -> None:
    """``inference_pb2.py(i)`` are what ``make grpc-stubs`` generates from the .proto."""
    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[2]
    proto = "service/grpc_api/inference.proto"
    args = ["protoc", f"-I{root}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", proto]
    assert protoc.main(args) == 0
    for name in ("inference_pb2.py", "inference_pb2.pyi"):
        generated = (tmp_path / "service" / "grpc_api" / name).read_text()
        assert generated == (root / "service" / "grpc_api" / name).read_text(), (
            f"{name} is stale: run `make grpc-stubs`"
        )


def test_every_rpc_writes_one_request_line_with_what_it_spent(
    client: tgrpc.InferenceServerClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="budgetserve.request")
    image = tgrpc.InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(np.array([png_bytes(4, 64)], dtype=np.object_))
    result = client.infer(
        "digits", [image], parameters={"budget": 1000.0}, headers={"x-request-id": "grpc-7"}
    )
    report = json.loads(result.as_numpy("RESPONSE")[0])
    with pytest.raises(InferenceServerException):
        client.infer("nope", [image], parameters={"budget": 5.0}, headers={"x-request-id": "g8"})
    assert client.is_server_live()

    def line(rid: str) -> dict[str, Any]:
        # the server answers on its own thread: its line may land just after the client's
        for _ in range(100):
            found = [
                r
                for r in caplog.records
                if r.name == "budgetserve.request" and r.fields["request_id"] == rid  # type: ignore[attr-defined]
            ]
            if found:
                (record,) = found
                assert record.levelno == logging.INFO
                return record.fields  # type: ignore[attr-defined, no-any-return]
            time.sleep(0.02)
        raise AssertionError(f"no request line for {rid}")

    ok = line("grpc-7")
    assert ok["method"] == "grpc" and ok["path"] == "/inference.GRPCInferenceService/ModelInfer"
    assert ok["status"] == "OK" and ok["outcome"] == "ok" and ok["model"] == "digits"
    assert ok["spent"] == report["cost"]["spent"] and ok["budget"] == 1000.0
    assert ok["client"].startswith("127.0.0.1:")
    missing = line("g8")
    assert missing["status"] == "NOT_FOUND" and missing["outcome"] == "model_not_found"
    live = [
        r
        for r in caplog.records
        if r.name == "budgetserve.request" and r.fields["path"].endswith("/ServerLive")  # type: ignore[attr-defined]
    ]
    assert live and all(r.levelno == logging.DEBUG for r in live)  # a probe


def test_the_request_id_comes_back_as_trailing_metadata(ports: Ports) -> None:
    import grpc

    from service.grpc_api import inference_pb2 as pb

    with grpc.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
        live = channel.unary_unary(
            "/inference.GRPCInferenceService/ServerLive",
            request_serializer=pb.ServerLiveRequest.SerializeToString,
            response_deserializer=pb.ServerLiveResponse.FromString,
        )
        answer, call = live.with_call(pb.ServerLiveRequest(), metadata=[("x-request-id", "t-1")])
        assert answer.live and ("x-request-id", "t-1") in call.trailing_metadata()
        _, fresh = live.with_call(pb.ServerLiveRequest(), metadata=[("x-request-id", "a b")])
        (rid,) = [v for k, v in fresh.trailing_metadata() if k == "x-request-id"]
        assert len(rid) == 32 and rid != "a b"  # not a sensible id: a new one
