"""The training CLI's output: progress (M of N, ETA; plain lines when not on a terminal),
full tables when piped and ``--format``, ``profile`` with basis and units, and ``profile
--into`` rewriting a bundle's cost curves (run as the real ``budgetserve-train``)."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from service.bundle import read_manifest
from service.registry import CalibrationSettings, load_bundle
from service.strategies.polydom import PolyDomRuntime
from tests.conftest import ROOT
from training.executor import LocalExecutor
from training.progress import StageProgress

TRAIN = Path(sys.executable).with_name("budgetserve-train")
LINE = re.compile(r"^(?P<label>[a-z -]+): (?P<done>\d+)/(?P<total>\d+) \(\d+%\), elapsed \S+, ")


def train(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The real CLI, its output piped (so not a terminal)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    return subprocess.run(
        [str(TRAIN), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def progress_lines(stderr: str, label: str) -> list[tuple[int, int]]:
    found = [LINE.match(line) for line in stderr.splitlines()]
    return [(int(m["done"]), int(m["total"])) for m in found if m and m["label"] == label]


def test_plain_progress_lines_count_up_with_an_eta() -> None:
    out = io.StringIO()
    with StageProgress(Console(file=out, width=200), every_s=3600) as bar:
        for done in range(0, 21):
            bar.update("evaluate", done, 20)
    lines = out.getvalue().splitlines()
    counts = [(int(m["done"]), int(m["total"])) for m in map(LINE.match, lines) if m]
    assert len(counts) == len(lines) == 11  # the start, then each tenth of the way
    assert counts[0] == (0, 20) and counts[-1] == (20, 20)
    assert [d for d, _ in counts] == sorted(d for d, _ in counts)
    assert lines[0].endswith("ETA unknown") and lines[-1].endswith("done")
    assert all("ETA " in line for line in lines[1:-1])


def test_executor_maps_report_progress_summed_over_calls() -> None:
    out = io.StringIO()
    with StageProgress(Console(file=out, width=200), every_s=0) as bar:
        for jobs in (1, 2):
            with LocalExecutor(jobs) as executor:
                executor.progress = bar.executor_hook
                assert executor.map(abs, [-3, -1, -2]) == [3, 1, 2]  # order kept
                assert executor.map(abs, [-5]) == [5]
    counts = progress_lines(out.getvalue(), "abs")
    assert counts[-1] == (8, 8)  # 3 + 1 items per executor, 2 executors
    assert [d for d, _ in counts] == sorted(d for d, _ in counts)


def test_a_terminal_gets_bars_with_m_of_n_and_eta() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120)
    with StageProgress(console, labels={"expand": "expanding lattice"}) as bar:
        for done in range(6):
            bar.update("expand", done, 5)
    text = out.getvalue()
    assert "expanding lattice" in text and "5/5" in text and "ETA" in text


@pytest.fixture(scope="module")
def evaluated(tiny_bundle_dir: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    common = ["evaluate", "--bundle", str(tiny_bundle_dir), "--sides", "16,32"]
    common += ["--budgets", "0.5,5", "--count", "10", "--strategies", "polydom-anytime,greedy"]
    return {fmt: train(*common, "--format", fmt) for fmt in ("table", "csv", "json", "markdown")}


def test_evaluate_piped_writes_the_full_table(
    evaluated: dict[str, subprocess.CompletedProcess[str]],
) -> None:
    done = evaluated["table"]
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout and "polydom-anytime" in done.stdout
    rows = [line for line in done.stdout.splitlines() if "polydom-anytime" in line]
    assert len(rows) == 4 and all("items" not in r for r in rows)
    header = next(line for line in done.stdout.splitlines() if "over budget" in line)
    assert "items" in header  # the last column, past 80 characters, is still there
    assert progress_lines(done.stderr, "evaluating")[-1] == (8, 8)
    assert "evaluating" not in done.stdout  # progress on stderr only


def test_evaluate_formats(evaluated: dict[str, subprocess.CompletedProcess[str]]) -> None:
    for done in evaluated.values():
        assert done.returncode == 0, done.stderr
    records = json.loads(evaluated["json"].stdout)
    assert len(records) == 2 * 2 * 2
    assert {r["strategy"] for r in records} == {"polydom-anytime", "greedy"}
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["n"] == 10 for r in records)
    table = list(csv.DictReader(io.StringIO(evaluated["csv"].stdout)))
    assert [row["strategy"] for row in table] == [r["strategy"] for r in records]
    assert [float(row["accuracy"]) for row in table] == pytest.approx(
        [r["accuracy"] for r in records], abs=5e-4
    )
    markdown = evaluated["markdown"].stdout.splitlines()
    assert markdown[2].startswith("| side | budget ms | strategy |") and markdown[3].startswith(
        "|---"
    )
    assert len([line for line in markdown if line.startswith("| ")]) == 1 + len(records)


def test_profile_prints_basis_and_units() -> None:
    done = train("profile", "--sides", "16,32", "--repeats", "3", "--format", "json")
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert {r["extractor"] for r in rows} >= {"thumbnail", "hog", "lbp"}
    assert all(r["c0"] >= 0 and r["ms_at_128px"] >= r["c0"] for r in rows)
    table = train("profile", "--sides", "16,64", "--repeats", "3")
    assert table.returncode == 0, table.stderr
    # a slope column exactly when some curve has one (on a loaded machine every fitted slope
    # can come out zero, and the basis is then c0 alone)
    sloped = "c0 + c1·n" in table.stdout
    assert sloped or "c(n) = c0," in table.stdout
    assert "c0 (ms)" in table.stdout and ("c1 (ms/px)" in table.stdout) == sloped
    assert "n = image pixels (side²)" in table.stdout and "95% quantile" in table.stdout
    assert progress_lines(table.stderr, "profiling extractors")[-1][0] > 0


def test_profile_into_rewrites_the_cost_curves_and_the_bundle_loads(
    tiny_bundle_dir: Path, tmp_path: Path
) -> None:
    bundle = tmp_path / "tiny"
    shutil.copytree(tiny_bundle_dir, bundle)
    before = read_manifest(bundle)
    done = train("profile", "--into", str(bundle), "--sides", "16,48", "--repeats", "3")
    assert done.returncode == 0, done.stderr
    after = read_manifest(bundle)
    assert after.version == before.version and after.models == before.models
    for old, new in zip(before.extractors, after.extractors, strict=True):
        assert new.name == old.name and new.dims == old.dims
        assert new.cost.profiled_sizes == [16 * 16, 48 * 48]
        assert new.cost.coefficients != old.cost.coefficients  # the fixture's were fixed
    assert after.provenance.parameters["cost_profile"]["sides"] == [16, 48]
    loaded = load_bundle(bundle, max_pixels=1 << 20)
    assert loaded.manifest.extractors == after.extractors
    assert f"cost curves of {len(after.extractors)} extractors rewritten" in " ".join(
        done.stderr.split()
    )
    assert not list(bundle.glob("*.tmp"))
    # The plans follow the new curves: for Poly-Dom, every index lookup is within ε of the
    # most accurate exported model that fits the budget (a scan of all of them: the oracle).
    fixed = load_bundle(bundle, max_pixels=1 << 20, calibration=CalibrationSettings(False))
    for name in ("polydom", "polydom-anytime"):
        runtime = fixed.runtimes[name]
        assert isinstance(runtime, PolyDomRuntime)
        lo, hi = runtime.size_domain
        for size in np.geomspace(lo, hi, 9):
            per_feature = runtime.costs.at(int(size))
            for budget in np.geomspace(0.005, 50.0, 25):
                planned, cost = runtime.plan(int(size), float(budget), frozenset(), per_feature)
                best, _ = runtime.scan(float(budget), frozenset(), per_feature)
                assert cost <= budget * (1 + 1e-9), (name, size, budget, planned)
                assert runtime.accuracy[planned] >= runtime.accuracy[best] - runtime.spec.epsilon


def test_profile_into_refuses_a_declared_cost_bundle(
    router_bundle_dir: Path, tmp_path: Path
) -> None:
    bundle = tmp_path / "router"
    shutil.copytree(router_bundle_dir, bundle)
    original = (bundle / "manifest.json").read_bytes()
    done = train("profile", "--into", str(bundle), "--repeats", "3")
    assert done.returncode == 2
    assert "only image bundles with measured (ms) costs" in " ".join(done.stderr.split())
    assert (bundle / "manifest.json").read_bytes() == original


def test_a_dag_sweep_shows_its_count_when_piped(tmp_path: Path) -> None:
    from training.data.synthetic import make_router_data

    x, y = make_router_data(400, seed=3)
    lines = [",".join(["r", "a1", "a2", "b1", "b2", "label"])]
    lines += [",".join([*map(str, row), str(label)]) for row, label in zip(x, y, strict=True)]
    (tmp_path / "data.csv").write_text("\n".join(lines) + "\n")
    spec = {
        "name": "router",
        "label": "label",
        "sensors": {"r": ["r"], "a": ["a1", "a2"], "b": ["b1", "b2"]},
        "costs": {"r": 1.0, "a": 5.0, "b": 5.0},
        "cost_scales": [0.0, 0.03, 0.3],
        "refine_scales": 2,
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    done = train(
        "dag",
        "--csv",
        str(tmp_path / "data.csv"),
        "--spec",
        str(tmp_path / "spec.json"),
        "--out",
        str(tmp_path / "out"),
    )
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout and "router" in done.stdout  # its table, whole when piped
    sweep = progress_lines(done.stderr, "sweeping cost trade-offs")
    assert sweep and sweep[-1][0] == sweep[-1][1] >= 2  # 2 scales after the first, + refinements
    assert progress_lines(done.stderr, "fitting the classifier bank")
