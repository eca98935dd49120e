"""Model management through the real app: versions side by side, reload and unload without a
restart (under concurrent requests, on a real uvicorn), a broken bundle keeping the old one
serving, folder watching, and the admin token."""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.cache import InProcessCache
from service.http import create_app
from service.registry import version_key
from service.settings import Settings
from tests.conftest import png_b64
from tests.service.serving import post_json, uvicorn_thread

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ITEM = {"png_base64": png_b64(np.linspace(0, 1, 32 * 32, dtype=np.float32).reshape(32, 32))}


def place(source: Path, target: Path, version: str, name: str | None = None) -> Path:
    """Copy the bundle ``source`` to ``target`` with its manifest's version (and name) set."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["version"] = version
    if name is not None:
        manifest["name"] = name
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def client_for(models: Path, **settings: Any) -> TestClient:
    options: dict[str, Any] = {"admin_token": TOKEN, **settings}
    app = create_app(Settings(models_dir=models, **options), cache=InProcessCache(1 << 20))
    return TestClient(app)


def predict(client: TestClient, **extra: Any) -> tuple[int, dict[str, Any]]:
    r = client.post("/predict", json={"model": "tiny", "item": ITEM, "budget": 1000, **extra})
    return r.status_code, r.json()


def test_version_labels_sort_numbers_as_numbers() -> None:
    labels = ["10", "2", "1", "1.10", "1.9", "2026.11.3", "2026.2.1"]
    assert sorted(labels, key=version_key) == [
        "1",
        "1.9",
        "1.10",
        "2",
        "10",
        "2026.2.1",
        "2026.11.3",
    ]


def test_versions_side_by_side_newest_by_default_selectable(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    for label in ("1", "2", "10"):
        place(tiny_bundle_dir, models / "tiny" / label, f"m-{label}")
    place(tiny_bundle_dir, models / "flat", "f-1", name="flat")  # the flat layout, alongside
    with client_for(models) as client:
        status, body = predict(client)
        assert status == 200 and body["model_version"] == "m-10", body  # 10 > 2 > 1
        for label in ("1", "2", "10"):
            status, body = predict(client, version=label)
            assert status == 200 and body["model_version"] == f"m-{label}"
        status, body = predict(client, version="3")
        assert status == 404 and body["error"]["type"] == "version_not_found"
        assert body["error"]["details"]["available"] == ["1", "2", "10"]
        listed = {m["name"]: m for m in client.get("/models").json()["models"]}
        assert listed["tiny"]["default_version"] == "10"
        assert [v["version"] for v in listed["tiny"]["versions"]] == ["1", "2", "10"]
        assert listed["flat"]["versions"] == [{"version": "f-1", "manifest_version": "f-1"}]
        flat = client.post(
            "/predict", json={"model": "flat", "item": ITEM, "budget": 1000, "version": "f-1"}
        )
        assert flat.status_code == 200 and flat.json()["model"] == "flat"
        # A batch runs every item on the version it names; v2 addresses versions by label.
        batch = client.post(
            "/predict",
            json={"model": "tiny", "items": [ITEM, ITEM], "total_budget": 1000, "version": "2"},
        )
        assert batch.status_code == 200, batch.text
        assert {r["model_version"] for r in batch.json()["results"]} == {"m-2"}
        missing = client.post(
            "/predict", json={"model": "tiny", "items": [ITEM], "budget": 1000, "version": "3"}
        )
        assert missing.status_code == 404
        assert missing.json()["error"]["type"] == "version_not_found"
        assert client.get("/v2/models/tiny").json()["versions"] == ["1", "2", "10"]
        assert client.get("/v2/models/tiny/versions/2/ready").json()["ready"] is True
        assert client.get("/v2/models/tiny/versions/3").status_code == 404


def test_a_version_folder_naming_another_bundle_fails_with_why(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    place(tiny_bundle_dir, models / "tiny" / "1", "m-1")
    place(tiny_bundle_dir, models / "tiny" / "2", "m-2", name="other")
    with client_for(models) as client:
        status, body = predict(client)
        assert status == 200 and body["model_version"] == "m-1"
        failed = client.get("/models").json()["failed"]
        assert [f["folder"] for f in failed] == ["tiny/2"]
        assert "must be named 'tiny'" in failed[0]["error"]


def test_reload_swaps_bundles_under_concurrent_requests(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    """Requests keep flowing (all 200) while the bundle is replaced and reloaded; every
    request sent after the reload answered is answered by the new bundle."""
    models = tmp_path / "models"
    place(tiny_bundle_dir, models / "tiny", "old")
    app = create_app(
        Settings(models_dir=models, admin_token=TOKEN),  # type: ignore[arg-type]
        cache=InProcessCache(1 << 20),
    )
    results: list[tuple[float, float, int, str]] = []  # (sent, answered, status, version)
    stop = threading.Event()
    body = {"model": "tiny", "item": ITEM, "budget": 1000}

    def hammer(port: int) -> None:
        while not stop.is_set():
            sent = time.monotonic()
            status, _, answer = post_json(port, "/predict", body)
            results.append((sent, time.monotonic(), status, answer.get("model_version", "")))

    with uvicorn_thread(app) as port:
        threads = [threading.Thread(target=hammer, args=(port,)) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.5)
            place(tiny_bundle_dir, models / "tiny", "new")
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/models/tiny/reload", headers=AUTH)
            response = conn.getresponse()
            report = json.loads(response.read())
            reloaded_at = time.monotonic()
            conn.close()
            time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
    assert response.status == 200, report
    assert report["loaded"] == [{"name": "tiny", "version": "new", "folder": "tiny"}]
    assert report["failed"] == [] and report["scope"]["workers"] == 1
    statuses = {status for _, _, status, _ in results}
    assert statuses == {200}, f"a request failed across the reload: {statuses}"
    before = [v for sent, done, _, v in results if done < reloaded_at - 0.5]
    after = [v for sent, _, _, v in results if sent > reloaded_at]
    assert before and set(before) == {"old"}
    assert after and set(after) == {"new"}, "a request sent after the reload got the old bundle"


def test_a_bundle_that_fails_validation_leaves_the_old_one_serving(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    folder = place(tiny_bundle_dir, models / "tiny", "good")
    with client_for(models) as client:
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["extractors"][0]["dims"] += 1  # the installed extractor yields fewer
        manifest["version"] = "broken"
        (folder / "manifest.json").write_text(json.dumps(manifest))
        r = client.post("/models/tiny/reload", headers=AUTH)
        assert r.status_code == 200, r.text
        report = r.json()
        assert report["loaded"] == [] and report["unloaded"] == []
        [failure] = report["failed"]
        assert failure["serving"] is True and "dims" in failure["error"]
        status, body = predict(client)
        assert status == 200 and body["model_version"] == "good"
        listed = client.get("/models").json()
        assert [m["version"] for m in listed["models"]] == ["good"]
        assert listed["failed"][0]["name"] == "tiny" and listed["failed"][0]["serving"] is True
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["failed"] == ["tiny"]
        # fixed on disk: the next reload serves it and clears the failure
        place(tiny_bundle_dir, models / "tiny", "fixed")
        r = client.post("/-/reload", headers=AUTH)
        assert r.json()["loaded"] == [{"name": "tiny", "version": "fixed", "folder": "tiny"}]
        assert predict(client)[1]["model_version"] == "fixed"
        assert client.get("/readyz").json()["failed"] == []
        assert client.get("/models").json()["failed"] == []


def test_a_bundle_with_nan_weights_is_refused_and_the_old_one_serves(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    """Issue 27: a bundle whose ONNX weights are NaN loaded and took over; every later
    request got 422 invalid_item, blaming the client's values. Its warm-up now checks that
    every model answers finite class probabilities, so the version is refused and the old
    one keeps serving."""
    import onnx
    from onnx import numpy_helper

    models = tmp_path / "models"
    folder = place(tiny_bundle_dir, models / "tiny", "good")
    with client_for(models) as client:
        assert predict(client)[1]["model_version"] == "good"
        place(tiny_bundle_dir, folder, "nan")
        for file in sorted(folder.glob("*.onnx")):  # every model, as a diverged training
            graph = onnx.load(file)
            for node in graph.graph.node:  # skl2onnx's LinearClassifier keeps them here
                for attr in node.attribute:
                    if attr.name == "coefficients":
                        attr.floats[:] = [float("nan")] * len(attr.floats)
            for init in graph.graph.initializer:
                weights = numpy_helper.to_array(init)
                if weights.dtype.kind == "f":
                    nan = np.full_like(weights, np.nan)
                    init.CopyFrom(numpy_helper.from_array(nan, init.name))
            onnx.save(graph, file)
        r = client.post("/models/tiny/reload", headers=AUTH)
        assert r.status_code == 200, r.text
        [failure] = r.json()["failed"]
        assert failure["serving"] is True
        assert "non-finite outputs" in failure["error"] and "warm-up" in failure["error"], failure
        status, body = predict(client)
        assert status == 200 and body["model_version"] == "good", body


def test_symlink_loops_in_a_bundle_folder_hang_neither_reload_nor_the_watcher(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    """Issue 27: fingerprint() walked with followlinks=True and no cycle check, under the
    manager's lock: two links back to the folder (2^40 paths before the kernel's ELOOP) hung
    reload and the watcher, RSS growing. Each folder is now walked once, and bounded."""
    from service.management import FINGERPRINT_MAX_ENTRIES, fingerprint

    models = tmp_path / "models"
    folder = place(tiny_bundle_dir, models / "tiny", "looped")
    (folder / "loop1").symlink_to(".", target_is_directory=True)
    (folder / "loop2").symlink_to("..", target_is_directory=True)
    (folder / "self").symlink_to("self")  # a link to itself: ELOOP
    walked: list[Any] = []
    walker = threading.Thread(target=lambda: walked.append(fingerprint(folder)), daemon=True)
    walker.start()
    walker.join(timeout=20)
    assert not walker.is_alive(), "fingerprint() did not end: it follows the loops"
    [entries] = walked
    assert ("loop1/", -2, -2) in entries and len(entries) <= FINGERPRINT_MAX_ENTRIES + 1
    files = {name for name, size, _ in entries if size >= 0}
    assert "manifest.json" in files and "self" not in files, sorted(files)
    with client_for(models, watch_interval_s=0.2) as client:
        r = client.post("/models/tiny/reload", headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["loaded"] == [{"name": "tiny", "version": "looped", "folder": "tiny"}]
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["version"] = "changed"
        (folder / "manifest.json").write_text(json.dumps(manifest))
        wait_for(lambda: predict(client)[1].get("model_version") == "changed")


def test_a_broken_version_keeps_its_previous_bundle_the_others_reload(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    place(tiny_bundle_dir, models / "tiny" / "1", "one")
    two = place(tiny_bundle_dir, models / "tiny" / "2", "two")
    with client_for(models) as client:
        (two / "manifest.json").write_text("{not json")
        place(tiny_bundle_dir, models / "tiny" / "1", "one-again")
        report = client.post("/models/tiny/reload", headers=AUTH).json()
        assert report["loaded"] == [{"name": "tiny", "version": "1", "folder": "tiny"}]
        assert [f["folder"] for f in report["failed"]] == ["tiny/2"]
        assert predict(client)[1]["model_version"] == "two"  # still the newest, still serving
        assert predict(client, version="1")[1]["model_version"] == "one-again"


def test_unload_then_reload_and_new_folders(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    models = tmp_path / "models"
    place(tiny_bundle_dir, models / "tiny", "v1")
    with client_for(models) as client:
        r = client.delete("/models/tiny", headers=AUTH)
        assert r.status_code == 200 and r.json()["unloaded"] == ["tiny"]
        status, body = predict(client)
        assert status == 404 and body["error"]["type"] == "model_not_found"
        assert client.get("/readyz").status_code == 503  # nothing serves any more
        assert client.delete("/models/tiny", headers=AUTH).status_code == 404
        r = client.post("/models/tiny/reload", headers=AUTH)
        assert r.status_code == 200 and predict(client)[0] == 200
        assert client.get("/readyz").status_code == 200
        # a folder copied in while running, loaded by name; an unknown name is a 404
        place(tiny_bundle_dir, models / "second", "s1", name="second")
        r = client.post("/models/second/reload", headers=AUTH)
        assert r.json()["loaded"] == [{"name": "second", "version": "s1", "folder": "second"}]
        assert client.post("/models/nothing/reload", headers=AUTH).status_code == 404
        for outside in ("..", ".hidden"):  # never a folder outside, or a hidden one
            assert client.post(f"/models/{outside}/reload", headers=AUTH).status_code == 404
        # a folder removed: reloading everything unloads its bundle
        shutil.rmtree(models / "second")
        assert client.post("/-/reload", headers=AUTH).json()["unloaded"] == ["second"]
        assert [m["name"] for m in client.get("/models").json()["models"]] == ["tiny"]


def test_admin_endpoints_need_the_token(tiny_bundle_dir: Path, tmp_path: Path) -> None:
    models = tmp_path / "models"
    place(tiny_bundle_dir, models / "tiny", "v1")
    with client_for(models, admin_token=None) as client:
        r = client.post("/-/reload", headers=AUTH)
        assert r.status_code == 403 and "BUDGETSERVE_ADMIN_TOKEN" in r.json()["error"]["message"]
        r = client.post("/-/reload")  # no credentials at all: 401, saying it is disabled
        assert r.status_code == 401 and "disabled" in r.json()["error"]["message"]
    with client_for(models) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            r = client.delete("/models/tiny", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "admin_unauthorized"
        assert predict(client)[0] == 200


def test_admin_answer_says_it_reloaded_one_worker_of_several(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    place(tiny_bundle_dir, models / "tiny", "v1")
    with client_for(models, workers=3) as client:
        scope = client.post("/-/reload", headers=AUTH).json()["scope"]
        assert scope["workers"] == 3 and "BUDGETSERVE_WATCH_INTERVAL_S" in scope["note"]


def wait_for(check: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail("the watcher did not pick the change up in time")
        time.sleep(0.1)


def test_watching_loads_new_versions_and_keeps_old_on_failure(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    place(tiny_bundle_dir, models / "tiny" / "1", "one")
    with client_for(models, watch_interval_s=0.2, admin_token=None) as client:
        assert predict(client)[1]["model_version"] == "one"
        place(tiny_bundle_dir, models / "tiny" / ".3", "hidden")  # being copied: not loaded
        place(tiny_bundle_dir, models / ".staging", "hidden", name="staging")
        place(tiny_bundle_dir, models / "tiny" / "2", "two")
        wait_for(lambda: predict(client)[1].get("model_version") == "two")
        listed = client.get("/models").json()["models"]
        assert [m["name"] for m in listed] == ["tiny"]
        assert [v["version"] for v in listed[0]["versions"]] == ["1", "2"]
        (models / "tiny" / "2" / "manifest.json").write_text("{}")
        wait_for(lambda: client.get("/models").json()["failed"] != [])
        assert predict(client)[1]["model_version"] == "two"  # the old version 2 serves on
        place(tiny_bundle_dir, models / "other", "o1", name="other")
        wait_for(lambda: "other" in client.get("/readyz").json()["models"])
        shutil.rmtree(models / "other")
        wait_for(lambda: "other" not in client.get("/readyz").json()["models"])
