"""The parser's decoder against brute force, its templates against the serving plugins, and
the perceptron against a trivial baseline on held-out EWT sentences."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from service.extractors import parsing
from service.extractors.hashed import hash_template
from service.extractors.parsing import (
    LEX_FEATURES,
    POS_FEATURES,
    UPOS,
    ParseLex,
    ParsePOS,
    Sentence,
    lex_features,
    pos_features,
)
from service.strategies.chu_liu_edmonds import chu_liu_edmonds, tree_score

EWT = Path(__file__).resolve().parents[3].parent / "shared" / "datasets" / "ud-english-ewt"


def is_tree(heads: np.ndarray) -> bool:
    n = len(heads) - 1
    for d in range(1, n + 1):
        v, steps = d, 0
        while v != 0 and steps <= n:
            v = int(heads[v])
            steps += 1
        if v != 0:
            return False
    return bool(heads[0] == -1)


def brute_force(scores: np.ndarray, single_root: bool) -> float:
    """The best tree's score, every head assignment enumerated."""
    n = scores.shape[0] - 1
    best = -np.inf
    for assignment in itertools.product(range(n + 1), repeat=n):
        heads = np.asarray([-1, *assignment])
        if any(heads[d] == d for d in range(1, n + 1)):
            continue
        if single_root and int((heads[1:] == 0).sum()) != 1:
            continue
        if is_tree(heads):
            best = max(best, tree_score(scores, heads))
    return best


def fewest_roots(scores: np.ndarray) -> tuple[int, float]:
    """(fewest root children of a finite tree, the best such tree's score), enumerated."""
    n = scores.shape[0] - 1
    best: tuple[int, float] = (n + 1, -np.inf)
    for assignment in itertools.product(range(n + 1), repeat=n):
        heads = np.asarray([-1, *assignment])
        if any(heads[d] == d for d in range(1, n + 1)) or not is_tree(heads):
            continue
        score = tree_score(scores, heads)
        if not np.isfinite(score):
            continue
        roots = int((heads[1:] == 0).sum())
        if roots < best[0] or (roots == best[0] and score > best[1]):
            best = (roots, score)
    return best


@pytest.mark.parametrize("single_root", [True, False])
def test_chu_liu_edmonds_matches_brute_force(single_root: bool) -> None:
    rng = np.random.default_rng(7)
    for _ in range(150):
        n = int(rng.integers(1, 6))
        # Integer scores make ties common: the decoder must still reach the optimum.
        scores = rng.integers(-3, 4, size=(n + 1, n + 1)).astype(np.float64)
        if rng.random() < 0.5:
            scores = rng.normal(size=(n + 1, n + 1)) * 10
        heads = chu_liu_edmonds(scores, single_root=single_root)
        assert is_tree(heads)
        if single_root:
            assert int((heads[1:] == 0).sum()) == 1
        assert tree_score(scores, heads) == pytest.approx(brute_force(scores, single_root))


@pytest.mark.parametrize("single_root", [True, False])
def test_chu_liu_edmonds_never_takes_a_pruned_arc(single_root: bool) -> None:
    """Arcs of -inf (pruned by the length filter) are never in the tree while the root's
    arcs keep every token reachable; the tree is still the best of the others."""
    rng = np.random.default_rng(11)
    for _ in range(150):
        n = int(rng.integers(2, 6))
        scores = rng.normal(size=(n + 1, n + 1)) * 5
        pruned = rng.random((n + 1, n + 1)) < 0.6
        pruned[0] = False  # the root's arcs stay
        scores[pruned] = -np.inf
        heads = chu_liu_edmonds(scores, single_root=single_root)
        assert is_tree(heads)
        assert np.isfinite(tree_score(scores, heads))
        if not single_root:
            assert tree_score(scores, heads) == pytest.approx(brute_force(scores, False))
            continue
        # the best tree of finite arcs with the fewest root children (one when there is one)
        fewest = fewest_roots(scores)
        assert int((heads[1:] == 0).sum()) == fewest[0]
        assert tree_score(scores, heads) == pytest.approx(fewest[1])


def test_chu_liu_edmonds_finds_non_projective_trees() -> None:
    # 1 → 3 and 2 → 4 cross; the decoder is not restricted to projective trees.
    n = 4
    scores = np.full((n + 1, n + 1), -5.0)
    for h, d in ((0, 1), (1, 3), (1, 2), (2, 4)):
        scores[h, d] = 5.0
    heads = chu_liu_edmonds(scores)
    assert heads.tolist() == [-1, 0, 1, 1, 2]


def test_chu_liu_edmonds_refuses_a_non_square_matrix() -> None:
    with pytest.raises(ValueError, match="n\\+1"):
        chu_liu_edmonds(np.zeros((3, 4)))


def test_plugins_compute_the_training_templates() -> None:
    sentence = Sentence(
        ["The", "cat", "sat", "on", "the", "mat", "."],
        ["DET", "NOUN", "VERB", "ADP", "DET", "NOUN", "PUNCT"],
    )
    n = len(sentence)
    heads = np.arange(n + 1)
    deps = np.arange(1, n + 1)
    pos = pos_features(sentence, heads, deps)
    lex = lex_features(sentence, heads, deps)
    assert pos.shape == (n + 1, n, POS_FEATURES) and lex.shape == (n + 1, n, LEX_FEATURES)
    for word in range(n + 1):
        for cls, batch in ((ParsePOS, pos), (ParseLex, lex)):
            plugin = cls(word=word, max_tokens=10)
            vector = plugin.extract(Sentence(sentence.forms, sentence.upos))
            rows = vector.reshape(11, -1)
            assert plugin.dims == vector.shape[0]
            np.testing.assert_array_equal(rows[1 : n + 1].astype(np.int64), batch[word])
            assert (rows[0] == -1).all() and (rows[n + 1 :] == -1).all()
    # Lexical features read the forms; POS ones do not.
    other = Sentence(["A", "dog", "ran", "in", "a", "park", "!"], sentence.upos)
    assert (pos_features(other, heads, deps) == pos).all()
    assert (lex_features(other, heads, deps) != lex).any()


@pytest.mark.parametrize("table", ["pos", "lex"])
def test_templates_computed_together_equal_each_template_hashed_alone(table: str) -> None:
    """The vectorised templates (one array of edges x templates, mixed part by part) give
    every template's ids exactly as :func:`hash_template` defines them, for any heads, dependents
    and bucket count: the bundles' weights are indexed by these ids."""
    templates = parsing._POS if table == "pos" else parsing._LEX
    features = pos_features if table == "pos" else lex_features
    rng = np.random.default_rng(11)
    words = ["the", "Cat", "sat", ".", "on", "a", "mat", "and", "ran", ",", "quickly"]
    for trial in range(60):
        n = int(rng.integers(1, 30))
        sentence = Sentence(
            [words[i] for i in rng.integers(0, len(words), n)],
            [UPOS[i] for i in rng.integers(0, len(UPOS), n)],
        )
        heads = np.arange(n + 1) if trial % 2 else rng.integers(0, n + 1, 3)
        deps = np.sort(rng.choice(np.arange(1, n + 1), int(rng.integers(1, n + 1)), replace=False))
        buckets = (1 << 20, 1 << 12, 2)[trial % 3]
        e = parsing._Edges(sentence, heads, deps)
        verbs, punct, conj = parsing._between_counts(sentence, e)
        forms = sentence.form_ids
        values = {
            **e.tags,
            **{"verbs": verbs, "punct": punct, "conj": conj},
            **{"hw": forms[e.hh + 1], "hw_l": forms[e.hh], "hw_r": forms[e.hh + 2]},
            **{"dw": forms[e.dd + 1], "dw_l": forms[e.dd], "dw_r": forms[e.dd + 2]},
        }
        expected = np.stack(
            [
                hash_template(code, [values[p] for p in parts], e.shape, buckets - 1)
                for code, parts in templates.templates
            ],
            axis=-1,
        )
        np.testing.assert_array_equal(features(sentence, heads, deps, buckets), expected)


def test_templates_refuse_what_they_cannot_serve() -> None:
    with pytest.raises(ValueError, match="unknown UPOS"):
        Sentence(["x"], ["NOPE"])
    with pytest.raises(ValueError, match="power of two"):
        ParsePOS(word=0, max_tokens=5, buckets=1000)
    with pytest.raises(ValueError, match="max_tokens"):
        ParsePOS(word=0, max_tokens=5).extract(Sentence(["a"] * 6, ["X"] * 6))


@pytest.mark.skipif(
    not EWT.is_dir(),
    reason=(
        f"the shared EWT treebank is not beside this checkout ({EWT}: "
        "../shared/datasets/ud-english-ewt)"
    ),
)
def test_perceptron_beats_the_adjacent_baseline_on_held_out_sentences() -> None:
    from training.parsing.data import read_split, uas
    from training.parsing.parser import ArcFactoredParser

    train = read_split("train", EWT).subset(np.arange(400))
    dev = read_split("dev", EWT).subset(np.arange(150))
    parser = ArcFactoredParser(buckets=1 << 18, epochs=3, seed=1).fit(train)
    assert parser.coef_.shape == (1 << 18,) and parser.coef_.dtype == np.float32
    results = {}
    for name, value in (("pos", False), ("full", True)):
        predicted = []
        for s in dev.sentences:
            full = np.full(len(s) + 1, value)
            full[0] = False
            heads = parser.parse(s, full)
            assert is_tree(heads)
            predicted.append(heads)
        results[name] = uas(predicted, dev.heads)
    # Every word attached to its left neighbour (the first to the root).
    adjacent = uas([np.arange(-1, len(s)) for s in dev.sentences], dev.heads)
    assert results["pos"] > adjacent + 0.2, (results, adjacent)
    assert results["full"] > adjacent + 0.2, (results, adjacent)
