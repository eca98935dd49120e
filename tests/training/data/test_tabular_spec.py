"""Tabular specs and CSV reading: spec errors are errors, and CSV errors say what was found
(the delimiter the file seems to use, the row, column and text of a bad cell)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from training.bundles.dag import DagSpec
from training.data.tabular import TabularSpec, detect_delimiter, read_csv

PIMA = Path(__file__).resolve().parents[3].parent / "shared/datasets/pima/pima-indians-diabetes.csv"
COLUMNS = ["a", "b", "c", "label"]
SENSORS = {"s1": ["a"], "s2": ["b", "c"]}
ROWS = [[1.0, 2.5, -3.0, "x"], [4.0, 5.0, 6.25, "y"], [7.0, 8.0, 9.0, "x"]]


def _spec(**change: Any) -> TabularSpec:
    raw: dict[str, Any] = {
        "name": "t",
        "label": "label",
        "sensors": SENSORS,
        "costs": {"s1": 1, "s2": 2},
    }
    raw.update(change)
    return TabularSpec(**raw)


def _write(path: Path, delimiter: str, header: bool = True) -> Path:
    lines = [delimiter.join(COLUMNS)] if header else []
    lines += [delimiter.join(map(str, row)) for row in ROWS]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_spec_file_must_cost_every_sensor(tmp_path: Path) -> None:
    raw = {"name": "t", "label": "label", "sensors": SENSORS, "costs": {"s1": 1}}
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"sensor\(s\) \['s2'\] have no cost"):
        TabularSpec.load(tmp_path / "spec.json")
    del raw["costs"]
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"\['s1', 's2'\] have no cost.*costs: \{s1: 1\}"):
        TabularSpec.load(tmp_path / "spec.json")
    raw["costs"] = {"s1": 1, "s2": 2}
    (tmp_path / "spec.json").write_text(json.dumps(raw))
    assert TabularSpec.load(tmp_path / "spec.json").sensor_costs() == {"s1": 1.0, "s2": 2.0}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"costs": {"s1": 1}}, r"sensor\(s\) \['s2'\] have no cost"),
        ({"costs": {"s1": 1, "s2": 2, "s3": 1}}, r"unknown sensors \['s3'\]"),
        ({"costs": {"s1": 1, "s2": True}}, "finite numbers >= 0"),
        ({"costs": {"s1": 1, "s2": float("inf")}}, "finite numbers >= 0"),
        ({"costs": {"s1": -1, "s2": 2}}, "finite numbers >= 0"),
        ({"columns": ["a", "b", "label"]}, r"\{'s2': \['c'\]\} name columns that are not in"),
        ({"columns": ["a", "b", "c"]}, "label 'label' is not one of `columns`"),
        ({"sensors": {"s1": ["a"], "s2": "b"}}, "s2.*list of column names"),
        ({"sensors": {"s1": ["a", "label"]}, "costs": {"s1": 1}}, "serves the label"),
        ({"delimiter": ", "}, "delimiter must be one character"),
    ],
)
def test_spec_errors_name_what_is_wrong(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(**change).check()


@pytest.mark.parametrize(
    ("delimiter", "expected"),
    [(",", ","), (";", ";"), ("\t", "\t"), ("|", "|"), (" ", "whitespace"), ("   ", "whitespace")],
)
def test_delimiters_are_detected(tmp_path: Path, delimiter: str, expected: str) -> None:
    path = _write(tmp_path / "d.csv", delimiter)
    assert detect_delimiter(path.read_text()) == expected
    x, y, columns = read_csv(path, _spec())
    assert columns == ["a", "b", "c"] and y.tolist() == ["x", "y", "x"]
    np.testing.assert_array_equal(x, np.asarray([r[:3] for r in ROWS], dtype=np.float64))


def test_a_wrong_delimiter_says_what_the_file_looks_like(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.txt", " ", header=False)
    spec = _spec(columns=COLUMNS, delimiter=",")
    with pytest.raises(ValueError) as info:
        read_csv(path, spec)
    message = str(info.value)
    assert "row 1 has 1 cell, expected 4 columns (read as comma-separated" in message
    assert "the file looks whitespace: set delimiter" in message
    x, _, _ = read_csv(path, spec, delimiter="whitespace")
    assert x.shape == (3, 3)


def test_a_header_read_with_the_wrong_delimiter_names_the_columns_found(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.csv", ";")
    with pytest.raises(ValueError, match=r"no column\(s\) \['a', 'b', 'c', 'label'\] .*looks "):
        read_csv(path, _spec(delimiter=","))


def test_a_non_numeric_cell_is_named_by_row_column_and_text(tmp_path: Path) -> None:
    path = tmp_path / "d.csv"
    path.write_text("a,b,c,label\n1,2,3,x\n4,five,6,y\n")
    with pytest.raises(ValueError, match=r"row 2, column 'b' holds 'five', not a number"):
        read_csv(path, _spec())


@pytest.mark.skipif(
    not PIMA.is_file(),
    reason="the shared datasets are not beside this checkout (../shared/datasets/pima); "
    "CI runs with ../shared beside the clone",
)
def test_pima_as_the_readme_reads_it() -> None:
    spec = DagSpec(
        name="pima",
        label="outcome",
        columns=[
            "pregnancies",
            "glucose",
            "pressure",
            "skin",
            "insulin",
            "bmi",
            "pedigree",
            "age",
            "outcome",
        ],
        sensors={
            "questionnaire": ["pregnancies", "age", "pedigree"],
            "vitals": ["pressure", "bmi", "skin"],
            "glucose": ["glucose"],
            "insulin": ["insulin"],
        },
        costs={"questionnaire": 1, "vitals": 2, "glucose": 5, "insulin": 10},
    )
    spec.check()
    x, y, _ = read_csv(PIMA, spec)
    assert x.shape == (768, 8) and set(y.tolist()) == {"0", "1"}


def test_cli_takes_a_delimiter_and_reports_a_wrong_one(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from training.cli import app

    data = _write(tmp_path / "d.txt", " ")
    spec = {"name": "t", "label": "label", "sensors": SENSORS, "costs": {"s1": 1, "s2": 2}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    args = ["dag", "--csv", str(data), "--spec", str(tmp_path / "spec.json")]
    result = CliRunner().invoke(app, [*args, "--delimiter", ","])
    assert result.exit_code != 0
    assert "looks whitespace" in " ".join(result.output.split()), result.output
    result = CliRunner().invoke(app, [*args, "--delimiter", ", "])
    assert result.exit_code != 0
    assert "delimiter must be one character" in " ".join(result.output.split())


# ---------------------------------------------------------------- missing cells (issue 26)


def _gappy(path: Path, rows: int = 60, seed: int = 0) -> Path:
    """A CSV whose sensor cells are blank a tenth of the time (empty, NA, nan, ?, null)."""
    rng = np.random.default_rng(seed)
    tokens = ["", "NA", "nan", "?", "null"]
    lines = [",".join(COLUMNS)]
    for r in range(rows):
        cells = [f"{v:.3f}" for v in rng.normal(size=3)]
        cells = [tokens[(r + j) % 5] if rng.random() < 0.1 else c for j, c in enumerate(cells)]
        lines.append(",".join([*cells, "xy"[r % 2]]))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_missing_cells_read_as_gaps_and_labels_must_be_there(tmp_path: Path) -> None:
    x, y, _ = read_csv(_gappy(tmp_path / "g.csv"), _spec())
    assert 0 < np.isnan(x).sum() < x.size and set(y) == {"x", "y"}
    (tmp_path / "nolabel.csv").write_text("a,b,c,label\n1,2,3,x\n1,2,3,NA\n4,5,6,\n")
    with pytest.raises(ValueError, match="2 rows have no label in 'label' \\(row 2 first\\)"):
        read_csv(tmp_path / "nolabel.csv", _spec())
    (tmp_path / "inf.csv").write_text("a,b,c,label\n1,inf,3,x\n")
    with pytest.raises(ValueError, match="row 1, column 'b' is inf"):
        read_csv(tmp_path / "inf.csv", _spec())


def test_gaps_need_a_declared_imputation(tmp_path: Path) -> None:
    x, y, _ = read_csv(_gappy(tmp_path / "g.csv"), _spec())
    with pytest.raises(ValueError, match=r"missing cells \(empty or NA\) in a \(\d+\)") as info:
        _spec().split(x, y)
    assert "impute: median" in str(info.value)
    for learner in ("linear", "gbrt"):  # the DAG estimator refuses gaps whatever its learner
        with pytest.raises(ValueError, match="impute"):
            DagSpec(name="t", label="label", sensors=SENSORS, learner=learner).split(x, y)

    class Native(TabularSpec):
        def native_missing(self) -> bool:
            return True

    native = Native(name="t", label="label", sensors=SENSORS)
    assert np.isnan(np.vstack(native.split(x, y)[:3])).any(), "a builder that takes gaps gets them"


@pytest.mark.parametrize("impute", ["median", "mean", "zero", {"a": 7.5, "b": "mean", "c": 0}])
def test_declared_imputation_fills_from_training_rows_only(
    tmp_path: Path, impute: str | dict[str, Any]
) -> None:
    x, y, _ = read_csv(_gappy(tmp_path / "g.csv", rows=80), _spec())
    spec = _spec(impute=impute)
    spec.check()
    x_train, x_val, x_test, *_ = spec.split(x, y)
    assert not np.isnan(np.vstack([x_train, x_val, x_test])).any()
    raw_train = _spec(impute=None).split(np.nan_to_num(x, nan=1e9), y)[0]  # same rows
    gaps = raw_train == 1e9
    rule = impute if isinstance(impute, str) else impute["b"]
    column = x_train[:, 1]
    known = raw_train[~gaps[:, 1], 1]
    expected = {"median": np.median(known), "mean": np.mean(known), "zero": 0.0}[rule]
    assert np.allclose(column[gaps[:, 1]], expected)
    if isinstance(impute, dict):
        assert np.all(x_train[gaps[:, 0], 0] == 7.5)


@pytest.mark.parametrize(
    ("impute", "message"),
    [
        ("mode", "impute must be one of"),
        ({"zz": 1}, "columns no sensor serves: \\['zz'\\]"),
        ({"a": float("nan")}, "finite numbers, 'mean' or 'median'"),
    ],
)
def test_bad_imputations_are_refused(impute: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(impute=impute).check()
