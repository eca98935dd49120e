"""The linear chain against the brute-force oracle (every label sequence enumerated)."""

from __future__ import annotations

import numpy as np
import pytest

from service.strategies import chain_kernels
from service.strategies.chain import marginals_one, policy_inputs_v1, viterbi_one
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


def test_marginals_one_rescales_a_chain_whose_scores_could_underflow() -> None:
    """A chain whose scores spread over hundreds of nats takes the rescaled passes; they
    agree with the log-space batch."""
    rng = np.random.default_rng(3)
    chain = _chain(rng, 4)
    steep = ChainParams(chain.transition * 40, chain.start * 40, chain.end * 40)
    assert steep.spread * 5 >= 600  # the rescaled branch
    for length in (1, 2, 5):
        word = rng.normal(size=(length, 4)) * 20
        em, mask = pad([word])
        np.testing.assert_allclose(
            marginals_one(word, steep), marginals(em, mask, steep)[0], atol=1e-9
        )
        assert viterbi_one(word, steep).tolist() == viterbi(em, mask, steep)[0].tolist()


def _inputs_reference(x: np.ndarray, em: np.ndarray, chain: ChainParams) -> np.ndarray:
    """letters-v1 written plainly, one quantity after another (the oracle of the
    whole-word version)."""
    p = np.exp(em - em.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    top = -np.sort(-p, axis=1)
    entropy = -(p * np.log(np.maximum(p, 1e-300))).sum(axis=1)
    _, marg = zip(*[brute_force(em, chain)], strict=True)
    m = -np.sort(-marg[0], axis=1)
    prev_top = np.concatenate([[1.0], m[:-1, 0]])
    next_top = np.concatenate([m[1:, 0], [1.0]])
    extra = np.stack(
        [top[:, 0], top[:, 0] - top[:, 1], entropy, m[:, 0], m[:, 0] - m[:, 1], prev_top, next_top],
        axis=1,
    )
    return np.concatenate([x, extra], axis=1)


@pytest.mark.parametrize("length", [1, 2, 4])
def test_policy_inputs_v1_match_the_plain_recipe(length: int) -> None:
    rng = np.random.default_rng(length)
    chain = _chain(rng, 3)
    x = rng.random((length, 5)).astype(np.float32)
    em = rng.normal(size=(length, 3)) * 3
    got = policy_inputs_v1(x, em, chain)
    np.testing.assert_allclose(got, _inputs_reference(x, em, chain), rtol=1e-5, atol=1e-6)
    assert got.dtype == np.float32


# -- the compiled kernels the structured runtimes serve with (service.strategies.chain_kernels)


@pytest.mark.parametrize("labels", [2, 3, 5])
def test_compiled_viterbi_and_marginals_match_brute_force(labels: int) -> None:
    rng = np.random.default_rng(100 + labels)
    for _ in range(20):
        chain = _chain(rng, labels)
        word = rng.normal(size=(int(rng.integers(1, 6)), labels)) * 2
        truth, truth_marg = brute_force(word, chain)
        found, marg = chain_kernels.decode(word, chain)
        assert chain_kernels.viterbi(word, chain).tolist() == found.tolist() == truth.tolist()
        np.testing.assert_allclose(marg, truth_marg, atol=1e-9)


def test_compiled_kernels_match_the_numpy_ones_on_ocr_sized_words() -> None:
    """26 labels, words of 1 to 14 letters, a steep chain (hundreds of nats: the compiled
    pass always rescales) and exact ties (both take the lowest label)."""
    rng = np.random.default_rng(26)
    chain = _chain(rng, 26)
    steep = ChainParams(chain.transition * 40, chain.start * 40, chain.end * 40)
    for c in (chain, steep):
        for length in range(1, 15):
            word = rng.normal(size=(length, 26)) * 3
            labels, marg = chain_kernels.decode(word, c)
            assert chain_kernels.viterbi(word, c).tolist() == viterbi_one(word, c).tolist()
            assert labels.tolist() == viterbi_one(word, c).tolist()
            np.testing.assert_allclose(marg, marginals_one(word, c), atol=1e-9)
    flat = ChainParams(np.zeros((26, 26)), np.zeros(26), np.zeros(26))
    tied = np.zeros((4, 26))
    assert chain_kernels.viterbi(tied, flat).tolist() == viterbi_one(tied, flat).tolist() == [0] * 4


@pytest.mark.parametrize("length", [1, 2, 4, 9])
def test_compiled_policy_inputs_match_the_plain_recipe(length: int) -> None:
    rng = np.random.default_rng(length)
    chain = _chain(rng, 3)
    x = rng.random((length, 5)).astype(np.float32)
    em = rng.normal(size=(length, 3)) * 3
    marg, got = chain_kernels.s0_pass(x, em, chain)
    np.testing.assert_allclose(marg, marginals_one(em, chain), atol=1e-9)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, _inputs_reference(x, em, chain), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, policy_inputs_v1(x, em, chain), rtol=1e-6, atol=1e-6)


def test_compiled_kernels_refuse_an_empty_word() -> None:
    """They do not check bounds inside: the wrappers refuse a word of no parts."""
    chain = _chain(np.random.default_rng(0), 3)
    empty = np.zeros((0, 3))
    for call in (
        lambda: chain_kernels.viterbi(empty, chain),
        lambda: chain_kernels.decode(empty, chain),
        lambda: chain_kernels.s0_pass(np.zeros((0, 2), dtype=np.float32), empty, chain),
    ):
        with pytest.raises(ValueError, match="at least one part"):
            call()
