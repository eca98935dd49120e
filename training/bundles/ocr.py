"""The OCR bundle (paper 004): measured template costs, the chain, one-shot and anytime
policies, exported as ONNX emission and policy scorers plus one manifest.

``budgetserve-train ocr`` calls :func:`build_ocr_bundle`.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
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
    StopPoint,
    StructuredAnytimeStrategy,
    StructuredOneShotStrategy,
    StructuredOperatingPoint,
    StructuredTemplate,
    write_manifest,
)
from service.execution import ExtractorSource, MeasuredCost, run_session
from service.extractors.letters import LetterHOG, LetterPixels
from service.registry import CalibrationSettings, load_bundle
from training.bundles.writer import bundle_version, provenance, staging
from training.export.structured import linear_onnx, verify_linear
from training.structured.ocr import LETTERS, OcrData, load_ocr, word_problem
from training.structured.ocr_train import (
    DEFAULT_LAMBDAS,
    DEFAULT_POSITIVE_WEIGHTS,
    OcrTraining,
    train_ocr,
)
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


@dataclass(frozen=True)
class ServedOverhead:
    """What a served request spends per letter besides extracting templates, in µs (medians
    over words): ``policy_us`` the policy (its inputs with one forward-backward, its
    scorer), ``decode_us`` the rest (the request loop, the emission scorers, Viterbi and the
    marginals): what the runtimes reserve. ``answer_us`` is the decoding alone (the session's
    ``decode``: the emission scorers, Viterbi and the marginals, the whole word at once), so
    ``decode_us - answer_us`` is the request loop's bookkeeping. ``per_word`` keeps every
    word's (letters, policy µs, rest µs)."""

    policy_us: float
    decode_us: float
    per_word: tuple[tuple[int, float, float], ...] = ()
    answer_us: float = 0.0

    @property
    def total_us(self) -> float:
        return self.policy_us + self.decode_us


def profile_served(
    folder: Path, data: OcrData, words: Sequence[int], repeats: int = 2
) -> ServedOverhead:
    """Measure :class:`ServedOverhead` on the bundle in ``folder`` as the service runs it:
    each structured runtime through the request loop (``run_session`` on the bundle's
    extractor plugins, then ``decode``) with a budget that buys every template its policy
    picks (the most decoding work), timed in wall time like a request. The policy's time
    is the session's own ``policy_ms``; the rest is the total less the extractions and
    the policy. Median per letter over ``words`` (training words: timing only)."""
    bundle = load_bundle(folder, 1 << 22, CalibrationSettings(enabled=False))
    runtimes = [bundle.strategy(s.name) for s in bundle.manifest.strategies]
    samples: list[tuple[int, float, float]] = []
    answers: list[float] = []
    for _ in range(repeats):
        for w in words:
            letters = np.ascontiguousarray(data.letters[data.word(w)], dtype=np.float32)
            size = len(letters)
            for runtime in runtimes:
                start = time.perf_counter()
                meter = MeasuredCost(start, bundle.calibrator, size)
                source = ExtractorSource(bundle.extractors, letters)
                run = run_session(runtime, size, 1e9, {}, source, meter)
                t_answer = time.perf_counter()
                run.session.decode(run.features)
                end = time.perf_counter()
                answers.append((end - t_answer) * 1e6 / size)
                total_ms = (end - start) * 1000.0
                policy_ms = float(getattr(run.session, "policy_ms", 0.0))
                rest_ms = total_ms - sum(run.acquire_ms.values()) - policy_ms
                samples.append((size, policy_ms * 1000.0, rest_ms * 1000.0))
    return ServedOverhead(
        policy_us=float(np.median([pol / n for n, pol, _ in samples])),
        decode_us=float(np.median([rest / n for n, _, rest in samples])),
        per_word=tuple(samples),
        answer_us=float(np.median(answers)),
    )


@dataclass
class OcrBundleReport:
    out: Path
    costs_us: dict[str, float]
    overhead: ServedOverhead
    summary: dict[str, Any]
    parity: dict[str, float]


def _fingerprint(path: Path) -> str:
    """The data's digest: the file's bytes, or a word-image folder's labels and images."""
    digest = hashlib.sha256()
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(file.relative_to(path).as_posix().encode() + b"\0")
            digest.update(file.read_bytes())
    else:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _accuracy(problem: Any, states: list[npt.NDArray[np.bool_]]) -> float:
    n = sum(len(y) for y in problem.labels)
    wrong = problem.losses(list(range(problem.n_examples)), states, soft=False).sum()
    return float(1.0 - wrong / n)


def build_ocr_bundle(
    out_dir: Path,
    data_path: Path,
    *,
    chain_words: int | None = None,
    policy_words: int | None = None,
    max_iter: int = 150,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    lambdas: tuple[float, ...] | None = None,
    positive_weights: tuple[float, ...] | None = None,
) -> OcrBundleReport:
    """Build the OCR bundle from ``data_path`` (the ``.npz`` or a word-image folder);
    ``lambdas`` / ``positive_weights``: the one-shot sweep (None: the trainer's defaults)."""
    say = log or (lambda _m: None)
    data = load_ocr(data_path)
    costs_us = profile_templates(data)
    say(f"template costs (µs per letter, median): {costs_us}")
    train = train_ocr(
        data,
        costs_us,
        chain_words=chain_words,
        policy_words=data.n_words if policy_words is None else policy_words,
        max_iter=max_iter,
        seed=seed,
        log=say,
        lambdas=DEFAULT_LAMBDAS if lambdas is None else lambdas,
        positive_weights=DEFAULT_POSITIVE_WEIGHTS if positive_weights is None else positive_weights,
    )
    report = write_ocr_bundle(out_dir, data, data_path, train, costs_us)
    o = report.overhead
    say(f"served overhead per letter: policy {o.policy_us:.1f} µs, decoding {o.decode_us:.1f} µs")
    return report


def write_ocr_bundle(
    out_dir: Path,
    data: OcrData,
    data_path: Path,
    train: OcrTraining,
    costs_us: dict[str, float],
    *,
    overhead_words: int = 100,
) -> OcrBundleReport:
    """Export ``train`` to ``out_dir``. The strategies' reserves (``decode_cost``,
    ``policy_cost``) are the bundle's own served overhead: the manifest is written once
    without them, the staged bundle is loaded and timed by :func:`profile_served` on
    ``overhead_words`` training words, and the manifest is written again with them."""
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
    out_dir.parent.mkdir(parents=True, exist_ok=True)
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

        def manifest_with(overhead: ServedOverhead) -> Manifest:
            common: dict[str, Any] = {
                "templates": templates,
                "base": chain.base.tolist(),
                "transition": chain.chain.transition.tolist(),
                "start": chain.chain.start.tolist(),
                "end": chain.chain.end.tolist(),
                "answer_model": "chain",
                "policy_input_dims": int(test_inputs.shape[1]),
                "decode_cost": overhead.decode_us / 1000.0,
                "policy_cost": overhead.policy_us / 1000.0,
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
                stop_below=train.anytime.stop_below,
                stops=[StopPoint(tolerance=t, stop_below=b) for t, b in train.anytime.stop_table],
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
            params = {
                "summary": train.summary(),
                "costs_us": costs_us,
                "decode_us": overhead.decode_us,
                "policy_us": overhead.policy_us,
            }
            return Manifest(
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

        write_manifest(tmp, manifest_with(ServedOverhead(0.0, 0.0)))
        overhead = profile_served(tmp, data, train.train_words[:overhead_words])
        write_manifest(tmp, manifest_with(overhead))
        (tmp / "verification.json").write_text(
            json.dumps({"parity_max_rel_error": parity}, indent=2) + "\n"
        )
    return OcrBundleReport(out_dir, costs_us, overhead, train.summary(), parity)
