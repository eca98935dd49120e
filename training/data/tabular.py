"""Tabular bundles: the spec read beside a CSV, the CSV reader, and the manifest parts shared
by every builder of tabular bundles (items ``{"values": {column: number}}``; each sensor is
an instance of the built-in ``sensor`` extractor serving its columns at a declared cost).

The module stays whole (over 450 lines): the spec's checks name the reader's columns, and
every tabular builder imports the spec, the reader and the manifest parts together.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
from sklearn.model_selection import train_test_split

from service.bundle import CostPolynomial, ExtractorSpec, ItemSpec
from service.types import FloatArray

S = TypeVar("S", bound="TabularSpec")


def read_mapping(path: Path) -> dict[str, Any]:
    """A spec file's top-level mapping: YAML (``.yaml``, ``.yml``) or JSON."""
    text = path.read_text()
    if path.suffix in {".yaml", ".yml"}:
        import yaml

        raw = yaml.safe_load(text)
    else:
        raw = json.loads(text)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return raw


@dataclass
class TabularSpec:
    """What a tabular builder reads besides the CSV (JSON or YAML)."""

    name: str
    label: str
    sensors: dict[str, list[str]]
    costs: dict[str, float] = field(default_factory=dict)
    unit: str = "units"
    columns: list[str] | None = None  # for a CSV without a header row
    delimiter: str | None = None  # one character, or "whitespace"; None: detected
    test_fraction: float = 0.2
    validation_fraction: float = 0.2
    seed: int = 0
    # Missing cells (empty, NA, NaN, null, ?): how to fill them before training, from the
    # training rows only: "mean", "median", "zero", or {column: number | "mean" | "median"};
    # None: refused when the CSV has gaps (see native_missing).
    impute: str | dict[str, float | str] | None = None

    @classmethod
    def load(cls: type[S], path: Path) -> S:
        raw = read_mapping(path)
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"{path}: unknown keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}"
            )
        spec = cls(**raw)
        spec.check()
        costs = spec.costs if isinstance(spec.costs, dict) else {}
        uncosted = [s for s in spec.sensors if s not in costs]
        if uncosted:
            raise ValueError(
                f"{path}: sensor(s) {uncosted} have no cost; give every sensor its cost in "
                f"`costs:` (in `unit`, {spec.unit!r}), e.g. costs: {{{uncosted[0]}: 1}}"
            )
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
        if self.delimiter in {"tab", "\\t"}:
            self.delimiter = "\t"
        if self.delimiter is not None and not (
            self.delimiter == WHITESPACE
            or (isinstance(self.delimiter, str) and len(self.delimiter) == 1)
        ):
            raise ValueError(
                f"delimiter must be one character (e.g. ',', ';', '\\t') or {WHITESPACE!r}, "
                f"got {self.delimiter!r}"
            )
        for fraction in ("test_fraction", "validation_fraction"):
            value = getattr(self, fraction)
            if not isinstance(value, int | float) or not 0 < value < 1:
                raise ValueError(f"{fraction} must be a number in (0, 1), got {value!r}")
        if self.test_fraction + self.validation_fraction >= 1:
            raise ValueError("test_fraction + validation_fraction must leave rows to train on")
        check_impute(self.impute, [c for cols in self.sensors.values() for c in cols])
        seen: dict[str, str] = {}
        for sensor, columns in self.sensors.items():
            if (
                not isinstance(columns, list)
                or not columns
                or not all(isinstance(c, str) and c for c in columns)
            ):
                raise ValueError(
                    f"sensor {sensor!r}: expected a non-empty list of column names, got {columns!r}"
                )
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
        if self.columns is not None:
            listed = set(self.columns)
            unknown_columns = {
                s: [c for c in cols if c not in listed]
                for s, cols in self.sensors.items()
                if any(c not in listed for c in cols)
            }
            if unknown_columns:
                raise ValueError(
                    f"sensors {unknown_columns} name columns that are not in `columns` "
                    f"({self.columns}): fix the names or add the columns"
                )
            if self.label not in listed:
                raise ValueError(f"label {self.label!r} is not one of `columns` ({self.columns})")
        unknown = set(self.costs) - set(self.sensors)
        if unknown:
            raise ValueError(
                f"costs given for unknown sensors {sorted(unknown)}; the sensors are "
                f"{list(self.sensors)}"
            )
        bad = {
            s: c
            for s, c in self.costs.items()
            if isinstance(c, bool) or not isinstance(c, int | float) or not 0 <= c < math.inf
        }
        if bad:
            raise ValueError(f"sensor costs must be finite numbers >= 0; got {bad}")
        uncosted = [s for s in self.sensors if s not in self.costs]
        if self.costs and uncosted:
            raise ValueError(
                f"sensor(s) {uncosted} have no cost: give every sensor its cost in `costs` "
                f"(in `unit`, {self.unit!r})"
            )

    def sensor_costs(self) -> dict[str, float]:
        """Every sensor's declared cost. A spec read from a file must give every sensor
        one (``load``); one built in code with no ``costs`` at all gives each sensor 1."""
        return {s: float(self.costs.get(s, 1.0)) for s in self.sensors}

    def extractors(self) -> list[ExtractorSpec]:
        """One ``sensor`` extractor per sensor, in declaration order."""
        return sensor_extractors(self.sensors, self.sensor_costs(), self.unit)

    def item(self) -> ItemSpec:
        return tabular_item(self.sensors)

    def native_missing(self) -> bool:
        """Whether every learner this spec trains takes missing values (NaN) as they are.
        None does yet: LightGBM would, but the DAG and gating estimators refuse non-finite
        rows and their exports are checked on complete rows; a builder that lifts that
        overrides this."""
        return False

    def split_indices(
        self, y: npt.NDArray[Any]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The row positions of :meth:`split`'s train, validation and test rows."""
        rows = np.arange(len(y), dtype=np.int64)
        rest, test, y_rest, _ = train_test_split(
            rows, y, test_size=self.test_fraction, stratify=y, random_state=self.seed
        )
        train, val = train_test_split(
            rest,
            test_size=self.validation_fraction / (1 - self.test_fraction),
            stratify=y_rest,
            random_state=self.seed,
        )
        return train, val, test

    def split(
        self, x: FloatArray, y: npt.NDArray[Any]
    ) -> tuple[
        FloatArray, FloatArray, FloatArray, npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]
    ]:
        """Stratified train / validation / test rows: x_train, x_val, x_test, y_train, ...

        Missing cells (NaN) are filled as ``impute`` declares, with values computed on the
        training rows only; without ``impute`` they are refused (:class:`MissingValues` says
        what to declare) unless every learner takes them as they are (:meth:`native_missing`)."""
        gaps = np.isnan(x)
        if gaps.any() and self.impute is None and not self.native_missing():
            raise MissingValues(self, gaps)
        train, val, test = self.split_indices(y)
        x_train, x_val, x_test = x[train], x[val], x[test]
        y_train, y_val, y_test = y[train], y[val], y[test]
        if gaps.any() and self.impute is not None:
            fill = fill_values(self, x_train)
            x_train, x_val, x_test = (_filled(part, fill) for part in (x_train, x_val, x_test))
        return x_train, x_val, x_test, y_train, y_val, y_test


IMPUTE_STRATEGIES = ("mean", "median", "zero")


def check_impute(impute: Any, columns: Sequence[str]) -> None:
    """``impute`` is None, a strategy for every column, or {column: number | mean | median}."""
    if impute is None or impute in IMPUTE_STRATEGIES:
        return
    if isinstance(impute, dict):
        unknown = [c for c in impute if c not in columns]
        if unknown:
            raise ValueError(
                f"impute names columns no sensor serves: {unknown}; the sensor columns are "
                f"{list(columns)}"
            )
        bad = {
            c: v
            for c, v in impute.items()
            if not (
                v in ("mean", "median")
                or (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v))
            )
        }
        if not bad:
            return
        raise ValueError(f"impute values must be finite numbers, 'mean' or 'median'; got {bad}")
    raise ValueError(
        f"impute must be one of {list(IMPUTE_STRATEGIES)}, or a mapping column -> number | "
        f"'mean' | 'median'; got {impute!r}"
    )


class MissingValues(ValueError):
    """The data has gaps and a learner of the spec cannot take them: declare an imputation."""

    def __init__(self, spec: TabularSpec, gaps: npt.NDArray[np.bool_]) -> None:
        columns = [c for cols in spec.sensors.values() for c in cols]
        per_column = gaps.sum(axis=0)
        shown = ", ".join(f"{c} ({int(n)})" for c, n in zip(columns, per_column, strict=True) if n)
        super().__init__(
            f"the data has {int(gaps.sum())} missing cells (empty or NA) in {shown}: declare "
            "how to fill them in the spec, `impute: median` (or mean, zero, or per column "
            "{column: number | mean | median}), computed on the training rows only. Served "
            "items with a missing value are read as that sensor not sent, whatever the fill"
        )


def fill_values(spec: TabularSpec, x_train: FloatArray) -> dict[int, float]:
    """The value filling each column's gaps (by position), from the training rows."""
    columns = [c for cols in spec.sensors.values() for c in cols]
    out: dict[int, float] = {}
    for j, column in enumerate(columns):
        rule = spec.impute if not isinstance(spec.impute, dict) else spec.impute.get(column)
        if rule is None:
            continue
        if isinstance(rule, int | float):
            out[j] = float(rule)
            continue
        known = x_train[:, j][~np.isnan(x_train[:, j])]
        if rule != "zero" and not len(known):
            raise ValueError(
                f"column {column!r} has no value in any training row: cannot take its {rule}; "
                "give it a number in `impute`, or leave the column out of `sensors`"
            )
        out[j] = (
            0.0 if rule == "zero" else float(np.mean(known) if rule == "mean" else np.median(known))
        )
    missing = [
        columns[j] for j in range(len(columns)) if j not in out and np.isnan(x_train[:, j]).any()
    ]
    if missing:
        raise ValueError(
            f"columns {missing} have missing cells and no rule in `impute`: add them "
            "(a number, mean or median)"
        )
    return out


def _filled(x: FloatArray, fill: dict[int, float]) -> FloatArray:
    out = np.array(x, dtype=np.float64, copy=True)
    for j, value in fill.items():
        out[np.isnan(out[:, j]), j] = value
    return out


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


WHITESPACE = "whitespace"
_CANDIDATES = ",;\t|"


def _describe_delimiter(delimiter: str) -> str:
    names = {",": "comma", ";": "semicolon", "\t": "tab", "|": "pipe", " ": "space"}
    if delimiter == WHITESPACE:
        return "whitespace"
    return names.get(delimiter, repr(delimiter)) + "-separated"


def detect_delimiter(sample: str) -> str:
    """The delimiter of a CSV sample: the one of ``, ; tab |`` that splits every line of the
    sample into the same number (> 1) of cells, preferring csv.Sniffer's choice; else
    ``"whitespace"`` when the lines split on runs of blanks into the same number (> 1) of
    cells; else ``,``."""
    lines = [line for line in sample.splitlines() if line.strip()][:20]
    if len(lines) > 1 and not sample.endswith("\n"):
        lines = lines[:-1]  # the last line of a sample may be cut short
    if not lines:
        return ","

    def consistent(split: Callable[[str], list[str]]) -> bool:
        counts = {len(split(line)) for line in lines}
        return len(counts) == 1 and counts.pop() > 1

    try:
        sniffed: str | None = csv.Sniffer().sniff("\n".join(lines), _CANDIDATES).delimiter
    except csv.Error:
        sniffed = None
    for delimiter in ([sniffed] if sniffed else []) + list(_CANDIDATES):
        if consistent(functools.partial(_split, delimiter=delimiter)):
            return delimiter
    if consistent(str.split):
        return WHITESPACE
    return ","


def _split(line: str, delimiter: str) -> list[str]:
    return next(csv.reader([line], delimiter=delimiter))


def _rows(text: str, delimiter: str) -> list[list[str]]:
    if delimiter == WHITESPACE:
        return [line.split() for line in text.splitlines()]
    return list(csv.reader(text.splitlines(), delimiter=delimiter))


#: Cells read as a missing value (a gap), whatever their case: empty, NA, N/A, NaN, null,
#: None, ?.
MISSING_CELLS = frozenset({"", "na", "n/a", "nan", "null", "none", "?"})


def read_csv(
    path: Path, spec: TabularSpec, delimiter: str | None = None
) -> tuple[FloatArray, npt.NDArray[Any], list[str]]:
    """The sensor columns as floats (NaN for a missing cell: :data:`MISSING_CELLS`), the
    label column as strings, and the column names.

    The delimiter is ``delimiter``, else the spec's, else detected (:func:`detect_delimiter`:
    comma, semicolon, tab, pipe or runs of whitespace). Errors name what was found: the
    row whose cells do not match the columns (and the delimiter the file seems to use), the
    row, column and text of a cell that is not a number."""
    text = path.read_text()
    chosen = delimiter or spec.delimiter
    detected = detect_delimiter(text[:65536])
    used = chosen or detected
    rows = _rows(text, used)
    header: list[str]
    if spec.columns is not None:
        header = list(spec.columns)
    elif rows:
        header, rows = [h.strip() for h in rows[0]], rows[1:]
    else:
        raise ValueError(f"{path}: the file is empty")
    hint = (
        f"; the file looks {_describe_delimiter(detected)}: set delimiter (spec "
        f"`delimiter:` or --delimiter)"
        if detected != used
        else ""
    )
    index = {name: i for i, name in enumerate(header)}
    needed = [c for cols in spec.sensors.values() for c in cols]
    missing = [c for c in [*needed, spec.label] if c not in index]
    if missing:
        shown = header if len(header) <= 40 else [*header[:40], "…"]
        raise ValueError(
            f"{path}: no column(s) {missing} (read as {_describe_delimiter(used)}); the "
            f"file's columns are {shown}{hint}"
        )
    rows = [r for r in rows if r and any(cell.strip() for cell in r)]
    short = [i for i, r in enumerate(rows) if len(r) < len(header)]
    if short:
        cells = len(rows[short[0]])
        raise ValueError(
            f"{path}: row {short[0] + 1} has {cells} cell{'s' if cells != 1 else ''}, "
            f"expected {len(header)} columns (read as {_describe_delimiter(used)}; "
            f"{len(short)} such rows){hint}"
        )
    if not rows:
        raise ValueError(f"{path}: no data rows")
    x = np.empty((len(rows), len(needed)), dtype=np.float64)
    positions = [index[c] for c in needed]
    for r, cells_of_row in enumerate(rows):
        for j, position in enumerate(positions):
            cell = cells_of_row[position]
            if cell.strip().lower() in MISSING_CELLS:
                x[r, j] = math.nan  # a gap: filled as the spec's `impute` says, or kept
                continue
            try:
                x[r, j] = float(cell)
            except ValueError:
                raise ValueError(
                    f"{path}: row {r + 1}, column {needed[j]!r} holds {cell.strip()[:40]!r}, "
                    "not a number: sensor columns must be numeric (encode categories as "
                    f"numbers, or leave the column out of `sensors`){hint}"
                ) from None
    bad = np.isinf(x)
    if bad.any():
        row, col = (int(v) for v in np.argwhere(bad)[0])
        raise ValueError(
            f"{path}: row {row + 1}, column {needed[col]!r} is {x[row, col]} ({int(bad.sum())} "
            "infinite cells in all): fix or drop such rows before training (a missing value "
            "is an empty cell or NA)"
        )
    y = np.asarray([r[index[spec.label]].strip() for r in rows])
    unlabelled = [i for i, label in enumerate(y) if label.lower() in MISSING_CELLS]
    if unlabelled:
        raise ValueError(
            f"{path}: {len(unlabelled)} rows have no label in {spec.label!r} (row "
            f"{unlabelled[0] + 1} first): drop them before training"
        )
    return x, y, needed


def fingerprint(x: FloatArray, y: npt.NDArray[Any]) -> str:
    h = hashlib.sha256(np.ascontiguousarray(x).tobytes())
    h.update("\n".join(map(str, y)).encode())
    return "sha256:" + h.hexdigest()


def column_positions(spec: TabularSpec, columns: Sequence[str]) -> dict[str, list[int]]:
    """Each sensor's columns as positions in the matrix ``read_csv`` returned."""
    position = {c: i for i, c in enumerate(columns)}
    return {s: [position[c] for c in cols] for s, cols in spec.sensors.items()}
