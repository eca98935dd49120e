"""Finding bundles on disk (repository) and loading them (registry).

A bundle is ready once its manifest parsed, every extractor it names is installed at the
recorded version, every ONNX model loaded and its strategy runtime was built. A bundle that
fails any of these is kept out of service and reported with the reason.

The module stays whole (over 450 lines): loading a bundle is one sequence (the manifest read
within its cap, extractors, models, the runtime, the warm-up checks), and every step refuses
a bundle through the same :class:`Failure` reporting that the folder scan and reloads use.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from pydantic import ValidationError

import service.strategies  # noqa: F401  (registers the built-in strategy runtimes)
from service.bundle import MANIFEST_FILE, Manifest
from service.cache import extractor_tag
from service.calibration import CostCalibrator
from service.errors import (
    BundleError,
    ModelNotFound,
    ModelNotReady,
    StrategyNotFound,
    VersionNotFound,
)
from service.extractors.base import Extractor, available_extractors, create_extractor
from service.extractors.tagging import load_tagger
from service.inference import LoadedModel, load_models
from service.items import ItemDecoder, make_decoder
from service.sources import SensorSource, SensorSources, acquirers
from service.strategies.base import CostModel, StrategyRuntime, strategy_for

log = logging.getLogger("budgetserve.registry")


@dataclass
class Bundle:
    name: str
    path: Path
    manifest: Manifest
    extractors: dict[str, Extractor]
    models: dict[str, LoadedModel]
    runtimes: dict[str, StrategyRuntime]
    costs: CostModel
    calibrator: CostCalibrator
    decoder: ItemDecoder
    tags: dict[str, str]
    # The version label it serves under (Registry.install sets it): the version folder's
    # name, or the manifest's version in the flat layout.
    label: str = ""

    @property
    def runtime(self) -> StrategyRuntime:
        """The default strategy's runtime."""
        return self.runtimes[self.manifest.default_strategy]

    def strategy(self, name: str | None) -> StrategyRuntime:
        if name is None:
            return self.runtime
        runtime = self.runtimes.get(name)
        if runtime is None:
            raise StrategyNotFound(self.name, name, sorted(self.runtimes))
        return runtime

    def forget_timings(self) -> None:
        """Forget what the service's own runs measured (a warm-up, the start-up floor): the
        calibrator's samples and every runtime's; live requests calibrate from their own."""
        self.calibrator.reset()
        for runtime in self.runtimes.values():
            runtime.forget_timings()


@dataclass(frozen=True)
class Failure:
    """A bundle folder that did not load: ``name`` is its manifest's name when the manifest
    parsed (else the folder's), ``reason`` is fit for clients (no server paths)."""

    folder: str
    name: str
    reason: str


@dataclass
class Registry:
    """The bundles that serve, by name. ``bundles`` holds each name's default (newest)
    version; ``versions`` every version of a name by its label (the version folder's name
    in the ``models/<name>/<version>/`` layout, the manifest's version in the flat
    ``models/<name>/`` one); ``owners`` the top-level folder of ``models_dir`` serving each
    name. :meth:`install` swaps in one folder's freshly loaded bundles in one step (see
    ``service.management``)."""

    bundles: dict[str, Bundle] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # name -> reason (for 503s)
    failures: list[Failure] = field(default_factory=list)
    versions: dict[str, dict[str, Bundle]] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)

    def fail(self, failure: Failure) -> None:
        """Record ``failure``; requests for its folder name or manifest name get 503 (unless
        another folder serves that name)."""
        self.failures.append(failure)
        for key in dict.fromkeys((failure.name, failure.folder)):
            if key not in self.bundles:
                self.failed.setdefault(key, failure.reason)

    def get(self, name: str, version: str | None = None) -> Bundle:
        bundle = self.bundles.get(name)
        if bundle is None:
            if name in self.failed:
                raise ModelNotReady(name, self.failed[name])
            raise ModelNotFound(name, sorted(self.bundles))
        if version is None:
            return bundle
        versions = self.versions.get(name) or {bundle.manifest.version: bundle}
        found = versions.get(version)
        if found is None:
            raise VersionNotFound(name, version, sorted(versions, key=version_key))
        return found

    def install(self, load: FolderLoad) -> None:
        """Serve what ``load`` loaded from its folder, in place of what that folder served.

        A version that failed to load keeps serving its previous bundle, if it had one; a
        name another folder already serves is refused (a failure). The dictionaries are
        replaced entry by entry on the caller's thread: a request that already holds a
        bundle finishes on it, the next one gets the new."""
        previous = [n for n, f in self.owners.items() if f == load.folder]
        new: dict[str, dict[str, Bundle]] = {}
        failures = list(load.failures)
        for label, bundle in load.bundles:
            owner = self.owners.get(bundle.name)
            if owner is not None and owner != load.folder:
                failures.append(
                    Failure(
                        load.folder,
                        load.folder,
                        f"duplicate bundle name {bundle.name!r}: folder {owner!r} already "
                        "serves it",
                    )
                )
                continue
            new.setdefault(bundle.name, {})[label] = bundle
        for name in previous:  # versions that failed now: the old bundle keeps serving
            for label, bundle in self.versions.get(name, {}).items():
                if "*" in load.failed_labels or label in load.failed_labels:
                    new.setdefault(name, {}).setdefault(label, bundle)
        for name, versions in new.items():
            for label, bundle in versions.items():
                bundle.label = label
            ordered = dict(sorted(versions.items(), key=lambda kv: version_key(kv[0])))
            self.versions[name] = ordered
            self.bundles[name] = ordered[next(reversed(ordered))]
            self.owners[name] = load.folder
        for name in previous:
            if name not in new:
                self.unload(name)
        kept = [f for f in self.failures if _top(f.folder) != load.folder]
        self.failures, self.failed = [], {}
        for failure in [*kept, *failures]:
            self.fail(failure)

    def unload(self, name: str) -> bool:
        """Stop serving ``name`` (every version); False if it was not loaded."""
        found = self.bundles.pop(name, None) is not None
        self.versions.pop(name, None)
        self.owners.pop(name, None)
        return found


def _top(folder: str) -> str:
    """The top-level folder of a failure's ``folder`` (``name/version`` → ``name``)."""
    return folder.split("/", 1)[0]


_NUMBER = re.compile(r"(\d+)")


def version_key(label: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key of version labels: digit runs compare as numbers (``2`` < ``10``,
    ``1.9`` < ``1.10``), the rest as text; the largest is the newest."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in _NUMBER.split(label) if part
    )


@dataclass(frozen=True)
class CalibrationSettings:
    enabled: bool = True
    quantile: float = 0.95
    window: int = 256
    min_samples: int = 30


#: Largest manifest.json read by default (``BUDGETSERVE_MAX_MANIFEST_BYTES``): the largest
#: manifests built here are ~2.5 MB (a parser bundle); parsing one costs ~70 ms per MB of CPU,
#: holding the GIL, and ~10x its size in memory.
MAX_MANIFEST_BYTES = 16 << 20


def load_bundle(
    path: Path,
    max_pixels: int,
    calibration: CalibrationSettings | None = None,
    sources: SensorSources | None = None,
    max_manifest_bytes: int = MAX_MANIFEST_BYTES,
) -> Bundle:
    """Load the bundle in ``path``; ``sources`` (``BUDGETSERVE_SENSOR_SOURCES``) gives its
    sensors their acquirers, looked up by the manifest's name. A manifest over
    ``max_manifest_bytes`` is refused before it is read."""
    calibration = calibration or CalibrationSettings()
    manifest = _read_manifest(path, max_manifest_bytes)
    try:
        return _load(path, manifest, max_pixels, calibration, (sources or {}).get(manifest.name))
    except BundleError as exc:
        exc.bundle = manifest.name
        raise
    except Exception as exc:  # a plugin or ONNX Runtime failing in its own way
        raise BundleError(
            f"bundle {manifest.name!r}: {type(exc).__name__}: {exc}", bundle=manifest.name
        ) from exc


def _read_manifest(path: Path, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
    """The bundle's manifest, with errors that name the problem and not the server's paths
    or the manifest's raw bytes. At most ``max_bytes`` are read: a larger file is refused
    from its size, without reading it."""
    entry = path / MANIFEST_FILE
    try:
        if not entry.resolve().is_relative_to(path.resolve()):
            raise BundleError(f"{MANIFEST_FILE} is a link leading outside the bundle folder")
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python 3.11)
        raise BundleError(f"{MANIFEST_FILE} cannot be resolved (a symlink loop?)") from exc
    if entry.is_dir():
        raise BundleError(f"{MANIFEST_FILE} is a directory, not a file")
    if not entry.is_file():
        raise BundleError(f"{MANIFEST_FILE} is not a regular file (a dangling link?)")
    try:
        with entry.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(max_bytes + 1) if size <= max_bytes else b""
        if size > max_bytes or len(raw) > max_bytes:
            size = max(size, len(raw))
            raise BundleError(
                f"{MANIFEST_FILE} is {_bytes(size)}; the limit is {_bytes(max_bytes)} "
                "(BUDGETSERVE_MAX_MANIFEST_BYTES): a manifest "
                "holds metadata, not data (keep arrays in files of the bundle), or raise the "
                "limit"
            )
        return Manifest.model_validate_json(raw)
    except ValidationError as exc:
        problems = exc.errors(include_url=False, include_input=False)
        shown = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}"
            for e in problems[:5]
        )
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise BundleError(
            f"{MANIFEST_FILE} is not a valid manifest: {shown}{more}",
            bundle=_declared_name(raw),
        ) from exc
    except OSError as exc:
        raise BundleError(f"cannot read {MANIFEST_FILE}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # not UTF-8
        raise BundleError(f"cannot read {MANIFEST_FILE}: {type(exc).__name__}") from exc


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def _declared_name(raw: bytes) -> str | None:
    """The ``name`` a manifest that failed validation declares, if it is readable JSON with a
    plain string name (so requests for that name get 503 rather than 404)."""
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    name = parsed.get("name") if isinstance(parsed, dict) else None
    if isinstance(name, str) and 0 < len(name) <= 128 and name.isprintable():
        return name
    return None


def _load(
    path: Path,
    manifest: Manifest,
    max_pixels: int,
    calibration: CalibrationSettings,
    sources: dict[str, SensorSource] | None = None,
) -> Bundle:
    broken: dict[str, str] = {}
    installed = available_extractors(broken)
    extractors: dict[str, Extractor] = {}
    for spec in manifest.extractors:
        plugin = spec.entry_point
        if plugin in broken and plugin not in installed:
            raise BundleError(
                f"bundle {manifest.name!r}: extractor {plugin!r} failed to import: {broken[plugin]}"
            )
        try:
            extractor = create_extractor(plugin, spec.version, spec.params, installed)
        except LookupError as exc:
            raise BundleError(f"bundle {manifest.name!r}: {exc}") from exc
        if extractor.dims != spec.dims:
            raise BundleError(
                f"bundle {manifest.name!r}: extractor {spec.name!r} yields {extractor.dims} "
                f"dims, the bundle was trained with {spec.dims}"
            )
        extractors[spec.name] = extractor
    extractors.update(acquirers(manifest, sources or {}, installed))
    models = load_models(manifest, path)
    tagger = None if manifest.item.tagger is None else load_tagger(path, manifest.item.tagger)
    decoder = make_decoder(manifest.item, max_pixels, tagger)
    _warm_up(manifest, decoder, extractors, models)
    calibrator = CostCalibrator(
        {e.name: e.cost for e in manifest.extractors},
        quantile=calibration.quantile,
        window=calibration.window,
        min_samples=calibration.min_samples,
        enabled=calibration.enabled,
    )
    costs = CostModel(manifest, calibrator)
    runtimes: dict[str, StrategyRuntime] = {}
    for strategy in manifest.strategies:
        try:
            runtime = strategy_for(strategy.kind)(manifest, strategy, models, costs, path)
            runtimes[strategy.name] = runtime
        except LookupError as exc:
            raise BundleError(f"bundle {manifest.name!r}: {exc}") from exc
    bundle = Bundle(
        name=manifest.name,
        path=path,
        manifest=manifest,
        extractors=extractors,
        models=models,
        runtimes=runtimes,
        costs=costs,
        calibrator=calibrator,
        decoder=decoder,
        tags={e.name: extractor_tag(e.name, e.version, e.params) for e in manifest.extractors},
    )
    _warm_sessions(bundle)
    return bundle


#: Blank items of the structured kinds (a few parts each).
_STRUCTURED_BLANKS: dict[str, dict[str, Any]] = {
    "letters": {"letters": np.zeros((3, 16, 8), dtype=int).tolist()},
    "tokens": {"tokens": [{"form": f, "upos": u} for f, u in (("a", "DET"), ("b", "NOUN"))]},
}


def blank_item(manifest: Manifest) -> dict[str, Any] | None:
    """A blank request item of ``manifest``'s kind (an image: a black PNG of at least 32 px;
    a word or a sentence of a few parts), which the warm-ups and the start-up measurement of
    the floor (``service.http.app.measure_floor``) ask for; None for tabular items."""
    if manifest.item.kind == "image":
        png = io.BytesIO()
        Image.new("L", (max(manifest.item.min_side, 32),) * 2).save(png, format="PNG")
        return {"png_base64": base64.b64encode(png.getvalue()).decode()}
    return _STRUCTURED_BLANKS.get(manifest.item.kind)


def _warm_sessions(bundle: Bundle) -> None:
    """Run every strategy's whole request loop twice on a blank item of a structured bundle
    (letters, tokens), so that a fresh process's first request does not pay the sessions'
    one-off costs (the policy's and the decoder's first calls: an OCR word's first request
    took 12 ms against 5-8 ms with this) against its budget. The calibrator and the
    runtimes then forget what these runs measured. A warm-up is an optimisation: one that
    fails (a bundle whose items a blank one does not fit) is logged, and the bundle loads as
    it would without."""
    from service.execution import execute

    if bundle.manifest.item.kind not in _STRUCTURED_BLANKS:
        return
    item = blank_item(bundle.manifest)
    try:
        decoded = bundle.decoder.decode(item)
        for runtime in bundle.runtimes.values():
            for _ in range(2):
                execute(bundle, decoded, 1e6, {}, time.perf_counter(), runtime=runtime)
    except Exception:
        log.warning("bundle %r: its sessions' warm-up failed", bundle.name, exc_info=True)
    bundle.forget_timings()


def _warm_up(
    manifest: Manifest,
    decoder: ItemDecoder,
    extractors: dict[str, Extractor],
    models: dict[str, LoadedModel],
) -> None:
    """Run the decoder (on a blank PNG for images), every extractor and every model once, so
    first requests don't pay one-off costs (lazy imports such as Pillow's PNG plugin, ~10 ms;
    allocator growth; ONNX Runtime's first-run set-up) against their budgets; and check that
    every model answers class probabilities there (a bundle with NaN weights would otherwise
    take over and answer every request 422, blaming the client's values)."""
    kind = manifest.item.kind
    blank: Any = dict.fromkeys(manifest.item.columns, 0.0)  # tabular
    if kind in ("image", "tokens"):
        blank = decoder.decode(blank_item(manifest)).data
    elif kind == "letters":  # every letter position the bundle takes
        blank = np.zeros((manifest.item.max_letters, 16, 8), dtype=np.float32)
    features = {}
    for name, extractor in extractors.items():
        try:
            features[name] = np.asarray(extractor.extract(blank), dtype=np.float32)
        except Exception as exc:  # a plugin that cannot handle a blank item
            raise BundleError(
                f"bundle {manifest.name!r}: extractor {name!r} failed its warm-up on a blank "
                f"{kind} item: {exc}"
            ) from exc
    if kind == "image":
        _warm_sizes(manifest, decoder, extractors)
    scores = {m for strategy in manifest.strategies for m in strategy.score_models()}
    for model_id, model in models.items():
        output = model.predict_proba(features)
        problem = not_finite(output) if model_id in scores else not_probabilities(output)
        if problem is not None:
            raise BundleError(
                f"bundle {manifest.name!r}: model {model_id!r} gives {problem} on a blank "
                f"{kind} item at warm-up (NaN or corrupted weights?); the bundle is refused"
            )


#: Sides at which an image bundle's decoder and extractors are warmed up (within its limits).
WARM_SIDES = (32, 64, 128, 256)


def _warm_sizes(manifest: Manifest, decoder: ItemDecoder, extractors: dict[str, Extractor]) -> None:
    """Decode and run every extractor twice on a textured image at each of ``WARM_SIDES``:
    the first call at a size pays one-off costs (buffers, caches, numpy's set-up for those
    shapes), several times a warm call (measured at 128 px on a fresh server: decoding 1.76
    ms then 0.33, thumbnail 1.24 then 0.12, lbp 1.77 then 0.22), which a first request would
    otherwise pay against its budget. (Extractor failures were reported by the blank item.)"""
    rng = np.random.default_rng(0)
    for side in WARM_SIDES:
        if side < manifest.item.min_side or side * side > manifest.item.max_pixels:
            continue
        coarse = (rng.random((8, 8)) * 255.0).astype(np.uint8)
        picture = Image.fromarray(coarse, "L").resize((side, side), Image.Resampling.BILINEAR)
        png = io.BytesIO()
        picture.save(png, format="PNG")
        item = {"png_base64": base64.b64encode(png.getvalue()).decode()}
        for _ in range(2):
            data = decoder.decode(item).data
            for extractor in extractors.values():
                extractor.extract(data)


#: How far from [0, 1], and from a sum of 1, a model's float32 probabilities may be.
PROBABILITY_TOLERANCE = 1e-3


def not_finite(values: Any) -> str | None:
    """What keeps ``values`` (a model's scores) from being a finite vector, or None."""
    scores = np.asarray(values, dtype=np.float64)
    if scores.size == 0:
        return "no output"
    if not np.all(np.isfinite(scores)):
        return f"non-finite outputs ({int(np.sum(~np.isfinite(scores)))} NaN or infinite)"
    return None


def not_probabilities(values: Any) -> str | None:
    """What keeps ``values`` from being class probabilities (finite, in [0, 1], summing to
    1 within :data:`PROBABILITY_TOLERANCE`), or None when they are."""
    problem = not_finite(values)
    if problem is not None:
        return problem
    probs = np.asarray(values, dtype=np.float64)
    if probs.min() < -PROBABILITY_TOLERANCE or probs.max() > 1.0 + PROBABILITY_TOLERANCE:
        return f"values outside [0, 1] (from {probs.min():.4g} to {probs.max():.4g})"
    if abs(probs.sum() - 1.0) > PROBABILITY_TOLERANCE:
        return f"probabilities that sum to {probs.sum():.4g}, not 1"
    return None


_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/-])/(?:[^\s'\"/:]+/)+([^\s'\":/]*)")


def public_reason(reason: str, folder: Path, models_dir: Path) -> str:
    """``reason`` without server paths: the bundle folder becomes its name, any other
    absolute path its last component."""
    for root, name in ((folder, folder.name), (models_dir, models_dir.name)):
        for variant in dict.fromkeys((str(root.resolve()), str(root.absolute()))):
            reason = reason.replace(variant, name)
    return _ABSOLUTE_PATH.sub(lambda m: f"…/{m.group(1)}", reason)


@dataclass
class FolderLoad:
    """What loading one top-level folder of ``models_dir`` gave: ``bundles`` as (version
    label, bundle), the failures, and the labels of the versions that failed (for which
    :meth:`Registry.install` keeps a previous bundle)."""

    folder: str
    bundles: list[tuple[str, Bundle]] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    failed_labels: set[str] = field(default_factory=set)


def bundle_folders(models_dir: Path) -> list[str]:
    """Top-level folders of ``models_dir`` that hold a bundle (``manifest.json``) or versions
    of one (subfolders with a ``manifest.json``), sorted. Hidden folders (``.name``) are left
    out, at both levels: a bundle being written there (the builders stage into one) is
    never loaded half-written."""
    if not models_dir.is_dir():
        return []
    return sorted(
        p.name
        for p in models_dir.iterdir()
        if _visible_dir(p) and (os.path.lexists(p / MANIFEST_FILE) or _version_dirs(p))
    )


def _visible_dir(path: Path) -> bool:
    return not path.name.startswith(".") and path.is_dir()


def _version_dirs(path: Path) -> list[Path]:
    try:
        return sorted(
            p for p in path.iterdir() if _visible_dir(p) and os.path.lexists(p / MANIFEST_FILE)
        )
    except OSError:
        return []


def load_folder(
    models_dir: Path,
    folder: str,
    max_pixels: int,
    calibration: CalibrationSettings | None = None,
    sources: SensorSources | None = None,
    max_manifest_bytes: int = MAX_MANIFEST_BYTES,
) -> FolderLoad:
    """Load ``models_dir/folder``: one bundle (flat layout, labelled by its manifest's
    version) or every ``<version>/`` subfolder of it (each labelled by its folder name and
    required to be named ``folder``). Never raises for a bad bundle: it is a failure."""
    path = models_dir / folder
    result = FolderLoad(folder)
    flat = os.path.lexists(path / MANIFEST_FILE)
    targets = [(None, path)] if flat else [(p.name, p) for p in _version_dirs(path)]
    for label, target in targets:
        where = folder if label is None else f"{folder}/{label}"
        try:
            bundle = load_bundle(target, max_pixels, calibration, sources, max_manifest_bytes)
            if label is not None and bundle.name != folder:
                raise BundleError(
                    f"version folder {where!r} holds bundle {bundle.name!r}; the versions in "
                    f"{folder!r} must be named {folder!r} (rename the folder or the bundle)",
                    bundle=folder,
                )
        except Exception as exc:  # a bundle must never take the others down with it
            if isinstance(exc, BundleError):
                log.error("bundle folder %s not loaded: %s", target, exc)
                reason = str(exc)
            else:
                log.exception("bundle folder %s not loaded", target)
                reason = f"{type(exc).__name__}: {exc}"
            name = getattr(exc, "bundle", None) or folder
            result.failures.append(Failure(where, name, public_reason(reason, target, models_dir)))
            result.failed_labels.add(label if label is not None else "")
            continue
        result.bundles.append((bundle.manifest.version if label is None else label, bundle))
        log.info("bundle %s (%s) loaded (%d models)", bundle.name, where, len(bundle.models))
    if flat and result.failed_labels:
        result.failed_labels = {"*"}  # the flat folder's one bundle, whatever its version
    return result


def load_registry(
    models_dir: Path,
    max_pixels: int,
    calibration: CalibrationSettings | None = None,
    sources: SensorSources | None = None,
    max_manifest_bytes: int = MAX_MANIFEST_BYTES,
) -> Registry:
    registry = Registry()
    for folder in bundle_folders(models_dir):
        registry.install(
            load_folder(models_dir, folder, max_pixels, calibration, sources, max_manifest_bytes)
        )
    for name in sorted(set(sources or {}) - set(registry.bundles) - set(registry.failed)):
        log.warning("BUDGETSERVE_SENSOR_SOURCES names bundle %r, which is not loaded", name)
    return registry
