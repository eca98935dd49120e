"""The OCR builder on a second data layout: a folder of word PNGs with ``labels.tsv`` (the
letters of the shared ``.npz`` written out that way), read back letter for letter and built
into a bundle that answers held-out words."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.registry import load_bundle
from training.structured.ocr import DEFAULT_DATA, load_ocr, write_ocr_folder

DATA = Path(__file__).resolve().parents[3] / DEFAULT_DATA

pytestmark = pytest.mark.skipif(
    not DATA.is_file(),
    reason="the shared OCR data is not beside this checkout (../shared/datasets/ocr-letters)",
)


def test_a_folder_of_word_images_reads_back_the_same_words(tmp_path: Path) -> None:
    data = load_ocr(DATA)
    words = list(range(0, 400, 10))
    write_ocr_folder(data, tmp_path, words)
    back = load_ocr(tmp_path)
    assert back.n_words == len(words)
    rows = np.concatenate([np.arange(*data.word(w).indices(len(data.labels))) for w in words])
    np.testing.assert_array_equal(back.letters, data.letters[rows])
    np.testing.assert_array_equal(back.labels, data.labels[rows])
    np.testing.assert_array_equal(back.folds, data.folds[words])
    np.testing.assert_array_equal(np.diff(back.offsets), np.diff(data.offsets)[words])


def test_a_bad_folder_says_which_line_and_what_is_required(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"labels\.tsv"):
        load_ocr(tmp_path)
    data = load_ocr(DATA)
    write_ocr_folder(data, tmp_path, [0, 1])
    listing = tmp_path / "labels.tsv"
    name, word, fold = listing.read_text().splitlines()[1].split("\t")
    listing.write_text(f"{name}\t{word}x\t{fold}\n")  # one letter more than the image has
    with pytest.raises(ValueError, match=r"labels\.tsv:1: .* must be \d+ wide and 16 high"):
        load_ocr(tmp_path)
    listing.write_text(f"{name}\tWord\n")
    with pytest.raises(ValueError, match="lower-case letters a-z"):
        load_ocr(tmp_path)


@pytest.mark.slow
def test_the_ocr_builder_runs_on_a_word_image_folder(tmp_path: Path) -> None:
    from training.bundles.ocr import build_ocr_bundle

    data = load_ocr(DATA)
    folder = tmp_path / "words"
    picked = list(range(0, 1800, 18))  # 100 words, their folds kept (fold 0 held out)
    write_ocr_folder(data, folder, picked)
    out = tmp_path / "models" / "ocr"
    report = build_ocr_bundle(
        out, folder, policy_words=40, max_iter=5, lambdas=(0.0,), positive_weights=(1.0, 4.0)
    )
    assert report.summary["train_words"] + report.summary["test_words"] == len(picked)
    bundle = load_bundle(out, 1 << 22)
    held_out = next(w for w in picked if data.folds[w] == 0)
    item = bundle.decoder.decode(
        {"letters": [letter.astype(int).tolist() for letter in data.letters[data.word(held_out)]]}
    )
    from service.execution import execute

    result = execute(bundle, item, 1e6, {}, 0.0)
    assert result.prediction is not None and len(result.prediction) == item.size
    assert bundle.manifest.provenance.data_fingerprint != ""
