"""The ``sensor`` extractor: serves a named group of columns of a tabular item.

Tabular bundles declare one sensor per group (``plugin: "sensor"``, ``params: {"columns":
[...]}``) with a declared acquisition cost in the bundle's unit. A request's item carries
whatever values the client already has (:class:`service.items.TabularRow`): a sensor whose
columns were all sent is in hand at cost 0 (the handler takes it without calling the
extractor). This plugin serves *only* the values sent: for a sensor the client did not send
it raises :class:`~service.extractors.base.FeatureUnavailable`, and the request answers from
what it has, naming the sensor to collect next. Acquirers that fetch the values
(``service.extractors.acquirers``: a Redis hash, an HTTP endpoint) replace it per sensor
through ``BUDGETSERVE_SENSOR_SOURCES``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from service.extractors.base import FeatureUnavailable, FloatVector


def check_columns(columns: Sequence[str]) -> list[str]:
    """``columns`` as a list, if it is a non-empty list of distinct non-empty names."""
    if (
        isinstance(columns, str)
        or not columns
        or not all(isinstance(c, str) and c for c in columns)
    ):
        raise ValueError(f"a sensor needs a non-empty list of column names, got {columns!r}")
    if len(set(columns)) != len(columns):
        raise ValueError(f"a sensor's columns must be distinct, got {list(columns)}")
    return list(columns)


def given_vector(columns: Sequence[str], item: Any) -> FloatVector | None:
    """The sensor's vector from the values the request sent, or None when any is missing."""
    if not isinstance(item, Mapping):
        raise TypeError(f"a sensor reads a tabular item (a mapping), got {type(item).__name__}")
    if not all(c in item for c in columns):
        return None
    return np.asarray([float(item[c]) for c in columns], dtype=np.float32)


class Sensor:
    name: ClassVar[str] = "sensor"
    version: ClassVar[str] = "1"
    item_kind: ClassVar[str] = "tabular"
    #: What a request is charged for acquiring it: the bundle's declared cost.
    charge: ClassVar[str] = "declared"

    def __init__(self, *, columns: Sequence[str] = ()) -> None:
        self.columns = check_columns(columns)

    @property
    def dims(self) -> int:
        return len(self.columns)

    def extract(self, item: Any) -> FloatVector:
        vector = given_vector(self.columns, item)
        if vector is None:
            missing = [c for c in self.columns if c not in item]
            raise FeatureUnavailable(
                f"the request did not send {', '.join(map(repr, missing))} and no acquirer is "
                "configured for this sensor (BUDGETSERVE_SENSOR_SOURCES): send its values"
            )
        return vector
