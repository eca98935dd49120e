"""The parser bundle served over HTTP: held-out EWT sentences parsed through the real app,
each served decision (the words given ψ^Full, the tree) checked against the trained policy
recomputed here from the bundle's own files; limits and bad items answered with 4xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.bundle import ParserStrategy, read_manifest
from service.cache import InProcessCache
from service.extractors.parsing import Sentence
from service.http.app import create_app
from service.settings import Settings
from tests.conftest import SHARED

EWT = SHARED / "datasets" / "ud-english-ewt"
pytestmark = pytest.mark.skipif(
    not EWT.is_dir(),
    reason=(
        f"the shared EWT treebank is not beside this checkout ({EWT}: "
        "../shared/datasets/ud-english-ewt)"
    ),
)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def parser_bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from training.parsing.bundle import ParserBuildConfig, build_parser_bundle

    out = tmp_path_factory.mktemp("parser") / "ewt-parser"
    config = ParserBuildConfig(
        name="ewt-parser",
        data_dir=EWT,
        epochs=2,
        train_limit=1000,
        max_tokens=MAX_TOKENS,
        buckets=1 << 18,
        policy_sentences=200,
        calibration_limit=150,
    )
    build_parser_bundle(out, config, log=lambda _: None)
    return out


@pytest.fixture
def client(parser_bundle_dir: Path) -> Iterator[TestClient]:
    settings = Settings(models_dir=parser_bundle_dir.parent)
    with TestClient(create_app(settings, cache=InProcessCache(1 << 24))) as c:
        yield c


@pytest.fixture(scope="module")
def held_out() -> list[tuple[Sentence, np.ndarray]]:
    from training.parsing.data import read_split

    test = read_split("test", EWT, max_tokens=MAX_TOKENS)
    picked = np.random.default_rng(3).choice(len(test), size=25, replace=False)
    return [(test.sentences[i], test.heads[i]) for i in picked]


def body(sentence: Sentence, budget: float, strategy: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "ewt-parser",
        "budget": budget,
        "item": {
            "tokens": [
                {"form": f, "upos": u} for f, u in zip(sentence.forms, sentence.upos, strict=True)
            ]
        },
    }
    if strategy is not None:
        out["strategy"] = strategy
    return out


def trained(bundle_dir: Path, strategy: str) -> tuple[Any, ParserStrategy]:
    from training.parsing.parser import ArcFactoredParser

    spec = read_manifest(bundle_dir).strategy(strategy)
    assert isinstance(spec, ParserStrategy)
    parser = ArcFactoredParser(buckets=spec.buckets)
    parser.coef_ = np.load(bundle_dir / spec.weights)
    return parser, spec


def test_served_oneshot_decisions_equal_the_trained_policy(
    client: TestClient, parser_bundle_dir: Path, held_out: list[tuple[Sentence, np.ndarray]]
) -> None:
    from training.parsing.policies import oneshot_words, parse_problems

    parser, spec = trained(parser_bundle_dir, "oneshot")
    # With a budget this large the most accurate point on the calibration sentences serves.
    best = max(spec.points, key=lambda p: (p.uas, -p.full_fraction))
    coef = np.load(parser_bundle_dir / str(best.policy_file))
    upgraded = 0
    for sentence, gold in held_out:
        response = client.post("/predict", json=body(sentence, 10_000.0, "oneshot"))
        assert response.status_code == 200, response.text
        served = response.json()
        decision = served["decision"]
        assert served["answered_by"] == best.id and decision["point"] == best.id
        problem = parse_problems(parser, [sentence], [gold])[0]
        words = oneshot_words(problem, coef)
        heads = problem.parse(words)
        assert decision["policy_full"] == sorted(words)
        assert decision["heads"] == heads[1:].tolist()
        assert served["prediction"] == " ".join(str(h) for h in heads[1:])
        templates = ["full" if w in words else "pos" for w in range(1, len(sentence) + 1)]
        assert [t["template"] for t in decision["tokens"]] == templates
        matrix = problem.scores.matrix(problem.full_mask(words))
        scores = [t["score"] for t in decision["tokens"]]
        np.testing.assert_allclose(scores, matrix[heads[1:], np.arange(1, len(sentence) + 1)])
        assert served["cost"]["unit"] == "ms" and served["cost"]["spent"] > 0
        assert f"lex@{len(sentence) + 1}" not in served["cost"]["extracted"]
        assert {f"pos@{i}" for i in range(len(sentence) + 1)} <= set(served["cost"]["charged"])
        upgraded += len(words)
    assert upgraded > 0  # the policy upgraded some words: the check above covered ψ^Full


def test_anytime_upgrades_in_policy_order_and_answers_at_any_budget(
    client: TestClient, parser_bundle_dir: Path, held_out: list[tuple[Sentence, np.ndarray]]
) -> None:
    from training.parsing.policies import anytime_order, parse_problems

    parser, spec = trained(parser_bundle_dir, "anytime")
    coef = np.load(parser_bundle_dir / str(spec.points[0].policy_file))
    sentence, gold = held_out[0]
    problem = parse_problems(parser, [sentence], [gold])[0]
    rich = client.post("/predict", json=body(sentence, 10_000.0, "anytime")).json()
    # Unlimited time: every word upgraded, in the policy's order, and the all-ψ^Full tree.
    order = anytime_order(problem, coef)
    lex = [f for f in rich["cost"]["extracted"] if f.startswith("lex@")]
    assert lex == [f"lex@{w}" for w in order]
    assert (
        rich["decision"]["heads"] == problem.parse(list(range(1, len(sentence) + 1)))[1:].tolist()
    )
    # A budget already spent: the serving loop's fallback still answers with a tree.
    poor = client.post("/predict", json=body(sentence, 1e-6, "anytime"))
    assert poor.status_code == 200, poor.text
    heads = poor.json()["decision"]["heads"]
    assert len(heads) == len(sentence) and poor.json()["deadline_exceeded"]


@pytest.mark.parametrize("strategy", ["myopic", "uniform-word", "uniform-sentence"])
def test_baseline_policies_serve_trees(
    client: TestClient, strategy: str, held_out: list[tuple[Sentence, np.ndarray]]
) -> None:
    sentence, _ = held_out[1]
    response = client.post("/predict", json=body(sentence, 10_000.0, strategy))
    assert response.status_code == 200, response.text
    decision = response.json()["decision"]
    heads = decision["heads"]
    assert len(heads) == len(sentence) and heads.count(0) == 1
    assert {t["template"] for t in decision["tokens"]} <= {"pos", "full"}


@pytest.mark.parametrize(
    ("item", "status", "mentions"),
    [
        ({"tokens": [{"form": "a", "upos": "DET"}] * (MAX_TOKENS + 1)}, 413, "limit is 40"),
        ({"tokens": []}, 422, "item.tokens"),
        ({"tokens": [{"form": "a", "upos": "DT"}]}, 422, "item.tokens.0.upos = 'DT'"),
        ({"tokens": [{"upos": "DET"}]}, 422, "item.tokens.0.form"),
        ({"tokens": [{"form": "a", "upos": "DET", "lemma": "a"}]}, 422, "lemma"),
        ({"words": ["a"]}, 422, "tokens"),
        ("a sentence", 422, "'tokens'"),
    ],
)
def test_bad_sentences_get_a_clear_4xx(
    client: TestClient, item: Any, status: int, mentions: str
) -> None:
    response = client.post("/predict", json={"model": "ewt-parser", "budget": 50, "item": item})
    assert response.status_code == status, response.text
    assert mentions in response.text


@pytest.mark.parametrize(
    "strategy", ["oneshot", "anytime", "myopic", "uniform-word", "uniform-sentence"]
)
def test_the_point_chosen_is_the_most_accurate_whose_planned_cost_fits(
    parser_bundle_dir: Path, strategy: str
) -> None:
    # Oracle: price every point as its session plans it (only one-shot and anytime read the
    # policy's `words` features), keep those within the budget, take the most accurate. The
    # runtime's choice must be that point: it once priced `words` for every policy, so the
    # baselines chose below what they could afford.
    from service.registry import load_bundle
    from service.strategies.parsing import ParserRuntime, ParserSession

    runtime = load_bundle(parser_bundle_dir, 1 << 20).strategy(strategy)
    assert isinstance(runtime, ParserRuntime)
    checked = 0
    for n in (5, 20, MAX_TOKENS):
        per_feature = runtime.costs.at(n)
        priced = [(ParserSession(runtime, p, n, per_feature).planned, p) for p in runtime.points]
        for cost, _ in priced:
            for budget in (cost * 0.999, cost, cost * 1.001):
                chosen = runtime.choose(n, budget, per_feature)
                fits = [p for c, p in priced if c <= budget]
                if fits:
                    assert chosen.uas == max(p.uas for p in fits), (n, budget)
                    assert ParserSession(runtime, chosen, n, per_feature).planned <= budget
                    checked += 1
                else:
                    assert chosen.full_fraction == min(p.full_fraction for p in runtime.points)
    assert checked > 0


def test_a_manifest_accepting_longer_sentences_than_its_parser_serves_is_refused(
    parser_bundle_dir: Path,
) -> None:
    import json

    from pydantic import ValidationError

    from service.bundle import Manifest

    raw = json.loads((parser_bundle_dir / "manifest.json").read_text())
    assert Manifest.model_validate(raw).item.max_tokens == MAX_TOKENS
    raw["item"]["max_tokens"] = MAX_TOKENS + 1
    with pytest.raises(ValidationError) as caught:
        Manifest.model_validate(raw)
    assert f"item.max_tokens = {MAX_TOKENS + 1}" in str(caught.value)


def test_duplicate_parser_point_ids_are_refused(parser_bundle_dir: Path) -> None:
    # The runtime keys its policies by point id: a repeat would silently replace one.
    import json

    from pydantic import ValidationError

    from service.bundle import Manifest

    raw = json.loads((parser_bundle_dir / "manifest.json").read_text())
    strategy = next(s for s in raw["strategies"] if len(s["points"]) > 1)
    strategy["points"][1]["id"] = strategy["points"][0]["id"]
    with pytest.raises(ValidationError) as caught:
        Manifest.model_validate(raw)
    assert "duplicate point ids" in str(caught.value)
