"""Item decoders: turn the JSON ``item`` of a request into what extractors consume.

A decoder validates the item against the bundle's ``ItemSpec``, measures its size ``n``
and derives the item's cache identity from its content: a digest of the PNG bytes (images)
or of the values in the bundle's column order (tabular), with the client's ``id`` folded in
when given. An ``id`` can only separate cache entries, never make two different items
share one.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.bundle import ItemSpec
from service.errors import InvalidItem, ItemTooLarge

#: Bump when decoding changes what a given PNG decodes to, so cached features of the old
#: decoding are not served for the new one.
IMAGE_KEY_SCHEME = "png1"
TABULAR_KEY_SCHEME = "tab1"

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Magic numbers of formats that are not PNG, to say what was sent instead.
_OTHER_FORMATS: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
)


@dataclass(frozen=True, slots=True)
class DecodedItem:
    data: Any
    size: int
    key: str


class ItemDecoder(Protocol):
    def decode(self, item: Any) -> DecodedItem: ...

    def heavy(self, item: Any) -> bool:
        """Whether decoding ``item`` is worth a worker thread (off the event loop)."""
        ...


def content_key(scheme: str, content: bytes, item_id: str | None) -> str:
    """``scheme:digest`` of ``content`` (BLAKE2b-256), plus ``:id:digest`` of the client's
    id when there is one: fixed-length, no client text in the key, and two different
    contents never share a key whatever their ids."""
    key = f"{scheme}:{hashlib.blake2b(content, digest_size=32).hexdigest()}"
    if item_id is not None:
        key += ":id:" + hashlib.blake2b(item_id.encode(), digest_size=16).hexdigest()
    return key


class ImageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, min_length=1, max_length=256)
    png_base64: str = Field(min_length=1)


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in ("item", *err["loc"]))
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def png_dimensions(raw: bytes) -> tuple[int, int] | None:
    """(width, height) declared by a PNG's IHDR chunk, read from the bytes without any
    decoding; None if ``raw`` does not start like a PNG."""
    if len(raw) < 24 or not raw.startswith(PNG_SIGNATURE) or raw[12:16] != b"IHDR":
        return None
    return int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")


def _not_png(raw: bytes) -> InvalidItem:
    for magic, name in _OTHER_FORMATS:
        if raw.startswith(magic):
            return InvalidItem(f"item.png_base64 holds a {name} image, not a PNG")
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return InvalidItem("item.png_base64 holds a WEBP image, not a PNG")
    return InvalidItem("item.png_base64 does not decode to a PNG image (no PNG signature)")


#: PNG modes Pillow opens (by bit depth and colour type), all decoded by :func:`grayscale`.
SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I"})
SUPPORTED_MODES = frozenset({"1", "L", "P", "RGB", "LA", "PA", "RGBA"}) | SIXTEEN_BIT_MODES

FloatImage = npt.NDArray[np.float32]


def grayscale(img: Image.Image) -> FloatImage:
    """Any PNG Pillow opens as a 2-D float32 array in [0, 1], as the digits were rendered:
    bright ink (1.0) on a black background (0.0).

    - 1-bit, 2/4/8-bit gray, palette and RGB: luma (ITU-R 601-2, Pillow's ``L``), / 255.
    - 16-bit gray (``I;16``): / 65535, the full range (not clipped to 8 bits).
    - Transparency (an alpha channel, or a ``tRNS`` colour or palette entries): composited
      over black, value = luma x alpha. A drawing held only in the alpha channel (e.g.
      white or any colour at alpha 0..255) therefore reads as that drawing.
    - 16-bit RGB / gray+alpha / RGBA: Pillow reads them at 8 bits per channel (scaled).
    """
    mode = img.mode
    if mode not in SUPPORTED_MODES:
        raise InvalidItem(
            f"item.png_base64 is a PNG in Pillow mode {mode!r}, which this service does not "
            f"decode; send one of {', '.join(sorted(SUPPORTED_MODES))}",
            mode=mode,
        )
    transparency = img.info.get("transparency")
    if mode in SIXTEEN_BIT_MODES:
        raw = np.asarray(img)
        gray = np.clip(raw.astype(np.float32), 0.0, 65535.0) / np.float32(65535.0)
        if isinstance(transparency, int):
            gray[raw == transparency] = 0.0
        return np.ascontiguousarray(gray, dtype=np.float32)
    if mode in {"LA", "PA", "RGBA"} or transparency is not None:
        rgba = img.convert("RGBA")
        luma = np.asarray(rgba.convert("L"), dtype=np.float32)
        alpha = np.asarray(rgba.getchannel("A"), dtype=np.float32)
        return (luma * alpha) / np.float32(255.0 * 255.0)
    pixels = np.asarray(img if mode == "L" else img.convert("L"), dtype=np.uint8)
    return pixels.astype(np.float32) / np.float32(255.0)


class ImageDecoder:
    """``{"id": optional str, "png_base64": str}`` → 2-D float32 array in [0, 1]; n = w*h.

    Dimensions are read from the PNG header before anything is decoded: more pixels than
    the limit is a 413 whatever the size (Pillow's own decompression-bomb check never
    comes into play), a side below ``min_side`` a 422. Every PNG mode decodes (see
    :func:`grayscale`). The cache key is a digest of the PNG bytes (see
    :func:`content_key`): re-encoding the same picture differently is a miss, never a
    wrong hit.
    """

    HEAVY_BASE64_CHARS = 64 * 1024

    def __init__(self, spec: ItemSpec, max_pixels: int) -> None:
        self.max_pixels = min(spec.max_pixels, max_pixels)
        self.min_side = spec.min_side

    def heavy(self, item: Any) -> bool:
        data = item.get("png_base64") if isinstance(item, dict) else None
        return isinstance(data, str) and len(data) > self.HEAVY_BASE64_CHARS

    def _check_dimensions(self, width: int, height: int) -> None:
        if width * height > self.max_pixels:
            raise ItemTooLarge(
                f"image is {width}x{height} = {width * height} pixels; the limit is "
                f"{self.max_pixels}: downscale it",
                pixels=width * height,
                limit=self.max_pixels,
            )
        if min(width, height) < self.min_side:
            raise InvalidItem(
                f"image is {width}x{height}; both sides must be at least {self.min_side} "
                "pixels: upscale it",
                width=width,
                height=height,
                min_side=self.min_side,
            )

    def decode(self, item: Any) -> DecodedItem:
        if not isinstance(item, dict):
            raise InvalidItem(
                f"'item' must be an object with 'png_base64' (and optional 'id'), "
                f"got {type(item).__name__}"
            )
        try:
            parsed = ImageItem.model_validate(item)
        except ValidationError as exc:
            raise InvalidItem(f"invalid image item: {_describe(exc)}") from None
        try:
            raw = base64.b64decode(parsed.png_base64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidItem("item.png_base64 is not valid base64") from None
        declared = png_dimensions(raw)
        if declared is None:
            raise _not_png(raw)
        self._check_dimensions(*declared)
        try:
            img = Image.open(io.BytesIO(raw), formats=["PNG"])
            if img.size != declared:  # pragma: no cover - Pillow reads the same IHDR
                self._check_dimensions(*img.size)
            data = grayscale(img)
        except (ItemTooLarge, InvalidItem):
            raise
        except Image.DecompressionBombError:  # pragma: no cover - dimensions checked above
            raise ItemTooLarge(
                f"image is {declared[0]}x{declared[1]}; the limit is {self.max_pixels} pixels",
                pixels=declared[0] * declared[1],
                limit=self.max_pixels,
            ) from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
            raise InvalidItem("item.png_base64 does not decode to a PNG image") from None
        if data.ndim != 2 or data.size == 0:
            raise InvalidItem("item.png_base64 decodes to an empty image")
        return DecodedItem(
            data=data, size=int(data.size), key=content_key(IMAGE_KEY_SCHEME, raw, parsed.id)
        )


_FLOAT32_MAX = float(np.finfo(np.float32).max)


class TabularItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="the entity's id: sensor acquirers look missing values up by it",
    )
    values: dict[str, Annotated[float, Field(strict=True)]] = Field(
        default_factory=dict,
        description="the values the client already has (any subset of the bundle's columns; "
        "free); the rest are acquired by the bundle's sensor acquirers",
    )


class TabularRow(Mapping[str, float]):
    """A decoded tabular item: the values the client sent (a read-only mapping, in the
    bundle's column order) and the item's ``id`` (None when not sent)."""

    __slots__ = ("_values", "id")

    def __init__(self, values: Mapping[str, float], item_id: str | None = None) -> None:
        self._values = dict(values)
        self.id = item_id

    def __getitem__(self, column: str) -> float:
        return self._values[column]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TabularRow):
            return self._values == other._values and self.id == other.id
        return isinstance(other, Mapping) and self._values == dict(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TabularRow({self._values!r}, id={self.id!r})"


class TabularDecoder:
    """``{"id": optional str, "values": {column: number}}`` → a :class:`TabularRow`; size 1.

    ``values`` holds any subset of the columns the bundle declares, each a finite number:
    a sensor whose columns are all sent is in hand at no cost, the others are acquired
    (by the item's ``id``) or named as the sensor to collect next. A column the bundle does
    not read (a typo, a label, a stale schema) is refused, naming it. The cache key is a
    digest of the values in the bundle's column order, NaN standing for a value not sent
    (see :func:`content_key`).
    """

    def __init__(self, spec: ItemSpec) -> None:
        self.columns = list(spec.columns)
        self._known = frozenset(self.columns)

    def heavy(self, item: Any) -> bool:
        return False

    def decode(self, item: Any) -> DecodedItem:
        if not isinstance(item, dict):
            raise InvalidItem(
                f"'item' must be an object with 'values' and/or 'id', got {type(item).__name__}"
            )
        try:
            parsed = TabularItem.model_validate(item)
        except ValidationError as exc:
            raise InvalidItem(f"invalid tabular item: {_describe(exc)}") from None
        unknown = [c for c in parsed.values if c not in self._known]
        if unknown:
            raise InvalidItem(
                f"item.values has {len(unknown)} column(s) this model does not read: "
                f"{_names(unknown)}; send only its columns ({_names(self.columns)})",
                unknown=[_clip(c) for c in unknown[:_LISTED]],
            )
        bad = [
            c
            for c in self.columns
            if c in parsed.values
            and (not math.isfinite(parsed.values[c]) or abs(parsed.values[c]) > _FLOAT32_MAX)
        ]
        if bad:
            raise InvalidItem(
                f"item.values has non-finite or out-of-range (beyond ±{_FLOAT32_MAX:.3g}) "
                f"values for {_names(bad)}"
            )
        values = {c: float(parsed.values[c]) for c in self.columns if c in parsed.values}
        canonical = np.asarray([values.get(c, math.nan) for c in self.columns], dtype=np.float64)
        return DecodedItem(
            data=TabularRow(values, parsed.id),
            size=1,
            key=content_key(TABULAR_KEY_SCHEME, canonical.tobytes(), parsed.id),
        )


_LISTED = 10


def _clip(name: str, limit: int = 40) -> str:
    return name if len(name) <= limit else name[: limit - 1] + "…"


def _names(names: Sequence[str]) -> str:
    """At most ``_LISTED`` names, quoted and clipped: client-sent names stay readable."""
    shown = ", ".join(repr(_clip(n)) for n in names[:_LISTED])
    return shown + (f" and {len(names) - _LISTED} more" if len(names) > _LISTED else "")


TOKENS_KEY_SCHEME = "tok1"
MAX_FORM_CHARS = 200


class TokenInput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    form: str = Field(min_length=1, max_length=MAX_FORM_CHARS)
    upos: str = Field(min_length=1, max_length=16)


class TokensItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, min_length=1, max_length=256)
    tokens: list[TokenInput] = Field(min_length=1)


class TokensDecoder:
    """``{"id"?, "tokens": [{"form": str, "upos": str}, ...]}`` → a
    :class:`service.extractors.parsing.Sentence`; size = number of tokens.

    More tokens than ``max_tokens`` is a 413 (checked before anything else is validated, so
    a huge list is refused cheaply); an empty list, a missing field or a tag that is not one
    of the 17 universal POS tags a 422 naming the token. The cache key is a digest of the
    forms and tags."""

    def __init__(self, spec: ItemSpec) -> None:
        self.max_tokens = spec.max_tokens

    def heavy(self, item: Any) -> bool:
        return False

    def decode(self, item: Any) -> DecodedItem:
        from service.extractors.parsing import UPOS, UPOS_ID, Sentence

        if not isinstance(item, dict):
            raise InvalidItem(
                f"'item' must be an object with 'tokens' (and optional 'id'), "
                f"got {type(item).__name__}"
            )
        tokens = item.get("tokens")
        if isinstance(tokens, list) and len(tokens) > self.max_tokens:
            raise ItemTooLarge(
                f"the sentence has {len(tokens)} tokens; the limit is {self.max_tokens}: "
                "split it into shorter sentences",
                tokens=len(tokens),
                limit=self.max_tokens,
            )
        try:
            parsed = TokensItem.model_validate(item)
        except ValidationError as exc:
            raise InvalidItem(f"invalid tokens item: {_describe(exc)}") from None
        bad = [(i, t.upos) for i, t in enumerate(parsed.tokens) if t.upos not in UPOS_ID]
        if bad:
            shown = ", ".join(f"item.tokens.{i}.upos = {_clip(tag)!r}" for i, tag in bad[:_LISTED])
            raise InvalidItem(
                f"{len(bad)} token(s) have a tag that is not a universal POS tag: {shown}; "
                f"use one of {', '.join(UPOS)}",
                tokens=[i for i, _ in bad[:_LISTED]],
            )
        forms = [t.form for t in parsed.tokens]
        upos = [t.upos for t in parsed.tokens]
        content = "\x1f".join(f"{f}\x1e{u}" for f, u in zip(forms, upos, strict=True))
        return DecodedItem(
            data=Sentence(forms, upos),
            size=len(forms),
            key=content_key(TOKENS_KEY_SCHEME, content.encode("utf-8"), parsed.id),
        )


def make_decoder(spec: ItemSpec, max_pixels: int) -> ItemDecoder:
    if spec.kind == "image":
        return ImageDecoder(spec, max_pixels)
    if spec.kind == "letters":
        from service.letter_items import LettersDecoder

        return LettersDecoder(spec)
    if spec.kind == "tokens":
        return TokensDecoder(spec)
    return TabularDecoder(spec)
