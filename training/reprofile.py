"""Re-profile a bundle's extractors on this machine and write the new cost curves into it
(``budgetserve-train profile --into BUNDLE``).

The curves change: each extractor's ``cost`` (coefficients, quantile, fit error, profiled
sizes), with a ``cost_profile`` entry in the provenance's parameters (when, where, sides,
repeats, quantile). So do the plans that were made under the old curves: each Poly-Dom
strategy's candidates and index are chosen again (:func:`replan_polydom`) among the bundle's
exported models, at the strategy's ε and size domain, so that a lookup answers for this
machine's costs. The models and the version stay as they are; greedy sequences keep their
order (each request still prices them with the new curves). The new
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

import numpy as np

from service.bundle import (
    CostPolynomial,
    Manifest,
    PolyDomIndex,
    PolyDomStrategy,
    read_manifest,
    write_manifest,
)
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


def replan_polydom(
    strategy: PolyDomStrategy, manifest: Manifest, curves: dict[str, CostPolynomial]
) -> PolyDomStrategy:
    """``strategy`` with its candidates and index chosen again under ``curves`` (paper 002:
    the ε-pruned candidates among every exported model, then the skylines at the curves'
    intersections), from the models' accuracies in ``manifest``."""
    from training.polydom.candidates import prune_candidates
    from training.polydom.index import build_index
    from training.polydom.poly import set_costs

    names = [e.name for e in manifest.extractors]
    width = max(len(curves[n].coefficients) for n in names)
    costs = np.array(
        [curves[n].coefficients + [0.0] * (width - len(curves[n].coefficients)) for n in names]
    )
    bit = {name: i for i, name in enumerate(names)}
    best: dict[int, tuple[float, str]] = {}  # feature mask -> the most accurate model on it
    for model in manifest.models:
        mask = sum(1 << bit[f] for f in model.features)
        if mask not in best or model.accuracy > best[mask][0]:
            best[mask] = (model.accuracy, model.id)
    accuracy = {mask: acc for mask, (acc, _) in best.items()}
    domain = (float(strategy.size_domain[0]), float(strategy.size_domain[1]))
    masks = prune_candidates(accuracy, costs, domain, strategy.epsilon)
    index = build_index([accuracy[m] for m in masks], set_costs(masks, costs), domain)
    ids = [best[m][1] for m in masks]
    return strategy.model_copy(
        update={
            "candidates": ids,
            "index": PolyDomIndex(
                breakpoints=[float(b) for b in index.breakpoints],
                skylines=[[ids[p] for p in skyline] for skyline in index.skylines],
            ),
        }
    )


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
    strategies = [
        replan_polydom(s, manifest, after) if isinstance(s, PolyDomStrategy) else s
        for s in manifest.strategies
    ]
    updated = Manifest.model_validate(
        {
            **manifest.model_dump(),
            "extractors": [
                {**e.model_dump(), "cost": after[e.name].model_dump()} for e in manifest.extractors
            ],
            "strategies": [s.model_dump() for s in strategies],
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
