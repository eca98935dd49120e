"""Benchmark the built-in extractors: cost at several sizes, fitted cost curves, accuracy.

Run ``python -m benchmarks.extractors [out.md]``; writes a Markdown report (default
``docs/benchmarks/extractors.md``) with, per extractor:

* the median extraction time at 16, 64, 128 and 256 px (square noise images);
* the median time at 128, 256 and 512 px with the C allocator as the service sets it
  (``service.allocator``) and with glibc's defaults (a fresh process: a threshold once
  raised stays);
* the cost polynomial fitted to the 0.95 quantile over 9 sides, and its fit error;
* the held-out accuracy of a logistic regression on that extractor alone, trained on
  digits rendered at mixed sides 16-64 px, tested at the same mix and at 128 px.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from benchmarks.report import prose
from service.allocator import DEFAULT_KEEP_MIB
from service.bundle import CostPolynomial
from service.extractors.base import Extractor, available_extractors
from training.data.digits import data_fingerprint, digits_source, load_digit_images, render_digit
from training.profiling import fit_profiles, profile_extractors

PROFILE_SIDES = (16, 24, 32, 48, 64, 96, 128, 192, 256)
TABLE_SIDES = (16, 64, 128, 256)
TRAIN_SIDES = (16, 24, 32, 48, 64)
TRANSFER_SIDE = 128
REPEATS = 21
SEED = 0
ALLOCATOR_SIDES = (128, 256, 512)
ORDER = ("thumbnail", "histogram", "projection", "hog", "lbp", "fft_bands", "gabor")


def _format_poly(poly: CostPolynomial) -> str:
    terms = []
    for power, c in enumerate(poly.coefficients):
        base = "" if power == 0 else ("·n" if power == 1 else f"·n^{power}")
        terms.append(f"{c:.3g}{base}")
    return " + ".join(terms)


def allocator_medians(
    keep_mib: int, sides: Sequence[int] = ALLOCATOR_SIDES
) -> dict[str, list[float]]:
    """Median ms per extractor at ``sides``, profiled with the allocator's thresholds set to
    ``keep_mib`` (``service.allocator``; 0: glibc's defaults) in a fresh process."""
    code = (
        "import json, sys, numpy as np;"
        "from benchmarks.extractors import _image_extractors;"
        "from training.profiling import profile_extractors;"
        "sides = json.loads(sys.argv[1]); extractors = _image_extractors();"
        f"t = profile_extractors(extractors, sides, repeats={REPEATS}, rng={SEED},"
        f" allocator_keep_mib={keep_mib});"
        "print(json.dumps({n: [float(np.median(t[n][s * s])) for s in sides] for n in t}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(list(sides))],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    medians: dict[str, list[float]] = json.loads(done.stdout)
    return medians


def _image_extractors() -> dict[str, Extractor]:
    registry = {
        name: cls for name, cls in available_extractors().items() if cls.item_kind == "image"
    }
    names = [n for n in ORDER if n in registry] + sorted(set(registry) - set(ORDER))
    return {name: registry[name]() for name in names}


def _features(
    extractor: Extractor, images: Sequence[npt.NDArray[np.float32]]
) -> npt.NDArray[np.float32]:
    return np.stack([extractor.extract(image) for image in images])


def _accuracies(
    extractors: dict[str, Extractor],
) -> tuple[dict[str, tuple[float, float]], float, int, int]:
    """Per extractor (and 'all'): accuracy on the mixed-size test split and at 128 px."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    samples = list(load_digit_images(TRAIN_SIDES, seed=SEED, mixed=True))
    images = [s.image for s in samples]
    labels = np.asarray([s.label for s in samples])
    train_idx, test_idx = train_test_split(
        np.arange(len(samples)), test_size=0.25, random_state=SEED, stratify=labels
    )
    source, _ = digits_source()
    transfer_images = [
        render_digit(
            source[samples[i].source_index],
            TRANSFER_SIDE,
            np.random.default_rng([SEED, samples[i].source_index, TRANSFER_SIDE]),
        )
        for i in test_idx
    ]
    start = time.perf_counter()
    feats = {name: _features(ex, images) for name, ex in extractors.items()}
    transfer = {name: _features(ex, transfer_images) for name, ex in extractors.items()}
    extraction_s = time.perf_counter() - start
    feats["all"] = np.hstack([feats[name] for name in extractors])
    transfer["all"] = np.hstack([transfer[name] for name in extractors])

    results: dict[str, tuple[float, float]] = {}
    for name, x in feats.items():
        model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=3000, C=0.5))
        model.fit(x[train_idx], labels[train_idx])
        mixed_acc = float(model.score(x[test_idx], labels[test_idx]))
        transfer_acc = float(model.score(transfer[name], labels[test_idx]))
        results[name] = (mixed_acc, transfer_acc)
    return results, extraction_s, len(train_idx), len(test_idx)


def main(out_path: str | Path = "docs/benchmarks/extractors.md") -> Path:
    started = time.perf_counter()
    extractors = _image_extractors()
    names = list(extractors)

    timings = profile_extractors(extractors, PROFILE_SIDES, repeats=REPEATS, rng=SEED)
    kept = allocator_medians(DEFAULT_KEEP_MIB)
    defaults = allocator_medians(0)
    fits = fit_profiles(timings, quantile=0.95, max_degree=2)
    accuracies, extraction_s, n_train, n_test = _accuracies(extractors)
    elapsed = time.perf_counter() - started

    lines = prose(
        "extractors",
        platform=f"{platform.machine()} / {platform.processor() or platform.system()}",
        cpus=os.cpu_count(),
        python=sys.version.split()[0],
        numpy=np.__version__,
        elapsed=f"{elapsed:.0f}",
        repeats=REPEATS,
    )
    lines += [
        "| extractor | dims | " + " | ".join(f"{s} px" for s in TABLE_SIDES) + " |",
        "|---|---:|" + "---:|" * len(TABLE_SIDES),
    ]
    for name in names:
        cells = [f"{np.median(timings[name][s * s]):.3f}" for s in TABLE_SIDES]
        lines.append(f"| {name} | {extractors[name].dims} | " + " | ".join(cells) + " |")
    lines += prose("extractors", "allocator", keep=DEFAULT_KEEP_MIB, repeats=REPEATS)
    lines += [
        "| extractor | " + " | ".join(f"{s} px kept / defaults" for s in ALLOCATOR_SIDES) + " |",
        "|---|" + "---:|" * len(ALLOCATOR_SIDES),
    ]
    for name in names:
        cells = [
            f"{k:.3f} / {d:.3f} ({d / k:.1f}×)"
            for k, d in zip(kept[name], defaults[name], strict=True)
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += prose("extractors", "costs", sides=", ".join(map(str, PROFILE_SIDES)))
    lines += [
        "| extractor | degree | c(n) | fit error | c(256²) |",
        "|---|---:|---|---:|---:|",
    ]
    for name in names:
        fit = fits[name]
        error = f"{fit.fit_error:.1%}" if fit.fit_error is not None else "n/a"
        lines.append(
            f"| {name} | {len(fit.coefficients) - 1} | {_format_poly(fit)} | {error}"
            f" | {fit(256 * 256):.3f} |"
        )
    lines += prose(
        "extractors",
        "accuracy",
        train_sides=list(TRAIN_SIDES),
        n_train=n_train,
        n_test=n_test,
        transfer_side=TRANSFER_SIDE,
        extraction_s=f"{extraction_s:.1f}",
        fingerprint=data_fingerprint(TRAIN_SIDES, seed=SEED, mixed=True),
    )
    lines += [
        f"| features | dims | accuracy (mixed 16-64 px) | accuracy (@{TRANSFER_SIDE} px) |",
        "|---|---:|---:|---:|",
    ]
    for name in [*names, "all"]:
        dims = sum(e.dims for e in extractors.values()) if name == "all" else extractors[name].dims
        mixed_acc, transfer_acc = accuracies[name]
        lines.append(f"| {name} | {dims} | {mixed_acc:.3f} | {transfer_acc:.3f} |")
    lines.append("")

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    return out


if __name__ == "__main__":
    main(*sys.argv[1:2])
