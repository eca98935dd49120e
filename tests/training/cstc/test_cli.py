"""``budgetserve-train cstc --csv … --spec … [--cascade]`` builds a bundle the service loads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from service.bundle import CstcStrategy, read_manifest
from service.registry import load_bundle
from tests.support.cstc_bundle import COLUMNS, COSTS, SENSORS, make_data
from training.cli import app


def test_cli_builds_trees_and_cascades(tmp_path: Path) -> None:
    x, y = make_data(500, seed=3)
    lines = [",".join([*COLUMNS, "label"])]
    lines += [",".join([*map(str, row), str(label)]) for row, label in zip(x, y, strict=True)]
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n")
    spec: dict[str, Any] = {
        "name": "trees2",
        "label": "label",
        "sensors": SENSORS,
        "costs": COSTS,
        "lambdas": [0.03, 0.3],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cascades = {"cscc", "cronus"}
    for flags, methods in (([], {"cstc", "root-only"}), (["--cascade"], cascades)):
        out = tmp_path / ("cascade" if flags else "tree") / "trees2"
        result = CliRunner().invoke(
            app,
            [
                "cstc",
                "--csv",
                str(tmp_path / "data.csv"),
                "--spec",
                str(tmp_path / "spec.json"),
                "--out",
                str(out),
                *flags,
            ],
        )
        assert result.exit_code == 0, result.output
        assert "…" not in result.output, result.output  # not a terminal: the table is whole
        manifest = read_manifest(out)
        strategy = manifest.strategy("cstc")
        assert isinstance(strategy, CstcStrategy)
        # CSCC's cascades and CSTC's trees also give points with confidence exits
        exits = {"cscc-exit"} if flags else {"cstc-exit"}
        assert {p.method for p in strategy.points} <= methods | exits
        assert set(manifest.provenance.parameters["methods"]) == methods
        assert load_bundle(out, max_pixels=1 << 20).runtimes["cstc"].kind == "cstc"
    bad = {**spec, "methods": ["cstc", "oblique"]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    result = CliRunner().invoke(
        app, ["cstc", "--csv", str(tmp_path / "data.csv"), "--spec", str(tmp_path / "bad.json")]
    )
    assert result.exit_code != 0 and "oblique" in result.output


def test_cli_builds_a_digits_bundle_on_the_image_extractors(tmp_path: Path) -> None:
    out = tmp_path / "digits-trees"
    args = ["cstc-digits", "--out", str(out), "--limit", "80", "--sides", "16,24"]
    args += ["--methods", "root-only", "--lambdas", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    manifest = read_manifest(out)
    assert manifest.item.kind == "image" and manifest.cost_unit == "ms"
    digits = read_manifest(Path(__file__).resolve().parents[3] / "models" / "digits")
    # the sensors are the digits bundle's extractors, at the same measured curves
    assert [(e.name, e.cost) for e in manifest.extractors] == [
        (e.name, e.cost) for e in digits.extractors
    ]
    strategy = manifest.strategy("cstc")
    assert isinstance(strategy, CstcStrategy)
    assert all(p.feature_rates for p in strategy.points)
    assert manifest.provenance.parameters["digits"]["test"] == 16  # 20 % of 80, by identity
    assert load_bundle(out, max_pixels=1 << 20).runtimes["cstc"].kind == "cstc"
    for bad, word in ((["--sides", "4"], "sides"), (["--methods", "oblique"], "oblique")):
        result = CliRunner().invoke(app, ["cstc-digits", "--out", str(tmp_path / "x"), *bad])
        assert result.exit_code != 0 and word in result.output


@pytest.mark.parametrize("levels", [[1.0], [0.0], [0.9, 1.5], [True], "0.9"])
def test_exit_levels_outside_0_1_are_refused_with_what_was_given(levels: Any) -> None:
    from training.bundles.cstc import CstcSpec

    spec = CstcSpec(name="t", label="label", sensors=SENSORS, costs=COSTS, exit_levels=levels)
    with pytest.raises(ValueError, match=r"exit_levels must be a list of numbers in \(0, 1\)"):
        spec.check()
