"""Items through the real app: every PNG mode decodes to the same picture, headers over the
pixel limit are 413 before anything decodes, and cached features are bound to the content
(an ``id`` never makes one item's answer another's), in-process and with a real Redis."""

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


@pytest.mark.parametrize("mode", ["CMYK", "F", "YCbCr"])
def test_modes_no_png_has_are_refused_by_name(mode: str) -> None:
    # Pillow never opens a PNG in these modes; should a future Pillow do so, the decoder
    # refuses it with a 422 naming the mode rather than guessing.
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


@pytest.mark.parametrize(("width", "height"), [(1 << 31, 1), (1 << 20, 1 << 20), (4097, 4096)])
def test_over_limit_header_is_413_whatever_its_shape(
    digits_client: TestClient, width: int, height: int
) -> None:
    r = digits_client.post(
        "/predict",
        json={
            "model": "digits",
            "budget": 5,
            "item": {"png_base64": b64(raw_png(width, height, 16, 6, rows=None))},
        },
    )
    assert r.status_code == 413, r.text


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
        (b"hello, world", "no PNG signature"),
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
