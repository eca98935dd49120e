"""A Poly-Dom image bundle from the user's own labelled folder (``budgetserve-train images``).

``build_folder_bundle(out, FolderConfig(data=DIR))``:

1. **Read** the folder (:mod:`training.data.image_folder`): one sub-folder per class, PNG,
   JPEG or WebP of any size and aspect ratio; every file's dimensions are read from its header
   first, so an unreadable, too large or too small file is named before any work is done.
2. **Split**: with ``test`` (``--test DIR``) the whole folder trains and ``DIR`` is held
   out; otherwise a stratified ``test_fraction`` of the files is held out, byte-identical
   files kept on one side (a copy of a training picture is not a held-out item).
3. **Choose** the extractors: the installed plugins of the ``budgetserve.extractors`` entry
   points that take images (built-ins and the user's own), or those the spec names, with
   parameters; colour reaches them when one of them reads it (``channels: rgb``).
4. **Profile** each extractor's cost curve c_f(n) on this machine, on the user's own images:
   training images at evenly spaced quantiles of their pixel counts (and, when the folder
   has fewer than three sizes, the median image rescaled ×½ and ×2, so that a curve has a
   slope to extrapolate with).
5. **Extract** every feature of every image once, as the service decodes it
   (:func:`service.items.decode_image`), and build the bundle with the generic Poly-Dom
   builder (:func:`training.bundles.images.build_image_bundle`): a(F) is cross-validated on
   the training images of every size at once, Poly-Dom and Greedy plan with the curves.
6. **Report**, before the bundle replaces ``out``: every held-out image through the serving
   loop (:func:`service.execution.execute`, measured extraction times, calibration off) at
   each budget, accuracy and cost per (size range, budget), next to the best fixed extractor
   set a user would deploy for that budget instead (the most accurate set by a(F) whose cost
   at the range's largest size fits the budget, on the same held-out images). The report is
   written into the bundle as ``evaluation.json`` (:mod:`training.bundles.folder_report`).

The module stays whole (over 450 lines): steps 1-5 read the one :class:`FolderConfig` and
:class:`FolderData` the others build (the CSTC builder, :mod:`training.bundles.cstc_folder`,
reuses them); the report, which only reads a written bundle, has its own module.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from PIL import Image

from service.bundle import CostPolynomial, Manifest
from service.extractors.base import available_extractors, reads_colour
from training.bundles.digits import DIGITS_EXTRACTORS
from training.bundles.folder_report import EvaluationRow, budget_grid, evaluate_folder_bundle
from training.bundles.images import (
    BuildResult,
    Feature,
    FeatureData,
    ImageBundleConfig,
    build_image_bundle,
    profile_costs,
)
from training.data.image_folder import (
    ImageFolder,
    ImageFolderError,
    load_image,
    probe_sizes,
    scan_folder,
)
from training.executor import INLINE, Executor

Progress = Callable[[str, int, int], None]
FloatImage = npt.NDArray[np.float32]
EVALUATION_FILE = "evaluation.json"
#: More extractors than this make the lattice (2^m sets) too slow to search on one machine.
MAX_EXTRACTORS = 10
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*")


def _noop(stage: str, done: int, total: int) -> None:
    return None


@dataclass(frozen=True)
class ExtractorChoice:
    """A feature of the bundle: its ``name``, the plugin that computes it and its params."""

    name: str
    plugin: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    def create(self) -> Feature:
        return Feature.create(self.name, self.plugin, self.params)


def installed_image_extractors() -> list[str]:
    """Every installed extractor plugin that takes images: the built-ins in their usual
    order, then the others by name."""
    found = [
        n for n, cls in available_extractors().items() if getattr(cls, "item_kind", "") == "image"
    ]
    return [n for n in DIGITS_EXTRACTORS if n in found] + sorted(
        n for n in found if n not in DIGITS_EXTRACTORS
    )


@dataclass
class FolderConfig:
    """What ``budgetserve-train images`` reads from its flags and optional spec file."""

    data: Path
    name: str = "images"
    test: Path | None = None
    extractors: list[ExtractorChoice] | None = None  # None: every installed image extractor
    test_fraction: float = 0.2
    epsilon: float = 0.02
    delta: float = 0.01
    folds: int = 5
    C: float = 0.5  # the learner's inverse regularisation (standardise + logistic regression)
    seed: int = 0
    max_pixels: int = 4096 * 4096
    min_side: int = 8
    channels: Literal["auto", "gray", "rgb"] = "auto"
    profile_images: int = 7
    profile_repeats: int = 21
    quantile: float = 0.95
    budgets: tuple[float, ...] | None = None  # None: a grid spanning the profiled costs
    reserve_ms: float = 0.5  # the service's BUDGETSERVE_OVERHEAD_RESERVE_MS default

    def check(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(
                f"bundle name {self.name!r}: use lower-case letters, digits, '_', '.', '-' "
                "(the folder name of --out)"
            )
        if not 0 < self.test_fraction < 1:
            raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if self.folds < 2:
            raise ValueError(f"folds must be >= 2, got {self.folds}")
        if not self.C > 0:
            raise ValueError(f"C must be > 0, got {self.C}")
        if self.min_side < 4:
            raise ValueError(
                f"min_side must be >= 4 (the built-ins' smallest side), got {self.min_side}"
            )
        if self.channels not in ("auto", "gray", "rgb"):
            raise ValueError(f"channels must be auto, gray or rgb, got {self.channels!r}")
        if self.budgets is not None and (not self.budgets or min(self.budgets) <= 0):
            raise ValueError(f"budgets must be numbers > 0, got {self.budgets}")
        if self.extractors is not None:
            names = [e.name for e in self.extractors]
            if not names or len(set(names)) != len(names):
                raise ValueError(f"extractors must be distinct names, got {names}")
            if len(names) > MAX_EXTRACTORS:
                raise ValueError(
                    f"{len(names)} extractors; Poly-Dom searches 2^m sets: choose at most "
                    f"{MAX_EXTRACTORS}"
                )

    def choices(self) -> list[ExtractorChoice]:
        if self.extractors is not None:
            return list(self.extractors)
        names = installed_image_extractors()
        if len(names) > MAX_EXTRACTORS:
            raise ValueError(
                f"{len(names)} image extractors are installed ({', '.join(names)}); Poly-Dom "
                f"searches 2^m sets: choose at most {MAX_EXTRACTORS} with --extractors"
            )
        return [ExtractorChoice(n) for n in names]


#: What a spec file may set: every setting but the folders (flags) and the reserve.
SPEC_KEYS = frozenset(FolderConfig.__dataclass_fields__) - {"data", "test", "reserve_ms"}


def parse_extractors(raw: Any) -> list[ExtractorChoice]:
    """``[name, ...]`` or ``{name: {plugin: entry point, params: {...}}, ...}`` (a name
    alone, or ``{}``, is the plugin of that name with its default parameters)."""
    if isinstance(raw, str):
        raw = [n.strip() for n in raw.split(",") if n.strip()]
    if isinstance(raw, list) and all(isinstance(n, str) for n in raw):
        return [ExtractorChoice(n) for n in raw]
    if isinstance(raw, dict):
        out = []
        for name, value in raw.items():
            value = value or {}
            if not isinstance(value, dict) or set(value) - {"plugin", "params"}:
                raise ValueError(
                    f"extractor {name!r}: expected {{plugin: <entry point>, params: {{...}}}}, "
                    f"got {value!r}"
                )
            params = value.get("params") or {}
            if not isinstance(params, dict):
                raise ValueError(f"extractor {name!r}: params must be a mapping, got {params!r}")
            out.append(ExtractorChoice(str(name), value.get("plugin"), params))
        return out
    raise ValueError(
        f"extractors: a list of plugin names, or a mapping name -> {{plugin, params}}; got {raw!r}"
    )


def read_spec(path: Path) -> dict[str, Any]:
    """The spec file's settings (JSON or YAML), checked for unknown keys."""
    from training.data.tabular import read_mapping

    raw = read_mapping(path)
    unknown = set(raw) - SPEC_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; known: {sorted(SPEC_KEYS)}")
    if "extractors" in raw:
        raw["extractors"] = parse_extractors(raw["extractors"])
    if "budgets" in raw:
        raw["budgets"] = tuple(float(b) for b in raw["budgets"])
    return raw


# --------------------------------------------------------------------------- the data


@dataclass
class FolderData:
    """The rows of the build: training folder files first, then the test folder's."""

    train_folder: ImageFolder
    test_folder: ImageFolder | None
    files: list[Path]
    labels: npt.NDArray[np.int64]
    shapes: npt.NDArray[np.int64]  # (width, height) per file
    train: npt.NDArray[np.int64]
    test: npt.NDArray[np.int64]
    duplicates: int  # held-out files with a byte-identical copy among the training files
    digests: list[str]  # each file's content digest

    @property
    def sizes(self) -> npt.NDArray[np.int64]:
        out: npt.NDArray[np.int64] = self.shapes[:, 0] * self.shapes[:, 1]
        return out


def read_folders(config: FolderConfig, progress: Progress = _noop) -> FolderData:
    """Scan, probe and split (see the module)."""
    from sklearn.model_selection import StratifiedGroupKFold

    train_folder = scan_folder(config.data, option="--data")
    test_folder = None
    if config.test is not None:
        test_folder = scan_folder(config.test, classes=train_folder.classes, option="--test")
    folders = [train_folder] + ([test_folder] if test_folder else [])
    files = [p for f in folders for p in f.files]
    labels = np.concatenate([f.labels for f in folders])
    shapes = np.concatenate(
        [
            probe_sizes(
                f, max_pixels=config.max_pixels, min_side=config.min_side, progress=progress
            )
            for f in folders
        ]
    )
    digests = [d for f in folders for d in f.digests()]
    n_train = len(train_folder.files)
    if test_folder is not None:
        train = np.arange(n_train, dtype=np.int64)
        test = np.arange(n_train, len(files), dtype=np.int64)
    else:
        counts = np.bincount(labels)
        folds = max(2, round(1 / config.test_fraction))
        if counts.min() < folds:
            raise ImageFolderError(
                f"class {train_folder.classes[int(np.argmin(counts))]!r} has {counts.min()} "
                f"images; holding out {config.test_fraction:.0%} needs at least {folds} per "
                "class: add images, or pass a separate --test folder"
            )
        groups = np.unique(digests, return_inverse=True)[1]
        splitter = StratifiedGroupKFold(folds, shuffle=True, random_state=config.seed)
        fit_rows, held = next(splitter.split(np.zeros(len(files)), labels, groups))
        train, test = np.sort(fit_rows).astype(np.int64), np.sort(held).astype(np.int64)
    per_class = np.bincount(labels[train], minlength=len(train_folder.classes))
    if per_class.min() < config.folds:
        thin = train_folder.classes[int(np.argmin(per_class))]
        raise ImageFolderError(
            f"class {thin!r} has {int(per_class.min())} training images; required: at least "
            f"{config.folds} per class, a(F) is cross-validated in {config.folds} folds; fix: "
            "add images of that class, or set `folds:` lower in a --spec file (at least 2)"
        )
    seen = {digests[i] for i in train}
    duplicates = sum(digests[i] in seen for i in test)
    return FolderData(
        train_folder, test_folder, files, labels, shapes, train, test, duplicates, digests
    )


def _rescaled(image: FloatImage, factor: float) -> FloatImage:
    """``image`` resized by ``factor`` per side (bilinear), channels kept."""
    height, width = image.shape[:2]
    size = (max(4, round(width * factor)), max(4, round(height * factor)))
    planes = [image] if image.ndim == 2 else [image[:, :, c] for c in range(image.shape[2])]
    resized = [
        np.asarray(Image.fromarray(p, mode="F").resize(size, Image.Resampling.BILINEAR))
        for p in planes
    ]
    out = resized[0] if image.ndim == 2 else np.stack(resized, axis=2)
    return np.ascontiguousarray(np.clip(out, 0.0, 1.0), dtype=np.float32)


def profiling_images(
    data: FolderData, config: FolderConfig, channels: Literal["gray", "rgb"]
) -> list[FloatImage]:
    """The images the cost curves are timed on (see the module, step 4)."""
    rows = data.train[np.argsort(data.sizes[data.train], kind="stable")]
    picks = sorted(
        {int(rows[round(q * (len(rows) - 1))]) for q in np.linspace(0, 1, config.profile_images)}
    )

    def load(row: int) -> FloatImage:
        return load_image(
            data.files[row],
            max_pixels=config.max_pixels,
            min_side=config.min_side,
            channels=channels,
        )

    images = [load(r) for r in picks]
    if len({int(data.sizes[r]) for r in picks}) < 3:
        median = load(int(rows[len(rows) // 2]))
        for factor in (0.5, 2.0):
            scaled = _rescaled(median, factor)
            if scaled.shape[0] * scaled.shape[1] <= config.max_pixels:
                images.append(scaled)
    return images


def profile_folder(
    data: FolderData,
    features: Sequence[Feature],
    config: FolderConfig,
    channels: Literal["gray", "rgb"],
    progress: Progress = _noop,
) -> dict[str, CostPolynomial]:
    """Each extractor's cost curve c_f(n), timed on :func:`profiling_images`."""
    images = profiling_images(data, config, channels)
    return profile_costs(
        {f.name: f.extractor for f in features},
        list(range(len(images))),
        config.profile_repeats,
        config.quantile,
        progress=progress,
        image_factory=lambda index, rng: images[index],
    )


def image_channels(features: Sequence[Feature], config: FolderConfig) -> Literal["gray", "rgb"]:
    """What the items decode to: colour when an extractor reads it (or the config says)."""
    if config.channels != "auto":
        return config.channels
    return "rgb" if any(reads_colour(f.extractor) for f in features) else "gray"


def extract_features(
    data: FolderData,
    features: Sequence[Feature],
    config: FolderConfig,
    channels: Literal["gray", "rgb"],
    progress: Progress = _noop,
) -> FeatureData:
    """Every feature of every file, decoded as the service decodes it."""
    n = len(data.files)
    blocks = {f.name: np.zeros((n, f.extractor.dims), dtype=np.float32) for f in features}
    digest = hashlib.sha256()
    for d, label, part in zip(
        data.digests, data.labels, np.isin(np.arange(n), data.test), strict=True
    ):
        digest.update(f"{d}:{label}:{int(part)}\n".encode())
    for i, path in enumerate(data.files):
        image = load_image(
            path, max_pixels=config.max_pixels, min_side=config.min_side, channels=channels
        )
        for f in features:
            try:
                blocks[f.name][i] = f.extractor.extract(image)
            except (ValueError, TypeError, ArithmeticError, IndexError) as exc:
                raise ImageFolderError(f"{path}: extractor {f.name!r} failed on it: {exc}") from exc
        progress("extract", i + 1, n)
    return FeatureData(
        names=[f.name for f in features],
        blocks=blocks,
        labels=data.labels,
        sizes=data.sizes,
        train=data.train,
        test=data.test,
        fingerprint="sha256:" + digest.hexdigest(),
        classes=data.train_folder.classes,
    )


# ------------------------------------------------------------------------------ build


@dataclass
class FolderResult:
    build: BuildResult
    data: FolderData
    features: list[Feature]
    costs: dict[str, CostPolynomial]
    channels: str
    budgets: tuple[float, ...]
    evaluation: list[EvaluationRow]
    seconds: dict[str, float]


def build_folder_bundle(
    out_dir: Path,
    config: FolderConfig,
    *,
    progress: Progress = _noop,
    executor: Executor = INLINE,
    data: FolderData | None = None,
) -> FolderResult:
    """Read, profile, extract, build, evaluate and write (see the module). Every native
    thread pool runs one thread: the lattice's many small logistic regressions are faster on
    one core each than split across busy ones (use ``executor`` for parallel fits)."""
    from threadpoolctl import threadpool_limits

    config.check()
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[stage] = now - clock
        clock = now

    features = [c.create() for c in config.choices()]
    channels = image_channels(features, config)
    if data is None:
        data = read_folders(config, progress)
    lap("scan")
    with threadpool_limits(1):
        costs = profile_folder(data, features, config, channels, progress)
        lap("profile")
        features_data = extract_features(data, features, config, channels, progress)
        lap("extract")
        train_sizes = data.sizes[data.train]
        lo, hi = float(train_sizes.min()), float(train_sizes.max())
        domain = (lo, hi) if hi > lo else (lo / 2, hi * 2)
        budgets = config.budgets or budget_grid(costs, data.sizes[data.test], config.reserve_ms)
        evaluation: list[EvaluationRow] = []

        def evaluate(folder: Path, manifest: Manifest) -> None:
            lap("build")
            evaluation.extend(
                evaluate_folder_bundle(
                    folder, manifest, features_data, data.files, config, budgets, progress
                )
            )
            (folder / EVALUATION_FILE).write_text(
                json.dumps(
                    {
                        "budgets": list(budgets),
                        "reserve_ms": config.reserve_ms,
                        "held_out": "test folder"
                        if config.test
                        else f"{config.test_fraction:.0%} of the folder",
                        "rows": [r.as_dict() for r in evaluation],
                    },
                    indent=1,
                )
            )
            lap("evaluate")

        image_config = ImageBundleConfig(
            name=config.name,
            size_domain=domain,
            epsilon=config.epsilon,
            delta=config.delta,
            seed=config.seed,
            folds=config.folds,
            max_pixels=config.max_pixels,
            min_side=config.min_side,
            channels=channels,
            learner=_learner(config),
            parameters={
                "source": "image folder",
                "classes": data.train_folder.classes,
                "images": {
                    "train": len(data.train),
                    "test": len(data.test),
                    "held_out": "test folder"
                    if config.test
                    else f"{config.test_fraction:.0%} split",
                },
                "sizes": {"min": int(data.sizes.min()), "max": int(data.sizes.max())},
                "extractors": {
                    f.name: {"plugin": f.plugin or f.name, "params": dict(f.params)}
                    for f in features
                },
                "profile_repeats": config.profile_repeats,
                "quantile": config.quantile,
                "C": config.C,
            },
        )
        build = build_image_bundle(
            out_dir,
            image_config,
            features,
            features_data,
            costs,
            progress=progress,
            executor=executor,
            before_commit=evaluate,
        )
    return FolderResult(
        build, data, features, dict(costs), channels, tuple(budgets), evaluation, seconds
    )


def _learner(config: FolderConfig) -> Any:
    from training.learners import default_learner

    return default_learner(C=config.C, seed=config.seed)
