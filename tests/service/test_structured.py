"""The structured OCR strategies (paper 004) served end to end: a small bundle trained by the
real trainer on the shared OCR data, loaded by the real app, asked for held-out words.

The module stays whole (over 450 lines): every test reads the one bundle its module fixture
trains (about 10 s of training); split in two, the suite would train it twice."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.bundle import StructuredAnytimeStrategy, StructuredOneShotStrategy
from service.cache import InProcessCache
from service.execution import ExtractorSource, run_session
from service.floor import FALLBACK_RESERVE_MS
from service.http import create_app
from service.registry import load_bundle
from service.settings import Settings
from service.strategies.structured import StructuredOneShotRuntime, StructuredSession
from training.bundles.ocr import profile_templates, write_ocr_bundle
from training.structured.ocr import DEFAULT_DATA, OcrData, load_ocr, word_problem
from training.structured.ocr_train import OcrTraining, train_ocr
from training.structured.policies import AnytimePolicy
from training.structured.problem import ChainProblem

DATA = Path(__file__).resolve().parents[2] / DEFAULT_DATA
RESERVE_MS = FALLBACK_RESERVE_MS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not DATA.is_file(),
        reason="the shared OCR data is not beside this checkout (../shared/datasets/ocr-letters)",
    ),
]


@dataclass
class Trained:
    folder: Path
    data: OcrData
    train: OcrTraining
    words: list[int]
    problem: ChainProblem


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    data = load_ocr(DATA)
    costs = profile_templates(data, letters=100, repeats=1)
    train = train_ocr(data, costs, chain_words=240, policy_words=150, max_iter=30, seed=1)
    folder = tmp_path_factory.mktemp("bundles") / "ocr"
    write_ocr_bundle(folder, data, DATA, train, costs, overhead_words=20)
    words = train.test_words[:12]
    problem = word_problem(train.chain, data, train.features, words, train.templates)
    return Trained(folder, data, train, words, problem)


@pytest.fixture
def client(trained: Trained) -> Iterator[TestClient]:
    # The reserve fixed at the value the budgets below are computed with (measured, it is
    # this machine's p95 of the work after planning, which a loaded machine raises: the
    # lower points then had no room for a HOG and the mid-budget test checked nothing).
    settings = Settings(models_dir=trained.folder.parent, overhead_reserve_ms=RESERVE_MS)
    app = create_app(settings, cache=InProcessCache(1 << 24))
    with TestClient(app) as c:
        yield c


def _letters(data: OcrData, word: int) -> list[list[list[int]]]:
    return [letter.astype(int).tolist() for letter in data.letters[data.word(word)]]


def _ask(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/predict", json={"model": "ocr", **body})
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


def _hogs(extracted: list[str]) -> list[int]:
    return [int(f.split("@")[1]) for f in extracted if f.startswith("hog@")]


def test_one_shot_serves_the_trained_policys_templates_and_the_chains_word(
    trained: Trained, client: TestClient
) -> None:
    manifest = load_bundle(trained.folder, 1 << 22).manifest
    spec = manifest.strategy("structured-oneshot")
    assert isinstance(spec, StructuredOneShotStrategy)
    points = spec.points
    richest = max(range(len(points)), key=lambda j: points[j].mean_cost)
    policy = trained.train.one_shot[points[richest].column]
    ts = trained.train.templates
    for i, w in enumerate(trained.words):
        body = _ask(
            client,
            {
                "strategy": "structured-oneshot",
                "budget": 5000,
                "item": {"letters": _letters(trained.data, w)},
            },
        )
        state = policy.state(trained.problem.policy_inputs(i), ts)
        expected = np.flatnonzero(state[:, 1]).tolist()
        assert sorted(_hogs(body["cost"]["extracted"])) == expected
        decision = body["decision"]
        assert [("hog" in letter["templates"]) for letter in decision["letters"]] == state[
            :, 1
        ].tolist()
        word = "".join(chr(97 + y) for y in trained.problem.predict([i], [state])[0])
        assert body["prediction"] == decision["word"] == word
        assert decision["lam"] == points[richest].lam
        assert all(0.0 < letter["confidence"] <= 1.0 for letter in decision["letters"])


def test_one_shot_points_below_the_richest_serve_their_own_policies(
    trained: Trained, client: TestClient
) -> None:
    """Budgets between the points' expected costs choose the cheaper points. Whichever point
    answers (named by its λ and class weight), the letters that got HOG are among those its
    policy chose, and all of them when the budget did not cut the word short."""
    runtime = load_bundle(trained.folder, 1 << 22).runtimes["structured-oneshot"]
    assert isinstance(runtime, StructuredOneShotRuntime)
    by_key = {(p.lam, p.positive_weight): p for p in runtime.points}
    richest = max(runtime.points, key=lambda p: p.mean_cost)
    ts = trained.train.templates
    below = 0  # HOG letters served by points below the richest
    for i, w in enumerate(trained.words):
        letters = _letters(trained.data, w)
        costs = sorted({runtime.expected_cost(p, len(letters)) for p in runtime.points})
        # The service plans within the budget less its overhead reserve (0.5 ms by default);
        # just below the next point's cost, a point has the most room for its templates.
        for budget in [RESERVE_MS + a + 0.9 * (b - a) for a, b in itertools.pairwise(costs)]:
            body = _ask(
                client,
                {
                    "strategy": "structured-oneshot",
                    "budget": budget,
                    "accounting": "work",
                    "item": {"letters": letters, "id": f"mid-{i}-{budget}"},
                },
            )
            decision = body["decision"]
            point = by_key[(decision["lam"], decision["positive_weight"])]
            state = trained.train.one_shot[point.column].state(trained.problem.policy_inputs(i), ts)
            chosen = set(np.flatnonzero(state[:, 1]).tolist())
            served = set(_hogs(body["cost"]["extracted"]))
            assert served <= chosen, (point, served, chosen)
            if decision["stopped_by"] == "policy":
                assert served == chosen
            if point is not richest:
                below += len(served)
    assert below > 0, "no point below the richest served any HOG: nothing was checked"


def test_anytime_acquires_in_the_trained_order(trained: Trained, client: TestClient) -> None:
    """The served sequence is the trained Alg. 2's, its stop included (the bundle carries
    the threshold training chose, and GET /models/{name} shows it)."""
    policy = trained.train.anytime
    ts = trained.train.templates
    described = client.get("/models/ocr").json()["strategies"]
    (anytime,) = [s for s in described if s["kind"] == "structured-anytime"]
    assert anytime["stop_below"] == policy.stop_below
    for i, w in enumerate(trained.words):
        body = _ask(
            client,
            {
                "strategy": "structured-anytime",
                "budget": 5000,
                "item": {"letters": _letters(trained.data, w)},
            },
        )
        inputs = trained.problem.policy_inputs(i)
        order = [p for p, _ in policy.order(inputs, ts.initial(len(inputs)))]
        assert _hogs(body["cost"]["extracted"]) == order
        assert body["decision"]["stopped_by"] == "policy"


def test_a_requests_tolerance_picks_its_stop_from_the_table(
    trained: Trained, client: TestClient, tmp_path: Path
) -> None:
    """A request's ``tolerance`` gets the threshold of the largest tolerance of the bundle's
    stop table at most it: the served sequence is the trained Alg. 2's with that threshold
    (0: the table's first entry; 1: its last), and a lower threshold never buys fewer HOGs.
    GET /models/{name} shows the table; a bundle without one refuses a tolerance (422)."""
    policy = trained.train.anytime
    ts = trained.train.templates
    table = policy.stop_table
    described = client.get("/models/ocr").json()["strategies"]
    (anytime,) = [s for s in described if s["kind"] == "structured-anytime"]
    assert anytime["stops"] == [{"tolerance": t, "stop_below": b} for t, b in table]
    assert table[0][1] != table[-1][1], "one threshold for every tolerance: nothing to compare"
    bought = {}
    for tolerance, stop in ((0.0, table[0][1]), (1.0, table[-1][1])):
        rule = AnytimePolicy(policy.lam, policy.optional, policy.scorer, policy.steps, [], stop)
        bought[tolerance] = 0
        for i, w in enumerate(trained.words):
            body = _ask(
                client,
                {
                    "strategy": "structured-anytime",
                    "budget": 5000,
                    "tolerance": tolerance,
                    "item": {"letters": _letters(trained.data, w), "id": f"tol{tolerance}-{i}"},
                },
            )
            inputs = trained.problem.policy_inputs(i)
            order = [p for p, _ in rule.order(inputs, ts.initial(len(inputs)))]
            assert _hogs(body["cost"]["extracted"]) == order
            bought[tolerance] += len(order)
    assert bought[0.0] >= bought[1.0]
    # A bundle built before the table: its manifest without ``stops``.
    folder = tmp_path / "models" / "ocr"
    shutil.copytree(trained.folder, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    for strategy in manifest["strategies"]:
        strategy.pop("stops", None)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with TestClient(create_app(Settings(models_dir=folder.parent))) as old:
        word = {"letters": _letters(trained.data, trained.words[0])}
        body = {"model": "ocr", "strategy": "structured-anytime", "budget": 50, "item": word}
        refused = old.post("/predict", json={**body, "tolerance": 0.0})
        assert refused.status_code == 422, refused.text
        assert "stop table" in refused.json()["error"]["message"]
        assert old.post("/predict", json=body).status_code == 200


def test_the_model_describes_its_structured_strategies(client: TestClient) -> None:
    body = client.get("/models/ocr").json()
    kinds = {s["kind"] for s in body["strategies"]}
    assert kinds == {"structured-oneshot", "structured-anytime"}
    skyline = client.get("/models/ocr/skyline", params={"size": 5})
    assert skyline.status_code == 200, skyline.text


def test_cached_templates_are_free(trained: Trained, client: TestClient) -> None:
    item = {"letters": _letters(trained.data, trained.words[0])}
    first = _ask(client, {"strategy": "structured-anytime", "budget": 5000, "item": item})
    second = _ask(client, {"strategy": "structured-anytime", "budget": 5000, "item": item})
    assert set(second["cost"]["cached"]) == set(first["cost"]["extracted"])
    assert second["cost"]["extracted"] == [] and second["cost"]["charged"] == {}
    assert second["prediction"] == first["prediction"]


@pytest.mark.parametrize(
    ("mutate", "status", "words"),
    [
        (lambda L: L.__setitem__(1, L[1][:15]), 422, ["letters[1]", "15 rows"]),
        (lambda L: L[2][3].pop(), 422, ["letters[2]", "row 3", "7 values"]),
        (lambda L: L[0][5].__setitem__(2, 2), 422, ["letters[0]", "row 5, column 2", "2"]),
        (lambda L: L.__setitem__(1, "not base64!"), 422, ["letters[1]", "base64"]),
        (lambda L: L.clear(), 422, ["empty"]),
        (lambda L: L.extend(L * 5), 413, ["at most 14"]),
    ],
)
def test_bad_words_get_a_4xx_naming_the_letter_and_the_problem(
    trained: Trained, client: TestClient, mutate: Any, status: int, words: list[str]
) -> None:
    letters = _letters(trained.data, trained.words[1])
    mutate(letters)
    response = client.post(
        "/predict", json={"model": "ocr", "budget": 50, "item": {"letters": letters}}
    )
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    for w in words:
        assert w in message


def test_a_png_letter_decodes_like_its_rows(trained: Trained, client: TestClient) -> None:
    import base64
    import io

    from PIL import Image

    letters = _letters(trained.data, trained.words[2])
    buf = io.BytesIO()
    Image.fromarray(np.asarray(letters[0], dtype=np.uint8) * 255).save(buf, format="PNG")
    as_png: list[Any] = [base64.b64encode(buf.getvalue()).decode(), *letters[1:]]
    rows = _ask(client, {"budget": 5000, "item": {"id": "a", "letters": letters}})
    png = _ask(client, {"budget": 5000, "item": {"id": "b", "letters": as_png}})
    assert rows["prediction"] == png["prediction"]


class NoisyMeter:
    """Charges each template its true cost: the manifest's prediction times a factor drawn
    from [0.5, 2]; spent is the sum charged (no other time)."""

    def __init__(self, predicted: dict[str, float], rng: np.random.Generator) -> None:
        self.predicted = predicted
        self.rng = rng
        self.total = 0.0
        self.errors: list[float] = []

    def spent(self) -> float:
        return self.total

    def charge(self, feature: str, seconds: float) -> float:
        true = self.predicted[feature] * float(self.rng.uniform(0.5, 2.0))
        self.errors.append(true - self.predicted[feature])
        self.total += true
        return true


def test_anytime_never_exceeds_the_budget_by_more_than_one_templates_misprediction(
    trained: Trained,
) -> None:
    bundle = load_bundle(trained.folder, 1 << 22)
    runtime = bundle.strategy("structured-anytime")
    rng = np.random.default_rng(0)
    checked = 0
    for w in trained.words:
        item = bundle.decoder.decode({"letters": _letters(trained.data, w)})
        predicted = bundle.costs.profiled_at(item.size)
        spec = runtime.spec
        reserve = (spec.decode_cost + spec.policy_cost) * item.size  # type: ignore[attr-defined]
        for budget in np.linspace(0.0, 0.4 * item.size, 9):
            meter = NoisyMeter(predicted, rng)
            run = run_session(
                runtime,
                item.size,
                budget + reserve,
                {},
                ExtractorSource(bundle.extractors, item.data),
                meter,
            )
            over = meter.total - (budget + reserve)
            worst = max([e for e in meter.errors if e > 0], default=0.0)
            assert over <= worst + 1e-9
            checked += len(run.acquired) > 0
    assert checked > 0


class ExactMeter:
    """Charges each template exactly the manifest's prediction (no other time)."""

    def __init__(self, predicted: dict[str, float]) -> None:
        self.predicted = predicted
        self.total = 0.0

    def spent(self) -> float:
        return self.total

    def charge(self, feature: str, seconds: float) -> float:
        self.total += self.predicted[feature]
        return self.predicted[feature]


@pytest.mark.parametrize("strategy", ["structured-anytime", "structured-oneshot"])
def test_a_budget_for_pixels_and_decoding_but_not_the_policy_gets_every_letters_pixels(
    trained: Trained, strategy: str
) -> None:
    """The policy's reserve is only needed when the policy runs: a budget that pays the
    base templates and decoding answers from the pixels (not from the label prior), and
    one that also pays the policy and a HOG buys HOG (the anytime policy's first pair,
    unless its stop ends the word at once)."""
    bundle = load_bundle(trained.folder, 1 << 22)
    runtime = bundle.strategy(strategy)
    spec = runtime.spec
    assert isinstance(spec, StructuredOneShotStrategy | StructuredAnytimeStrategy)
    assert spec.policy_cost > 0.0 and spec.decode_cost > 0.0
    ts = trained.train.templates
    bought = 0
    for i, w in enumerate(trained.words[:6]):
        item = bundle.decoder.decode({"letters": _letters(trained.data, w)})
        n = item.size
        predicted = bundle.costs.profiled_at(n)
        pixels = sum(predicted[f"pixels@{p}"] for p in range(n))
        decoding = spec.decode_cost * n
        budget = pixels + decoding + 0.5 * spec.policy_cost * n
        run = run_session(
            runtime,
            n,
            budget,
            {},
            ExtractorSource(bundle.extractors, item.data),
            ExactMeter(predicted),
        )
        assert sorted(run.acquired) == sorted(f"pixels@{p}" for p in range(n))
        session = run.session
        assert isinstance(session, StructuredSession)
        assert session.scores is None  # the policy did not run
        session.decode(run.features)
        pixels_only = trained.problem.predict([i], [ts.initial(n)])[0]
        assert session.prediction == "".join(chr(97 + y) for y in pixels_only)
        assert session.result is not None and session.result["stopped_by"] == "budget"
        richer = pixels + decoding + spec.policy_cost * n + predicted["hog@0"]
        run = run_session(
            runtime,
            n,
            richer,
            {},
            ExtractorSource(bundle.extractors, item.data),
            ExactMeter(predicted),
        )
        assert isinstance(run.session, StructuredSession) and run.session.scores is not None
        if strategy == "structured-anytime":  # the one-shot point may choose no HOG
            # the first of the policy's pairs, unless its stop ends the word before any
            order = trained.train.anytime.order(trained.problem.policy_inputs(i), ts.initial(n))
            assert _hogs(list(run.acquired)) == [p for p, _ in order[:1]]
            bought += len(order[:1])
    if strategy == "structured-anytime":
        assert bought > 0, "no word bought a HOG: the budget that pays one was not checked"


def test_v2_infer_takes_words_as_json_item_elements(trained: Trained, client: TestClient) -> None:
    """The Open Inference Protocol carries items of other kinds as one BYTES input 'ITEM', one
    JSON document per item: the same answers as POST /predict."""
    import json

    words = [_letters(trained.data, w) for w in trained.words[:2]]
    meta = client.get("/v2/models/ocr").json()
    assert [i["name"] for i in meta["inputs"]] == ["ITEM", "ID"]
    documents = [json.dumps({"letters": letters}) for letters in words]

    def infer(name: str, data: list[str]) -> Any:
        tensor = {"name": name, "datatype": "BYTES", "shape": [len(data)], "data": data}
        body = {
            "inputs": [tensor],
            "parameters": {"budget": 5000, "strategy": "structured-oneshot"},
        }
        return client.post("/v2/models/ocr/infer", json=body)

    answer = infer("ITEM", documents)
    assert answer.status_code == 200, answer.text
    predicted = next(o for o in answer.json()["outputs"] if o["name"] == "PREDICTION")["data"]
    direct = [
        _ask(
            client,
            {"strategy": "structured-oneshot", "budget": 5000, "item": {"letters": letters}},
        )["prediction"]
        for letters in words
    ]
    assert predicted == direct
    refused = infer("IMAGE", documents)
    assert refused.status_code == 400 and "'ITEM'" in refused.json()["error"]
    refused = infer("ITEM", ["{", "[1]"])
    assert refused.status_code == 400
    assert "ITEM[0] is not a JSON document" in refused.json()["error"]


def test_a_manifest_accepting_longer_words_than_its_strategies_serve_is_refused(
    trained: Trained,
) -> None:
    # A word the decoder accepts but the strategy cannot serve would fail mid-request: the
    # manifest refuses the combination when it is read, naming both fields and the fix.
    import json

    from pydantic import ValidationError

    from service.bundle import Manifest

    raw = json.loads((trained.folder / "manifest.json").read_text())
    served = min(s["max_parts"] for s in raw["strategies"])
    assert Manifest.model_validate(raw).item.max_letters <= served
    raw["item"]["max_letters"] = served + 1
    with pytest.raises(ValidationError) as caught:
        Manifest.model_validate(raw)
    message = str(caught.value)
    assert f"item.max_letters = {served + 1}" in message and f"max_parts = {served}" in message
