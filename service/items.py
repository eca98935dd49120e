"""Item decoders: turn the JSON ``item`` of a request into what extractors consume.

A decoder validates the item against the bundle's ``ItemSpec``, measures its size ``n``
and derives the item's cache identity from its content: a digest of the image bytes (images)
or of the values in the bundle's column order (tabular), with the client's ``id`` folded in
when given. An ``id`` can only separate cache entries, never make two different items
share one.

Images are PNG, JPEG or WebP (:data:`IMAGE_FORMATS`), read by :func:`decode_image`, which
the training side calls too (``training.data.image_folder``), so a bundle is trained on
exactly the pixels the service extracts from. How colour reaches extractors is the bundle's
``item.channels``: ``gray`` (the default) decodes every image to one 2-D luma plane;
``rgb`` keeps three channels, (H, W, 3), for extractor plugins that read colour (the
built-in extractors turn such an item into the same luma themselves).

The module stays whole (over 450 lines): three small decoders (images, table rows, tokens)
behind :func:`make_decoder`; most of the length is the image checks (header before pixels,
formats, colour modes), which only :class:`ImageDecoder` uses and which belong beside it.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageOps, UnidentifiedImageError, features
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from service.bundle import ItemSpec
from service.decoded import DecodedItem, ItemDecoder, content_key, describe_errors
from service.errors import InvalidItem, ItemTooLarge
from service.letter_items import LettersDecoder

if TYPE_CHECKING:
    from service.extractors.tagging import Tagger

__all__ = [
    "IMAGE_FORMATS",
    "DecodedItem",
    "ImageDecoder",
    "ItemDecoder",
    "TabularDecoder",
    "TokensDecoder",
    "content_key",
    "decode_image",
    "grayscale",
    "make_decoder",
]

#: Bump when decoding changes what given image bytes decode to, so cached features of the
#: old decoding are not served for the new one. One scheme per ``item.channels``: the same
#: bytes decode to a luma plane or to three channels.
IMAGE_KEY_SCHEME = "png1"
RGB_KEY_SCHEME = "rgb1"
TABULAR_KEY_SCHEME = "tab1"

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

#: The image formats decoded (Pillow's names), by their leading bytes; WebP where the
#: installed Pillow reads it (the wheels on PyPI do).
IMAGE_FORMATS: tuple[str, ...] = ("PNG", "JPEG", *(("WEBP",) if features.check("webp") else ()))
_FORMAT_NAMES = {"PNG": "PNG", "JPEG": "JPEG", "WEBP": "WebP"}
ACCEPTED = ", ".join(_FORMAT_NAMES[f] for f in IMAGE_FORMATS[:-1]) + (
    f" or {_FORMAT_NAMES[IMAGE_FORMATS[-1]]}"
)

# Magic numbers of formats that are not decoded, to say what was sent instead.
_OTHER_FORMATS: tuple[tuple[bytes, str], ...] = (
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
)

Channels = Literal["gray", "rgb"]
FloatImage = npt.NDArray[np.float32]


class ImageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, min_length=1, max_length=256)
    image_base64: str | None = Field(
        default=None, min_length=1, description="a PNG, JPEG or WebP image, base64"
    )
    png_base64: str | None = Field(
        default=None,
        min_length=1,
        description="the older name of image_base64 (any of the same formats); send one of them",
    )

    @model_validator(mode="after")
    def _one_image(self) -> ImageItem:
        if (self.image_base64 is None) == (self.png_base64 is None):
            raise ValueError(
                "send the image as exactly one of 'image_base64' or 'png_base64' (base64 of a "
                f"{ACCEPTED} file)"
            )
        return self

    @property
    def field(self) -> str:
        return "item.image_base64" if self.image_base64 is not None else "item.png_base64"

    @property
    def text(self) -> str:
        return self.image_base64 if self.image_base64 is not None else str(self.png_base64)


def png_dimensions(raw: bytes) -> tuple[int, int] | None:
    """(width, height) declared by a PNG's IHDR chunk, read from the bytes without any
    decoding; None if ``raw`` does not start like a PNG."""
    if len(raw) < 24 or not raw.startswith(PNG_SIGNATURE) or raw[12:16] != b"IHDR":
        return None
    return int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")


def image_format(raw: bytes) -> str | None:
    """Pillow's name of the format ``raw`` starts like (PNG, JPEG, WEBP), else None."""
    if raw.startswith(PNG_SIGNATURE):
        return "PNG"
    if raw.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "WEBP"
    return None


def _unsupported(raw: bytes, field: str) -> InvalidItem:
    fmt = image_format(raw)
    if fmt is not None:  # WebP with a Pillow built without it
        return InvalidItem(f"{field} holds a {_FORMAT_NAMES[fmt]} image; send {ACCEPTED}")
    for magic, name in _OTHER_FORMATS:
        if raw.startswith(magic):
            return InvalidItem(f"{field} holds a {name} image; send {ACCEPTED}")
    return InvalidItem(f"{field} is not a {ACCEPTED} image (no known file signature)")


#: Pillow modes decoded (by bit depth and colour type), all read by :func:`to_array`.
SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I"})
SUPPORTED_MODES = frozenset({"1", "L", "P", "RGB", "LA", "PA", "RGBA", "CMYK"}) | SIXTEEN_BIT_MODES


def _check_mode(img: Image.Image) -> None:
    if img.mode not in SUPPORTED_MODES:
        raise InvalidItem(
            f"the image is in Pillow mode {img.mode!r}, which this service does not decode; "
            f"send one of {', '.join(sorted(SUPPORTED_MODES))}",
            mode=img.mode,
        )


def grayscale(img: Image.Image) -> FloatImage:
    """Any image Pillow opens in a supported mode as a 2-D float32 array in [0, 1], as the
    digits were rendered: bright ink (1.0) on a black background (0.0).

    - 1-bit, 2/4/8-bit gray, palette, RGB and CMYK: luma (ITU-R 601-2, Pillow's ``L``), / 255.
    - 16-bit gray (``I;16``): / 65535, the full range (not clipped to 8 bits).
    - Transparency (an alpha channel, or a ``tRNS`` colour or palette entries): composited
      over black, value = luma x alpha. A drawing held only in the alpha channel (e.g.
      white or any colour at alpha 0..255) therefore reads as that drawing.
    - 16-bit RGB / gray+alpha / RGBA: Pillow reads them at 8 bits per channel (scaled).
    """
    _check_mode(img)
    mode = img.mode
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


def colour(img: Image.Image) -> FloatImage:
    """Any image Pillow opens in a supported mode as (H, W, 3) float32 RGB in [0, 1]:
    transparency composited over black as in :func:`grayscale`, gray replicated into the
    three channels (16-bit gray at its full range)."""
    _check_mode(img)
    mode = img.mode
    if mode in SIXTEEN_BIT_MODES:
        return np.ascontiguousarray(np.repeat(grayscale(img)[:, :, None], 3, axis=2))
    if mode in {"LA", "PA", "RGBA"} or img.info.get("transparency") is not None:
        rgba = np.asarray(img.convert("RGBA"), dtype=np.float32)
        return np.ascontiguousarray(rgba[:, :, :3] * (rgba[:, :, 3:] / np.float32(255.0 * 255.0)))
    pixels = np.asarray(img if mode == "RGB" else img.convert("RGB"), dtype=np.uint8)
    return pixels.astype(np.float32) / np.float32(255.0)


def to_array(img: Image.Image, channels: Channels = "gray") -> FloatImage:
    """The decoded pixels: a luma plane (``gray``) or three channels (``rgb``)."""
    return grayscale(img) if channels == "gray" else colour(img)


_ORIENTATION = 0x0112  # EXIF: how the camera held the picture


def _upright(img: Image.Image) -> Image.Image:
    """A JPEG or WebP photo turned as its EXIF orientation says (as viewers show it)."""
    if img.getexif().get(_ORIENTATION, 1) in (2, 3, 4, 5, 6, 7, 8):
        return ImageOps.exif_transpose(img)
    return img


def check_dimensions(width: int, height: int, max_pixels: int, min_side: int) -> None:
    """413 over ``max_pixels`` whatever the shape, 422 for a side under ``min_side``."""
    if width * height > max_pixels:
        raise ItemTooLarge(
            f"image is {width}x{height} = {width * height} pixels; the limit is "
            f"{max_pixels}: downscale it",
            pixels=width * height,
            limit=max_pixels,
        )
    if min(width, height) < min_side:
        raise InvalidItem(
            f"image is {width}x{height}; both sides must be at least {min_side} pixels: upscale it",
            width=width,
            height=height,
            min_side=min_side,
        )


def decode_image(
    raw: bytes,
    *,
    max_pixels: int,
    min_side: int = 1,
    channels: Channels = "gray",
    field: str = "the image",
) -> FloatImage:
    """PNG, JPEG or WebP bytes → float32 pixels in [0, 1] (:func:`to_array`).

    The dimensions are checked before any pixel is decoded: a PNG's from its IHDR bytes, a
    JPEG's or WebP's from the header Pillow reads when it opens the file (decoding is lazy).
    More pixels than ``max_pixels`` is :class:`ItemTooLarge` (413) whatever the shape, a side
    below ``min_side``, an unknown format or a file that does not decode :class:`InvalidItem`
    (422). A JPEG or WebP photo is turned upright by its EXIF orientation."""
    fmt = image_format(raw)
    if fmt is None or fmt not in IMAGE_FORMATS:
        raise _unsupported(raw, field)
    declared = png_dimensions(raw) if fmt == "PNG" else None
    if fmt == "PNG" and declared is None:
        raise InvalidItem(f"{field} does not decode to a PNG image (no IHDR header)")
    if declared is not None:
        check_dimensions(*declared, max_pixels, min_side)
    try:
        img: Image.Image = Image.open(io.BytesIO(raw), formats=[fmt])
        check_dimensions(*img.size, max_pixels, min_side)  # the header only, nothing decoded
        if fmt != "PNG":
            img = _upright(img)
        data = to_array(img, channels)
    except (ItemTooLarge, InvalidItem):
        raise
    except Image.DecompressionBombError:
        raise ItemTooLarge(
            f"{field} declares more pixels than Pillow opens; the limit is {max_pixels}: "
            "downscale it",
            limit=max_pixels,
        ) from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        raise InvalidItem(
            f"{field} does not decode to a {_FORMAT_NAMES[fmt]} image (truncated or corrupt)"
        ) from None
    if data.size == 0:
        raise InvalidItem(f"{field} decodes to an empty image")
    return data


@functools.cache
def _load_format_plugins() -> None:
    """Decode a tiny image of every format once, so the first request of a fresh process
    does not pay for importing Pillow's plugins (milliseconds) against its budget."""
    for fmt in IMAGE_FORMATS:
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buffer, format=fmt)
        decode_image(buffer.getvalue(), max_pixels=64)


class ImageDecoder:
    """``{"id"?: str, "image_base64" | "png_base64": str}`` → float32 pixels in [0, 1]
    (2-D, or (H, W, 3) for a bundle whose ``item.channels`` is ``rgb``); n = width x height.

    PNG, JPEG and WebP (:func:`decode_image`); dimensions are read before anything is
    decoded: more pixels than the limit is a 413 whatever the size, a side below
    ``min_side`` a 422. The cache key is a digest of the image bytes (see
    :func:`content_key`): re-encoding the same picture differently is a miss, never a
    wrong hit.
    """

    HEAVY_BASE64_CHARS = 64 * 1024

    def __init__(self, spec: ItemSpec, max_pixels: int) -> None:
        self.max_pixels = min(spec.max_pixels, max_pixels)
        self.min_side = spec.min_side
        self.channels: Channels = spec.channels
        self.scheme = IMAGE_KEY_SCHEME if spec.channels == "gray" else RGB_KEY_SCHEME
        _load_format_plugins()

    def heavy(self, item: Any) -> bool:
        if not isinstance(item, dict):
            return False
        data = item.get("image_base64", item.get("png_base64"))
        return isinstance(data, str) and len(data) > self.HEAVY_BASE64_CHARS

    def size_hint(self, item: Any) -> int | None:
        """The item's size (pixels) before any decoding, from a PNG's IHDR (its first 24
        bytes, 32 base64 characters); None for another format, anything malformed or more
        pixels than the limit (decoding then says what is wrong). Admission prices the
        decoding with it when the request sends no ``size``."""
        if not isinstance(item, dict):
            return None
        data = item.get("image_base64", item.get("png_base64"))
        if not isinstance(data, str) or len(data) < 32:
            return None
        try:
            head = base64.b64decode(data[:32], validate=True)
        except (binascii.Error, ValueError):
            return None
        dims = png_dimensions(head)
        if dims is None or not 0 < dims[0] * dims[1] <= self.max_pixels:
            return None
        return dims[0] * dims[1]

    def size_range(self) -> tuple[int, int, str]:
        return (
            self.min_side**2,
            self.max_pixels,
            f"images of {self.min_side} px a side up to {self.max_pixels} pixels",
        )

    def decode(self, item: Any) -> DecodedItem:
        if not isinstance(item, dict):
            raise InvalidItem(
                f"'item' must be an object with 'image_base64' (and optional 'id'), "
                f"got {type(item).__name__}"
            )
        if "image_base64" not in item and "png_base64" not in item:
            raise InvalidItem(
                f"item has no 'image_base64' (base64 of a {ACCEPTED} file; 'png_base64' is its "
                f"older name); it has {_names([str(k) for k in item]) or 'no fields'}"
            )
        try:
            parsed = ImageItem.model_validate(item)
        except ValidationError as exc:
            raise InvalidItem(f"invalid image item: {describe_errors(exc)}") from None
        try:
            raw = base64.b64decode(parsed.text, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidItem(f"{parsed.field} is not valid base64") from None
        data = decode_image(
            raw,
            max_pixels=self.max_pixels,
            min_side=self.min_side,
            channels=self.channels,
            field=parsed.field,
        )
        return DecodedItem(
            data=data,
            size=int(data.shape[0] * data.shape[1]),
            key=content_key(self.scheme, raw, parsed.id),
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
    values: dict[str, Annotated[float, Field(strict=True)] | None] = Field(
        default_factory=dict,
        description="the values the client already has (any subset of the bundle's columns; "
        "free); the rest are acquired by the bundle's sensor acquirers. A value null or NaN "
        "is missing: as if not sent",
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

    ``values`` holds any subset of the columns the bundle declares, each a finite number,
    or null / NaN for a value the client does not have (a gap in its row: read as not
    sent, never a 422): a sensor whose columns are all sent is in hand at no cost, the
    others are acquired (by the item's ``id``) or named as the sensor to collect next. A
    column the bundle does not read (a typo, a label, a stale schema) is refused, naming
    it, and so is an infinite value or one beyond float32. The cache key is a digest of the
    values in the bundle's column order, NaN standing for a value not sent (see
    :func:`content_key`).
    """

    def __init__(self, spec: ItemSpec) -> None:
        self.columns = list(spec.columns)
        self._known = frozenset(self.columns)

    def heavy(self, item: Any) -> bool:
        return False

    def size_hint(self, item: Any) -> int | None:
        return None

    def size_range(self) -> tuple[int, int, str]:
        return 1, 1, "table rows, each of size 1"

    def decode(self, item: Any) -> DecodedItem:
        if not isinstance(item, dict):
            raise InvalidItem(
                f"'item' must be an object with 'values' and/or 'id', got {type(item).__name__}"
            )
        try:
            parsed = TabularItem.model_validate(item)
        except ValidationError as exc:
            raise InvalidItem(f"invalid tabular item: {describe_errors(exc)}") from None
        unknown = [c for c in parsed.values if c not in self._known]
        if unknown:
            raise InvalidItem(
                f"item.values has {len(unknown)} column(s) this model does not read: "
                f"{_names(unknown)}; send only its columns ({_names(self.columns)})",
                unknown=[_clip(c) for c in unknown[:_LISTED]],
            )
        sent = {
            c: float(v)
            for c, v in parsed.values.items()
            if v is not None and not math.isnan(v)  # a gap: not in hand
        }
        bad = [
            c
            for c in self.columns
            if c in sent and (math.isinf(sent[c]) or abs(sent[c]) > _FLOAT32_MAX)
        ]
        if bad:
            raise InvalidItem(
                f"item.values has infinite or out-of-range (beyond ±{_FLOAT32_MAX:.3g}) "
                f"values for {_names(bad)}; send a missing value as null"
            )
        values = {c: sent[c] for c in self.columns if c in sent}
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
    upos: str | None = Field(default=None, min_length=1, max_length=16)


class TokensItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(default=None, min_length=1, max_length=256)
    tokens: list[TokenInput] = Field(min_length=1)


class TokensDecoder:
    """``{"id"?, "tokens": [{"form": str, "upos"?: str}, ...]}`` → a
    :class:`service.extractors.parsing.Sentence`; size = number of tokens.

    Tokens sent without ``upos`` are tagged by the bundle's ``tagger``
    (:class:`service.extractors.tagging.Tagger`, keeping the tags that were sent), here,
    so the time is charged as decoding (on a worker thread past ``HEAVY_UNTAGGED_TOKENS``
    tokens to tag); without a tagger every token needs its tag.
    More tokens than ``max_tokens`` is a 413 (checked before anything else is validated, so
    a huge list is refused cheaply); an empty list, a missing field or a tag that is not one
    of the 17 universal POS tags a 422 naming the token. The cache key is a digest of the
    forms and the tags sent (the tagger is the bundle's: the same forms, the same tags)."""

    #: Untagged tokens beyond which tagging (~12 µs a token here) goes to a worker thread.
    HEAVY_UNTAGGED_TOKENS = 64

    def __init__(self, spec: ItemSpec, tagger: Tagger | None = None) -> None:
        self.max_tokens = spec.max_tokens
        self.tagger = tagger

    def heavy(self, item: Any) -> bool:
        """A long sentence that the tagger has to tag: decoded on a worker thread."""
        tokens = item.get("tokens") if isinstance(item, dict) and self.tagger else None
        if not isinstance(tokens, list) or len(tokens) <= self.HEAVY_UNTAGGED_TOKENS:
            return False
        untagged = sum(not (isinstance(t, dict) and t.get("upos")) for t in tokens)
        return untagged > self.HEAVY_UNTAGGED_TOKENS

    def size_hint(self, item: Any) -> int | None:
        return None

    def size_range(self) -> tuple[int, int, str]:
        return 1, self.max_tokens, f"sentences of 1 to {self.max_tokens} tokens"

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
            raise InvalidItem(f"invalid tokens item: {describe_errors(exc)}") from None
        bad = [
            (i, t.upos)
            for i, t in enumerate(parsed.tokens)
            if t.upos is not None and t.upos not in UPOS_ID
        ]
        if bad:
            shown = ", ".join(f"item.tokens.{i}.upos = {_clip(tag)!r}" for i, tag in bad[:_LISTED])
            raise InvalidItem(
                f"{len(bad)} token(s) have a tag that is not a universal POS tag: {shown}; "
                f"use one of {', '.join(UPOS)}",
                tokens=[i for i, _ in bad[:_LISTED]],
            )
        forms = [t.form for t in parsed.tokens]
        sent = [t.upos for t in parsed.tokens]
        untagged = [i for i, u in enumerate(sent) if u is None]
        upos = [u for u in sent if u is not None]
        if untagged:
            if self.tagger is None:
                raise InvalidItem(
                    f"{len(untagged)} token(s) have no 'upos' (item.tokens.{untagged[0]} "
                    "first) and this bundle has no tagger: send a universal POS tag with every "
                    "token, or use a parser bundle built with a tagger",
                    tokens=untagged[:_LISTED],
                )
            upos = self.tagger.tag(forms, sent)
        content = "\x1f".join(f"{f}\x1e{u or ''}" for f, u in zip(forms, sent, strict=True))
        return DecodedItem(
            data=Sentence(forms, upos),
            size=len(forms),
            key=content_key(TOKENS_KEY_SCHEME, content.encode("utf-8"), parsed.id),
        )


def make_decoder(spec: ItemSpec, max_pixels: int, tagger: Tagger | None = None) -> ItemDecoder:
    """The decoder of ``spec``'s kind (``tagger``: a tokens bundle's, from its manifest)."""
    if spec.kind == "image":
        return ImageDecoder(spec, max_pixels)
    if spec.kind == "letters":
        return LettersDecoder(spec)
    if spec.kind == "tokens":
        return TokensDecoder(spec, tagger)
    return TabularDecoder(spec)
