"""OCR benchmark (paper 004, Fig. 2 and 3): letter accuracy vs measured time per word on the
held-out fold (the paper's 90/10 split), for the one-shot and anytime policies against the
uniform and myopic baselines and a plain per-letter scikit-learn classifier on all features.

Every method runs through the service's own request loop (``run_session`` on the bundle's
extractor plugins, ``MeasuredCost``) and decoder, so "time per word" is extraction + policy +
inference, as the paper counts it. Methods are interleaved word by word (each word runs every
method in a random order) so that the shared machine's load affects them alike.

``python -m benchmarks.ocr [--chain-words N --policy-words N --test-words N --max-iter N]``
writes docs/benchmarks/ocr.md, ocr.png (Fig. 3) and ocr_example.png (Fig. 2).

The module stays whole (over 450 lines): training, the interleaved timing of every method
and the Fig. 2/3 report are one experiment; the method itself lives in training/structured/.
"""

from __future__ import annotations

import argparse
import pickle
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression

from benchmarks.report import OUT, machine, measured_at, prose, wilson
from service.bundle import StructuredOperatingPoint
from service.execution import ExtractorSource, MeasuredCost, run_session
from service.registry import Bundle, CalibrationSettings, load_bundle
from service.strategies.base import Observation, Session, StrategyRuntime
from service.strategies.chain import marginals_one
from service.strategies.structured import (
    StructuredAnytimeRuntime,
    StructuredOneShotRuntime,
    StructuredSession,
)
from training.bundles.ocr import ServedOverhead, profile_templates, write_ocr_bundle
from training.structured.baselines import myopic_states, uniform_states
from training.structured.ocr import DEFAULT_DATA, OcrData, load_ocr, word_problem
from training.structured.ocr_train import train_ocr
from training.structured.stops import STOP_TOLERANCE

ROOT = Path(__file__).resolve().parents[1]
TMP = ROOT / ".bench-tmp" / "ocr"
UNIFORM = (0.0, 0.25, 0.5, 0.75, 1.0)
MYOPIC = (0.8, 0.9, 0.95, 0.98)
ANYTIME_MS_PER_LETTER = (0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.15, 0.2, 0.3, 0.5)
ANYTIME_TOP_MS_PER_LETTER = (0.1, 0.2, 0.5)  # the anytime strategy asked with tolerance 0
WITHIN = 0.005  # "at the top performance": within half a point of all templates everywhere
# Every template extraction's wall time in this run's timed requests, by template (ms).
EXTRACTED: dict[str, list[float]] = {}


class _PlanSession(StructuredSession):
    """A baseline served by the structured machinery: base templates, then ``plan(obs)``'s
    pairs (no policy model runs)."""

    def __init__(
        self,
        runtime: Any,
        size: int,
        plan: Callable[[StructuredSession, Observation], list[tuple[int, int]]],
    ) -> None:
        super().__init__(runtime, size, 1e9)
        self.make_plan = plan

    def step(self, obs: Observation) -> Any:
        self.scores = np.zeros((1, 1))  # no policy model
        return super().step(obs)

    def plan_pairs(self, obs: Observation) -> list[tuple[int, int]]:
        return self.make_plan(self, obs)


class _Fixed(StrategyRuntime):
    """Wraps a structured runtime so that ``begin`` returns a session of our making."""

    kind = "bench"

    def __init__(self, inner: Any, make: Callable[[int], Session]) -> None:
        self.inner = inner
        self.make = make
        self.name = "bench"

    def begin(self, size: int, budget: float, in_hand: frozenset[str]) -> Session:
        return self.make(size)


@dataclass
class Point:
    method: str
    setting: str
    correct: int = 0
    letters: int = 0
    ms: list[float] = field(default_factory=list)
    extraction_ms: float = 0.0
    hog: int = 0

    @property
    def accuracy(self) -> float:
        return self.correct / max(1, self.letters)

    @property
    def mean_ms(self) -> float:
        return float(np.mean(self.ms)) if self.ms else 0.0

    @property
    def overhead_us(self) -> float:
        """Measured time less template extraction, per letter: the request loop, policy
        and decoding."""
        return (sum(self.ms) - self.extraction_ms) * 1000.0 / max(1, self.letters)


def _run(
    bundle: Bundle, runtime: Any, item_data: Any, size: int, budget: float
) -> tuple[StructuredSession, float, int, float]:
    start = time.perf_counter()
    meter = MeasuredCost(start, bundle.calibrator, size)
    run = run_session(
        runtime, size, budget, {}, ExtractorSource(bundle.extractors, item_data), meter
    )
    session = run.session
    assert isinstance(session, StructuredSession)
    session.decode(run.features)
    spent = meter.spent()
    hogs = sum(1 for f in run.features if f.startswith("hog@"))
    for name, ms in run.acquire_ms.items():
        EXTRACTED.setdefault(name.split("@")[0], []).append(ms)
    return session, spent, hogs, sum(run.acquire_ms.values())


Job = tuple[str, str, Callable[[], tuple[Any, float, int, str, float]]]


def _jobs(
    bundle: Bundle,
    one_shot: StructuredOneShotRuntime,
    anytime: StructuredAnytimeRuntime,
    plain: LogisticRegression,
    item: Any,
    size: int,
    rng: np.random.Generator,
) -> list[Job]:
    """Every method and setting, each a job measuring one word."""
    jobs: list[Job] = []

    for p_spec in one_shot.points:

        def run_point(p: StructuredOperatingPoint = p_spec) -> tuple[Any, float, int, str, float]:
            def make(sz: int) -> Session:
                s = one_shot.session(sz, 1e9)
                s.point = p  # type: ignore[attr-defined]
                return s

            s, ms, h, ext = _run(bundle, _Fixed(one_shot, make), item.data, size, 1e9)
            return s, ms, h, s.prediction or "", ext

        jobs.append(("one-shot", f"λ={p_spec.lam:g}, w+={p_spec.positive_weight:g}", run_point))
    for b in ANYTIME_MS_PER_LETTER:

        def run_any(b: float = b) -> tuple[Any, float, int, str, float]:
            s, ms, h, ext = _run(bundle, anytime, item.data, size, b * size)
            return s, ms, h, s.prediction or "", ext

        jobs.append(("anytime", f"{b:g} ms/letter", run_any))
    # The same strategy for a request that wants the top (tolerance 0: the stop table's
    # threshold that lost nothing on the policy words).
    top = anytime.with_options(tolerance=0.0) if anytime.spec.stops else None
    for b in ANYTIME_TOP_MS_PER_LETTER if top is not None else ():

        def run_top(b: float = b) -> tuple[Any, float, int, str, float]:
            s, ms, h, ext = _run(bundle, top, item.data, size, b * size)
            return s, ms, h, s.prediction or "", ext

        jobs.append(("anytime-top", f"{b:g} ms/letter, tolerance 0", run_top))
    for frac in UNIFORM:

        def run_uni(frac: float = frac) -> tuple[Any, float, int, str, float]:
            chosen = [(p, 1) for p in range(size) if rng.random() < frac]
            s, ms, h, ext = _run(
                bundle,
                _Fixed(
                    one_shot, lambda sz: _PlanSession(one_shot, sz, lambda _s, _o: list(chosen))
                ),
                item.data,
                size,
                1e9,
            )
            return s, ms, h, s.prediction or "", ext

        jobs.append(("uniform", f"{frac:.0%} HOG", run_uni))
    for tau in MYOPIC:

        def plan_myopic(
            s: StructuredSession, obs: Observation, tau: float = tau
        ) -> list[tuple[int, int]]:
            em = one_shot.s0_emission(obs.features, s.size)
            conf = float(marginals_one(em, one_shot.chain).max(axis=1).mean())
            return [(p, 1) for p in range(s.size)] if conf < tau else []

        def run_my(plan: Any = plan_myopic) -> tuple[Any, float, int, str, float]:
            s, ms, h, ext = _run(
                bundle,
                _Fixed(one_shot, lambda sz: _PlanSession(one_shot, sz, plan)),
                item.data,
                size,
                1e9,
            )
            return s, ms, h, s.prediction or "", ext

        jobs.append(("myopic", f"τ={tau:g}", run_my))

    def run_plain() -> tuple[Any, float, int, str, float]:
        t0 = time.perf_counter()
        feats = np.stack(
            [
                np.concatenate(
                    [bundle.extractors[f"{t}@{p}"].extract(item.data) for t in ("pixels", "hog")]
                )
                for p in range(size)
            ]
        )
        t1 = time.perf_counter()
        pred = plain.predict(feats)
        return (
            None,
            (time.perf_counter() - t0) * 1000.0,
            size,
            "".join(chr(97 + int(y)) for y in pred),
            (t1 - t0) * 1000.0,
        )

    jobs.append(("plain", "LogisticRegression, pixels+HOG, no chain", run_plain))
    return jobs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ocr")
    ap.add_argument("--data", type=Path, default=ROOT / DEFAULT_DATA)
    ap.add_argument(
        "--chain-words", type=int, default=0, help="0: every training word (the paper's 90 %%)"
    )
    ap.add_argument("--policy-words", type=int, default=0, help="0: every training word")
    ap.add_argument("--max-iter", type=int, default=150)
    ap.add_argument("--test-words", type=int, default=0, help="0: the whole held-out fold")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--training-cache",
        type=Path,
        default=None,
        help="a pickle of the training (local, never shipped): loaded when it exists and was "
        "made with the same arguments, else written after training",
    )
    ap.add_argument("--train-only", action="store_true", help="train (and cache), then stop")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    data = load_ocr(args.data)
    costs, train = _training(args, data)
    if args.train_only:
        return
    folder = TMP / "ocr"
    TMP.mkdir(parents=True, exist_ok=True)
    report = write_ocr_bundle(folder, data, args.data, train, costs)
    overhead = report.overhead
    bundle = load_bundle(folder, 1 << 22, CalibrationSettings(enabled=False))
    one_shot = bundle.strategy("structured-oneshot")
    anytime = bundle.strategy("structured-anytime")
    assert isinstance(one_shot, StructuredOneShotRuntime) and isinstance(
        anytime, StructuredAnytimeRuntime
    )
    train_s = time.perf_counter() - t_start

    # the user's alternative: one scikit-learn classifier per letter on all features
    rows = np.concatenate(
        [np.arange(*data.word(w).indices(len(data.labels))) for w in train.train_words]
    )
    x_all = np.concatenate(train.features, axis=1)
    plain = LogisticRegression(max_iter=args.max_iter)
    with warnings.catch_warnings():  # the iteration cap is the run's time budget
        warnings.simplefilter("ignore", ConvergenceWarning)
        plain.fit(x_all[rows], data.labels[rows])

    words = train.test_words if args.test_words <= 0 else train.test_words[: args.test_words]
    rng = np.random.default_rng(0)
    points: dict[tuple[str, str], Point] = {}

    def point(method: str, setting: str) -> Point:
        return points.setdefault((method, setting), Point(method, setting))

    example: dict[str, Any] = {}
    for w in words:
        letters = [letter.astype(int).tolist() for letter in data.letters[data.word(w)]]
        item = bundle.decoder.decode({"letters": letters})
        truth = "".join(chr(97 + y) for y in data.labels[data.word(w)])
        size = item.size
        jobs = _jobs(bundle, one_shot, anytime, plain, item, size, rng)
        for j in rng.permutation(len(jobs)):
            method, setting, job = jobs[j]
            _session, ms, hogs, word, extraction = job()
            pt = point(method, setting)
            pt.extraction_ms += extraction
            pt.correct += sum(a == b for a, b in zip(word, truth, strict=True))
            pt.letters += size
            pt.ms.append(ms)
            pt.hog += hogs
        if not example.get("informative"):
            steps = []
            # Fig. 2: the anytime policy's order on this word, and the decode after each step
            feats = {
                f"pixels@{p}": bundle.extractors[f"pixels@{p}"].extract(item.data)
                for p in range(size)
            }
            scores = anytime.policy_scores(feats, size)
            state: set[int] = set()
            for k in range(size + 1):
                have = dict(feats)
                for p in state:
                    have[f"hog@{p}"] = bundle.extractors[f"hog@{p}"].extract(item.data)
                labels, _marg, _ = anytime.decode_word(have, size)
                steps.append(("".join(chr(97 + y) for y in labels), sorted(state)))
                if k == size:
                    break
                best, best_s = -1, -np.inf
                for p in range(size):
                    col = anytime.column(len(state), 0)
                    if p not in state and scores[p, col] > best_s:
                        best, best_s = p, scores[p, col]
                state.add(best)
            wrong_at_s0 = sum(a != b for a, b in zip(steps[0][0], truth, strict=True))
            if not example or wrong_at_s0 >= 2:
                # the first word the pixels alone get at least two letters wrong (Fig. 2)
                example = {
                    "word": w,
                    "truth": truth,
                    "steps": steps,
                    "letters": data.letters[data.word(w)],
                    "informative": wrong_at_s0 >= 2,
                }
    bench_s = time.perf_counter() - t_start - train_s
    offline = _offline(data, train, words)
    _write(
        data.n_words,
        args,
        points,
        example,
        report,
        train,
        costs,
        overhead,
        len(words),
        train_s,
        bench_s,
        offline,
    )


def _training(args: argparse.Namespace, data: OcrData) -> tuple[dict[str, float], Any]:
    """The template costs and the training, from ``--training-cache`` when it holds a
    training made with these arguments (the whole-data run takes tens of minutes)."""
    # (the last element: what the training does; bump it when that changes, so that a cache
    # made before is not taken for this training)
    key = (str(args.data), args.chain_words, args.policy_words, args.max_iter, "stop-table")
    cache: Path | None = args.training_cache
    if cache is not None and cache.is_file():
        with cache.open("rb") as handle:
            stored = pickle.load(handle)  # our own file, written below
        if stored["key"] == key:
            print(f"training loaded from {cache}")
            return stored["costs"], stored["train"]
    costs = profile_templates(data)
    train = train_ocr(
        data,
        costs,
        chain_words=args.chain_words or None,
        policy_words=args.policy_words or data.n_words,
        max_iter=args.max_iter,
        log=print,
    )
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        with cache.open("wb") as handle:
            pickle.dump({"key": key, "costs": costs, "train": train}, handle)
    return costs, train


def _offline(data: OcrData, train: Any, words: list[int]) -> list[tuple[str, str, float, float]]:
    """Policy quality without overhead: accuracy against the fraction of letters given HOG,
    on the same held-out words, computed with the trained objects (no timing)."""
    problem = word_problem(train.chain, data, train.features, words, train.templates)
    ts = train.templates
    idx = list(range(problem.n_examples))
    letters = sum(problem.parts(i) for i in idx)
    hog = ts.optional[0]
    delta = float(ts.costs[hog])

    def row(method: str, setting: str, states: list[Any]) -> tuple[str, str, float, float]:
        wrong = problem.losses(idx, states, soft=False).sum()
        frac = sum(int(st[:, hog].sum()) for st in states) / letters
        return method, setting, float(1.0 - wrong / letters), frac

    out = []
    rng = np.random.default_rng(1)
    for frac in UNIFORM:
        out.append(row("uniform", f"{frac:.0%} HOG", uniform_states(problem, frac, rng)))
    for pol in train.one_shot:
        states = [pol.state(problem.policy_inputs(i), ts) for i in idx]
        out.append(row("one-shot", f"λ={pol.lam:g}, w+={pol.positive_weight:g}", states))
    for frac in (0.1, 0.2, 0.3, 0.5, 0.7):
        states = []
        for i in idx:
            start = ts.initial(problem.parts(i))
            budget = ts.cost(start) + frac * problem.parts(i) * delta - 1e-9
            states.append(train.anytime.run(problem.policy_inputs(i), start, ts, budget))
        out.append(row("anytime", f"{frac:.0%} of letters' HOG", states))
    for tau in MYOPIC:
        out.append(row("myopic", f"τ={tau:g}", myopic_states(problem, tau)[0]))
    return sorted(out, key=lambda r: (r[0], r[3]))


def _saving_interval(point: Point, top: Point, rounds: int = 2000) -> tuple[float, float]:
    """95 % bootstrap interval of ``1 - mean time / top's mean time`` over the held-out
    words (paired: every word ran every method, in the same order of words)."""
    a = np.asarray(point.ms)
    b = np.asarray(top.ms)
    idx = np.random.default_rng(0).integers(0, len(a), size=(rounds, len(a)))
    savings = 1.0 - a[idx].mean(axis=1) / b[idx].mean(axis=1)
    low, high = np.quantile(savings, [0.025, 0.975])
    return float(low), float(high)


def _write(
    data_words: int,
    args: argparse.Namespace,
    points: Mapping[tuple[str, str], Point],
    example: dict[str, Any],
    report: Any,
    train: Any,
    costs: dict[str, float],
    overhead: ServedOverhead,
    n_words: int,
    train_s: float,
    bench_s: float,
    offline: list[tuple[str, str, float, float]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    by_method: dict[str, list[Point]] = {}
    for p in points.values():
        by_method.setdefault(p.method, []).append(p)
    for pts in by_method.values():
        pts.sort(key=lambda p: p.mean_ms)
    uniform = by_method["uniform"]
    # the top performance: every template on every letter (uniform at 100 %)
    top = max(uniform, key=lambda p: p.hog / max(1, p.letters))
    hog_run_us = float(np.median(EXTRACTED["hog"])) * 1000.0
    lines = prose(
        "ocr",
        measured_at=measured_at(),
        machine=machine(),
        words=n_words,
        chain_words=len(train.train_words),
        policy_words=len(train.policy_words),
        max_iter=args.max_iter,
        pixels_us=f"{costs['pixels']:.1f}",
        hog_us=f"{costs['hog']:.1f}",
        hog_run_us=f"{hog_run_us:.1f}",
        pixels_run_us=f"{float(np.median(EXTRACTED['pixels'])) * 1000.0:.1f}",
        policy_us=f"{overhead.policy_us:.1f}",
        decode_us=f"{overhead.decode_us:.1f}",
        overhead_us=f"{overhead.total_us:.1f}",
        answer_us=f"{overhead.answer_us:.1f}",
        loop_us=f"{overhead.decode_us - overhead.answer_us:.1f}",
        ratio=f"{(overhead.policy_us + overhead.answer_us) / hog_run_us:.0%}",
        stop=(
            "never stopping before its budget (no threshold kept its accuracy)"
            if train.anytime.stop_below is None
            else f"stopping before its budget once π_t's best pair scores below "
            f"{train.anytime.stop_below:g}, the highest threshold that cost at most "
            f"{STOP_TOLERANCE} of accuracy with every budget on the policy words"
        ),
        training=(
            f"the deployed chain is fitted on all {len(train.train_words)} training words (the "
            "paper's 90 %)"
            if len(train.train_words) + n_words >= data_words
            else f"**training is subsampled**: the deployed chain is fitted on "
            f"{len(train.train_words)} training words"
        ),
        policy_words_text=f"the policies on {len(train.policy_words)} training words",
        train_min=f"{train_s / 60:.1f}",
        train_steps=", ".join(f"{k} {v / 60:.1f} min" for k, v in train.seconds.items()),
        bench_min=f"{bench_s / 60:.1f}",
        parity=f"{max(report.parity.values()):.1e}",
    )
    lines += [
        "",
        "| method | setting | letter accuracy (95 % CI) | ms per word (mean) "
        "| overhead µs per letter | HOG letters |",
        "|---|---|---|---|---|---|",
    ]
    for method in ("uniform", "one-shot", "anytime", "anytime-top", "myopic", "plain"):
        for p in by_method.get(method, []):
            lo, hi = wilson(p.correct, p.letters)
            lines.append(
                f"| {method} | {p.setting} | {p.accuracy:.4f} ({lo:.3f}–{hi:.3f}) "
                f"| {p.mean_ms:.2f} | {p.overhead_us:.0f} | {p.hog / max(1, p.letters):.0%} |"
            )
    lines.append("")
    summary = []
    goal = {"one-shot": (WITHIN, 0.40), "anytime": (0.01, 0.30), "myopic": (WITHIN, 0.40)}
    for method in ("one-shot", "anytime", "myopic"):
        within, wanted = goal[method]
        pts = by_method.get(method, [])
        good = [p for p in pts if p.accuracy >= top.accuracy - within]
        if good:
            cheapest = min(good, key=lambda p: p.mean_ms)
            saving = 1.0 - cheapest.mean_ms / top.mean_ms
            low, high = _saving_interval(cheapest, top)
            summary.append(
                f"- goal for **{method}**: within {within} of all-HOG ({top.accuracy:.4f}) at "
                f"≥ {wanted:.0%} less time: cheapest such point {cheapest.setting}, "
                f"{cheapest.accuracy:.4f} at {cheapest.mean_ms:.3f} ms against "
                f"{top.mean_ms:.3f} ms, {saving:+.1%} (95 % bootstrap interval over the words "
                f"{low:+.1%} to {high:+.1%}): **{'met' if saving >= wanted else 'not met'}**."
            )
        else:
            summary.append(
                f"- goal for **{method}**: never within {within} of all-HOG ({top.accuracy:.4f})"
                ": **not met**."
            )
    for method in ("one-shot", "anytime", "myopic"):
        pts = by_method.get(method, [])
        best = max(pts, key=lambda p: p.accuracy) if pts else None
        good = [p for p in pts if p.accuracy >= top.accuracy - WITHIN]
        if good:
            cheapest = min(good, key=lambda p: p.mean_ms)
            saving = 1.0 - cheapest.mean_ms / top.mean_ms
            summary.append(
                f"- **{method}**: reaches {cheapest.accuracy:.4f} (all templates: "
                f"{top.accuracy:.4f}, minus {WITHIN}) at {cheapest.mean_ms:.2f} ms per word "
                f"({cheapest.setting}): **{saving:+.0%}** time saved against all templates' "
                f"{top.mean_ms:.2f} ms."
            )
        elif best is not None:
            summary.append(
                f"- **{method}**: never within {WITHIN} of all templates ({top.accuracy:.4f}); "
                f"its best is {best.accuracy:.4f} at {best.mean_ms:.2f} ms ({best.setting})."
            )

    # part by part vs whole word at comparable HOG use
    def at_fraction(method: str, frac: float) -> Point | None:
        pts = [p for p in by_method.get(method, []) if p.letters]
        if not pts:
            return None
        return min(pts, key=lambda p: abs(p.hog / p.letters - frac))

    for frac in (0.3, 0.6):
        a, b = at_fraction("one-shot", frac), at_fraction("myopic", frac)
        if a and b:
            summary.append(
                f"- near {frac:.0%} HOG letters: one-shot (part by part) {a.accuracy:.4f} at "
                f"{a.mean_ms:.2f} ms with {a.hog / a.letters:.0%} HOG; myopic (whole word) "
                f"{b.accuracy:.4f} at {b.mean_ms:.2f} ms with {b.hog / b.letters:.0%} HOG."
            )
    lines += summary
    lines += ["", *prose("ocr", "offline")]
    lines += ["", "| method | setting | letter accuracy | HOG letters |", "|---|---|---|---|"]
    lines += [f"| {m} | {st} | {acc:.4f} | {frac:.0%} |" for m, st, acc, frac in offline]
    lines += ["", *prose("ocr", "after")]
    lines += [
        "",
        "![accuracy vs time per word](ocr.png)",
        "",
        "![one word, step by step](ocr_example.png)",
        "",
    ]
    (out / "ocr.md").write_text("\n".join(lines) + "\n", encoding="utf-8")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    style = {
        "uniform": "k-o",
        "one-shot": "r-s",
        "anytime": "b-^",
        "anytime-top": "c-v",
        "myopic": "g-d",
        "plain": "mx",
    }
    for method, pts in by_method.items():
        ax.plot([p.mean_ms for p in pts], [p.accuracy for p in pts], style[method], label=method)
    ax.set_xlabel("measured time per word (ms): extraction + policy + inference")
    ax.set_ylabel("letter accuracy (held-out fold)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ocr.png", dpi=120)
    plt.close(fig)

    if example:
        steps = example["steps"]
        img = example["letters"]
        fig, axes = plt.subplots(len(steps), 1, figsize=(0.6 * len(img) + 2, 0.9 * len(steps)))
        for k, (word, state) in enumerate(steps):
            rgb = []
            for pos, letter in enumerate(img):
                cell = np.ones((18, 10, 3))
                cell[1:17, 1:9] = 1.0 - letter[:, :, None]
                if pos in state:  # HOG acquired: orange background
                    cell[1:17, 1:9][letter == 0] = (1.0, 0.8, 0.5)
                rgb.append(cell)
            axes[k].imshow(np.concatenate(rgb, axis=1))
            axes[k].set_xticks([])
            axes[k].set_yticks([])
            right = sum(a == b for a, b in zip(word, example["truth"], strict=True))
            axes[k].set_ylabel(f"step {k}", rotation=0, ha="right", va="center")
            axes[k].set_title(
                f"{word}  ({right}/{len(word)} right; HOG on {state})", fontsize=8, loc="left"
            )
        fig.suptitle(f"anytime policy on '{example['truth']}' (orange: HOG acquired)", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "ocr_example.png", dpi=110)
        plt.close(fig)
    print((out / "ocr.md").read_text())


if __name__ == "__main__":
    main()
