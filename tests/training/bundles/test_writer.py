"""The bundle writer's staging folder: a build lands whole where it was asked to, or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.bundles.writer import staging


def test_a_bundle_lands_in_folders_not_there_yet(tmp_path: Path) -> None:
    """A build into ``a/b/name`` whose parents do not exist yet lands there (it used to fail
    at this last step, after all the fitting, with FileNotFoundError)."""
    out = tmp_path / "a" / "b" / "name"
    with staging(out) as tmp:
        (tmp / "manifest.json").write_text("{}")
    assert (out / "manifest.json").read_text() == "{}"
    assert [p.name for p in out.parent.iterdir()] == ["name"]  # no staging folder left


def test_a_failed_build_leaves_the_old_bundle_and_no_staging_folder(tmp_path: Path) -> None:
    out = tmp_path / "name"
    out.mkdir()
    (out / "manifest.json").write_text("old")
    with pytest.raises(RuntimeError), staging(out) as tmp:
        (tmp / "manifest.json").write_text("half")
        raise RuntimeError("the fit failed")
    assert (out / "manifest.json").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["name"]
