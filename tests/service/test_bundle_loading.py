"""Loading bundles from disk: files confined to the bundle folder, failures reported under
the manifest's name with a readable reason that shows no server path, odd manifests
reported rather than skipped. Through the real app (``/models``, ``/readyz``, 503s)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from service.bundle import Manifest, bundle_relative
from service.cache import InProcessCache
from service.http import create_app
from service.registry import load_registry
from service.settings import Settings
from tests.conftest import digit_image, png_b64

# Every path Python opens while a registry loads (audit hook; hooks cannot be removed, so
# this one records only while ``_recording`` is set).
_opened: list[str] = []
_recording = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _recording and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _opened.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@pytest.fixture
def record_opens() -> Iterator[list[str]]:
    global _recording
    _opened.clear()
    _recording = True
    try:
        yield _opened
    finally:
        _recording = False


def _copy(
    tiny: Path,
    root: Path,
    folder: str,
    mutate: Callable[[dict[str, Any], Path], None],
    name: str | None = None,
) -> Path:
    target = root / folder
    shutil.copytree(tiny, target)
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["name"] = name or folder
    mutate(manifest, target)
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def _first_file_model(manifest: dict[str, Any]) -> dict[str, Any]:
    model: dict[str, Any] = next(m for m in manifest["models"] if m.get("file"))
    return model


ITEM = {"png_base64": png_b64(digit_image(2, 32))}


def _client(models_dir: Path) -> TestClient:
    return TestClient(create_app(Settings(models_dir=models_dir), cache=InProcessCache(1 << 20)))


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("/etc/passwd", "absolute"),
        ("../../outside.onnx", "'..' segment"),
        ("sub/../../x.onnx", "'..' segment"),
        ("C:/models/x.onnx", "absolute"),
        ("a\\..\\b.onnx", "backslash"),
        ("", "empty"),
    ],
)
def test_manifest_refuses_files_outside_the_bundle(
    digits_bundle_dir: Path, value: str, problem: str
) -> None:
    raw = json.loads((digits_bundle_dir / "manifest.json").read_text())
    _first_file_model(raw)["file"] = value
    with pytest.raises(ValidationError, match=problem) as info:
        Manifest.model_validate(raw)
    [error] = info.value.errors()
    assert error["loc"][0] == "models" and error["loc"][-1] == "file"


@pytest.mark.parametrize("value", ["m.onnx", "onnx/m.onnx", "./m.onnx", "a..b.onnx"])
def test_relative_files_inside_are_fine(value: str) -> None:
    assert bundle_relative(value) == value


def test_escaping_files_never_load_and_are_never_opened(
    tmp_path: Path, tiny_bundle_dir: Path, record_opens: list[str]
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    model_file = _first_file_model(json.loads((tiny_bundle_dir / "manifest.json").read_text()))
    # A valid ONNX model of the right shape, outside every bundle: it would load if reached.
    stray = outside / "stray.onnx"
    shutil.copy(tiny_bundle_dir / model_file["file"], stray)

    def absolute(m: dict[str, Any], _: Path) -> None:
        _first_file_model(m)["file"] = str(stray)

    def dotdot(m: dict[str, Any], _: Path) -> None:
        _first_file_model(m)["file"] = "../../outside/stray.onnx"

    def symlink(m: dict[str, Any], folder: Path) -> None:
        (folder / "link.onnx").symlink_to(stray)
        _first_file_model(m)["file"] = "link.onnx"

    def inner_link(m: dict[str, Any], folder: Path) -> None:
        # A link that stays inside (as Kubernetes volume mounts make them) is fine.
        (folder / "data").mkdir()
        target = folder / "data" / "model.onnx"
        shutil.move(folder / _first_file_model(m)["file"], target)
        (folder / "model.onnx").symlink_to(Path("data") / "model.onnx")
        _first_file_model(m)["file"] = "model.onnx"

    for folder, mutate in (
        ("absolute", absolute),
        ("dotdot", dotdot),
        ("symlink", symlink),
        ("inner", inner_link),
    ):
        _copy(tiny_bundle_dir, models, folder, mutate)
    record_opens.clear()  # what setting up opened; from here on, what loading opens
    registry = load_registry(models, 1 << 20)
    assert any(p.endswith("manifest.json") for p in record_opens), "the hook records opens"
    assert sorted(registry.bundles) == ["inner"]
    assert sorted(f.folder for f in registry.failures) == ["absolute", "dotdot", "symlink"]
    assert not [p for p in record_opens if Path(p).resolve().is_relative_to(outside)], record_opens
    reasons = {f.folder: f.reason for f in registry.failures}
    assert "models.1.file" in reasons["absolute"] and "absolute" in reasons["absolute"]
    assert "'..' segment" in reasons["dotdot"]
    assert "'link.onnx' resolves outside the bundle folder" in reasons["symlink"]
    for reason in reasons.values():
        assert str(tmp_path) not in reason, reason


def test_failures_are_readable_named_and_pathless(tmp_path: Path, tiny_bundle_dir: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    shutil.copytree(tiny_bundle_dir, models / "tiny")

    _copy(
        tiny_bundle_dir,
        models,
        "old-folder",
        lambda m, _: m["extractors"][0].update(version="99"),
        name="renamed",
    )
    _copy(
        tiny_bundle_dir,
        models,
        "garbled-onnx",
        lambda m, folder: (folder / _first_file_model(m)["file"]).write_bytes(b"not an onnx model"),
    )
    _copy(
        tiny_bundle_dir,
        models,
        "escaping-file",
        lambda m, _: _first_file_model(m).update(file="../../etc/passwd"),
        name="escaping-name",
    )
    broken_json = models / "broken-json"
    shutil.copytree(tiny_bundle_dir, broken_json)
    (broken_json / "manifest.json").write_text('{"name": "SECRET-MANIFEST-BYTES", ')
    invalid = models / "invalid"
    shutil.copytree(tiny_bundle_dir, invalid)
    # Fails validation, but declares a name: requests for that name get 503, not 404.
    (invalid / "manifest.json").write_text(
        json.dumps({"name": "declared", "description": "SECRET-MANIFEST-BYTES"})
    )
    directory = models / "dir-manifest"
    (directory / "manifest.json").mkdir(parents=True)
    (models / "escaping-manifest").mkdir()
    (models / "escaping-manifest" / "manifest.json").symlink_to(tiny_bundle_dir / "manifest.json")

    with _client(models) as client:
        listed = client.get("/models").json()
        ready = client.get("/readyz").json()
        renamed = client.post("/predict", json={"model": "renamed", "item": ITEM, "budget": 5})
        by_folder = client.post("/predict", json={"model": "old-folder", "item": ITEM, "budget": 5})
        served = client.post("/predict", json={"model": "tiny", "item": ITEM, "budget": 5})
        declared = client.post("/predict", json={"model": "declared", "item": ITEM, "budget": 5})
        escaping = client.get("/models/escaping-name")
    failed = {f["folder"]: f for f in listed["failed"]}
    assert set(failed) == {
        "old-folder",
        "garbled-onnx",
        "broken-json",
        "invalid",
        "dir-manifest",
        "escaping-manifest",
        "escaping-file",
    }
    assert failed["escaping-file"]["name"] == "escaping-name"
    assert failed["old-folder"]["name"] == "renamed"
    assert "thumbnail" in failed["old-folder"]["error"] and "99" in failed["old-folder"]["error"]
    assert failed["garbled-onnx"]["name"] == "garbled-onnx"
    assert "cannot load file" in failed["garbled-onnx"]["error"]
    assert failed["broken-json"]["error"].startswith("manifest.json is not a valid manifest")
    assert "Invalid JSON" in failed["broken-json"]["error"]
    assert "version: Field required" in failed["invalid"]["error"]
    assert failed["invalid"]["name"] == "declared"
    assert failed["broken-json"]["name"] == "broken-json"  # no readable name: the folder's
    assert failed["dir-manifest"]["error"] == "manifest.json is a directory, not a file"
    assert "outside the bundle folder" in failed["escaping-manifest"]["error"]
    assert "renamed" in ready["failed"] and "tiny" in ready["models"]

    assert served.status_code == 200
    for r in (renamed, by_folder, declared, escaping):
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "model_not_ready"
    text = json.dumps([listed, ready, renamed.json(), by_folder.json(), declared.json()])
    assert "SECRET-MANIFEST-BYTES" not in text, "raw manifest bytes are not for clients"
    assert str(tmp_path) not in text and str(tiny_bundle_dir) not in text
    assert str(Path.cwd()) not in text


def test_failed_bundle_does_not_shadow_a_loaded_one(tmp_path: Path, tiny_bundle_dir: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    _copy(
        tiny_bundle_dir,
        models,
        "a-broken",
        lambda m, _: m["extractors"][0].update(version="99"),
        name="tiny",
    )
    shutil.copytree(tiny_bundle_dir, models / "tiny")
    _copy(tiny_bundle_dir, models, "z-duplicate", lambda m, _: None, name="tiny")
    with _client(models) as client:
        r = client.post("/predict", json={"model": "tiny", "item": ITEM, "budget": 5})
        listed = client.get("/models").json()
    assert r.status_code == 200, r.text
    failed = {f["folder"]: f["error"] for f in listed["failed"]}
    assert set(failed) == {"a-broken", "z-duplicate"}
    assert "folder 'tiny' already serves it" in failed["z-duplicate"]


def test_a_huge_manifest_is_refused_from_its_size_without_being_read(
    tmp_path: Path, tiny_bundle_dir: Path
) -> None:
    """Issue 27: a 32 MB manifest stalled serving 2-3 s and took RSS to 607 MB. A manifest
    over BUDGETSERVE_MAX_MANIFEST_BYTES (16 MiB by default) keeps its bundle out with the
    reason, and is refused from its size: loading it allocates next to nothing."""
    import tracemalloc

    from service.registry import load_folder

    models = tmp_path / "models"
    big = _copy(tiny_bundle_dir, models, "big", lambda m, _: None)
    text = (big / "manifest.json").read_text()
    (big / "manifest.json").write_text(text[:-1] + " " * (32 << 20) + text[-1])  # valid JSON
    tracemalloc.start()
    try:
        load = load_folder(models, "big", 1 << 22)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    [failure] = load.failures
    assert "manifest.json is 32.0 MiB; the limit is 16.0 MiB" in failure.reason, failure
    assert "BUDGETSERVE_MAX_MANIFEST_BYTES" in failure.reason
    assert peak < 4 << 20, f"refusing it allocated {peak / 2**20:.1f} MiB"
    # The setting, through the app: a smaller cap refuses the tiny bundle's own manifest.
    settings = Settings(models_dir=models, max_manifest_bytes=4096)
    small = _copy(tiny_bundle_dir, models, "small", lambda m, _: None, name="small")
    assert (small / "manifest.json").stat().st_size > 4096
    with TestClient(create_app(settings, cache=InProcessCache(1 << 20))) as client:
        failed = {f["folder"]: f["error"] for f in client.get("/models").json()["failed"]}
        assert set(failed) == {"big", "small"}, failed
        assert "KiB; the limit is 4.0 KiB (BUDGETSERVE_MAX_MANIFEST_BYTES)" in failed["small"]
        r = client.post("/predict", json={"model": "small", "item": {}, "budget": 1.0})
        assert r.status_code == 503 and r.json()["error"]["type"] == "model_not_ready"
