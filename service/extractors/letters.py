"""Feature templates of one letter of a handwritten word (``letters`` items, paper 004).

A decoded ``letters`` item is a (letters, 16, 8) float32 array of 0/1 pixels. Each
extractor computes one template for the letter at ``position``, so a bundle declares one
extractor per (template, position) — ``pixels@3``, ``hog@3`` — and the request loop
acquires, caches and charges them part by part. The batched functions
(:func:`pixels_batch`, :func:`hog_batch`) are what training computes over the whole data
set; ``extract`` runs the same code on one letter, so both agree bit for bit.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from service.types import FloatVector

LETTER_SHAPE = (16, 8)

F32 = npt.NDArray[np.float32]


def _letter(item: Any, position: int) -> F32:
    word = np.asarray(item, dtype=np.float32)
    if word.ndim != 3 or word.shape[1:] != LETTER_SHAPE:
        raise ValueError(f"expected a (letters, 16, 8) word, got an array of shape {word.shape}")
    if not 0 <= position < len(word):
        raise ValueError(f"the word has {len(word)} letters; there is no letter at {position}")
    out: F32 = word[position]
    return out


def pixels_batch(letters: npt.ArrayLike) -> F32:
    """The raw-pixel template of (n, 16, 8) letters: (n, 128) in row-major order."""
    arr = np.asarray(letters, dtype=np.float32)
    return np.ascontiguousarray(arr.reshape(len(arr), -1))


def hog_batch(letters: npt.ArrayLike, cell: int = 3, orientations: int = 9) -> F32:
    """HOG of (n, 16, 8) letters with ``cell`` x ``cell`` pixel cells: the letter is padded
    with zeros to a multiple of the cell (18 x 9 for 3 x 3), gradients are central
    differences, each pixel votes its magnitude into the two nearest of ``orientations``
    unsigned bins, and the cell histograms are L2-Hys normalised over overlapping 2 x 2-cell
    blocks: (n, (rows-1)(cols-1) · 4 · orientations), 360 dims for 3 x 3 cells."""
    arr = np.asarray(letters, dtype=np.float32)
    n, h, w = arr.shape
    rows, cols = -(-h // cell), -(-w // cell)
    img = np.zeros((n, rows * cell + 2, cols * cell + 2), dtype=np.float32)
    img[:, 1 : h + 1, 1 : w + 1] = arr
    gx = img[:, 1:-1, 2:] - img[:, 1:-1, :-2]
    gy = img[:, 2:, 1:-1] - img[:, :-2, 1:-1]
    magnitude = np.sqrt(gx * gx + gy * gy)
    position = (np.arctan2(gy, gx) % np.pi) * np.float32(orientations / np.pi) - np.float32(0.5)
    lower = np.floor(position)
    upper_w = position - lower
    bin0 = lower.astype(np.intp) % orientations
    bin1 = (bin0 + 1) % orientations
    ry = np.arange(rows * cell) // cell
    cx = np.arange(cols * cell) // cell
    cell_id = (ry[:, None] * cols + cx[None, :])[None, :, :] * orientations
    base = (np.arange(n) * rows * cols * orientations)[:, None, None]
    size = n * rows * cols * orientations
    hist = np.bincount(
        (base + cell_id + bin0).ravel(), weights=(magnitude * (1 - upper_w)).ravel(), minlength=size
    )
    hist += np.bincount(
        (base + cell_id + bin1).ravel(), weights=(magnitude * upper_w).ravel(), minlength=size
    )
    hist = hist.reshape(n, rows, cols, orientations)
    blocks = np.stack(
        [
            hist[:, i : i + 2, j : j + 2].reshape(n, -1)
            for i in range(rows - 1)
            for j in range(cols - 1)
        ],
        axis=1,
    )
    norm = np.sqrt((blocks * blocks).sum(axis=-1, keepdims=True)) + 1e-6
    clipped = np.minimum(blocks / norm, 0.2)
    norm = np.sqrt((clipped * clipped).sum(axis=-1, keepdims=True)) + 1e-6
    return np.ascontiguousarray((clipped / norm).reshape(n, -1), dtype=np.float32)


class LetterPixels:
    """The 128 raw 0/1 pixels of the letter at ``position``. Cost class O(1): a copy."""

    name: ClassVar[str] = "letter_pixels"
    version: ClassVar[str] = "1"
    item_kind: ClassVar[str] = "letters"

    def __init__(self, *, position: int = 0) -> None:
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        self.position = position

    @property
    def dims(self) -> int:
        return LETTER_SHAPE[0] * LETTER_SHAPE[1]

    def extract(self, item: Any) -> FloatVector:
        out: FloatVector = pixels_batch(_letter(item, self.position)[None])[0]
        return out


class LetterHOG:
    """HOG with ``cell`` x ``cell`` pixel cells of the letter at ``position`` (see
    :func:`hog_batch`). Cost class O(1) per letter, about ten times the pixels' constant."""

    name: ClassVar[str] = "letter_hog"
    version: ClassVar[str] = "1"
    item_kind: ClassVar[str] = "letters"

    def __init__(self, *, position: int = 0, cell: int = 3, orientations: int = 9) -> None:
        if position < 0 or cell < 2 or orientations < 2:
            raise ValueError("position must be >= 0, cell and orientations >= 2")
        self.position = position
        self.cell = cell
        self.orientations = orientations

    @property
    def dims(self) -> int:
        rows = -(-LETTER_SHAPE[0] // self.cell)
        cols = -(-LETTER_SHAPE[1] // self.cell)
        return (rows - 1) * (cols - 1) * 4 * self.orientations

    def extract(self, item: Any) -> FloatVector:
        letter = _letter(item, self.position)[None]
        out: FloatVector = hog_batch(letter, self.cell, self.orientations)[0]
        return out
