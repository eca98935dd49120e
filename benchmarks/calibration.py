"""Live cost calibration on a mis-profiled bundle.

The digits bundle is copied with every cost curve scaled by 0.3 (as if profiled on a machine
three times faster). A stream of held-out digits at mixed sizes and budgets is served through
the serving code path (``service.execution.execute``), once with the correct bundle, once with
the mis-scaled bundle and calibration off, once with calibration on. Reported per window of
requests: the share over budget, and the accuracy.

``python -m benchmarks.calibration`` writes ``docs/benchmarks/calibration.md`` and a PNG.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.report import machine, measured_at, prose
from service.floor import FALLBACK_RESERVE_MS
from service.items import DecodedItem
from service.registry import CalibrationSettings, load_bundle

ROOT = Path(__file__).resolve().parents[1]
SCALE = 0.3
LOW, HIGH = 0.6, 10.0  # ms: from budgets that buy one cheap feature to the full set
STRATEGIES = ("polydom", "polydom-anytime", "greedy-cost")


Stream = list[tuple[DecodedItem, int, float]]


@dataclass
class Run:
    label: str
    strategy: str
    over: list[bool]
    correct: list[bool]
    expected: list[float]
    spent: list[float]
    calibrated_at: int | None


def _misscaled_copy(src: Path, dst: Path, scale: float) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    for extractor in manifest["extractors"]:
        cost = extractor["cost"]
        cost["coefficients"] = [c * scale for c in cost["coefficients"]]
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _stream(requests: int, seed: int) -> Stream:
    from training.data.digits import render_digit
    from training.evaluate import held_out_digits

    images8, labels = held_out_digits(200)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(requests):
        k = int(rng.integers(len(labels)))
        side = int(rng.choice([32, 64, 128, 256]))
        budget = float(np.exp(rng.uniform(np.log(LOW), np.log(HIGH))))
        item = DecodedItem(
            data=render_digit(images8[k], side, rng), size=side * side, key=f"cal:{i}"
        )
        out.append((item, int(labels[k]), budget))
    return out


def _serve(path: Path, calibrate: bool, strategy: str, stream: Stream, label: str) -> Run:
    from service.execution import execute

    bundle = load_bundle(path, 1 << 24, CalibrationSettings(enabled=calibrate))
    runtime = bundle.strategy(strategy)
    reserve = FALLBACK_RESERVE_MS
    classes = bundle.manifest.classes
    run = Run(label, strategy, [], [], [], [], None)
    for i, (item, label_, budget) in enumerate(stream):
        result = execute(
            bundle, item, budget, {}, time.perf_counter(), reserve_ms=reserve, runtime=runtime
        )
        run.over.append(result.over_budget(budget))
        run.correct.append(classes[int(np.argmax(result.probabilities))] == str(label_))
        run.expected.append(bundle.manifest.model(result.answer).accuracy)
        run.spent.append(result.spent / budget)
        if run.calibrated_at is None and bundle.costs.calibrated:
            run.calibrated_at = i
    return run


def main(
    out_path: str = "docs/benchmarks/calibration.md", requests: int = 600, window: int = 100
) -> Path:
    src = ROOT / "models" / "digits"
    stream = _stream(requests, seed=0)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory() as tmp:
        wrong = _misscaled_copy(src, Path(tmp) / "digits", SCALE)
        for strategy in STRATEGIES:
            runs.append(_serve(src, False, strategy, stream, "correct profile"))
            runs.append(_serve(wrong, False, strategy, stream, f"×{SCALE}, no calibration"))
            runs.append(_serve(wrong, True, strategy, stream, f"×{SCALE}, calibration"))

    windows = [(s, min(s + window, requests)) for s in range(0, requests, window)]
    head = " | ".join(f"{a + 1}–{b}" for a, b in windows)
    lines = prose(
        "calibration",
        measured_at=measured_at(),
        machine=machine(),
        scale=SCALE,
        speedup=f"{1 / SCALE:.1f}",
        requests=requests,
        low=f"{LOW:g}",
        high=f"{HIGH:g}",
        window=window,
    )
    lines += [
        f"| strategy | configuration | {head} | overall | test accuracy "
        f"| expected accuracy (last {requests // 2}) | calibrated from request |",
        "|---|---|" + "---|" * len(windows) + "---|---|---|---|",
    ]
    for run in runs:
        over = np.asarray(run.over)
        correct = np.asarray(run.correct)
        cells = " | ".join(f"{over[a:b].mean():.1%}" for a, b in windows)
        lines.append(
            f"| {run.strategy} | {run.label} | {cells} | {over.mean():.1%} | "
            f"{correct.mean():.3f} | {np.mean(run.expected[requests // 2 :]):.3f} | "
            f"{'-' if run.calibrated_at is None else run.calibrated_at + 1} |"
        )
    png = _plot(runs, window, ROOT / Path(out_path).with_suffix(".png"))
    lines += ["", f"![over-budget share per window]({png.name})", ""]
    path = ROOT / out_path
    path.write_text("\n".join(lines))
    return path


def _plot(runs: list[Run], window: int, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = list(dict.fromkeys(r.strategy for r in runs))
    fig, axes = plt.subplots(
        1, len(strategies), figsize=(4.6 * len(strategies), 3.6), squeeze=False, sharey=True
    )
    for ax, strategy in zip(axes[0], strategies, strict=True):
        for run in (r for r in runs if r.strategy == strategy):
            over = np.asarray(run.over, dtype=float)
            smooth = np.convolve(over, np.ones(window) / window, mode="valid") * 100
            ax.plot(np.arange(window, len(over) + 1), smooth, label=run.label)
        ax.set_title(strategy)
        ax.set_xlabel("request")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"over budget, % (moving {window})")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main())
