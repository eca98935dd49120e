"""The linear chain against the brute-force oracle (every label sequence enumerated)."""

from __future__ import annotations

import numpy as np
import pytest

from service.chain import marginals_one, viterbi_one
from training.structured.chain import ChainParams, brute_force, marginals, pad, viterbi


def _chain(rng: np.random.Generator, labels: int) -> ChainParams:
    return ChainParams(
        rng.normal(size=(labels, labels)) * 2, rng.normal(size=labels), rng.normal(size=labels)
    )


@pytest.mark.parametrize("labels", [2, 3, 5])
def test_viterbi_and_marginals_match_brute_force_on_short_words(labels: int) -> None:
    rng = np.random.default_rng(labels)
    for _ in range(20):
        chain = _chain(rng, labels)
        words = [rng.normal(size=(int(rng.integers(1, 6)), labels)) * 2 for _ in range(4)]
        em, mask = pad(words)
        best = viterbi(em, mask, chain)
        marg = marginals(em, mask, chain)
        for row, word in enumerate(words):
            truth, truth_marg = brute_force(word, chain)
            n = len(word)
            assert best[row, :n].tolist() == truth.tolist()
            assert (best[row, n:] == -1).all()
            np.testing.assert_allclose(marg[row, :n], truth_marg, atol=1e-9)
            assert viterbi_one(word, chain).tolist() == truth.tolist()
            np.testing.assert_allclose(marginals_one(word, chain), truth_marg, atol=1e-9)


def test_padding_does_not_change_a_word() -> None:
    rng = np.random.default_rng(7)
    chain = _chain(rng, 4)
    word = rng.normal(size=(3, 4))
    alone = viterbi(*pad([word]), chain)[0]
    padded = viterbi(*pad([word], width=6), chain)[0]
    assert alone.tolist() == padded[:3].tolist()
