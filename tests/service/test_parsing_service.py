"""The parser bundle served over HTTP: held-out EWT sentences parsed through the real app,
each served decision (the words given ψ^Full, the tree) checked against the trained policy
recomputed here from the bundle's own files; limits and bad items answered with 4xx.

Why one module over 450 lines: every test serves the one parser bundle trained here from EWT
and the held-out sentences read once; a split would train it once per module.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from service.bundle import ParserStrategy, read_manifest
from service.cache import InProcessCache
from service.execution import DeclaredCost, ExtractorSource, run_session
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
    assert spec.points[0].id.startswith("anytime-T")  # Alg. 1's per-step policies
    assert coef.ndim == 2 and coef.shape[1] > 1
    # A budget that buys nothing: the session answers at once, still with a tree.
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


def test_tokens_without_tags_are_tagged_by_the_bundles_tagger(
    client: TestClient, parser_bundle_dir: Path, held_out: list[tuple[Sentence, np.ndarray]]
) -> None:
    """Raw tokens (no ``upos``) get the tree the parser gives the tags the bundle's tagger
    predicts, as if the client had sent those tags; tags sent with some tokens are kept."""
    from service.extractors.tagging import Tagger

    manifest = read_manifest(parser_bundle_dir)
    assert manifest.item.tagger is not None and manifest.item.tagger.accuracy is not None
    tagger = Tagger(np.load(parser_bundle_dir / manifest.item.tagger.file))
    wrong = 0
    for sentence, _ in held_out[:10]:
        raw = {"tokens": [{"form": f} for f in sentence.forms]}
        untagged = client.post(
            "/predict", json={"model": "ewt-parser", "budget": 10_000, "item": raw}
        )
        assert untagged.status_code == 200, untagged.text
        tags = tagger.tag(sentence.forms)
        wrong += sum(t != g for t, g in zip(tags, sentence.upos, strict=True))
        tagged = client.post("/predict", json=body(Sentence(sentence.forms, tags), 10_000.0))
        assert untagged.json()["prediction"] == tagged.json()["prediction"]
        assert untagged.json()["decision"]["upos"] == tags == tagged.json()["decision"]["upos"]
        assert untagged.json()["timings_ms"]["decode"] > 0
        # One gold tag sent, the rest predicted around it.
        given: list[str | None] = [None] * len(sentence)
        given[0] = sentence.upos[0]
        mixed = tagger.tag(sentence.forms, given)
        item = {
            "tokens": [
                {"form": f} if g is None else {"form": f, "upos": g}
                for f, g in zip(sentence.forms, given, strict=True)
            ]
        }
        served = client.post(
            "/predict", json={"model": "ewt-parser", "budget": 10_000, "item": item}
        )
        expected = client.post("/predict", json=body(Sentence(sentence.forms, mixed), 10_000.0))
        assert served.json()["prediction"] == expected.json()["prediction"]
    total = sum(len(s) for s, _ in held_out[:10])
    assert wrong < 0.25 * total, (wrong, total)  # a tagger, not noise (1,000 training sentences)


def test_a_bundle_without_a_tagger_asks_for_the_tags(
    parser_bundle_dir: Path, tmp_path: Path
) -> None:
    import json
    import shutil

    copy = tmp_path / "ewt-parser"
    shutil.copytree(parser_bundle_dir, copy)
    raw = json.loads((copy / "manifest.json").read_text())
    del raw["item"]["tagger"]
    (copy / "manifest.json").write_text(json.dumps(raw))
    settings = Settings(models_dir=tmp_path)
    item = {"tokens": [{"form": "I", "upos": "PRON"}, {"form": "saw"}, {"form": "it"}]}
    with TestClient(create_app(settings, cache=InProcessCache(1 << 20))) as c:
        response = c.post("/predict", json={"model": "ewt-parser", "budget": 50, "item": item})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert "2 token(s) have no 'upos' (item.tokens.1 first)" in error["message"]
    assert "no tagger" in error["message"] and error["details"]["tokens"] == [1, 2]


def test_a_tagger_file_of_the_wrong_shape_keeps_the_bundle_out(
    parser_bundle_dir: Path, tmp_path: Path
) -> None:
    import shutil

    copy = tmp_path / "ewt-parser"
    shutil.copytree(parser_bundle_dir, copy)
    np.save(copy / "tagger.npy", np.zeros((100, 17), dtype=np.float32))
    settings = Settings(models_dir=tmp_path)
    with TestClient(create_app(settings, cache=InProcessCache(1 << 20))) as c:
        listed = c.get("/models").json()
    text = json.dumps(listed)
    assert "item.tagger" in text and "buckets a power of two" in text, text


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


@pytest.fixture(scope="module")
def filtered_bundle_dir(parser_bundle_dir: Path) -> Path:
    """The same parser (its weights reused) with the length-dictionary filter."""
    from training.parsing.bundle import ParserBuildConfig, build_parser_bundle

    out = parser_bundle_dir.parent.parent / "filtered" / "ewt-parser"
    config = ParserBuildConfig(
        name="ewt-parser",
        data_dir=EWT,
        train_limit=1000,
        max_tokens=MAX_TOKENS,
        buckets=1 << 18,
        policy_sentences=120,
        calibration_limit=60,
        weights=parser_bundle_dir / "weights.npy",
        length_filter=True,
        anytime_steps=3,
    )
    build_parser_bundle(out, config, log=lambda _: None)
    return out


def test_the_length_filter_never_scores_a_pruned_arc(
    filtered_bundle_dir: Path, held_out: list[tuple[Sentence, np.ndarray]]
) -> None:
    """The filtered templates leave pruned arcs uncomputed (-1 ids), the served tree never
    takes one, and it is the tree the trainer parses with the same filter."""
    from service.extractors.parsing import LengthFilter
    from training.parsing.policies import oneshot_words, parse_problems

    manifest = read_manifest(filtered_bundle_dir)
    params = next(e.params for e in manifest.extractors if e.name == "pos@1")
    length_filter = LengthFilter.of(params["length_filter"])
    parser, spec = trained(filtered_bundle_dir, "oneshot")
    best = max(spec.points, key=lambda p: (p.uas, -p.full_fraction))
    coef = np.load(filtered_bundle_dir / str(best.policy_file))
    settings = Settings(models_dir=filtered_bundle_dir.parent)
    pruned = 0
    with TestClient(create_app(settings, cache=InProcessCache(1 << 24))) as client:
        for sentence, gold in held_out[:10]:
            n = len(sentence)
            deps = np.arange(1, n + 1)
            served = client.post("/predict", json=body(sentence, 10_000.0, "oneshot")).json()
            heads = np.asarray(served["decision"]["heads"])
            for d, h in zip(deps, heads, strict=True):
                assert length_filter.kept(sentence, int(h), np.asarray([d]))[0], (d, h)
            for h in range(n + 1):
                pruned += int((~length_filter.kept(sentence, h, deps)).sum())
            problem = parse_problems(parser, [sentence], [gold], length_filter)[0]
            assert heads.tolist() == problem.parse(oneshot_words(problem, coef))[1:].tolist()
    assert pruned > 0  # the filter pruned arcs in these sentences: the checks above bit


def test_the_length_filter_keeps_every_training_arc_and_the_roots() -> None:
    from service.extractors.parsing import LengthFilter, ParsePOS

    sentence = Sentence(
        ["I", "saw", "a", "friend", "today", "."], ["PRON", "VERB", "DET", "NOUN", "NOUN", "PUNCT"]
    )
    gold = np.asarray([-1, 2, 0, 4, 2, 2, 2])
    learned = LengthFilter.learn([sentence], [gold])
    deps = np.arange(1, 7)
    for d in deps:  # every training arc is kept
        assert learned.kept(sentence, int(gold[d]), np.asarray([d]))[0]
    assert learned.kept(sentence, 0, deps).all()  # the root may head any token
    # "friend" (NOUN) headed a DET one to its left: only that arc of its stays
    assert learned.kept(sentence, 4, deps).tolist() == [False, False, True, False, False, False]
    # a determiner heads nothing in training: no arc, no template to compute
    assert not learned.kept(sentence, 3, deps).any()
    assert learned.heads(sentence).tolist() == [True, False, True, False, True, False, False]
    pruned_word = ParsePOS(word=3, max_tokens=8, length_filter=learned.flat()).extract(sentence)
    assert (pruned_word == -1).all()
    rows = ParsePOS(word=4, max_tokens=8, length_filter=learned.flat()).extract(sentence)
    rows = rows.reshape(9, -1)
    assert (rows[[1, 2, 4, 5, 6]] == -1).all() and (rows[3] >= 0).all()
    with pytest.raises(ValueError, match="length_filter must be"):
        LengthFilter.of([1, 2, 3])


def session_parts(
    bundle_dir: Path, strategy: str, held_out: list[tuple[Sentence, np.ndarray]]
) -> tuple[Any, Any, Sentence, dict[str, float], float]:
    """The parser bundle, its ``strategy`` runtime, a held-out sentence, each template's
    predicted cost at its length and the decode's: what the session tests run a
    session on (with ``run_session``, outside the HTTP layer)."""
    from service.registry import load_bundle

    bundle = load_bundle(bundle_dir, 1 << 20)
    runtime = bundle.strategy(strategy)
    sentence, _ = held_out[2]
    n = len(sentence)
    decode = runtime.spec.decode_cost(n)  # type: ignore[attr-defined]
    return bundle, runtime, sentence, runtime.costs.at(n), decode


@pytest.mark.parametrize("strategy", ["anytime", "oneshot", "myopic"])
def test_no_acquisition_starts_that_the_budget_cannot_pay_with_the_decode(
    parser_bundle_dir: Path, strategy: str, held_out: list[tuple[Sentence, np.ndarray]]
) -> None:
    """Charged each template's predicted cost (no misprediction), a session never overruns:
    what it acquired plus the decode fits every budget, from nothing to everything."""
    bundle, runtime, sentence, per_feature, decode = session_parts(
        parser_bundle_dir, strategy, held_out
    )
    n = len(sentence)
    names = ["words", *(f"pos@{i}" for i in range(n + 1)), *(f"lex@{i}" for i in range(1, n + 1))]
    everything = sum(per_feature[name] for name in names) + decode
    sizes = set()
    for budget in np.linspace(0.0, everything, 80)[1:]:
        meter = DeclaredCost(per_feature)
        run = run_session(
            runtime, n, float(budget), {}, ExtractorSource(bundle.extractors, sentence), meter
        )
        if run.acquired:
            assert meter.spent() + decode <= budget + 1e-9, (budget, sorted(run.acquired))
        sizes.add(len(run.acquired))
    assert len(sizes) > 3  # budgets bought different amounts: the bound was tested


@pytest.mark.parametrize("strategy", ["anytime", "oneshot"])
def test_every_word_gets_its_pos_template_before_the_policy_inputs(
    parser_bundle_dir: Path, strategy: str, held_out: list[tuple[Sentence, np.ndarray]]
) -> None:
    """A budget that pays every word's ψ^POS and the decode but not the policy's inputs
    too: every word is parsed with ψ^POS (the inputs, bought first, left the last words
    without a template, and their arcs scored 0); with room for the inputs, the policy's
    time and an upgrade, they come next."""
    bundle, runtime, sentence, per_feature, decode = session_parts(
        parser_bundle_dir, strategy, held_out
    )
    n = len(sentence)
    pos = {f"pos@{i}" for i in range(n + 1)}
    base = sum(per_feature[name] for name in pos) + decode
    assert per_feature["words"] > 0.01
    for room, words in ((per_feature["words"] / 2, False), (2 * per_feature["words"], True)):
        budget = base + room
        if words:  # the inputs, the policy's time (none learnt yet) and one ψ^Lex
            budget += runtime.decide.at(n) + per_feature["lex@1"]
        run = run_session(
            runtime,
            n,
            budget,
            {},
            ExtractorSource(bundle.extractors, sentence),
            DeclaredCost(per_feature),
        )
        assert pos <= set(run.acquired), sorted(pos - set(run.acquired))
        assert ("words" in run.acquired) == words, sorted(run.acquired)


def test_the_policys_own_time_is_charged_before_the_next_template(
    parser_bundle_dir: Path,
    held_out: list[tuple[Sentence, np.ndarray]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A budget with room for every ψ^POS, the policy's inputs, the decode and 2 ms more
    (several ψ^Lex): with the policy taking 5 ms to score its inputs, nothing is left when
    it is done, and no ψ^Lex starts (priced with the time measured before the policy ran,
    upgrades started and the request overran by the policy's time)."""
    bundle, runtime, sentence, per_feature, decode = session_parts(
        parser_bundle_dir, "anytime", held_out
    )
    n = len(sentence)
    base = sum(per_feature[f"pos@{i}"] for i in range(n + 1)) + per_feature["words"] + decode
    assert 2 * per_feature["lex@1"] < 2.0

    def run(slow: bool) -> list[str]:
        if slow:
            scores = type(runtime).word_scores

            def slow_scores(self: Any, *args: Any) -> Any:
                time.sleep(0.005)
                return scores(self, *args)

            monkeypatch.setattr(type(runtime), "word_scores", slow_scores)
        source = ExtractorSource(bundle.extractors, sentence)
        done = run_session(runtime, n, base + 2.0, {}, source, DeclaredCost(per_feature))
        return [name for name in done.acquired if name.startswith("lex@")]

    assert run(slow=False), "2 ms buy upgrades"
    assert run(slow=True) == []


@pytest.mark.parametrize("strategy", ["anytime", "oneshot"])
def test_the_policys_inputs_are_bought_only_when_its_time_and_an_upgrade_follow(
    parser_bundle_dir: Path,
    strategy: str,
    held_out: list[tuple[Sentence, np.ndarray]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The runtime learns the policy's own CPU time from the requests it ran (5 ms here). A
    budget with room for every ψ^POS, the policy's inputs, the decode and 2 ms more (several
    ψ^Lex, were the policy free) then buys no inputs: bought, they would run a policy whose
    5 ms leave no upgrade, an overrun for nothing (the anytime parser's overruns beyond its
    bound on EWT: each bought the inputs, then the policy took 0.04-0.1 ms the budget no
    longer had). The answer is all ψ^POS, as it would have been. The estimate forgets with
    time, so one slow call does not price the inputs out for good (nothing would time the
    policy again)."""
    bundle, runtime, sentence, per_feature, decode = session_parts(
        parser_bundle_dir, strategy, held_out
    )
    n = len(sentence)
    base = sum(per_feature[f"pos@{i}"] for i in range(n + 1)) + per_feature["words"] + decode
    assert 2 * per_feature["lex@1"] < 2.0
    scores = type(runtime).word_scores

    def slow_scores(self: Any, *args: Any) -> Any:
        spin = time.thread_time() + 0.005  # 5 ms of this thread's CPU (a sleep has none)
        while time.thread_time() < spin:
            pass
        return scores(self, *args)

    def run(budget: float) -> list[str]:
        source = ExtractorSource(bundle.extractors, sentence)
        done = run_session(runtime, n, budget, {}, source, DeclaredCost(per_feature))
        return list(done.acquired)

    assert runtime.decide.at(n) == 0.0  # the loader's warm-up is forgotten
    assert "words" in run(base + 2.0)  # the policy is quick: its inputs are worth buying
    monkeypatch.setattr(type(runtime), "word_scores", slow_scores)
    assert "words" in run(1000.0)
    assert runtime.decide.at(n) >= 5.0
    acquired = run(base + 2.0)
    assert acquired == [f"pos@{i}" for i in range(n + 1)], acquired
    assert "words" in run(base + runtime.decide.at(n) + 2.0)  # room for its time: bought
    now = runtime.decide.clock()
    monkeypatch.setattr(runtime.decide, "clock", lambda: now + 20 * runtime.decide.half_life_s)
    assert "words" in run(base + 2.0)  # 20 half-lives on, without a sample in between


@pytest.mark.parametrize("strategy", ["anytime", "oneshot"])
def test_a_request_running_slower_than_predicted_prices_what_is_left_so(
    parser_bundle_dir: Path, strategy: str, held_out: list[tuple[Sentence, np.ndarray]]
) -> None:
    """Every acquisition charged twice its predicted cost (a loaded machine): the session
    learns the slowdown from its first acquisition and prices the rest, decode included, at
    it, so only that first acquisition, made before anything was measured, can overrun the
    budget. (Priced at the prediction alone, later acquisitions overran too.)"""
    bundle, runtime, sentence, per_feature, decode = session_parts(
        parser_bundle_dir, strategy, held_out
    )
    n = len(sentence)
    doubled = {name: 2.0 * cost for name, cost in per_feature.items()}
    everything = 2.0 * (sum(per_feature.values()) + decode)
    slowdowns, sizes = set(), set()
    for budget in np.linspace(0.0, everything, 80)[1:]:
        meter = DeclaredCost(doubled)
        run = run_session(
            runtime, n, float(budget), {}, ExtractorSource(bundle.extractors, sentence), meter
        )
        sizes.add(len(run.acquired))
        if len(run.acquired) > 1:
            assert meter.spent() + 2.0 * decode <= budget + 1e-9, (budget, len(run.acquired))
            slowdowns.add(round(run.session.slowdown, 6))  # type: ignore[attr-defined]
    # several plans of more than one acquisition, each priced after the slowdown was learned
    # (which sizes the grid meets depends on the cost curves calibrated on this machine)
    assert slowdowns == {2.0} and len(sizes - {0, 1}) >= 2, (slowdowns, sizes)
