"""The ``sensor`` extractor: serves a named group of columns of a tabular item.

Tabular bundles declare one sensor per group (``plugin: "sensor"``, ``params: {"columns":
[...]}``) with a declared acquisition cost in the bundle's unit; acquiring the sensor yields
the group's values in the declared order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from service.extractors.base import FloatVector


class Sensor:
    name: ClassVar[str] = "sensor"
    version: ClassVar[str] = "1"
    item_kind: ClassVar[str] = "tabular"

    def __init__(self, *, columns: Sequence[str] = ()) -> None:
        if not columns or not all(isinstance(c, str) and c for c in columns):
            raise ValueError(f"a sensor needs a non-empty list of column names, got {columns!r}")
        if len(set(columns)) != len(columns):
            raise ValueError(f"a sensor's columns must be distinct, got {list(columns)}")
        self.columns = list(columns)

    @property
    def dims(self) -> int:
        return len(self.columns)

    def extract(self, item: Any) -> FloatVector:
        if not isinstance(item, Mapping):
            raise TypeError(f"a sensor reads a tabular item (a mapping), got {type(item).__name__}")
        try:
            values = [float(item[c]) for c in self.columns]
        except KeyError as exc:
            raise ValueError(f"the item has no column {exc.args[0]!r}") from None
        return np.asarray(values, dtype=np.float32)
