"""An image set the project has never seen, as a user would hand it over: folders of files.

``python -m benchmarks.letter_folders OUT`` writes ``OUT/train/<class>/*.{png,jpg,webp}`` and
``OUT/test/<class>/...`` (torchvision's ``ImageFolder`` layout) from real handwriting: the
letters of Taskar's OCR words in the shared datasets (``ocr-letters.npz``: 16 x 8 binary
letters from many writers). Ten classes, the ten most frequent letters; the train and test
letters come from disjoint words (the data set's folds 0-7 for train, 8-9 for test), so a test
letter was never seen at any size.

Each letter is drawn as a photo or a scan of it would be: upscaled smoothly (bicubic) to a
height drawn from ``HEIGHTS`` and a width of height / 2 times an aspect ratio drawn in
[0.7, 1.5], in a random ink colour on a random paper colour, with a little blur and pixel
noise, saved as PNG (colour or grey), JPEG (quality 70-95) or WebP in the proportions of
``FORMATS``. Everything is seeded: the same arguments write the same files. The data is
generated, never committed (the benchmark writes it under ``.bench-tmp/``).
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageFilter

OCR = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "ocr-letters"
OCR_FILE = OCR / "ocr-letters.npz"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
HEIGHTS = (24, 48, 96, 160)
FORMATS = (("png", 0.4), ("jpg", 0.4), ("webp", 0.2))
TEST_FOLDS = (8, 9)


@dataclass(frozen=True)
class FolderSet:
    root: Path
    train: Path
    test: Path
    classes: list[str]
    counts: dict[str, int]  # files per split


def _pick(
    labels: npt.NDArray[np.int64],
    rows: npt.NDArray[np.int64],
    label: int,
    count: int,
    rng: np.random.Generator,
) -> npt.NDArray[np.int64]:
    mine = rows[labels[rows] == label]
    return np.sort(rng.choice(mine, size=min(count, len(mine)), replace=False))


def _colours(rng: np.random.Generator) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """(ink, paper) RGB in [0, 1]: dark ink on light paper mostly, sometimes the reverse."""
    paper = rng.uniform(0.70, 1.0, size=3)
    ink = rng.uniform(0.0, 0.35, size=3)
    if rng.random() < 0.2:
        paper, ink = ink, paper
    return ink, paper


def render_letter(
    pixels: npt.NDArray[np.uint8], height: int, rng: np.random.Generator
) -> Image.Image:
    """One 16 x 8 binary letter as a colour picture ``height`` high."""
    width = max(8, round(height / 2 * rng.uniform(0.7, 1.5)))
    mask = Image.fromarray((pixels.reshape(16, 8) * 255).astype(np.uint8))
    pad = Image.new("L", (12, 20))
    pad.paste(mask, (2, 2))
    ink_level = np.asarray(pad.resize((width, height), Image.Resampling.BICUBIC), np.float64)
    ink_level = (
        np.asarray(
            Image.fromarray(np.clip(ink_level, 0, 255).astype(np.uint8)).filter(
                ImageFilter.GaussianBlur(radius=rng.uniform(0.0, 0.04) * height)
            ),
            dtype=np.float64,
        )
        / 255.0
    )
    ink, paper = _colours(rng)
    level = ink_level[..., None]
    rgb = paper[None, None, :] * (1 - level) + ink[None, None, :] * level
    rgb += rng.normal(0.0, 0.03, size=rgb.shape)
    return Image.fromarray(np.round(np.clip(rgb, 0, 1) * 255).astype(np.uint8), "RGB")


def _save(image: Image.Image, path: Path, fmt: str, rng: np.random.Generator) -> Path:
    if fmt == "png":
        if rng.random() < 0.3:
            image = image.convert("L")
        target = path.with_suffix(".png")
        image.save(target, format="PNG")
    elif fmt == "jpg":
        target = path.with_suffix(".jpg")
        image.save(target, format="JPEG", quality=int(rng.integers(70, 96)))
    else:
        target = path.with_suffix(".webp")
        buffer = io.BytesIO()
        image.save(buffer, format="WEBP", quality=int(rng.integers(70, 96)))
        target.write_bytes(buffer.getvalue())
    return target


def write_folders(
    out: Path,
    *,
    classes: int = 10,
    train_per_class: int = 300,
    test_per_class: int = 100,
    heights: Sequence[int] = HEIGHTS,
    seed: int = 0,
    source: Path = OCR_FILE,
) -> FolderSet:
    """Write the train and test folders under ``out`` (which must not hold files yet)."""
    data = np.load(source)
    pixels = np.asarray(data["pixels"], dtype=np.uint8)
    labels = np.asarray(data["labels"], dtype=np.int64)
    offsets = np.asarray(data["word_offsets"], dtype=np.int64)
    folds = np.asarray(data["folds"], dtype=np.int64)
    word_of = np.repeat(np.arange(len(folds)), np.diff(offsets))
    in_test = np.isin(folds[word_of], TEST_FOLDS)
    top = np.argsort(-np.bincount(labels, minlength=26), kind="stable")[:classes]
    names = [LETTERS[int(t)] for t in top]
    rng = np.random.default_rng(seed)
    fmt_names = [f for f, _ in FORMATS]
    fmt_p = np.asarray([p for _, p in FORMATS])
    counts = {"train": 0, "test": 0}
    for split, rows, per_class in (
        ("train", np.flatnonzero(~in_test), train_per_class),
        ("test", np.flatnonzero(in_test), test_per_class),
    ):
        for label, name in zip(top, names, strict=True):
            folder = out / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for row in _pick(labels, rows, int(label), per_class, rng):
                height = int(rng.choice(np.asarray(heights)))
                image = render_letter(pixels[row], height, rng)
                fmt = str(rng.choice(fmt_names, p=fmt_p))
                _save(image, folder / f"{name}-{row:05d}", fmt, rng)
                counts[split] += 1
    return FolderSet(out, out / "train", out / "test", names, counts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--train-per-class", type=int, default=300)
    parser.add_argument("--test-per-class", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    done = write_folders(
        args.out,
        classes=args.classes,
        train_per_class=args.train_per_class,
        test_per_class=args.test_per_class,
        seed=args.seed,
    )
    print(f"wrote {done.counts} files of classes {done.classes} under {done.root}")


if __name__ == "__main__":
    main()
