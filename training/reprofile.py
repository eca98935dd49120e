"""Re-profile a bundle's extractors on this machine and write the new cost curves into it
(``budgetserve-train profile --into BUNDLE``).

Only the curves change: each extractor's ``cost`` (coefficients, quantile, fit error,
profiled sizes) and a ``cost_profile`` entry in the provenance's parameters (when, where,
sides, repeats, quantile). The models, strategies and version stay as they are. The new
manifest is validated, written atomically (a temporary file renamed over ``manifest.json``),
then the bundle is loaded the way the service loads it; if that fails the previous manifest
is put back.
"""

from __future__ import annotations

import datetime as _dt
import math
import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from service.bundle import CostPolynomial, Manifest, read_manifest, write_manifest
from service.extractors.base import Extractor, available_extractors, create_extractor

DEFAULT_SIDES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Reprofiled:
    manifest: Manifest
    before: dict[str, CostPolynomial]
    after: dict[str, CostPolynomial]
    sides: tuple[int, ...]


def bundle_extractors(manifest: Manifest) -> dict[str, Extractor]:
    """The bundle's extractors, as its manifest configures them, by their names in it."""
    installed = available_extractors()
    return {
        spec.name: create_extractor(spec.entry_point, spec.version, spec.params, installed)
        for spec in manifest.extractors
    }


def profiled_sides(manifest: Manifest) -> tuple[int, ...]:
    """The image sides the bundle's curves were profiled at (else the defaults)."""
    sides = {math.isqrt(n) for e in manifest.extractors for n in e.cost.profiled_sizes}
    return tuple(sorted(s for s in sides if s >= 8)) or DEFAULT_SIDES


def reprofile_bundle(
    bundle: Path,
    sides: Sequence[int] | None = None,
    repeats: int = 31,
    quantile: float = 0.95,
    progress: bool | Callable[[str, int, int], None] = False,
) -> Reprofiled:
    """Profile ``bundle``'s extractors here and write the curves into its manifest."""
    from service.registry import load_bundle
    from training.profiling import fit_profiles, profile_extractors

    manifest = read_manifest(bundle)
    if manifest.cost_basis != "measured" or manifest.item.kind != "image":
        raise ValueError(
            f"bundle {manifest.name!r} has {manifest.cost_basis} costs on {manifest.item.kind} "
            "items: only image bundles with measured (ms) costs can be re-profiled"
        )
    chosen = tuple(sides) if sides else profiled_sides(manifest)
    timings = profile_extractors(
        bundle_extractors(manifest), list(chosen), repeats, progress=progress
    )
    fitted = fit_profiles(timings, quantile=quantile)
    before = {e.name: e.cost for e in manifest.extractors}
    after = {name: fitted[name].model_copy(update={"unit": before[name].unit}) for name in before}
    parameters = dict(manifest.provenance.parameters)
    parameters["cost_profile"] = {
        "profiled_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "host": {"platform": platform.platform(), "machine": platform.machine()},
        "sides": list(chosen),
        "repeats": repeats,
        "quantile": quantile,
    }
    updated = Manifest.model_validate(
        {
            **manifest.model_dump(),
            "extractors": [
                {**e.model_dump(), "cost": after[e.name].model_dump()} for e in manifest.extractors
            ],
            "provenance": {**manifest.provenance.model_dump(), "parameters": parameters},
        }
    )
    write_manifest(bundle, updated)
    try:
        load_bundle(bundle, max_pixels=manifest.item.max_pixels)
    except Exception:
        write_manifest(bundle, manifest)
        raise
    return Reprofiled(updated, before, after, chosen)
