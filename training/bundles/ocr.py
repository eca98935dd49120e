"""The OCR bundle (paper 004): measured template costs, the chain, one-shot and anytime
policies, exported as ONNX emission and policy scorers plus one manifest.

``budgetserve-train ocr`` calls :func:`build_ocr_bundle`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from service.bundle import (
    CostPolynomial,
    ExtractorSpec,
    ItemSpec,
    Manifest,
    ModelSpec,
    StructuredAnytimeStrategy,
    StructuredOneShotStrategy,
    StructuredOperatingPoint,
    StructuredTemplate,
    write_manifest,
)
from service.chain import marginals, policy_inputs_v1, viterbi
from service.extractors.letters import LetterHOG, LetterPixels
from training.bundles.writer import bundle_version, provenance, staging
from training.export.structured import linear_onnx, verify_linear
from training.structured.ocr import LETTERS, OcrData, load_ocr, word_problem
from training.structured.ocr_train import OcrTraining, train_ocr
from training.structured.policies import LinearScorer

F32 = npt.NDArray[np.float32]
MAX_LETTERS = 14


def profile_templates(data: OcrData, letters: int = 400, repeats: int = 3) -> dict[str, float]:
    """Median µs of each template's extractor on one letter (the plugins themselves)."""
    word = data.letters[:letters].astype(np.float32)
    out = {}
    for name, cls in (("pixels", LetterPixels), ("hog", LetterHOG)):
        times = []
        extractors = [cls(position=p) for p in range(letters)]
        for _ in range(repeats):
            for e in extractors:
                t0 = time.perf_counter()
                e.extract(word)
                times.append(time.perf_counter() - t0)
        out[name] = float(np.median(times) * 1e6)
    return out


def profile_decode(train: OcrTraining, data: OcrData, words: int = 200) -> float:
    """Median µs per letter of what a request does besides extracting: the policy inputs
    (one forward-backward), two scorer products, Viterbi and marginals."""
    chain = train.chain
    per_letter = []
    for w in train.test_words[:words]:
        sl = data.word(w)
        x = [f[sl] for f in train.features]
        t0 = time.perf_counter()
        contrib = [
            xk.astype(np.float64) @ wk + uk
            for xk, wk, uk in zip(x, chain.weights, chain.offsets_k, strict=True)
        ]
        em0 = chain.base[None, :] + contrib[0]
        inputs = policy_inputs_v1(x[0], em0, chain.chain)
        train.anytime.scorer.scores(inputs)
        em = (em0 + contrib[1])[None]
        mask = np.ones((1, len(x[0])), dtype=bool)
        viterbi(em, mask, chain.chain)
        marginals(em, mask, chain.chain)
        per_letter.append((time.perf_counter() - t0) / len(x[0]))
    return float(np.median(per_letter) * 1e6)


@dataclass
class OcrBundleReport:
    out: Path
    costs_us: dict[str, float]
    decode_us: float
    summary: dict[str, Any]
    parity: dict[str, float]


def _fingerprint(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _accuracy(problem: Any, states: list[npt.NDArray[np.bool_]]) -> float:
    n = sum(len(y) for y in problem.labels)
    wrong = problem.losses(list(range(problem.n_examples)), states, soft=False).sum()
    return float(1.0 - wrong / n)


def build_ocr_bundle(
    out_dir: Path,
    data_path: Path,
    *,
    chain_words: int | None = None,
    policy_words: int = 1500,
    max_iter: int = 150,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> OcrBundleReport:
    say = log or (lambda _m: None)
    data = load_ocr(data_path)
    costs_us = profile_templates(data)
    say(f"template costs (µs per letter, median): {costs_us}")
    train = train_ocr(
        data,
        costs_us,
        chain_words=chain_words,
        policy_words=policy_words,
        max_iter=max_iter,
        seed=seed,
        log=say,
    )
    decode_us = profile_decode(train, data)
    say(f"decode + policy: {decode_us:.1f} µs per letter")
    return write_ocr_bundle(out_dir, data, data_path, train, costs_us, decode_us)


def write_ocr_bundle(
    out_dir: Path,
    data: OcrData,
    data_path: Path,
    train: OcrTraining,
    costs_us: dict[str, float],
    decode_us: float,
) -> OcrBundleReport:
    chain = train.chain
    problem = train.policy_problem
    assert problem is not None
    ts = train.templates
    n = problem.n_examples
    parts = [problem.parts(i) for i in range(n)]
    acc_template = {
        name: _accuracy(problem, [np.tile(np.arange(len(ts)) == k, (m, 1)) for m in parts])
        for k, name in enumerate(ts.names)
    }
    acc_full = _accuracy(problem, [ts.full(m) for m in parts])
    # the one-shot points, on the policy words (cross-fitted chain)
    points = []
    letters_total = sum(parts)
    one_shot_scorer = LinearScorer.stack([p.scorer for p in train.one_shot])
    for j, policy in enumerate(train.one_shot):
        states = [policy.state(problem.policy_inputs(i), ts) for i in range(n)]
        extra = sum(float(s[:, ts.optional].sum(axis=0) @ ts.costs[ts.optional]) for s in states)
        points.append(
            StructuredOperatingPoint(
                lam=policy.lam,
                positive_weight=policy.positive_weight,
                column=j,
                mean_cost=extra / letters_total / 1000.0,
                train_accuracy=_accuracy(problem, states),
            )
        )
    # parity rows: held-out letters and words
    test_rows = np.concatenate(
        [np.arange(*data.word(w).indices(len(data.labels)))[:3] for w in train.test_words[:200]]
    )
    parity: dict[str, float] = {}
    test_problem = word_problem(chain, data, train.features, train.test_words[:200], ts)
    test_inputs = np.concatenate(test_problem.inputs)
    prior = np.bincount(data.labels, minlength=26).astype(np.float64)
    prior /= prior.sum()
    with staging(out_dir) as tmp:
        templates = []
        models = []
        for k, name in enumerate(ts.names):
            blob = linear_onnx(chain.weights[k], chain.offsets_k[k])
            x = train.features[k][test_rows]
            parity[f"emission-{name}"] = verify_linear(
                blob,
                x.astype(np.float64) @ chain.weights[k] + chain.offsets_k[k],
                x,
                what=f"emission-{name}",
            )
            (tmp / f"emission_{name}.onnx").write_bytes(blob)
            models.append(
                ModelSpec(
                    id=f"emission-{name}",
                    features=[f"{name}@0"],
                    accuracy=acc_template[name],
                    file=f"emission_{name}.onnx",
                    input_dims=int(x.shape[1]),
                )
            )
            templates.append(
                StructuredTemplate(
                    name=name,
                    base=bool(ts.templates[k].base),
                    cost=costs_us[name] / 1000.0,
                    model=f"emission-{name}",
                )
            )
        models.append(
            ModelSpec(
                id="chain", features=[], accuracy=acc_full, prior=prior.tolist(), input_dims=0
            )
        )
        policies = {"oneshot": one_shot_scorer, "anytime": train.anytime.scorer}
        for key, scorer in policies.items():
            st = scorer.standardiser
            blob = linear_onnx(scorer.weight, scorer.bias, st.mean, st.scale)
            parity[f"policy-{key}"] = verify_linear(
                blob, scorer.scores(test_inputs), test_inputs, what=f"{key} policy"
            )
            (tmp / f"policy_{key}.onnx").write_bytes(blob)
        common: dict[str, Any] = {
            "templates": templates,
            "base": chain.base.tolist(),
            "transition": chain.chain.transition.tolist(),
            "start": chain.chain.start.tolist(),
            "end": chain.chain.end.tolist(),
            "answer_model": "chain",
            "policy_input_dims": int(test_inputs.shape[1]),
            "decode_cost": decode_us / 1000.0,
            "max_parts": MAX_LETTERS,
        }
        one_shot = StructuredOneShotStrategy(
            policy_file="policy_oneshot.onnx",
            subsets=[[ts.names[k] for k in s] for s in ts.subsets()],
            points=points,
            **common,
        )
        anytime = StructuredAnytimeStrategy(
            policy_file="policy_anytime.onnx",
            optional=[ts.names[k] for k in ts.optional],
            steps=train.anytime.steps,
            **common,
        )
        extractors = [
            ExtractorSpec(
                name=f"{name}@{p}",
                plugin=f"letter_{name}",
                version="1",
                dims=int(train.features[k].shape[1]),
                params={"position": p},
                cost=CostPolynomial(coefficients=[costs_us[name] / 1000.0], quantile=0.5),
            )
            for p in range(MAX_LETTERS)
            for k, name in enumerate(ts.names)
        ]
        params = {"summary": train.summary(), "costs_us": costs_us, "decode_us": decode_us}
        manifest = Manifest(
            name="ocr",
            version=bundle_version(tmp, json.dumps(params, sort_keys=True).encode()),
            classes=LETTERS,
            item=ItemSpec(kind="letters", max_letters=MAX_LETTERS, size_unit="letters"),
            extractors=extractors,
            models=models,
            strategies=[one_shot, anytime],
            default_strategy=one_shot.name,
            provenance=provenance(_fingerprint(data_path), params),
        )
        write_manifest(tmp, manifest)
        (tmp / "verification.json").write_text(
            json.dumps({"parity_max_rel_error": parity}, indent=2) + "\n"
        )
    return OcrBundleReport(out_dir, costs_us, decode_us, train.summary(), parity)
