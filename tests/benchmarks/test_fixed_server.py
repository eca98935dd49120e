"""The fixed-server benchmark's core (benchmarks/fixed_server.py) on a handful of digits."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sklearn.datasets import load_digits

from benchmarks import fixed_server as fs
from benchmarks.report import wilson
from service.bundle import PolyDomStrategy, read_manifest
from training.bundles.digits import digits_features
from training.data.digits import render_digit, to_png
from training.evaluate import digit_split

MANIFEST = read_manifest(fs.BUNDLE)
FULL = "+".join(sorted(e.name for e in MANIFEST.extractors))
# A model of two features, whichever the bundle ships (its models depend on its build).
PAIR = next(m.id for m in MANIFEST.models if len(m.features) == 2)


def test_held_out_split_excludes_every_training_digit() -> None:
    seed = int(MANIFEST.provenance.parameters["seed"])
    train, test = digit_split(seed, MANIFEST.provenance.parameters.get("limit"))
    assert len(train) == MANIFEST.provenance.parameters["rows"]["train"]
    assert len(test) == MANIFEST.provenance.parameters["rows"]["test"]
    assert not set(train.tolist()) & set(test.tolist())
    # Held out: the last 20 % of scikit-learn's digits, by index (whatever the seed).
    n = len(load_digits().target)
    assert sorted(test.tolist()) == list(range(int(0.8 * n), n))
    assert sorted(digit_split(seed + 1)[1].tolist()) == list(range(int(0.8 * n), n))
    assert not (digit_split(seed + 1)[0] == train).all()  # the training order is the seed's
    indices, labels = fs.held_out_items(50)
    assert set(indices.tolist()) <= set(test.tolist())
    assert not set(indices.tolist()) & set(train.tolist())
    assert (labels == load_digits().target[indices]).all()
    # The split is the one the builder trains on: its train rows are these digits, in order.
    data = digits_features([], (16,), seed=seed, limit=40)
    small_train, small_test = digit_split(seed, 40)
    target = load_digits().target
    assert (data.labels[data.train] == target[small_train]).all()
    assert (data.labels[data.test] == target[small_test]).all()
    assert (small_test >= int(0.8 * n)).all() and (small_train < int(0.8 * n)).all()


def _body(index: int, side: int) -> dict[str, object]:
    image = render_digit(load_digits().images[index], side, np.random.default_rng(index))
    return {
        "model": "digits",
        "budget": 5.0,
        "item": {"id": f"t{index}", "png_base64": base64.b64encode(to_png(image)).decode()},
    }


@pytest.mark.parametrize("model_id", ["thumbnail", PAIR, FULL])
def test_fixed_app_computes_exactly_its_feature_set(model_id: str) -> None:
    features = MANIFEST.model(model_id).features
    with TestClient(fs.create_fixed_app(fs.BUNDLE, model_id)) as client:
        response = client.post("/predict", json=_body(int(fs.held_out_items(1)[0][0]), 32))
        assert response.status_code == 200
        answer = response.json()
        assert answer["answered_by"] == model_id
        assert answer["extracted"] == sorted(features)
        assert answer["prediction"] in MANIFEST.classes
        bad = client.post("/predict", json={"item": {"png_base64": "not base64!"}})
        assert bad.status_code == 422


def test_fixed_app_rejects_an_unknown_model() -> None:
    with pytest.raises(KeyError, match="no model 'nope'"):
        fs.create_fixed_app(fs.BUNDLE, "nope")


def test_fixed_model_ids_are_candidates_hog_and_full_set() -> None:
    ids = fs.fixed_model_ids(MANIFEST)
    strategy = MANIFEST.strategy()
    assert isinstance(strategy, PolyDomStrategy)
    candidates = strategy.candidates
    assert set(ids) == {c for c in candidates if c != "prior"} | {"hog", FULL}
    assert ids[-1] == FULL  # the most expensive at 512 x 512


def test_compare_runs_real_servers_on_a_handful_of_items() -> None:
    cells, ids = fs.compare(
        sides=(32,), budgets=(1.0, 20.0), count=4, fixed_ids=["thumbnail", FULL]
    )
    assert ids == ["thumbnail", FULL]
    assert [(c.server, c.budget) for c in cells] == [
        ("budgetserve", 1.0),
        ("budgetserve", 20.0),
        ("fixed thumbnail", None),
        (f"fixed {FULL}", None),
    ]
    for cell in cells:
        assert cell.n == 4 and cell.errors == 0 and cell.side == 32
        assert len(cell.latency_ms) == 4 and all(t > 0 for t in cell.latency_ms)
    for cell, model_id in zip(cells[2:], ids, strict=True):
        assert cell.extracted == {tuple(sorted(MANIFEST.model(model_id).features))}
        assert cell.features == {model_id: 4}
    # budgetserve answered with models of the bundle, planned per budget.
    known = {m.id for m in MANIFEST.models}
    assert all(set(c.features) <= known for c in cells[:2])
    lines = fs.render(cells, ids, (32,), 4, None, 1.0, ["thumbnail"])
    text = "\n".join(lines)
    assert "### 32×32" in text and "budgetserve @ 20 ms" in text and "fixed thumbnail" in text


def test_wilson_interval() -> None:
    lo, hi = wilson(5, 10)
    assert lo == pytest.approx(1 - hi) and 0.2 < lo < 0.25
    assert wilson(0, 20)[0] == 0.0 and wilson(20, 20)[1] == 1.0
    assert wilson(0, 0) == (0.0, 1.0)


def test_a_connection_the_server_dropped_is_opened_again() -> None:
    """A kept-alive connection the server closed while it sat idle (here: after every
    answer) is opened again and the request sent once more, not counted as an error."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class DropsAfterEachAnswer(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
            self.close_connection = True

        def log_message(self, *args: object) -> None:
            return None

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), DropsAfterEachAnswer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    server = fs.Server("dropper", httpd.server_address[1], process=None)  # type: ignore[arg-type]
    try:
        answers = [server.request("POST", "/predict", b"{}") for _ in range(3)]
        assert answers == [(200, b"ok")] * 3
    finally:
        if server.conn is not None:
            server.conn.close()
        httpd.shutdown()
        httpd.server_close()
