"""The digits builder writes what it wrote before the restructuring into training/bundles/.

``tests/support/golden/tiny_manifest.json`` is the manifest of the session's tiny bundle
(``tiny_bundle_dir``: 3 extractors, 400 digits, fixed costs) as the builder wrote it at commit
8cb94d2, before the move (rewritten when the held-out digits became the last 20 % of
scikit-learn's digits, which changed the training rows), less what changes from build to
build: the version (its date and a digest of the ONNX bytes, which depend on the machine's
float rounding), the build time, the library versions and the host. Every other field
(lattice statistics, accuracies, models, strategies, the index) must be the same. If a change
to the builder is meant to change the bundle, rewrite the golden file from a fresh build and
say so in the commit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from service.bundle import read_manifest

GOLDEN = Path(__file__).resolve().parents[2] / "support" / "golden" / "tiny_manifest.json"
VOLATILE_PROVENANCE = ("created_at", "libraries", "host")


def _stable(manifest: dict[str, Any]) -> dict[str, Any]:
    out = dict(manifest)
    out.pop("version")
    out["provenance"] = {
        k: v for k, v in manifest["provenance"].items() if k not in VOLATILE_PROVENANCE
    }
    return out


def test_tiny_manifest_matches_the_builder_before_the_move(tiny_bundle_dir: Path) -> None:
    built = json.loads((tiny_bundle_dir / "manifest.json").read_text())
    golden = json.loads(GOLDEN.read_text())
    assert set(built["provenance"]) >= set(VOLATILE_PROVENANCE)
    assert _stable(built) == golden
    # and it is still a bundle the service reads
    assert read_manifest(tiny_bundle_dir).name == "tiny"
