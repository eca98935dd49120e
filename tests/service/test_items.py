"""Items through the real app: every PNG mode decodes to the same picture, headers over the
pixel limit are 413 before anything decodes, and cached features are bound to the content
(an ``id`` never makes one item's answer another's), in-process and with a real Redis.

Why one module over 450 lines: one theme, the item decoders as the app serves them, with
shared PNG builders and the digits client; cache binding and formats are too small to split.
"""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from PIL import Image

from service.bundle import ItemSpec
from service.cache import InProcessCache
from service.errors import InvalidItem
from service.http import create_app
from service.items import ImageDecoder, grayscale, make_decoder, png_dimensions
from service.settings import Settings
from tests.conftest import ROUTER_COLUMNS, digit_image, png_b64
from tests.support.sensor_store import SensorStore

# ---------------------------------------------------------------------------- PNG encoding


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (
        struct.pack(">I", len(data))
        + kind
        + data
        + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    )


def raw_png(width: int, height: int, depth: int, colour: int, rows: bytes | None) -> bytes:
    """A PNG written by hand: IHDR as given, one IDAT of ``rows`` (already filtered, i.e.
    each row prefixed by filter byte 0), IEND. ``rows=None`` writes no IDAT at all: a
    header that declares any size while being a few dozen bytes."""
    ihdr = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    body = _chunk(b"IHDR", ihdr)
    if rows is not None:
        body += _chunk(b"IDAT", zlib.compress(rows))
    return b"\x89PNG\r\n\x1a\n" + body + _chunk(b"IEND", b"")


def _rows(channels: np.ndarray) -> bytes:
    """(h, w, c) big-endian samples → filtered scanlines."""
    return b"".join(b"\x00" + row.tobytes() for row in channels)


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _save(image: Image.Image, **options: Any) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG", **options)
    return b64(buf.getvalue())


def encodings(gray: np.ndarray) -> dict[str, str]:
    """The same 8-bit picture (bright ink on black) in every PNG flavour Pillow opens."""
    base = Image.fromarray(gray)
    white = Image.new("L", base.size, 255)
    h, w = gray.shape
    wide = gray.astype(">u2") * 257
    return {
        "L": _save(base),
        "I;16": _save(Image.fromarray(gray.astype(np.uint16) * 257)),
        "RGB": _save(base.convert("RGB")),
        "RGBA drawing in alpha": _save(Image.merge("RGBA", [white, white, white, base])),
        "RGBA opaque": _save(Image.merge("RGBA", [base, base, base, white])),
        "LA drawing in alpha": _save(Image.merge("LA", [white, base])),
        "LA opaque": _save(Image.merge("LA", [base, white])),
        "P": _save(base.convert("P")),
        "P with tRNS": _save(base.convert("P"), transparency=0),
        "L with tRNS": _save(base, transparency=0),
        "16-bit RGB": b64(raw_png(w, h, 16, 2, _rows(np.dstack([wide] * 3)))),
        "16-bit LA drawing in alpha": b64(
            raw_png(w, h, 16, 4, _rows(np.dstack([np.full_like(wide, 65535), wide])))
        ),
        "16-bit RGBA drawing in alpha": b64(
            raw_png(w, h, 16, 6, _rows(np.dstack([np.full_like(wide, 65535)] * 3 + [wide])))
        ),
    }


@pytest.fixture(scope="module")
def three() -> np.ndarray:
    return np.clip(digit_image(3, 64) * 255.0 + 0.5, 0, 255).astype(np.uint8)


def test_every_png_mode_decodes_to_the_same_picture(three: np.ndarray) -> None:
    decoder = ImageDecoder(ItemSpec(), 1 << 22)
    reference = decoder.decode({"png_base64": encodings(three)["L"]}).data
    np.testing.assert_array_equal(reference, three.astype(np.float32) / 255.0)
    for name, data in encodings(three).items():
        decoded = decoder.decode({"png_base64": data}).data
        assert decoded.shape == reference.shape and decoded.dtype == np.float32, name
        np.testing.assert_allclose(decoded, reference, atol=1e-6, err_msg=name)


def test_sixteen_bit_gray_is_scaled_not_clipped() -> None:
    # Values 0..65535 spread over the whole range: Pillow's own L conversion would make
    # everything >= 255 white.
    ramp = np.linspace(0, 65535, 32 * 32).astype(np.uint16).reshape(32, 32)
    decoded = (
        ImageDecoder(ItemSpec(), 1 << 22).decode({"png_base64": _save(Image.fromarray(ramp))}).data
    )
    np.testing.assert_allclose(decoded, ramp / 65535.0, atol=1e-6)
    assert 0.45 < float(decoded.mean()) < 0.55


def test_one_bit_png_is_the_thresholded_picture(three: np.ndarray) -> None:
    data = _save(Image.fromarray(three).convert("1", dither=Image.Dither.NONE))
    decoded = ImageDecoder(ItemSpec(), 1 << 22).decode({"png_base64": data}).data
    assert set(np.unique(decoded).tolist()) == {0.0, 1.0}
    assert np.array_equal(decoded > 0.5, three >= 128)


@pytest.mark.parametrize("mode", ["F", "YCbCr"])
def test_modes_no_format_has_are_refused_by_name(mode: str) -> None:
    # Pillow never opens a PNG, JPEG or WebP in these modes; should a future Pillow do so,
    # the decoder refuses it with a 422 naming the mode rather than guessing.
    with pytest.raises(InvalidItem, match=f"Pillow mode '{mode}'") as info:
        grayscale(Image.new(mode, (8, 8)))
    assert info.value.details == {"mode": mode}


@pytest.fixture(scope="module")
def digits_client(digits_bundle_dir: Path) -> Iterator[TestClient]:
    app = create_app(Settings(models_dir=digits_bundle_dir.parent), cache=InProcessCache(1 << 20))
    with TestClient(app) as client:
        yield client


def _predict(
    client: TestClient, item: dict[str, Any], budget: float = 50.0, model: str = "digits"
) -> dict[str, Any]:
    r = client.post("/predict", json={"model": model, "item": item, "budget": budget})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


@pytest.mark.parametrize("index", [3, 7])
def test_every_png_mode_gets_the_same_answer(digits_client: TestClient, index: int) -> None:
    gray = np.clip(digit_image(index, 64) * 255.0 + 0.5, 0, 255).astype(np.uint8)
    variants = encodings(gray)
    variants["1-bit"] = _save(Image.fromarray(gray).convert("1", dither=Image.Dither.NONE))
    reference = _predict(digits_client, {"png_base64": variants["L"]})
    assert reference["prediction"] == str(index)
    for name, data in variants.items():
        body = _predict(digits_client, {"png_base64": data})
        assert body["prediction"] == reference["prediction"], name
        if name != "1-bit":  # thresholding changes the picture, not the digit
            for label, p in reference["probabilities"].items():
                assert body["probabilities"][label] == pytest.approx(p, abs=2e-3), name


# ------------------------------------------------------------------- limits and refusals


@pytest.mark.parametrize("side", [13_000, 13_400, 30_000, 65_535])
def test_huge_png_headers_are_413_before_decoding(digits_client: TestClient, side: int) -> None:
    data = raw_png(side, side, 8, 0, rows=None)
    assert len(data) < 100 and png_dimensions(data) == (side, side)
    r = digits_client.post(
        "/predict", json={"model": "digits", "budget": 5, "item": {"png_base64": b64(data)}}
    )
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["type"] == "item_too_large"
    assert error["details"]["pixels"] == side * side
    assert f"{side}x{side}" in error["message"]


def _jpeg_header(width: int, height: int) -> bytes:
    """The start of a baseline JPEG declaring ``width`` x ``height``: SOI, then an SOF0
    segment (three components), and no scan data at all."""
    sof = struct.pack(">BHHB", 8, height, width, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    return b"\xff\xd8" + b"\xff\xc0" + struct.pack(">H", len(sof) + 2) + sof + b"\xff\xd9"


@pytest.mark.parametrize(
    ("width", "height", "fmt"),
    [
        (1 << 31, 1, "PNG"),
        (1 << 20, 1 << 20, "PNG"),
        (4097, 4096, "PNG"),
        (4097, 4096, "JPEG"),  # read from the header Pillow parses when it opens the file
        (65_000, 65_000, "JPEG"),  # over Pillow's own bomb limit: still our 413
    ],
)
def test_over_limit_header_is_413_whatever_its_shape(
    digits_client: TestClient, width: int, height: int, fmt: str
) -> None:
    png = raw_png(width, height, 16, 6, rows=None)
    header = png if fmt == "PNG" else _jpeg_header(width, height)
    r = digits_client.post(
        "/predict", json={"model": "digits", "budget": 5, "item": {"image_base64": b64(header)}}
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["type"] == "item_too_large"


def test_within_limit_header_with_no_pixels_is_a_422(digits_client: TestClient) -> None:
    r = digits_client.post(
        "/predict",
        json={
            "model": "digits",
            "budget": 5,
            "item": {"png_base64": b64(raw_png(64, 64, 8, 0, rows=None))},
        },
    )
    assert r.status_code == 422, r.text
    assert r.json()["error"]["type"] == "invalid_item"


@pytest.mark.parametrize(
    ("payload", "mentions"),
    [
        (b"GIF89a" + b"\x00" * 20, "GIF"),
        (b"BM" + b"\x00" * 40, "BMP"),
        (b"hello, world", "not a PNG, JPEG or WebP image (no known file signature)"),
    ],
)
def test_other_formats_are_named(digits_client: TestClient, payload: bytes, mentions: str) -> None:
    r = digits_client.post(
        "/predict", json={"model": "digits", "budget": 5, "item": {"png_base64": b64(payload)}}
    )
    assert r.status_code == 422 and mentions in r.json()["error"]["message"]


# ------------------------------------------------------------- cache bound to the content


def _poisoning_attempt(
    first: Callable[[dict[str, Any]], dict[str, Any]],
    second: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    """Client A sends a 3 as 'scan-42', client B a 7 at the same size as 'scan-42': B must
    get a 7 computed from its own pixels; A's 3 sent again under the same id still hits."""
    a = {"id": "scan-42", "png_base64": png_b64(digit_image(3, 64))}
    b = {"id": "scan-42", "png_base64": png_b64(digit_image(7, 64))}
    answer_a = first(a)
    assert answer_a["prediction"] == "3" and answer_a["cost"]["extracted"]
    answer_b = second(b)
    assert answer_b["prediction"] == "7", answer_b
    assert answer_b["cost"]["cached"] == [], "B was served features computed from A's item"
    again = first(a)
    assert again["prediction"] == "3"
    assert set(answer_a["cost"]["extracted"]) <= set(again["cost"]["cached"])


def test_same_id_different_picture_is_not_served_from_cache(digits_bundle_dir: Path) -> None:
    app = create_app(Settings(models_dir=digits_bundle_dir.parent), cache=InProcessCache(1 << 22))
    with TestClient(app) as client:
        _poisoning_attempt(lambda item: _predict(client, item), lambda item: _predict(client, item))


@pytest.mark.redis
def test_same_id_different_picture_across_workers_with_redis(
    redis_url: str, digits_bundle_dir: Path
) -> None:
    redis.Redis.from_url(redis_url).flushdb()
    # Two apps sharing one Redis: two workers (or replicas) of the service.
    settings = Settings(
        models_dir=digits_bundle_dir.parent, redis_url=redis_url, redis_timeout_ms=500
    )
    with TestClient(create_app(settings)) as one, TestClient(create_app(settings)) as two:
        _poisoning_attempt(
            lambda item: _predict(one, item, budget=200.0),
            lambda item: _predict(two, item, budget=200.0),
        )
    keys = [
        k.decode() if isinstance(k, bytes) else k
        for k in redis.Redis.from_url(redis_url).keys("bs:*")
    ]
    assert keys and not any("scan-42" in k for k in keys), "no client text in Redis keys"


def _router_rows() -> tuple[list[float], list[float]]:
    from training.data.synthetic import make_router_data

    x, y = make_router_data(40, seed=11)
    first = next(i for i in range(len(y)) if y[i] == y[0])
    other = next(i for i in range(len(y)) if y[i] != y[first])
    return [float(v) for v in x[first]], [float(v) for v in x[other]]


def _tabular_attempt(send: Callable[[dict[str, Any]], dict[str, Any]], store: SensorStore) -> None:
    """Two requests for entity row-1 that send different values of r: the sensors acquired
    for one (from the store) must not be served from the cache to the other."""
    row_a, row_b = _router_rows()
    store.put(row_a, "row-1")
    a = {"id": "row-1", "values": {"r": row_a[0]}}
    b = {"id": "row-1", "values": {"r": row_b[0] if row_b[0] != row_a[0] else row_a[0] + 1}}
    answer_a = send(a)
    assert answer_a["cost"]["extracted"] and answer_a["cost"]["given"] == ["r"]
    answer_b = send(b)
    assert answer_b["cost"]["cached"] == [], "B was served A's sensor values"
    assert answer_b["cost"]["extracted"], "B acquired its own"
    assert send(a)["cost"]["cached"], "the same values under the same id still hit"


def _router_app(router_bundle_dir: Path, store: SensorStore, **settings: Any) -> FastAPI:
    sources = {"router": {"*": store.source()}}
    config = Settings(models_dir=router_bundle_dir.parent, sensor_sources=sources, **settings)
    if "redis_url" in settings:
        return create_app(config)
    return create_app(config, cache=InProcessCache(1 << 20))


def test_tabular_same_id_different_values_is_not_served_from_cache(
    router_bundle_dir: Path, redis_url: str
) -> None:
    store = SensorStore(redis_url, ROUTER_COLUMNS)
    with TestClient(_router_app(router_bundle_dir, store)) as client:
        _tabular_attempt(lambda item: _predict(client, item, budget=11.0, model="router"), store)


@pytest.mark.redis
def test_tabular_same_id_different_values_with_redis(
    redis_url: str, router_bundle_dir: Path
) -> None:
    redis.Redis.from_url(redis_url).flushdb()
    store = SensorStore(redis_url, ROUTER_COLUMNS)
    app = _router_app(router_bundle_dir, store, redis_url=redis_url, redis_timeout_ms=500)
    with TestClient(app) as client:
        _tabular_attempt(lambda item: _predict(client, item, budget=11.0, model="router"), store)


def test_content_keys() -> None:
    decoder = ImageDecoder(ItemSpec(), 1 << 22)
    three = png_b64(digit_image(3, 32))
    seven = png_b64(digit_image(7, 32))
    keys = {
        (data, item_id): decoder.decode(
            {"png_base64": data} | ({"id": item_id} if item_id else {})
        ).key
        for data in (three, seven)
        for item_id in (None, "x", "y")
    }
    assert len(set(keys.values())) == 6, "content and id both separate keys"
    assert keys[(three, "x")] == decoder.decode({"png_base64": three, "id": "x"}).key
    tabular = make_decoder(ItemSpec(kind="tabular", columns=["a", "b"]), 1)
    one = tabular.decode({"id": "r", "values": {"a": 1, "b": 2}}).key
    assert one == tabular.decode({"id": "r", "values": {"b": 2.0, "a": 1.0}}).key
    assert one != tabular.decode({"id": "r", "values": {"a": 1, "b": 3}}).key


# ------------------------------------------------------------------- tabular extra columns


def test_tabular_extra_columns_are_refused_and_named(router_bundle_dir: Path) -> None:
    app = create_app(Settings(models_dir=router_bundle_dir.parent), cache=InProcessCache(1 << 20))
    values = dict.fromkeys(ROUTER_COLUMNS, 0.5) | {"label": 1.0, "a3": 2.0}
    with TestClient(app) as client:
        r = client.post(
            "/predict", json={"model": "router", "budget": 6.0, "item": {"values": values}}
        )
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_item"
    assert "'label'" in error["message"] and "'a3'" in error["message"]
    assert error["details"]["unknown"] == ["label", "a3"]


def test_tabular_names_in_messages_are_bounded() -> None:
    decoder = make_decoder(ItemSpec(kind="tabular", columns=["a"]), 1)
    values = {"a": 1.0} | {f"{'x' * 500}{i}": 0.0 for i in range(50)}
    with pytest.raises(InvalidItem) as info:
        decoder.decode({"values": values})
    assert len(info.value.message) < 1000 and "and 40 more" in info.value.message


# ------------------------------------------------------------- JPEG, WebP, colour (issue 26)


def _encoded(image: Image.Image, fmt: str, **options: Any) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
def test_jpeg_and_webp_decode_like_the_png_of_their_pixels(three: np.ndarray, fmt: str) -> None:
    """A lossy file decodes to what Pillow reads from it (the same luma a PNG of those
    pixels gives), under either field name, with a size of width x height."""
    photo = Image.fromarray(three).convert("RGB")
    raw = _encoded(photo, fmt, quality=90)
    decoder = ImageDecoder(ItemSpec(), 1 << 22)
    for field in ("image_base64", "png_base64"):
        item = decoder.decode({field: b64(raw)})
        assert item.size == three.size and item.data.shape == three.shape
        as_png = _save(Image.open(io.BytesIO(raw)).convert("L"))
        np.testing.assert_array_equal(item.data, decoder.decode({"png_base64": as_png}).data)
    assert np.abs(item.data - three / 255.0).mean() < 0.02  # and close to the original


def test_jpeg_is_served_like_its_png(digits_client: TestClient, three: np.ndarray) -> None:
    raw = _encoded(Image.fromarray(three), "JPEG", quality=95)
    body = _predict(digits_client, {"image_base64": b64(raw)})
    assert body["prediction"] == "3"
    r = digits_client.post(
        "/predict",
        json={"model": "digits", "budget": 5, "item": {"image_base64": b64(raw[:200])}},
    )
    assert r.status_code == 422 and "JPEG" in r.json()["error"]["message"], r.text


def test_an_item_sends_exactly_one_image_field(three: np.ndarray) -> None:
    decoder = ImageDecoder(ItemSpec(), 1 << 22)
    data = encodings(three)["L"]
    with pytest.raises(InvalidItem, match="exactly one of 'image_base64' or 'png_base64'"):
        decoder.decode({"image_base64": data, "png_base64": data})
    with pytest.raises(InvalidItem, match=r"no 'image_base64'.*it has 'id', 'values'"):
        decoder.decode({"id": "x", "values": {}})


def test_colour_reaches_rgb_items_and_gray_is_its_luma() -> None:
    """``channels: rgb`` keeps three channels (transparency over black as in gray); the
    built-in extractors read such an item as the luma the gray decoding gives."""
    from service.extractors.builtin import HOG, Thumbnail

    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, size=(24, 40, 3), dtype=np.uint8)
    rgb[:, :20] = [200, 30, 10]  # a red half: colour a gray plane cannot tell from others
    raw = base64.b64decode(_save(Image.fromarray(rgb, "RGB")))
    gray = ImageDecoder(ItemSpec(), 1 << 22).decode({"image_base64": b64(raw)})
    colour = ImageDecoder(ItemSpec(channels="rgb"), 1 << 22).decode({"image_base64": b64(raw)})
    assert gray.data.shape == (24, 40) and colour.data.shape == (24, 40, 3)
    assert colour.size == gray.size == 24 * 40
    assert colour.key != gray.key, "the two decodings never share cached features"
    np.testing.assert_allclose(colour.data, rgb / 255.0, atol=1e-6)
    np.testing.assert_allclose(colour.data @ [0.299, 0.587, 0.114], gray.data, atol=1 / 255)
    for extractor in (Thumbnail(), HOG()):
        np.testing.assert_allclose(
            extractor.extract(colour.data), extractor.extract(gray.data), atol=0.02
        )
    alpha = Image.new("L", (40, 24), 128)
    half = Image.merge("RGBA", [*Image.fromarray(rgb, "RGB").split(), alpha])
    faded = ImageDecoder(ItemSpec(channels="rgb"), 1 << 22).decode({"image_base64": _save(half)})
    np.testing.assert_allclose(faded.data, rgb / 255.0 * (128 / 255), atol=1e-6)


def test_exif_orientation_turns_a_photo_upright() -> None:
    tall = np.zeros((40, 20), dtype=np.uint8)
    tall[:10] = 255  # bright top
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned: viewers rotate it 90° clockwise
    stored = Image.fromarray(tall).transpose(Image.Transpose.ROTATE_90)  # 20 high, 40 wide
    raw = _encoded(stored, "JPEG", quality=95, exif=exif.tobytes())
    item = ImageDecoder(ItemSpec(), 1 << 22).decode({"image_base64": b64(raw)})
    assert item.data.shape == (40, 20)
    assert item.data[:10].mean() > 0.9 and item.data[12:].mean() < 0.1


# -------------------------------------------------------------- tabular gaps (issue 26)


def test_tabular_null_and_nan_are_gaps_not_errors() -> None:
    decoder = make_decoder(ItemSpec(kind="tabular", columns=["a", "b", "c"]), 1)
    item = decoder.decode({"id": "r", "values": {"a": 1.0, "b": None, "c": float("nan")}})
    assert dict(item.data) == {"a": 1.0}
    assert item.key == decoder.decode({"id": "r", "values": {"a": 1.0}}).key
    for bad in (float("inf"), -float("inf"), 1e300):
        with pytest.raises(InvalidItem, match="send a missing value as null"):
            decoder.decode({"values": {"a": bad}})


def test_a_long_sentence_to_tag_is_decoded_on_a_worker_thread() -> None:
    """Tagging costs ~12 µs a token: past 64 untagged tokens the decoding leaves the event
    loop (``heavy``); tagged tokens, short sentences and bundles without a tagger stay."""
    from service.extractors.parsing import UPOS
    from service.extractors.tagging import Tagger
    from service.items import TokensDecoder

    spec = ItemSpec(kind="tokens", size_unit="tokens")
    decoder = TokensDecoder(spec, Tagger(np.zeros((2, len(UPOS)), dtype=np.float32)))
    raw = [{"form": "word"}] * 65
    assert decoder.heavy({"tokens": raw})
    assert not decoder.heavy({"tokens": raw[:64]})
    assert not decoder.heavy({"tokens": [{"form": "word", "upos": "NOUN"}] * 100})
    assert not TokensDecoder(spec).heavy({"tokens": raw})
    assert not decoder.heavy({"tokens": "not a list"}) and not decoder.heavy([])
    # and it decodes there as anywhere: every token tagged
    assert len(decoder.decode({"tokens": raw}).data.upos) == 65
