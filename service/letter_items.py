"""The ``letters`` item: a handwritten word as a sequence of 16 x 8 binary letter images.

``{"id"?: str, "letters": [letter, ...]}`` where each letter is either a list of 16 rows of
8 values in {0, 1}, or a base64 PNG 8 pixels wide and 16 high whose gray levels are
exactly black (0) or white (255, read as 1). Decoded to a (letters, 16, 8) float32 array;
size = the number of letters. Every problem names the letter (0-based) and says what was
found and what is required.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from service.bundle import ItemSpec
from service.decoded import DecodedItem, content_key
from service.errors import InvalidItem, ItemTooLarge

LETTERS_KEY_SCHEME = "let1"
ROWS, COLS = 16, 8


def _bad(index: int, problem: str) -> InvalidItem:
    return InvalidItem(
        f"item.letters[{index}]: {problem}; each letter must be {ROWS} rows of {COLS} values "
        "in {0, 1} (or a base64 PNG, 8 wide and 16 high, black and white)",
        letter=index,
    )


def _from_rows(index: int, rows: list[Any]) -> np.ndarray[Any, np.dtype[np.float32]]:
    if len(rows) != ROWS:
        raise _bad(index, f"has {len(rows)} rows")
    out = np.zeros((ROWS, COLS), dtype=np.float32)
    for r, row in enumerate(rows):
        if not isinstance(row, list):
            raise _bad(index, f"row {r} is a {type(row).__name__}, not a list")
        if len(row) != COLS:
            raise _bad(index, f"row {r} has {len(row)} values (ragged rows)")
        for c, v in enumerate(row):
            if isinstance(v, bool) or v not in (0, 1):
                raise _bad(index, f"row {r}, column {c} is {v!r}, outside {{0, 1}}")
            out[r, c] = float(v)
    return out


def _from_png(index: int, text: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    try:
        raw = base64.b64decode(text, validate=True)
        img = Image.open(io.BytesIO(raw), formats=["PNG"])
        img.load()
    except (binascii.Error, ValueError):
        raise _bad(index, "is a string but not valid base64") from None
    except (UnidentifiedImageError, OSError, SyntaxError, EOFError):
        raise _bad(index, "is a string but not a PNG image") from None
    if img.size != (COLS, ROWS):
        raise _bad(index, f"is a {img.size[0]}x{img.size[1]} PNG")
    gray = np.asarray(img.convert("L"), dtype=np.uint8)
    if not np.all((gray == 0) | (gray == 255)):
        raise _bad(index, "is a PNG with gray levels other than 0 and 255")
    out: np.ndarray[Any, np.dtype[np.float32]] = (gray == 255).astype(np.float32)
    return out


class LettersDecoder:
    """Decoder of ``letters`` items (see the module docstring)."""

    def __init__(self, spec: ItemSpec) -> None:
        self.max_letters = spec.max_letters

    def heavy(self, item: Any) -> bool:
        return False

    def size_hint(self, item: Any) -> int | None:
        return None

    def size_range(self) -> tuple[int, int, str]:
        return 1, self.max_letters, f"words of 1 to {self.max_letters} letters"

    def decode(self, item: Any) -> DecodedItem:
        if not isinstance(item, dict):
            raise InvalidItem(
                f"'item' must be an object with 'letters' (and optional 'id'), got "
                f"{type(item).__name__}"
            )
        unknown = sorted(set(item) - {"id", "letters"})
        if unknown:
            raise InvalidItem(f"item has unknown fields {unknown}; a word has 'letters' and 'id'")
        item_id = item.get("id")
        if item_id is not None and (not isinstance(item_id, str) or not 1 <= len(item_id) <= 256):
            raise InvalidItem("item.id must be a string of 1 to 256 characters")
        letters = item.get("letters")
        if not isinstance(letters, list):
            raise InvalidItem(
                f"item.letters must be a list of letters, got {type(letters).__name__}"
            )
        if not letters:
            raise InvalidItem("item.letters is empty; send a word of at least one letter")
        if len(letters) > self.max_letters:
            raise ItemTooLarge(
                f"item.letters has {len(letters)} letters; this model reads words of at most "
                f"{self.max_letters}: split the word",
                letters=len(letters),
                limit=self.max_letters,
            )
        word = np.zeros((len(letters), ROWS, COLS), dtype=np.float32)
        for i, letter in enumerate(letters):
            if isinstance(letter, list):
                word[i] = _from_rows(i, letter)
            elif isinstance(letter, str):
                word[i] = _from_png(i, letter)
            else:
                raise _bad(i, f"is a {type(letter).__name__}")
        packed = np.packbits(word.astype(np.uint8), axis=None).tobytes()
        content = len(letters).to_bytes(2, "big") + packed
        return DecodedItem(
            data=word, size=len(letters), key=content_key(LETTERS_KEY_SCHEME, content, item_id)
        )
