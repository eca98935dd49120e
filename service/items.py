"""Item decoders: turn the JSON ``item`` of a request into what extractors consume.

A decoder validates the item against the bundle's ``ItemSpec``, measures its size ``n``
and derives a cache identity (the client's ``id`` if given, else a content hash).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import numpy as np
from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.bundle import ItemSpec
from service.errors import InvalidItem, ItemTooLarge


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


class ImageDecoder:
    """``{"id": optional str, "png_base64": str}`` → 2-D float32 array in [0, 1]; n = w*h.

    The cache key is the client's ``id`` (with the image's dimensions) when given: the id
    must identify the picture's content. Without an id it is a hash of the pixels.
    """

    HEAVY_BASE64_CHARS = 64 * 1024

    def __init__(self, spec: ItemSpec, max_pixels: int) -> None:
        self.max_pixels = min(spec.max_pixels, max_pixels)
        self.min_side = spec.min_side

    def heavy(self, item: Any) -> bool:
        data = item.get("png_base64") if isinstance(item, dict) else None
        return isinstance(data, str) and len(data) > self.HEAVY_BASE64_CHARS

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
        try:
            img = Image.open(io.BytesIO(raw))
            width, height = img.size  # header only: nothing decoded yet
            if img.format != "PNG":
                raise InvalidItem(f"item.png_base64 holds a {img.format} image, not a PNG")
            # Checked before decoding, so PIL's own (larger) decompression-bomb limit is moot.
            if min(width, height) < self.min_side:
                raise InvalidItem(
                    f"image is {width}x{height}; both sides must be at least {self.min_side} "
                    "pixels: upscale it",
                    width=width,
                    height=height,
                    min_side=self.min_side,
                )
            if width * height > self.max_pixels:
                raise ItemTooLarge(
                    f"image is {width}x{height} = {width * height} pixels; the limit is "
                    f"{self.max_pixels}: downscale it",
                    pixels=width * height,
                    limit=self.max_pixels,
                )
            pixels = np.asarray(img if img.mode == "L" else img.convert("L"), dtype=np.uint8)
        except (ItemTooLarge, InvalidItem):
            raise
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError,
                Image.DecompressionBombError):
            raise InvalidItem("item.png_base64 does not decode to a PNG image") from None
        if pixels.ndim != 2 or pixels.size == 0:
            raise InvalidItem("item.png_base64 decodes to an empty image")
        data = pixels.astype(np.float32) / np.float32(255.0)
        if parsed.id is not None:
            # The client's identity for the content; the size guards against reusing an id
            # for the same picture at another resolution.
            key = f"id:{parsed.id}:{pixels.shape[1]}x{pixels.shape[0]}"
        else:
            digest = hashlib.blake2b(pixels.tobytes(), digest_size=16)
            digest.update(np.asarray(pixels.shape, dtype=np.int64).tobytes())
            key = "h:" + digest.hexdigest()
        return DecodedItem(data=data, size=int(pixels.size), key=key)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


class TabularItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, min_length=1, max_length=256)
    values: dict[str, Annotated[float, Field(strict=True)]] = Field(min_length=1)


class TabularDecoder:
    """``{"id": optional str, "values": {column: number}}`` → the values as a dict; size 1.

    Every column the bundle declares must be present and finite (a sensor serves a group of
    them at a declared cost). The cache key is the ``id`` when given, else a hash of the
    values.
    """

    def __init__(self, spec: ItemSpec) -> None:
        self.columns = list(spec.columns)

    def heavy(self, item: Any) -> bool:
        return False

    def decode(self, item: Any) -> DecodedItem:
        if not isinstance(item, dict):
            raise InvalidItem(
                f"'item' must be an object with 'values' (and optional 'id'), "
                f"got {type(item).__name__}"
            )
        try:
            parsed = TabularItem.model_validate(item)
        except ValidationError as exc:
            raise InvalidItem(f"invalid tabular item: {_describe(exc)}") from None
        missing = [c for c in self.columns if c not in parsed.values]
        if missing:
            raise InvalidItem(
                f"item.values lacks {len(missing)} column(s) this model needs: "
                f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}",
                missing=missing,
            )
        bad = [
            c for c in self.columns
            if not math.isfinite(parsed.values[c]) or abs(parsed.values[c]) > _FLOAT32_MAX
        ]
        if bad:
            raise InvalidItem(
                f"item.values has non-finite or out-of-range (beyond ±{_FLOAT32_MAX:.3g}) "
                f"values for {', '.join(bad[:10])}"
            )
        values = {c: float(parsed.values[c]) for c in self.columns}
        if parsed.id is not None:
            key = "id:" + parsed.id
        else:
            digest = hashlib.blake2b(
                np.asarray([values[c] for c in self.columns], dtype=np.float64).tobytes(),
                digest_size=16,
            )
            key = "h:" + digest.hexdigest()
        return DecodedItem(data=values, size=1, key=key)


def make_decoder(spec: ItemSpec, max_pixels: int) -> ItemDecoder:
    if spec.kind == "image":
        return ImageDecoder(spec, max_pixels)
    return TabularDecoder(spec)
