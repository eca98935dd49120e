"""Finding bundles on disk (repository) and loading them (registry).

A bundle is ready once its manifest parsed, every extractor it names is installed at the
recorded version, every ONNX model loaded and its strategy runtime was built. A bundle that
fails any of these is kept out of service and reported with the reason.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ValidationError

import service.strategies  # noqa: F401  (registers the built-in strategy runtimes)
from service.bundle import MANIFEST_FILE, Manifest, read_manifest
from service.cache import extractor_tag
from service.calibration import CostCalibrator
from service.errors import BundleError, ModelNotFound, ModelNotReady, StrategyNotFound
from service.extractors.base import Extractor, available_extractors, create_extractor
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


@dataclass(frozen=True)
class Failure:
    """A bundle folder that did not load: ``name`` is its manifest's name when the manifest
    parsed (else the folder's), ``reason`` is fit for clients (no server paths)."""

    folder: str
    name: str
    reason: str


@dataclass
class Registry:
    bundles: dict[str, Bundle] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # name -> reason (for 503s)
    failures: list[Failure] = field(default_factory=list)

    def fail(self, failure: Failure) -> None:
        """Record ``failure``; requests for its folder name or manifest name get 503 (unless
        another folder serves that name)."""
        self.failures.append(failure)
        for key in dict.fromkeys((failure.name, failure.folder)):
            if key not in self.bundles:
                self.failed.setdefault(key, failure.reason)

    def get(self, name: str) -> Bundle:
        bundle = self.bundles.get(name)
        if bundle is not None:
            return bundle
        if name in self.failed:
            raise ModelNotReady(name, self.failed[name])
        raise ModelNotFound(name, sorted(self.bundles))


def find_bundles(models_dir: Path) -> list[Path]:
    """Folders of ``models_dir`` holding a ``manifest.json`` entry, sorted by name: a file,
    or anything else by that name (a directory, a dangling link), which then fails to load
    with a reason instead of being skipped silently."""
    if not models_dir.is_dir():
        return []
    return sorted(
        p for p in models_dir.iterdir() if p.is_dir() and os.path.lexists(p / MANIFEST_FILE)
    )


@dataclass(frozen=True)
class CalibrationSettings:
    enabled: bool = True
    quantile: float = 0.95
    window: int = 256
    min_samples: int = 30


def load_bundle(
    path: Path,
    max_pixels: int,
    calibration: CalibrationSettings | None = None,
    sources: SensorSources | None = None,
) -> Bundle:
    """Load the bundle in ``path``; ``sources`` (``BUDGETSERVE_SENSOR_SOURCES``) gives its
    sensors their acquirers, looked up by the manifest's name."""
    calibration = calibration or CalibrationSettings()
    manifest = _read_manifest(path)
    try:
        return _load(path, manifest, max_pixels, calibration, (sources or {}).get(manifest.name))
    except BundleError as exc:
        exc.bundle = manifest.name
        raise
    except Exception as exc:  # a plugin or ONNX Runtime failing in its own way
        raise BundleError(
            f"bundle {manifest.name!r}: {type(exc).__name__}: {exc}", bundle=manifest.name
        ) from exc


def _read_manifest(path: Path) -> Manifest:
    """The bundle's manifest, with errors that name the problem and not the server's paths
    or the manifest's raw bytes."""
    entry = path / MANIFEST_FILE
    if not entry.resolve().is_relative_to(path.resolve()):
        raise BundleError(f"{MANIFEST_FILE} is a link leading outside the bundle folder")
    if entry.is_dir():
        raise BundleError(f"{MANIFEST_FILE} is a directory, not a file")
    if not entry.is_file():
        raise BundleError(f"{MANIFEST_FILE} is not a regular file (a dangling link?)")
    try:
        return read_manifest(path)
    except ValidationError as exc:
        problems = exc.errors(include_url=False, include_input=False)
        shown = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}"
            for e in problems[:5]
        )
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise BundleError(
            f"{MANIFEST_FILE} is not a valid manifest: {shown}{more}",
            bundle=_declared_name(entry),
        ) from exc
    except OSError as exc:
        raise BundleError(f"cannot read {MANIFEST_FILE}: {exc.strerror or exc}") from exc
    except ValueError as exc:  # not UTF-8
        raise BundleError(f"cannot read {MANIFEST_FILE}: {type(exc).__name__}") from exc


def _declared_name(entry: Path) -> str | None:
    """The ``name`` a manifest that failed validation declares, if it is readable JSON with a
    plain string name (so requests for that name get 503 rather than 404)."""
    try:
        raw = json.loads(entry.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    name = raw.get("name") if isinstance(raw, dict) else None
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
    _warm_up(manifest, extractors, models)
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
    return Bundle(
        name=manifest.name,
        path=path,
        manifest=manifest,
        extractors=extractors,
        models=models,
        runtimes=runtimes,
        costs=costs,
        calibrator=calibrator,
        decoder=make_decoder(manifest.item, max_pixels),
        tags={e.name: extractor_tag(e.name, e.version, e.params) for e in manifest.extractors},
    )


def _warm_up(
    manifest: Manifest, extractors: dict[str, Extractor], models: dict[str, LoadedModel]
) -> None:
    """Run every extractor and model once, so first requests don't pay one-off costs
    (lazy imports, allocator growth, ONNX Runtime's first-run initialisation) against
    their budgets."""
    blank: Any = (
        np.zeros((32, 32), dtype=np.float32)
        if manifest.item.kind == "image"
        else dict.fromkeys(manifest.item.columns, 0.0)
    )
    if manifest.item.kind == "tokens":
        from service.extractors.parsing import blank_sentence

        blank = blank_sentence()
    features = {}
    for name, extractor in extractors.items():
        try:
            features[name] = np.asarray(extractor.extract(blank), dtype=np.float32)
        except Exception as exc:  # a plugin that cannot handle a blank item
            raise BundleError(
                f"bundle {manifest.name!r}: extractor {name!r} failed its warm-up on a blank "
                f"{manifest.item.kind} item: {exc}"
            ) from exc
    for model in models.values():
        model.predict_proba(features)


_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/-])/(?:[^\s'\"/:]+/)+([^\s'\":/]*)")


def public_reason(reason: str, folder: Path, models_dir: Path) -> str:
    """``reason`` without server paths: the bundle folder becomes its name, any other
    absolute path its last component."""
    for root, name in ((folder, folder.name), (models_dir, models_dir.name)):
        for variant in dict.fromkeys((str(root.resolve()), str(root.absolute()))):
            reason = reason.replace(variant, name)
    return _ABSOLUTE_PATH.sub(lambda m: f"…/{m.group(1)}", reason)


def load_registry(
    models_dir: Path,
    max_pixels: int,
    calibration: CalibrationSettings | None = None,
    sources: SensorSources | None = None,
) -> Registry:
    registry = Registry()
    for path in find_bundles(models_dir):
        try:
            bundle = load_bundle(path, max_pixels, calibration, sources)
        except Exception as exc:  # a bundle must never take the others down with it
            if isinstance(exc, BundleError):
                log.error("bundle folder %s not loaded: %s", path, exc)
                reason = str(exc)
            else:
                log.exception("bundle folder %s not loaded", path)
                reason = f"{type(exc).__name__}: {exc}"
            name = getattr(exc, "bundle", None) or path.name
            registry.fail(Failure(path.name, name, public_reason(reason, path, models_dir)))
            continue
        if bundle.name in registry.bundles:
            first = registry.bundles[bundle.name].path.name
            registry.fail(
                Failure(
                    path.name,
                    path.name,
                    f"duplicate bundle name {bundle.name!r}: folder {first!r} already serves it",
                )
            )
            continue
        registry.bundles[bundle.name] = bundle
        registry.failed.pop(bundle.name, None)
        log.info("bundle %s loaded (%d models)", bundle.name, len(bundle.models))
    for name in sorted(set(sources or {}) - set(registry.bundles) - set(registry.failed)):
        log.warning("BUDGETSERVE_SENSOR_SOURCES names bundle %r, which is not loaded", name)
    return registry
