"""Tabular items and the 'sensor' extractor plugin."""

from __future__ import annotations

import numpy as np
import pytest

from service.bundle import ItemSpec
from service.errors import InvalidItem
from service.extractors.base import (
    ExtractorBroken,
    FeatureUnavailable,
    available_extractors,
    create_extractor,
)
from service.extractors.sensor import Sensor
from service.items import TabularRow, make_decoder

SPEC = ItemSpec(kind="tabular", columns=["a", "b", "c"])


def test_sensor_is_registered_and_reads_its_columns_in_order() -> None:
    assert available_extractors()["sensor"] is Sensor
    sensor = create_extractor("sensor", "1", {"columns": ["c", "a"]})
    assert sensor.dims == 2
    vec = sensor.extract({"a": 1.0, "b": 2.0, "c": 3.5})
    assert vec.dtype == np.float32 and vec.tolist() == [3.5, 1.0]


@pytest.mark.parametrize(
    "params", [{}, {"columns": []}, {"columns": ["a", "a"]}, {"columns": [""]}]
)
def test_sensor_rejects_bad_columns(params: dict[str, object]) -> None:
    with pytest.raises(ExtractorBroken, match="sensor"):
        create_extractor("sensor", "1", params)


def test_sensor_without_its_values_is_unavailable_and_names_them() -> None:
    with pytest.raises(FeatureUnavailable, match=r"did not send 'z'.*BUDGETSERVE_SENSOR_SOURCES"):
        Sensor(columns=["a", "z"]).extract({"a": 1.0})


def test_tabular_decoder_accepts_values_and_keys_by_content_and_id() -> None:
    decoder = make_decoder(SPEC, 1)
    item = decoder.decode({"values": {"a": 1, "b": 2.5, "c": -3}})
    assert item.size == 1 and item.data == {"a": 1.0, "b": 2.5, "c": -3.0}
    assert isinstance(item.data, TabularRow) and item.data.id is None
    same = decoder.decode({"values": {"c": -3, "b": 2.5, "a": 1}})
    assert item.key == same.key and item.key.startswith("tab1:")
    with_id = decoder.decode({"id": "row-7", "values": {"a": 1, "b": 2.5, "c": -3}}).key
    assert with_id.startswith(item.key + ":id:") and "row-7" not in with_id


@pytest.mark.parametrize(
    ("item", "mentions"),
    [
        ({"values": {"a": 1, "b": 2, "c": 3, "extra": 9}}, "does not read: 'extra'"),
        ({"values": {"a": 1, "b": 2, "c": float("inf")}}, "infinite"),
        ({"values": {"a": 1, "b": 2, "c": "x"}}, "values.c"),
        ({"values": {"a": 1, "b": 2, "c": "1.5"}}, "values.c"),
        ({"values": {"a": 1, "b": 2, "c": True}}, "values.c"),
        ({"values": {"a": 1, "b": 2, "c": 1e300}}, "out-of-range"),
        ({"png_base64": "AAAA"}, "png_base64"),
        ({"id": "", "values": {"a": 1}}, "item.id"),
        ([1, 2, 3], "list"),
    ],
)
def test_tabular_decoder_rejects_bad_items(item: object, mentions: str) -> None:
    with pytest.raises(InvalidItem, match=mentions):
        make_decoder(SPEC, 1).decode(item)


@pytest.mark.parametrize(
    "item",
    [{"values": {"a": 1, "c": 2}}, {"id": "p-1"}, {"id": "p-1", "values": {}}, {}],
)
def test_tabular_decoder_takes_any_subset_of_the_values(item: dict[str, object]) -> None:
    decoded = make_decoder(SPEC, 1).decode(item)
    sent = item.get("values", {})
    assert isinstance(sent, dict)
    assert dict(decoded.data) == {k: float(v) for k, v in sent.items()}
    assert decoded.data.id == item.get("id")


def test_tabular_keys_tell_a_missing_value_from_any_value() -> None:
    decoder = make_decoder(SPEC, 1)
    partial = decoder.decode({"id": "p", "values": {"a": 1}}).key
    assert partial != decoder.decode({"id": "p", "values": {"a": 1, "b": 0}}).key
    assert partial != decoder.decode({"id": "p"}).key
    assert partial == decoder.decode({"values": {"a": 1.0}, "id": "p"}).key
