"""``budgetserve-train images`` and ``cstc-images`` on tiny folders written here: a bundle
from any labelled folder (PNG, JPEG, WebP; any size, gray or colour), served by the real app,
and every folder problem refused with what was found, what is required and the fix."""

from __future__ import annotations

import base64
import io
import itertools
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from typer.testing import CliRunner

from service.bundle import read_manifest
from service.cache import InProcessCache
from service.http import create_app
from service.settings import Settings
from tests.support.colour_plugin import registered
from training.bundles.folder import EVALUATION_FILE
from training.bundles.folder_report import size_ranges
from training.cli import app
from training.data.image_folder import ImageFolderError, probe_sizes, scan_folder

#: Three classes told apart by hue only (random brightness): a gray picture cannot.
HUES = {"red": (1.0, 0.15, 0.1), "green": (0.1, 0.9, 0.2), "blue": (0.15, 0.2, 1.0)}
FORMATS = ("PNG", "JPEG", "WEBP")


def picture(hue: tuple[float, float, float], rng: np.random.Generator) -> Image.Image:
    """A blob of the class's hue on a dark background, at a random size and aspect."""
    height = int(rng.integers(12, 64))
    width = int(height * rng.uniform(0.6, 1.6))
    y, x = np.mgrid[0:height, 0:width]
    blob = ((y / height - 0.5) ** 2 + (x / width - 0.5) ** 2) < rng.uniform(0.05, 0.2)
    level = rng.uniform(0.4, 1.0)
    rgb = blob[..., None] * np.asarray(hue) * level + rng.normal(0, 0.03, (height, width, 3))
    return Image.fromarray(np.round(np.clip(rgb, 0, 1) * 255).astype(np.uint8), "RGB")


def write(root: Path, per_class: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for name, hue in HUES.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            fmt = FORMATS[i % 3]
            picture(hue, rng).save(root / name / f"{i}.{fmt.lower()}", format=fmt)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("colours")
    write(root / "train", 14, seed=1)
    write(root / "test", 6, seed=2)
    (root / "spec.yaml").write_text("folds: 3\nprofile_repeats: 3\nprofile_images: 4\n")
    return root


def b64(image: Image.Image, fmt: str) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return base64.b64encode(buffer.getvalue()).decode()


def test_a_colour_folder_builds_serves_and_reports(
    folders: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's plugin that reads colour (mean_colour) with a built-in: the bundle decodes to
    three channels, the held-out report covers every size range and budget next to the best
    fixed set, and the served bundle answers JPEG and WebP items with the hue's class."""
    registered(monkeypatch)
    out = tmp_path / "models" / "colours"
    result = CliRunner().invoke(
        app,
        [
            "images",
            "--data", str(folders / "train"),
            "--test", str(folders / "test"),
            "--out", str(out),
            "--spec", str(folders / "spec.yaml"),
            "--extractors", "histogram,mean_colour",
            "--budgets", "0.3,1,50",
            "--format", "json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert manifest.item.channels == "rgb" and manifest.classes == ["blue", "green", "red"]
    assert [e.name for e in manifest.extractors] == ["histogram", "mean_colour"]
    report = json.loads((out / EVALUATION_FILE).read_text())
    assert report["budgets"] == [0.3, 1.0, 50.0]
    rows = report["rows"]
    assert {r["budget"] for r in rows} == {0.3, 1.0, 50.0}
    assert sum(r["items"] for r in rows if r["budget"] == 50.0) == 18
    for row in rows:
        assert 0.0 <= row["accuracy"] <= 1.0 and row["fixed_set"]
        if row["budget"] == 50.0:  # colour tells the classes apart; the prior cannot
            assert row["accuracy"] >= 0.8, row
    printed = json.loads(result.stdout)
    assert len(printed) == len(rows) and {"fixed_set", "accuracy"} <= set(printed[0])

    settings = Settings(models_dir=out.parent)
    rng = np.random.default_rng(7)
    with TestClient(create_app(settings, cache=InProcessCache(1 << 20))) as client:
        for name, hue in HUES.items():
            for fmt in ("JPEG", "WEBP"):
                item = {"image_base64": b64(picture(hue, rng), fmt)}
                r = client.post("/predict", json={"model": "colours", "item": item, "budget": 50})
                assert r.status_code == 200, r.text
                assert r.json()["prediction"] == name
                assert "mean_colour" in r.json()["features"]


def test_cstc_on_the_same_folder(folders: Path, tmp_path: Path) -> None:
    """cstc-digits generalised: trees over the folder's feature groups, gray built-ins."""
    out = tmp_path / "colours-cstc"
    result = CliRunner().invoke(
        app,
        [
            "cstc-images",
            "--data", str(folders / "train"),
            "--test", str(folders / "test"),
            "--out", str(out),
            "--extractors", "thumbnail,histogram",
            "--methods", "root-only,cstc",
            "--lambdas", "0.3",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert manifest.default_strategy == "cstc" and manifest.item.channels == "gray"
    params = manifest.provenance.parameters
    assert params["images"]["test"] == 18
    assert params["images"]["fit"] + params["images"]["validation"] == 42
    with TestClient(create_app(Settings(models_dir=tmp_path), cache=InProcessCache(1 << 20))) as c:
        item = {"png_base64": b64(picture(HUES["red"], np.random.default_rng(3)), "PNG")}
        r = c.post("/predict", json={"model": "colours-cstc", "item": item, "budget": 50})
        assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------ refusals


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` and holds no pixels at all."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    chunk = struct.pack(">I", 13) + b"IHDR" + ihdr
    chunk += struct.pack(">I", zlib.crc32(b"IHDR" + ihdr) & 0xFFFFFFFF)
    return b"\x89PNG\r\n\x1a\n" + chunk


def _folder(root: Path, counts: dict[str, int]) -> Path:
    rng = np.random.default_rng(0)
    for name, count in counts.items():
        (root / name).mkdir(parents=True)
        for i in range(count):
            picture(HUES["red"], rng).save(root / name / f"{i}.png")
    return root


@pytest.mark.parametrize(
    ("counts", "found", "fix"),
    [
        ({"cat": 3, "dog": 0}, "holds 0 images", "add images of that class, or remove the folder"),
        ({"cat": 3}, "one class only ('cat')", "add a folder per other class"),
        ({}, "has no class sub-folders", "move each class's images into a folder"),
    ],
)
def test_layout_problems_say_found_required_fix(
    tmp_path: Path, counts: dict[str, int], found: str, fix: str
) -> None:
    root = _folder(tmp_path / "data", counts)
    root.mkdir(exist_ok=True)
    (root / "notes.txt").write_text("not an image")
    with pytest.raises(ImageFolderError, match="required") as info:
        scan_folder(root)
    assert found in str(info.value) and fix in str(info.value)


def test_bad_files_are_named_before_any_work(tmp_path: Path) -> None:
    root = _folder(tmp_path / "data", {"cat": 3, "dog": 3})
    (root / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    (root / "dog" / "huge.png").write_bytes(_png_header(5000, 5000))
    (root / "dog" / "tiny.png").write_bytes(_png_header(3, 40))
    (root / "dog" / "readme.md").write_text("left out")
    folder = scan_folder(root)
    assert [p.name for p in folder.ignored] == ["readme.md"]
    with pytest.raises(ImageFolderError) as info:
        probe_sizes(folder, max_pixels=4096 * 4096, min_side=8)
    message = str(info.value)
    assert "cat/broken.jpg" in message and "cannot be read as images" in message
    assert "dog/huge.png (5000x5000)" in message and "--max-pixels" in message
    assert "dog/tiny.png (3x40)" in message and "--min-side" in message
    # through the command: exit status 2, the same message, nothing written
    out = tmp_path / "models" / "x"
    result = CliRunner().invoke(app, ["images", "--data", str(root), "--out", str(out)])
    assert result.exit_code == 2 and "broken.jpg" in result.output
    assert not out.exists()


def test_a_test_folder_may_not_bring_new_classes(tmp_path: Path) -> None:
    train = _folder(tmp_path / "train", {"cat": 3, "dog": 3})
    test = _folder(tmp_path / "test", {"cat": 2, "bird": 2})
    with pytest.raises(ImageFolderError, match="'bird'"):
        scan_folder(test, classes=scan_folder(train).classes, option="--test")


def test_size_ranges_split_at_the_widest_gaps() -> None:
    sizes = np.asarray([100, 110, 120] * 10 + [1000, 1100] * 10 + [9000, 9500, 9900] * 10)
    assert size_ranges(sizes) == [(100, 120), (1000, 1100), (9000, 9900)]
    assert size_ranges(np.asarray([64, 64, 256])) == [(64, 64), (256, 256)]
    spread = np.arange(100, 10_000, 7)
    ranges = size_ranges(spread)
    assert 2 <= len(ranges) <= 4 and ranges[0][0] == 100 and ranges[-1][1] == spread.max()
    assert all(a[1] < b[0] for a, b in itertools.pairwise(ranges))


def test_thin_classes_and_unknown_extractors_are_refused(tmp_path: Path) -> None:
    root = _folder(tmp_path / "data", {"cat": 5, "dog": 6})
    out = tmp_path / "models" / "x"
    thin = CliRunner().invoke(app, ["images", "--data", str(root), "--out", str(out)])
    assert thin.exit_code == 2 and "class 'cat' has 4 training images" in thin.output
    assert "set `folds:` lower" in thin.output
    unknown = CliRunner().invoke(
        app, ["images", "--data", str(root), "--out", str(out), "--extractors", "nope"]
    )
    assert unknown.exit_code == 2 and "'nope' is not installed" in unknown.output
    assert not out.exists()
