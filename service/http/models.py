"""``GET /models``, ``/models/{name}``, ``/models/{name}/costs``, ``/models/{name}/skyline``."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from fastapi import Depends, Query

from service.bundle import Manifest
from service.errors import InvalidRequest
from service.http.state import AppState, app_state
from service.registry import Registry

State = Annotated[AppState, Depends(app_state)]


async def list_models(state: State) -> dict[str, Any]:
    """Loaded bundles, and the bundle folders that failed to load: ``name`` is the
    manifest's name when it parsed (else the folder's), ``error`` the reason."""
    reg = state.loaded_registry()
    return {
        "models": [{**_summary(b.manifest), **_versions(reg, n)} for n, b in reg.bundles.items()],
        "failed": [
            {
                "name": f.name,
                "folder": f.folder,
                "error": f.reason,
                # a reload that failed while an earlier load of the name still serves
                "serving": f.name in reg.bundles,
            }
            for f in sorted(reg.failures, key=lambda f: (f.name, f.folder))
        ],
    }


def _versions(reg: Registry, name: str) -> dict[str, Any]:
    """The versions of ``name`` (oldest first) with their manifests' versions, and the
    default one (the newest)."""
    versions = reg.versions.get(name) or {reg.bundles[name].manifest.version: reg.bundles[name]}
    return {
        "versions": [
            {"version": v, "manifest_version": b.manifest.version} for v, b in versions.items()
        ],
        "default_version": next(reversed(versions)),
    }


async def get_model(name: str, state: State) -> dict[str, Any]:
    reg = state.loaded_registry()
    bundle = reg.get(name)
    m = bundle.manifest
    detail = {**_summary(m), **_versions(reg, name)}
    detail["extractors"] = [
        {"name": e.name, "version": e.version, "dims": e.dims, "cost": e.cost.model_dump()}
        for e in m.extractors
    ]
    if m.item.kind == "tabular":
        # Where each sensor's missing values come from: "sensor" (only the values a request
        # sends) or the acquirer BUDGETSERVE_SENSOR_SOURCES gives it, and how it is charged.
        for entry in detail["extractors"]:
            served_by = bundle.extractors[entry["name"]]
            entry["source"] = {
                "plugin": getattr(type(served_by), "name", type(served_by).__name__),
                "charge": getattr(served_by, "charge", "declared"),
            }
    detail["models"] = [
        {"id": s.id, "features": s.features, "accuracy": s.accuracy} for s in m.models
    ]
    detail["strategies"] = [s.summary() for s in m.strategies]
    detail["provenance"] = m.provenance.model_dump()
    if m.cost_basis == "measured":
        # What this process itself costs a request, measured here (service.floor): the
        # cheapest budget that buys any feature, at a few sizes of the bundle's domain.
        detail["floor"] = state.loaded_handler().floor.snapshot(name, _sizes(m))
    return detail


async def get_costs(name: str, state: State) -> dict[str, Any]:
    """Profiled vs live-calibrated cost curve of every extractor."""
    bundle = state.loaded_registry().get(name)
    sizes = _sizes(bundle.manifest)
    return {
        "model": name,
        "unit": bundle.manifest.cost_unit,
        "calibrated": bundle.costs.calibrated,
        **bundle.calibrator.snapshot(sizes),
    }


async def get_skyline(
    name: str,
    size: Annotated[
        int,
        Query(
            gt=0,
            le=1 << 26,
            description="item size n (in the bundle's size_unit; tabular bundles: 1, every row)",
        ),
    ],
    state: State,
    strategy: Annotated[str | None, Query(max_length=64)] = None,
) -> dict[str, Any]:
    """What each budget buys at ``size``: (cost, accuracy, features), cost-sorted; ``model``
    is a model id, or an operating point id for strategies that choose between points
    (gating: its cost is the expected cost, its features those of the gate and f1). For
    bundles with measured costs, ``floor_ms`` is the service's own cost for an item of that
    size (``GET /models/{name}``: ``floor``) and each point's ``budget`` the budget that buys
    it: its cost plus the floor."""
    bundle = state.loaded_registry().get(name)
    runtime = bundle.strategy(strategy)
    lo, hi, what = bundle.decoder.size_range()
    if not lo <= size <= hi:
        raise InvalidRequest(
            f"size {size} is not one this bundle's items can have: {what} ({lo} to {hi} "
            f"{bundle.manifest.item.size_unit}); ask for a size in that range"
        )
    floor = None
    if bundle.manifest.cost_basis == "measured":
        floor = state.loaded_handler().floor.floor_ms(name, size)
    return {
        "model": name,
        "strategy": runtime.name,
        "size": size,
        "unit": bundle.manifest.cost_unit,
        "calibrated": bundle.costs.calibrated,
        "floor_ms": floor,
        "skyline": [
            {
                "cost": cost,
                "budget": None if floor is None else cost + floor,
                "accuracy": acc,
                "model": model,
                "features": runtime.skyline_features(model),
            }
            for cost, acc, model in runtime.skyline(size)
        ],
    }


def _summary(m: Manifest) -> dict[str, Any]:
    return {
        "name": m.name,
        "version": m.version,
        "task": m.task,
        "classes": m.classes,
        "strategies": [s.name for s in m.strategies],
        "default_strategy": m.default_strategy,
        "cost_unit": m.cost_unit,
        "item": m.item.described(),
        "n_models": len(m.models),
    }


def _sizes(m: Manifest) -> list[int]:
    """Seven sizes spanning the bundle's domain (geometric)."""
    lo, hi = _size_domain(m)
    return sorted({int(v) for v in np.geomspace(max(lo, 1.0), hi, 7)})


def _size_domain(m: Manifest) -> tuple[float, float]:
    """The sizes to sample cost curves at: a strategy's own domain when one declares it, else
    the profiled sizes of the extractors."""
    for s in m.strategies:
        domain = s.size_domain_hint()
        if domain is not None:
            return domain
    sizes = [n for e in m.extractors for n in e.cost.profiled_sizes]
    return (float(min(sizes)), float(max(sizes))) if sizes else (64.0, 65536.0)
