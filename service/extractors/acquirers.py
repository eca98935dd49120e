"""Sensor acquirers: plugins that fetch the values of a sensor a request did not send.

Registered in the ``budgetserve.extractors`` entry-point group like every extractor, and
put in place of a tabular bundle's ``sensor`` extractors by ``BUDGETSERVE_SENSOR_SOURCES``
(see ``service.sources`` and docs/operating.md#sensor-sources). Each is created with the
sensor's ``columns`` plus its own parameters and serves the sensor's vector for an item:

* values the request sent are used as they are (an acquirer never overrides the client);
* the missing ones are fetched by the item's ``id``: :class:`RedisHashSensor` reads them
  from a Redis hash (an online feature store, the layout Feast uses: one hash per entity,
  one field per column), :class:`HttpSensor` from a JSON endpoint;
* anything that keeps the values from being had (no id, the store down or slow, no entry
  for the id, a missing or non-numeric field, an HTTP error) raises
  :class:`~service.extractors.base.FeatureUnavailable` with the reason: the request then
  answers from what it has and names the sensor as the one to collect next.

``charge`` says what acquiring costs a request: ``"declared"`` (the bundle's declared cost
of the sensor) or ``"measured"`` (the acquisition's wall time in milliseconds, for bundles
whose cost unit is ``ms``; checked when the bundle loads).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import redis

from service.extractors.base import FeatureUnavailable, FloatVector
from service.extractors.sensor import check_columns, given_vector

__all__ = ["CHARGES", "HttpSensor", "RedisHashSensor", "SensorAcquirer"]

CHARGES = ("declared", "measured")
ID_FIELD = "{id}"


def _template(value: Any, what: str) -> str:
    if not isinstance(value, str) or ID_FIELD not in value:
        raise ValueError(f"{what} must be a string holding {ID_FIELD!r}, got {value!r}")
    return value


def _timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 60_000:
        raise ValueError(f"timeout_ms must be a number in (0, 60000], got {value!r}")
    return float(value) / 1000.0


class SensorAcquirer(ABC):
    """What the acquirers share: given values first, then :meth:`fetch` for the rest."""

    version: ClassVar[str] = "1"
    item_kind: ClassVar[str] = "tabular"

    def __init__(self, *, columns: Sequence[str] = (), charge: str = "declared") -> None:
        self.columns = check_columns(columns)
        if charge not in CHARGES:
            raise ValueError(f"charge must be one of {CHARGES}, got {charge!r}")
        self.charge = charge

    @property
    def dims(self) -> int:
        return len(self.columns)

    @abstractmethod
    def fetch(self, item_id: str, columns: list[str]) -> Mapping[str, Any]:
        """The raw values of ``columns`` for ``item_id`` (a missing column may be absent or
        None); raise :class:`FeatureUnavailable` when the source cannot be read."""

    def extract(self, item: Any) -> FloatVector:
        given = given_vector(self.columns, item)
        if given is not None:
            return given
        item_id = getattr(item, "id", None)
        if not isinstance(item_id, str):
            raise FeatureUnavailable(
                "the item has no 'id' to look the sensor up by: send an id, or the values"
            )
        missing = [c for c in self.columns if c not in item]
        raw = self.fetch(item_id, missing)
        absent = [c for c in missing if raw.get(c) is None]
        if absent:
            raise FeatureUnavailable(
                f"{self.describe(item_id)} has no value for {', '.join(map(repr, absent))}"
            )
        values: dict[str, float] = {}
        for column in missing:
            value = _number(raw[column])
            if value is None:
                raise FeatureUnavailable(
                    f"{self.describe(item_id)} holds {_show(raw[column])} for {column!r}, "
                    "not a finite number"
                )
            values[column] = value
        return np.asarray(
            [float(item[c]) if c in item else values[c] for c in self.columns], dtype=np.float32
        )

    @abstractmethod
    def describe(self, item_id: str) -> str:
        """Where ``item_id``'s values are looked up, for messages (no credentials)."""


def _number(value: Any) -> float | None:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and abs(number) <= 3.4e38 else None


def _show(value: Any, limit: int = 40) -> str:
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _where(url: str) -> str:
    """``scheme://host:port/path`` of ``url``, without credentials, query or fragment."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class RedisHashSensor(SensorAcquirer):
    """The sensor's columns from the Redis hash at ``key`` (``{id}`` replaced by the item's
    id; e.g. ``patient:{id}``), one field per column: ``HMGET key column...``.

    ``url`` is a redis-py URL (``redis://host:port/db``, ``rediss://`` for TLS); every call
    waits at most ``timeout_ms`` (connecting included), and a Redis that is down or slower
    makes the sensor unavailable for that request, never an error."""

    name: ClassVar[str] = "redis_hash"

    def __init__(
        self,
        *,
        columns: Sequence[str] = (),
        url: str = "",
        key: str = "",
        timeout_ms: float = 50.0,
        charge: str = "declared",
    ) -> None:
        super().__init__(columns=columns, charge=charge)
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got {url!r}")
        self.key = _template(key, "key")
        timeout = _timeout(timeout_ms)
        self.where = _where(url)
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    def describe(self, item_id: str) -> str:
        return f"Redis hash {self.key.replace(ID_FIELD, item_id)!r} at {self.where}"

    def fetch(self, item_id: str, columns: list[str]) -> Mapping[str, Any]:
        key = self.key.replace(ID_FIELD, item_id)
        try:
            found = self.client.hmget(key, columns)
        except redis.RedisError as exc:
            raise FeatureUnavailable(
                f"Redis at {self.where} did not answer ({type(exc).__name__}: {exc})"
            ) from exc
        if all(v is None for v in found):
            raise FeatureUnavailable(f"no Redis hash {key!r} at {self.where} holds these columns")
        return dict(zip(columns, found, strict=True))


class HttpSensor(SensorAcquirer):
    """The sensor's columns from ``GET url`` (``{id}`` replaced by the URL-quoted item id;
    e.g. ``http://lab.internal/patients/{id}/glucose``), answering a JSON object of
    ``{column: number}`` (or ``{"values": {column: number}}``).

    Waits at most ``timeout_ms``; connects directly (proxy variables are not used). A
    status other than 200, a timeout, a refused connection or a body that is not such an
    object makes the sensor unavailable for that request."""

    name: ClassVar[str] = "http"

    def __init__(
        self,
        *,
        columns: Sequence[str] = (),
        url: str = "",
        timeout_ms: float = 1000.0,
        charge: str = "declared",
        max_bytes: int = 1 << 20,
    ) -> None:
        super().__init__(columns=columns, charge=charge)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL, got {url!r}")
        self.url = _template(url, "url")
        self.timeout = _timeout(timeout_ms)
        self.max_bytes = int(max_bytes)
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _url(self, item_id: str) -> str:
        return self.url.replace(ID_FIELD, urllib.parse.quote(item_id, safe=""))

    def describe(self, item_id: str) -> str:
        return f"GET {_where(self._url(item_id))}"

    def fetch(self, item_id: str, columns: list[str]) -> Mapping[str, Any]:
        where = self.describe(item_id)
        request = urllib.request.Request(self._url(item_id), headers={"Accept": "application/json"})
        try:
            with self.opener.open(request, timeout=self.timeout) as response:
                body = response.read(self.max_bytes + 1)
        except urllib.error.HTTPError as exc:
            raise FeatureUnavailable(f"{where} answered HTTP {exc.code}") from exc
        except (urllib.error.URLError, OSError) as exc:  # refused, unreachable, timed out
            reason = getattr(exc, "reason", exc)
            raise FeatureUnavailable(f"{where} failed: {reason}") from exc
        if len(body) > self.max_bytes:
            raise FeatureUnavailable(f"{where} answered more than {self.max_bytes} bytes")
        try:
            data = json.loads(body)
        except ValueError as exc:
            raise FeatureUnavailable(f"{where} did not answer JSON") from exc
        if isinstance(data, dict) and isinstance(data.get("values"), dict):
            data = data["values"]
        if not isinstance(data, dict):
            raise FeatureUnavailable(
                f"{where} answered a JSON {type(data).__name__}, expected an object of "
                "{column: number}"
            )
        return data
