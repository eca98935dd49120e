"""The bundle format: schema, publication, and ONNX models reproducing training."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from service.bundle import Manifest, json_schema, read_manifest
from service.inference import load_models
from training.bundles.digits import VERIFICATION_FILE

ROOT = Path(__file__).resolve().parents[2]


def test_published_schema_is_current() -> None:
    published = json.loads((ROOT / "service" / "schema" / "manifest.schema.json").read_text())
    assert published == json_schema(), "run `make schema` after changing service/bundle.py"


def test_digits_manifest_is_complete(digits_bundle_dir: Path) -> None:
    m = read_manifest(digits_bundle_dir)
    assert m.name == "digits" and m.cost_unit == "ms"
    assert len(m.extractors) >= 6
    assert all(e.cost.unit == "ms" and e.cost.fit_error is not None for e in m.extractors)
    assert {s.name for s in m.strategies} == {
        "polydom",
        "polydom-anytime",
        "greedy",
        "greedy-acc",
        "greedy-cost",
    }
    assert m.default_strategy == "polydom-anytime"
    assert any(not model.features for model in m.models), "the empty set answers any budget"
    assert m.provenance.data_fingerprint.startswith("sha256:")
    assert {"numpy", "scikit-learn", "onnxruntime"} <= set(m.provenance.libraries)
    assert not [p for p in digits_bundle_dir.iterdir() if p.suffix in {".pkl", ".joblib"}]
    for model in m.models:
        if model.file:
            assert (digits_bundle_dir / model.file).is_file()


def test_onnx_models_reproduce_training_predictions(digits_bundle_dir: Path) -> None:
    manifest = read_manifest(digits_bundle_dir)
    verification = json.loads((digits_bundle_dir / VERIFICATION_FILE).read_text())
    rows = {k: np.asarray(v, dtype=np.float32) for k, v in verification["rows"].items()}
    loaded = load_models(manifest, digits_bundle_dir)
    checked = 0
    for model_id, expected in verification["expected"].items():
        model = loaded[model_id]
        for i, exp in enumerate(expected):
            got = model.predict_proba({f: rows[f][i] for f in model.features})
            np.testing.assert_allclose(got, exp, atol=1e-4)
            checked += 1
    assert checked >= 8 * (len(manifest.models) - 1)


def test_manifest_rejects_inconsistencies(digits_bundle_dir: Path) -> None:
    raw = json.loads((digits_bundle_dir / "manifest.json").read_text())
    bad = json.loads(json.dumps(raw))
    bad["strategies"][0]["candidates"].append("no-such-model")
    with pytest.raises(ValidationError, match="no-such-model"):
        Manifest.model_validate(bad)
    bad = json.loads(json.dumps(raw))
    bad["extractors"][0]["cost"]["coefficients"] = [-1.0]
    with pytest.raises(ValidationError, match="cost coefficients"):
        Manifest.model_validate(bad)
    bad = json.loads(json.dumps(raw))
    first = bad["strategies"][0]["index"]["skylines"][0]
    bad["strategies"][0]["index"] = {"breakpoints": [2.0, 1.0], "skylines": [first, first]}
    with pytest.raises(ValidationError, match="strictly increasing"):
        Manifest.model_validate(bad)
    bad = json.loads(json.dumps(raw))
    bad["default_strategy"] = "nope"
    with pytest.raises(ValidationError, match="default_strategy"):
        Manifest.model_validate(bad)
    bad = json.loads(json.dumps(raw))
    bad["strategies"][1]["name"] = bad["strategies"][0]["name"]
    with pytest.raises(ValidationError, match="duplicate strategy names"):
        Manifest.model_validate(bad)
    bad = json.loads(json.dumps(raw))
    greedy = next(s for s in bad["strategies"] if s["kind"] == "greedy")
    greedy["skyline"].append([99, 0])
    with pytest.raises(ValidationError, match="out of range"):
        Manifest.model_validate(bad)
    bad = json.loads(json.dumps(raw))
    bad["format_version"] = 2
    with pytest.raises(ValidationError):
        Manifest.model_validate(bad)
