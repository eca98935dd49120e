"""The batch benchmark (benchmarks/batch.py) end to end on two small batches."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import batch as b


def test_both_arms_run_on_the_same_items_and_render(
    digits_bundle_dir: Path, tmp_path: Path
) -> None:
    predicted = b.run(2, 4, (0.05, 0.4), measured=False)
    results, info = predicted
    assert info["items"] == 8 and info["batches"] == 2
    for arms in results.values():
        for arm in arms.values():
            assert arm.items == 8 and len(arm.spent) == 2
        # predicted costs are exact: neither arm overruns a batch total
        assert arms["planned"].over == 0 and arms["even"].over == 0
        assert max(arms["planned"].spent) <= 4 * max(results) + 1e-9
    measured = b.run(1, 4, (5.0,), measured=True)
    text = b.render(predicted, measured, 4, elapsed=1.0)
    rows = [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ")]
    assert rows.count("| 0.05") == 1 and rows.count("| 0.4") == 1 and rows.count("| 5") == 1
    assert "${" not in text
    unlimited = info["unlimited"]
    assert isinstance(unlimited, b.Arm) and unlimited.accuracy >= 0.5


def test_planning_beats_an_even_split_where_budgets_are_tight(digits_bundle_dir: Path) -> None:
    # 0.8 of the thumbnail's predicted cost per item buys it for no item under an even
    # split, but for most items when the batch shares its total.
    from service.bundle import read_manifest

    manifest = read_manifest(digits_bundle_dir)
    tight = 0.8 * next(e.cost(16 * 16) for e in manifest.extractors if e.name == "thumbnail")
    results, _ = b.run(2, 8, (tight,), measured=False)
    planned, even = results[tight]["planned"], results[tight]["even"]
    assert planned.accuracy > even.accuracy + 0.2, (planned.accuracy, even.accuracy)


@pytest.mark.parametrize("name", ["batch"])
def test_benchmark_is_part_of_make_bench(name: str) -> None:
    source = (Path(b.__file__).parent / "__main__.py").read_text()
    assert f"{name}.main()" in source
