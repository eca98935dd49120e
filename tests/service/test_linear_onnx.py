"""Linear models scored by numpy (``service.linear_onnx``) against ONNX Runtime, the oracle:
the shipped bundle's own models on real features, scikit-learn exports with and without a
scaler, and what must stay ONNX Runtime's (other graphs, files that do not parse, a linear
reading that does not agree)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.tree import DecisionTreeClassifier

from service.linear_onnx import AGREEMENT_ATOL, agrees, read_linear
from service.registry import load_bundle
from training.data.digits import digits_source, render_digit
from training.export.sklearn import export_classifier


def session(data: bytes) -> tuple[ort.InferenceSession, str, str]:
    s = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    outputs = [o.name for o in s.get_outputs()]
    return s, s.get_inputs()[0].name, "probabilities" if "probabilities" in outputs else outputs[-1]


@pytest.fixture(scope="module")
def digits_xy() -> tuple[np.ndarray, np.ndarray]:
    data = load_digits()
    return data.data.astype(np.float32) / 16.0, data.target


def test_the_shipped_bundles_models_are_scored_by_numpy_as_onnx_runtime_scores_them(
    digits_bundle_dir: Path,
) -> None:
    """Every model of models/digits but the prior is a linear chain, read and used; on
    rendered digits (the last 20 %, held out from its training) its probabilities are ONNX
    Runtime's within the tolerance and its answers the same."""
    bundle = load_bundle(digits_bundle_dir, max_pixels=1 << 24)
    models = bundle.runtime.models
    linear = {k: m for k, m in models.items() if m.linear is not None}
    assert len(linear) == len(models) - 1, sorted(set(models) - set(linear))
    images, _ = digits_source()
    held_out = range(int(len(images) * 0.8), len(images), 23)
    for index in held_out:
        image = render_digit(images[index], 64)
        features = {
            name: np.asarray(extractor.extract(image), np.float32)
            for name, extractor in bundle.extractors.items()
        }
        for model_id, model in linear.items():
            assert model._session is not None
            x = np.concatenate([features[f] for f in model.features])[None, :]
            expected = model._session.run([model._output], {model._input: x})[0][0]
            got = model.predict_proba(features)
            assert got.dtype == np.float32 and got.shape == expected.shape
            np.testing.assert_allclose(got, expected, rtol=0, atol=AGREEMENT_ATOL, err_msg=model_id)
            assert np.argmax(got) == np.argmax(expected), model_id


@pytest.mark.parametrize("scaled", [True, False], ids=["scaler", "no-scaler"])
def test_scikit_learn_logistic_regressions_read_as_linear(
    digits_xy: tuple[np.ndarray, np.ndarray], scaled: bool
) -> None:
    x, y = digits_xy
    estimator = LogisticRegression(max_iter=300)
    fitted = (make_pipeline(StandardScaler(), estimator) if scaled else estimator).fit(x, y)
    data = export_classifier(fitted, x.shape[1])
    s, name_in, name_out = session(data)
    model = read_linear(data, name_in, name_out)
    assert model is not None and model.input_dims == x.shape[1]
    assert (model.offset is not None) == scaled
    assert agrees(model, s, name_in, name_out)
    rows = x[-50:]
    expected = s.run([name_out], {name_in: rows})[0]
    got = np.stack([model.predict_proba(r) for r in rows])
    np.testing.assert_allclose(got, expected, rtol=0, atol=AGREEMENT_ATOL)
    np.testing.assert_allclose(got, fitted.predict_proba(rows), rtol=0, atol=1e-4)
    # Values that overflow float32: non-finite probabilities, as ONNX Runtime gives, no
    # warning (warnings are errors in these tests)
    huge = np.full(x.shape[1], 3e38, np.float32)
    assert not np.isfinite(model.predict_proba(huge)).all()
    assert not np.isfinite(s.run([name_out], {name_in: huge[None, :]})[0]).all()


def test_other_graphs_and_broken_files_stay_onnx_runtimes(
    digits_xy: tuple[np.ndarray, np.ndarray],
) -> None:
    x, y = digits_xy
    tree = export_classifier(DecisionTreeClassifier(max_depth=4).fit(x, y), x.shape[1])
    _, name_in, name_out = session(tree)
    assert read_linear(tree, name_in, name_out) is None
    linear = export_classifier(LogisticRegression(max_iter=300).fit(x, y), x.shape[1])
    assert read_linear(linear, name_in, "label") is None, "not the probabilities output"
    assert read_linear(linear, "another_input", name_out) is None, "not fed by the input"
    assert read_linear(linear[: len(linear) // 2], name_in, name_out) is None  # truncated
    assert read_linear(b"not an onnx file", name_in, name_out) is None
    # A Scaler without its offset (which ONNX Runtime refuses to load): None, not a KeyError
    model = onnx.load_from_string(
        export_classifier(
            make_pipeline(StandardScaler(), LogisticRegression(max_iter=300)).fit(x, y), 64
        )
    )
    scaler = next(n for n in model.graph.node if n.op_type == "Scaler")
    kept = [a for a in scaler.attribute if a.name != "offset"]
    del scaler.attribute[:]
    scaler.attribute.extend(kept)
    partial = model.SerializeToString()
    assert read_linear(partial, name_in, name_out) is None


def test_a_linear_reading_that_disagrees_is_not_used(
    digits_xy: tuple[np.ndarray, np.ndarray],
) -> None:
    """``agrees`` is what lets numpy score a model: weights that differ from the graph's
    (here one intercept moved by 0.5) fail it."""
    x, y = digits_xy
    data = export_classifier(LogisticRegression(max_iter=300).fit(x, y), x.shape[1])
    s, name_in, name_out = session(data)
    model = read_linear(data, name_in, name_out)
    assert model is not None and agrees(model, s, name_in, name_out)
    moved = model.intercepts.copy()
    moved[3] += 0.5
    assert not agrees(replace(model, intercepts=moved), s, name_in, name_out)
