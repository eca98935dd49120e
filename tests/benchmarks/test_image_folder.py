"""The image-folder benchmark's parts: the folders it writes from the shared OCR letters (the
ImageFolder layout, every file readable by the service, test letters from other words than the
training ones), the blanked pima of the gaps benchmark, and the stage times it reads back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.image_folder import _stages
from benchmarks.letter_folders import OCR_FILE, write_folders
from benchmarks.tabular_gaps import COLUMNS, PIMA, blank
from service.items import decode_image


@pytest.mark.skipif(
    not OCR_FILE.is_file(),
    reason="the shared datasets are not beside this checkout (../shared/datasets/ocr-letters)",
)
def test_letter_folders_are_an_image_folder_of_held_out_words(tmp_path: Path) -> None:
    done = write_folders(tmp_path, classes=3, train_per_class=4, test_per_class=2, seed=1)
    assert done.classes == ["n", "e", "i"] and done.counts == {"train": 12, "test": 6}
    for split, per_class in (("train", 4), ("test", 2)):
        for name in done.classes:
            files = sorted((tmp_path / split / name).iterdir())
            assert len(files) == per_class
            for f in files:
                image = decode_image(f.read_bytes(), max_pixels=1 << 20, channels="rgb")
                assert image.ndim == 3 and image.shape[0] in (24, 48, 96, 160)
    rows = {f.stem.split("-")[1] for f in (tmp_path / "train").rglob("*.*")}
    held = {f.stem.split("-")[1] for f in (tmp_path / "test").rglob("*.*")}
    assert not rows & held
    data = np.load(OCR_FILE)
    word = np.repeat(np.arange(len(data["folds"])), np.diff(data["word_offsets"]))
    assert {int(data["folds"][word[int(r)]]) for r in held} <= {8, 9}


@pytest.mark.skipif(
    not PIMA.is_file(),
    reason="the shared datasets are not beside this checkout (../shared/datasets/pima)",
)
def test_pima_is_blanked_a_tenth_and_never_the_label(tmp_path: Path) -> None:
    target = tmp_path / "gaps.csv"
    count = blank(PIMA, target)
    rows = [line.split(",") for line in target.read_text().splitlines()]
    cells = [c for r in rows for c in r[: len(COLUMNS)]]
    assert count == sum(c in ("", "NA") for c in cells)
    assert 0.08 < count / len(cells) < 0.12 and all(r[-1] in ("0", "1") for r in rows)


def test_stage_seconds_are_read_from_the_last_line() -> None:
    stderr = (
        "letters 2026.11.27-386a7738b7 written to models/letters in 158 s (scan 1 s, \n"
        "profile 3 s, extract 20 s, build 121 s, evaluate 13 s): 76 of 128 sets expanded,\n"
    )
    assert _stages(stderr) == {
        "scan": 1.0,
        "profile": 3.0,
        "extract": 20.0,
        "build": 121.0,
        "evaluate": 13.0,
    }
