"""Tabular bundles: the spec read beside a CSV, the CSV reader, and the manifest parts shared
by every builder of tabular bundles (items ``{"values": {column: number}}``; each sensor is
an instance of the built-in ``sensor`` extractor serving its columns at a declared cost)."""

from __future__ import annotations

import csv
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from sklearn.model_selection import train_test_split

from service.bundle import CostPolynomial, ExtractorSpec, ItemSpec
from service.types import FloatArray

S = TypeVar("S", bound="TabularSpec")


@dataclass
class TabularSpec:
    """What a tabular builder reads besides the CSV (JSON or YAML)."""

    name: str
    label: str
    sensors: dict[str, list[str]]
    costs: dict[str, float] = field(default_factory=dict)
    unit: str = "units"
    columns: list[str] | None = None  # for a CSV without a header row
    test_fraction: float = 0.2
    validation_fraction: float = 0.2
    seed: int = 0

    @classmethod
    def load(cls: type[S], path: Path) -> S:
        text = path.read_text()
        if path.suffix in {".yaml", ".yml"}:
            import yaml

            raw = yaml.safe_load(text)
        else:
            raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a mapping at the top level, got {type(raw)}")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"{path}: unknown keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}"
            )
        spec = cls(**raw)
        spec.check()
        return spec

    def check(self) -> None:
        if not isinstance(self.name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", self.name):
            raise ValueError(
                f"name {self.name!r}: a bundle name is lower-case letters, digits, '_', '.', '-'"
            )
        if not isinstance(self.sensors, dict) or not self.sensors:
            raise ValueError(
                f"sensors must map sensor names to lists of columns, got {self.sensors!r}"
            )
        if not isinstance(self.costs, dict):
            raise ValueError(f"costs must map sensor names to numbers, got {self.costs!r}")
        for fraction in ("test_fraction", "validation_fraction"):
            value = getattr(self, fraction)
            if not isinstance(value, int | float) or not 0 < value < 1:
                raise ValueError(f"{fraction} must be a number in (0, 1), got {value!r}")
        if self.test_fraction + self.validation_fraction >= 1:
            raise ValueError("test_fraction + validation_fraction must leave rows to train on")
        seen: dict[str, str] = {}
        for sensor, columns in self.sensors.items():
            if not isinstance(columns, list) or not columns:
                raise ValueError(f"sensor {sensor!r}: expected a non-empty list of columns")
            if self.label in columns:
                raise ValueError(
                    f"sensor {sensor!r} serves the label column {self.label!r}: remove it"
                )
            for column in columns:
                if column in seen:
                    raise ValueError(
                        f"column {column!r} belongs to sensors {seen[column]!r} and {sensor!r}; "
                        "each column may belong to one sensor"
                    )
                seen[column] = sensor
        unknown = set(self.costs) - set(self.sensors)
        if unknown:
            raise ValueError(f"costs given for unknown sensors {sorted(unknown)}")
        if any(not isinstance(c, int | float) or not c >= 0 for c in self.costs.values()):
            raise ValueError(f"sensor costs must be numbers >= 0, got {self.costs}")

    def sensor_costs(self) -> dict[str, float]:
        """Every sensor's declared cost (1 where the spec gives none)."""
        return {s: float(self.costs.get(s, 1.0)) for s in self.sensors}

    def extractors(self) -> list[ExtractorSpec]:
        """One ``sensor`` extractor per sensor, in declaration order."""
        return sensor_extractors(self.sensors, self.sensor_costs(), self.unit)

    def item(self) -> ItemSpec:
        return tabular_item(self.sensors)

    def split(
        self, x: FloatArray, y: npt.NDArray[Any]
    ) -> tuple[
        FloatArray, FloatArray, FloatArray, npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]
    ]:
        """Stratified train / validation / test rows: x_train, x_val, x_test, y_train, ..."""
        x_rest, x_test, y_rest, y_test = train_test_split(
            x, y, test_size=self.test_fraction, stratify=y, random_state=self.seed
        )
        x_train, x_val, y_train, y_val = train_test_split(
            x_rest,
            y_rest,
            test_size=self.validation_fraction / (1 - self.test_fraction),
            stratify=y_rest,
            random_state=self.seed,
        )
        return x_train, x_val, x_test, y_train, y_val, y_test


def tabular_item(sensors: Mapping[str, Sequence[str]]) -> ItemSpec:
    """The item spec of a tabular bundle: every sensor's columns, sensors in order."""
    return ItemSpec(
        kind="tabular", columns=[c for cols in sensors.values() for c in cols], size_unit="row"
    )


def sensor_extractors(
    sensors: Mapping[str, Sequence[str]], costs: Mapping[str, float], unit: str
) -> list[ExtractorSpec]:
    """One ``sensor`` extractor per sensor, serving its columns at its declared cost (a
    constant: a row's cost does not depend on its size)."""
    return [
        ExtractorSpec(
            name=name,
            plugin="sensor",
            version="1",
            dims=len(columns),
            params={"columns": list(columns)},
            cost=CostPolynomial(coefficients=[float(costs[name])], unit=unit),
        )
        for name, columns in sensors.items()
    ]


def read_csv(path: Path, spec: TabularSpec) -> tuple[FloatArray, npt.NDArray[Any], list[str]]:
    """The sensor columns as floats, the label column as strings, and the column names."""
    with path.open(newline="") as handle:
        rows = list(csv.reader(handle))
    header: list[str]
    if spec.columns is not None:
        header = list(spec.columns)
    elif rows:
        header, rows = [h.strip() for h in rows[0]], rows[1:]
    else:
        raise ValueError(f"{path}: the file is empty")
    index = {name: i for i, name in enumerate(header)}
    needed = [c for cols in spec.sensors.values() for c in cols]
    missing = [c for c in [*needed, spec.label] if c not in index]
    if missing:
        raise ValueError(f"{path}: no column(s) {missing}; the file has {header}")
    rows = [r for r in rows if r and any(cell.strip() for cell in r)]
    short = [i for i, r in enumerate(rows) if len(r) < len(header)]
    if short:
        raise ValueError(
            f"{path}: row {short[0] + 1} has fewer cells than the {len(header)} columns"
        )
    if not rows:
        raise ValueError(f"{path}: no data rows")
    try:
        x = np.asarray([[float(r[index[c]]) for c in needed] for r in rows], dtype=np.float64)
    except ValueError as exc:
        raise ValueError(f"{path}: a sensor column holds a non-number: {exc}") from None
    bad = ~np.isfinite(x)
    if bad.any():
        row, col = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(
            f"{path}: row {row + 1}, column {needed[col]!r} is {x[row, col]} ({int(bad.sum())} "
            "non-finite cells in all): fill or drop such rows before training"
        )
    y = np.asarray([r[index[spec.label]].strip() for r in rows])
    return x, y, needed


def fingerprint(x: FloatArray, y: npt.NDArray[Any]) -> str:
    h = hashlib.sha256(np.ascontiguousarray(x).tobytes())
    h.update("\n".join(map(str, y)).encode())
    return "sha256:" + h.hexdigest()


def column_positions(spec: TabularSpec, columns: Sequence[str]) -> dict[str, list[int]]:
    """Each sensor's columns as positions in the matrix ``read_csv`` returned."""
    position = {c: i for i, c in enumerate(columns)}
    return {s: [position[c] for c in cols] for s, cols in spec.sensors.items()}
