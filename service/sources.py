"""Where a tabular bundle's sensors get the values a request did not send.

``BUDGETSERVE_SENSOR_SOURCES`` (JSON) maps a bundle name to its sensors' sources; a sensor
name ``"*"`` stands for every sensor of the bundle without a source of its own::

    {"pima": {"*":       {"plugin": "redis_hash", "url": "redis://feast:6379/0",
                          "key": "patient:{id}"},
              "glucose": {"plugin": "http", "url": "http://lab/glucose/{id}",
                          "timeout_ms": 300, "charge": "measured"}}}

``plugin`` names an acquirer in the ``budgetserve.extractors`` entry-point group (built in:
``redis_hash``, ``http``; see ``service.extractors.acquirers``); every other key is passed to
it, with the sensor's ``columns``. A sensor without a source serves only the values sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.bundle import Manifest
from service.errors import BundleError
from service.extractors.base import Extractor, create_extractor

ALL_SENSORS = "*"
SENSOR_PLUGIN = "sensor"


class SensorSource(BaseModel):
    """One sensor's acquirer: its plugin and the plugin's parameters (the other keys)."""

    model_config = ConfigDict(extra="allow")

    plugin: str = Field(min_length=1, description="acquirer entry point, e.g. redis_hash, http")

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


SensorSources = dict[str, dict[str, SensorSource]]


def acquirers(
    manifest: Manifest,
    sources: Mapping[str, SensorSource],
    registry: Mapping[str, type[Extractor]],
) -> dict[str, Extractor]:
    """The acquirer of each of ``manifest``'s sensors that ``sources`` gives one, by sensor
    name; a :class:`BundleError` names a source that does not fit the bundle."""
    what = f"bundle {manifest.name!r}: BUDGETSERVE_SENSOR_SOURCES"
    sensors = {e.name: e for e in manifest.extractors if e.entry_point == SENSOR_PLUGIN}
    unknown = sorted(set(sources) - set(sensors) - {ALL_SENSORS})
    if unknown:
        raise BundleError(
            f"{what} names {unknown}, which are not sensors of this bundle (its sensors: "
            f"{sorted(sensors) or 'none'}); fix the names or use '*' for every sensor"
        )
    out: dict[str, Extractor] = {}
    for name, spec in sensors.items():
        source = sources.get(name) or sources.get(ALL_SENSORS)
        if source is None:
            continue
        params = {**source.params, "columns": list(spec.params.get("columns", []))}
        try:
            acquirer = create_extractor(source.plugin, None, params, registry)
        except LookupError as exc:
            raise BundleError(f"{what}, sensor {name!r}: {exc}") from exc
        if getattr(acquirer, "item_kind", None) != "tabular" or acquirer.dims != spec.dims:
            raise BundleError(
                f"{what}, sensor {name!r}: plugin {source.plugin!r} is not a tabular sensor "
                f"acquirer serving its {spec.dims} column(s)"
            )
        if getattr(acquirer, "charge", "declared") == "measured" and manifest.cost_unit != "ms":
            raise BundleError(
                f"{what}, sensor {name!r}: charge 'measured' charges milliseconds, but the "
                f"bundle's costs are in {manifest.cost_unit!r}; use charge 'declared'"
            )
        out[name] = acquirer
    return out
