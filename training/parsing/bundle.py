"""Build the parser bundle (``budgetserve-train parser``) from the EWT treebank.

Data use, so that every number the bundle or the benchmark reports is on held-out
sentences: the parser is trained on ``train``; ``dev`` is split in two, the policies learn
from the first part (``policy_sentences``) and every operating point's UAS and ψ^Full share
are measured on the rest (``calibration``); ``test`` is left to the benchmark.

The bundle: ``weights.npy`` (float32 hashed edge weights), ``tagger.npy`` (the POS tagger's
float32 hashed weights, trained on ``train``, so tokens may be sent without tags; its tag
accuracy is measured on the calibration sentences) and one ``policy-*.npy`` per
learned point (float64 linear word policies), a JSON manifest naming them (no pickles, no
ONNX: the scorer is a gather-and-sum and the decoder Chu–Liu–Edmonds, both in
``service.strategies``), one extractor per (template, word position), their cost curves
measured here, and ``evaluation.json`` (training history, dev numbers).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from service.bundle import (
    AnyStrategy,
    CostPolynomial,
    ExtractorSpec,
    ItemSpec,
    Manifest,
    ParserPoint,
    ParserPolicy,
    ParserStrategy,
    TaggerSpec,
    write_manifest,
)
from service.extractors.parsing import (
    POLICY_FEATURES,
    LengthFilter,
    ParseLex,
    ParsePOS,
    ParseWords,
    Sentence,
)
from service.strategies.chu_liu_edmonds import chu_liu_edmonds
from training.bundles.writer import bundle_version, provenance, staging
from training.parsing.data import DEFAULT_DIR, Treebank, read_conllu, split_path, uas
from training.parsing.parser import ArcFactoredParser
from training.parsing.policies import (
    ParseProblem,
    Trajectory,
    filter_stats,
    fit_anytime_steps,
    fit_word_policy,
    greedy_trajectory,
    oneshot_words,
    parse_problems,
    parsimonious_labels,
)
from training.parsing.tagger import build_tagger, jackknifed
from training.profiling import fit_cost_polynomial

CLASS_WEIGHTS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
UNIFORM_P = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
MYOPIC_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.9)


@dataclass
class ParserBuildConfig:
    name: str = "ewt-parser"
    data_dir: Path = DEFAULT_DIR
    epochs: int = 5
    train_limit: int | None = None  # first N training sentences (None: all)
    max_tokens: int = 120
    buckets: int = 1 << 20
    policy_sentences: int = 1500
    calibration_limit: int | None = None  # dev sentences the points are measured on (None: rest)
    seed: int = 0
    weights: Path | None = None  # reuse trained edge weights (a float32 .npy) instead of training
    # Any CoNLL-U files (plain or gzip); None: the EWT split of that name in data_dir.
    train_file: Path | None = None
    dev_file: Path | None = None
    # Prune arcs longer than training saw for their (head tag, dependent tag, direction).
    length_filter: bool = False
    anytime_steps: int = 20  # Alg. 1's per-step policies (the last serves every later step)
    # A POS tagger in the bundle, so tokens may be sent without tags (training/parsing/tagger).
    tagger: bool = True
    tagger_epochs: int = 10
    tagger_weights: Path | None = None  # reuse an earlier build's tagger.npy
    # Train the parser on the tags the tagger predicts (jackknifed), not the gold ones.
    predicted_tags: bool = False

    def path(self, split: str) -> Path:
        chosen = {"train": self.train_file, "dev": self.dev_file}.get(split)
        return chosen if chosen is not None else split_path(split, self.data_dir)


def _uas_of(
    problems: Sequence[ParseProblem], choose: Callable[[ParseProblem], Any]
) -> tuple[float, float]:
    """(UAS, share of words given ψ^Full) when ``choose(problem)`` picks the ψ^Full words."""
    predicted, gold = [], []
    full = words = 0
    for p in problems:
        chosen = choose(p)
        state = p.full_mask(chosen)
        full += int(state.sum())
        words += p.n_parts
        predicted.append(p.scores.parse(state))
        gold.append(p.gold)
    return uas(predicted, gold), full / max(words, 1)


def _every_word(p: ParseProblem) -> list[int]:
    return list(range(1, p.n_parts + 1))


def _oneshot(p: ParseProblem, coef: np.ndarray) -> list[int]:
    return oneshot_words(p, coef)


def _myopic(p: ParseProblem, tau: float) -> list[int]:
    return _every_word(p) if p.margin() < tau else []


def _labels(problems: Sequence[ParseProblem], chosen: Sequence[Sequence[int]]) -> np.ndarray:
    y = []
    for p, words in zip(problems, chosen, strict=True):
        label = np.zeros(p.n_parts, dtype=bool)
        label[[w - 1 for w in words]] = True
        y.append(label)
    return np.concatenate(y)


def profile(
    sentences: Sequence[Sentence],
    weights: np.ndarray,
    max_tokens: int,
    buckets: int,
    length_filter: LengthFilter | None = None,
) -> dict[str, CostPolynomial]:
    """Median time per extraction of each template (per head word) and of scoring plus
    decoding, by sentence length, fitted as cost curves (ms). CPU time of this thread, not
    wall time: on a shared machine wall times carry the other jobs' load."""
    by: dict[str, tuple[list[float], list[float]]] = {
        k: ([], []) for k in ("words", "pos", "lex", "decode")
    }
    words = ParseWords(max_tokens=max_tokens)
    w64 = weights.astype(np.float64)
    for s in sentences:
        n = len(s)
        fresh = Sentence(s.forms, s.upos)
        t0 = time.thread_time()
        words.extract(fresh)
        by["words"][0].append(n)
        by["words"][1].append((time.thread_time() - t0) * 1e3)
        rows = []
        kept = np.ones(n + 1, dtype=bool) if length_filter is None else length_filter.heads(fresh)
        # words the filter leaves an arc (the others' templates are near-free and their
        # ψ^Lex is never acquired): the curves are those of the words that cost
        candidates = [w for w in (1 + n // 2, n, *range(1, n + 1)) if kept[w]]
        for word in (0, *candidates[:2]):
            for key, cls in (("pos", ParsePOS), ("lex", ParseLex)):
                plugin = cls(
                    word=word,
                    max_tokens=max_tokens,
                    buckets=buckets,
                    length_filter=None if length_filter is None else length_filter.flat(),
                )
                t0 = time.thread_time()
                vector = plugin.extract(fresh)
                by[key][0].append(n)
                by[key][1].append((time.thread_time() - t0) * 1e3)
                if key == "pos":
                    rows.append(vector)
        t0 = time.thread_time()
        matrix = np.full((n + 1, n + 1), -np.inf)
        for h in range(n + 1):
            ids = (
                rows[min(h, len(rows) - 1)].reshape(max_tokens + 1, -1)[1 : n + 1].astype(np.int64)
            )
            matrix[h, 1:] = np.where(ids[:, 0] >= 0, w64[ids].sum(axis=-1), -np.inf)
        chu_liu_edmonds(matrix + np.random.default_rng(n).normal(size=matrix.shape))
        by["decode"][0].append(n)
        by["decode"][1].append((time.thread_time() - t0) * 1e3)
    out = {}
    for key, (sizes, times) in by.items():
        out[key] = fit_cost_polynomial(sizes, times, quantile=0.5, max_degree=2)
    return out


def build_parser_bundle(
    out_dir: Path, config: ParserBuildConfig, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Train, choose and export; returns the evaluation written to ``evaluation.json``."""
    if config.predicted_tags and config.weights is not None:
        raise ValueError(
            "predicted tags train the parser, and the weights given would replace that "
            "training: drop --weights (or --predicted-tags)"
        )
    rng = np.random.default_rng(config.seed)
    train = read_conllu(
        config.path("train"), max_tokens=config.max_tokens, limit=config.train_limit
    )
    dev = read_conllu(config.path("dev"), max_tokens=config.max_tokens)
    order = rng.permutation(len(dev))
    policy_set = dev.subset(order[: config.policy_sentences])
    calib_set = dev.subset(order[config.policy_sentences :][: config.calibration_limit])
    if len(calib_set) == 0:
        raise ValueError("policy_sentences leaves no dev sentence to measure the points on")
    parser = ArcFactoredParser(buckets=config.buckets, epochs=config.epochs, seed=config.seed)
    if config.weights is None:
        log(f"parser: {len(train)} training sentences, {config.epochs} epochs")
        parser.fit(_with_predicted_tags(train, config, log) if config.predicted_tags else train)
    else:
        coef = np.load(config.weights, allow_pickle=False)
        if coef.shape != (config.buckets,) or coef.dtype != np.float32:
            raise ValueError(
                f"{config.weights} holds {coef.dtype} {coef.shape}; expected float32 "
                f"({config.buckets},): the weights.npy of a bundle built with these buckets"
            )
        log(f"parser: weights from {config.weights} (not retrained)")
        parser.coef_ = coef
        parser.history_ = []
    length_filter = (
        LengthFilter.learn(train.sentences, train.heads) if config.length_filter else None
    )
    policy_problems = parse_problems(parser, policy_set.sentences, policy_set.heads, length_filter)
    calib_problems = parse_problems(parser, calib_set.sentences, calib_set.heads, length_filter)

    log(f"pseudo-labels on {len(policy_problems)} dev sentences")
    trajectories: list[Trajectory] = [
        greedy_trajectory(p.n_parts, p.errors, p.candidates) for p in policy_problems
    ]
    trajectory_words = [[w + 1 for w in t.prefix(1e-3)] for t in trajectories]
    parsimonious_words = [
        [w + 1 for w in parsimonious_labels(p.n_parts, p.errors, p.candidates)]
        for p in policy_problems
    ]
    x = np.concatenate([p.features for p in policy_problems])
    files: dict[str, np.ndarray] = {"weights.npy": parser.coef_}
    strategies: list[AnyStrategy] = []
    evaluation: dict[str, Any] = {"history": parser.history_, "points": {}}
    tagger: TaggerSpec | None = None
    if config.tagger:  # its accuracy on the dev sentences the policies do not learn from
        files["tagger.npy"], accuracy = build_tagger(
            train.sentences,
            calib_set.sentences,
            config.tagger_epochs,
            config.seed,
            reuse=config.tagger_weights,
            log=log,
        )
        tagger = TaggerSpec(file="tagger.npy", accuracy=round(accuracy, 6))
        evaluation["tagger"] = {"accuracy": accuracy, "sentences": len(calib_set)}

    def learned(
        policy: ParserPolicy, name: str, labels: list[list[int]], weights: Sequence[float]
    ) -> list[ParserPoint]:
        y = _labels(policy_problems, labels)
        points = []
        for cw in weights:
            coef = fit_word_policy(x, y, cw, seed=config.seed)
            pid = f"{name}-cw{cw:g}"
            files[f"policy-{pid}.npy"] = coef
            if policy == "oneshot":
                score, share = _uas_of(calib_problems, partial(_oneshot, coef=coef))
            else:
                score, share = _uas_of(calib_problems, _every_word)
            points.append(
                ParserPoint(
                    id=pid,
                    policy_file=f"policy-{pid}.npy",
                    full_fraction=share,
                    uas=score,
                )
            )
            log(f"  {pid}: dev UAS {score:.4f}, ψ^Full share {share:.3f}")
        return points

    costs = profile(
        calib_set.sentences[:300], parser.coef_, config.max_tokens, config.buckets, length_filter
    )

    def strategy(name: str, policy: Any, points: list[ParserPoint]) -> None:
        strategies.append(
            ParserStrategy(
                name=name,
                policy=policy,
                weights="weights.npy",
                buckets=config.buckets,
                max_tokens=config.max_tokens,
                policy_features=POLICY_FEATURES,
                decode_cost=costs["decode"],
                points=points,
            )
        )
        evaluation["points"][name] = [p.model_dump() for p in points]

    strategy("oneshot", "oneshot", learned("oneshot", "traj", trajectory_words, CLASS_WEIGHTS))
    strategy(
        "oneshot-parsimonious",
        "oneshot",
        learned("oneshot", "pars", parsimonious_words, CLASS_WEIGHTS),
    )
    log(f"anytime: Alg. 1, up to {config.anytime_steps} per-step policies")
    steps = fit_anytime_steps(policy_problems, config.anytime_steps, seed=config.seed, log=log)
    files["policy-anytime.npy"] = steps
    score, share = _uas_of(calib_problems, _every_word)
    strategy(
        "anytime",
        "anytime",
        [
            ParserPoint(
                id=f"anytime-T{steps.shape[1]}",
                policy_file="policy-anytime.npy",
                full_fraction=share,
                uas=score,
            )
        ],
    )
    margins = np.asarray([p.margin() for p in policy_problems])
    myopic = []
    for frac in MYOPIC_FRACTIONS:
        tau = float(np.quantile(margins, frac))
        score, share = _uas_of(calib_problems, partial(_myopic, tau=tau))
        myopic.append(
            ParserPoint(id=f"myopic-q{frac:g}", threshold=tau, full_fraction=share, uas=score)
        )
    strategy("myopic", "myopic", myopic)
    for policy in ("uniform-word", "uniform-sentence"):
        points = []
        for prob in UNIFORM_P:
            draw = np.random.default_rng(config.seed)

            def choose(
                p: ParseProblem,
                q: float = prob,
                pol: str = policy,
                draw: np.random.Generator = draw,
            ) -> list[int]:
                if pol == "uniform-word":
                    return [int(i) + 1 for i in np.flatnonzero(draw.random(p.n_parts) < q)]
                return list(range(1, p.n_parts + 1)) if draw.random() < q else []

            score, share = _uas_of(calib_problems, choose)
            points.append(
                ParserPoint(
                    id=f"{policy}-p{prob:g}", threshold=prob, full_fraction=share, uas=score
                )
            )
        strategy(policy, policy, points)
    all_pos = _uas_of(calib_problems, lambda p: [])
    all_full = _uas_of(calib_problems, lambda p: list(range(1, p.n_parts + 1)))
    evaluation.update(
        {
            "dev_calibration_sentences": len(calib_problems),
            "dev_policy_sentences": len(policy_problems),
            "uas_all_pos_dev": all_pos[0],
            "uas_all_full_dev": all_full[0],
            "trajectory_mean_upgrades": float(np.mean([len(t) for t in trajectory_words])),
            "costs_ms": {k: v.coefficients for k, v in costs.items()},
            "length_filter": filter_stats(length_filter, calib_problems),
            "anytime_steps": int(steps.shape[1]),
        }
    )
    log(f"dev (calibration part): all ψ^POS UAS {all_pos[0]:.4f}, all ψ^Full {all_full[0]:.4f}")

    extractors = [
        ExtractorSpec(
            name="words",
            plugin=ParseWords.name,
            version=ParseWords.version,
            dims=config.max_tokens * POLICY_FEATURES,
            params={"max_tokens": config.max_tokens},
            cost=costs["words"],
        )
    ]
    for i in range(config.max_tokens + 1):
        for key, cls in (("pos", ParsePOS), ("lex", ParseLex)):
            if key == "lex" and i == 0:
                continue
            params: dict[str, Any] = {
                "word": i,
                "max_tokens": config.max_tokens,
                "buckets": config.buckets,
            }
            if length_filter is not None:
                params["length_filter"] = length_filter.flat()
            extractors.append(
                ExtractorSpec(
                    name=f"{key}@{i}",
                    plugin=cls.name,
                    version=cls.version,
                    dims=cls(**params).dims,
                    params=params,
                    cost=costs[key],
                )
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with staging(out_dir) as tmp:
        for file, array in files.items():
            np.save(tmp / file, array, allow_pickle=False)
        digest = b"".join((tmp / f).read_bytes() for f in sorted(files))
        manifest = Manifest(
            name=config.name,
            version=bundle_version(tmp, digest),
            task="parsing",
            cost_unit="ms",
            item=ItemSpec(
                kind="tokens", max_tokens=config.max_tokens, size_unit="tokens", tagger=tagger
            ),
            extractors=extractors,
            strategies=strategies,
            default_strategy="oneshot",
            provenance=provenance(
                f"{train.fingerprint}+{dev.fingerprint}",
                {
                    "epochs": config.epochs,
                    "train_sentences": len(train),
                    "buckets": config.buckets,
                    "max_tokens": config.max_tokens,
                    "policy_sentences": config.policy_sentences,
                    "seed": config.seed,
                    "length_filter": config.length_filter,
                    "anytime_steps": config.anytime_steps,
                    "tagger_epochs": config.tagger_epochs if config.tagger else None,
                    "parser_tags": "predicted" if config.predicted_tags else "gold",
                    "weights_from": None
                    if config.weights is None
                    else hashlib.sha256(config.weights.read_bytes()).hexdigest()[:16],
                },
            ),
        )
        write_manifest(tmp, manifest)
        (tmp / "evaluation.json").write_text(json.dumps(evaluation, indent=2) + "\n")
    return evaluation


def _with_predicted_tags(
    train: Treebank, config: ParserBuildConfig, log: Callable[[str], None]
) -> Treebank:
    tagged = jackknifed(train.sentences, epochs=config.tagger_epochs, seed=config.seed, log=log)
    return Treebank(tagged, train.heads, f"{train.fingerprint}:jackknifed-tags")
