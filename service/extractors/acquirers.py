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

A source costs a request at most its ``timeout_ms``, for the whole call (connecting,
sending, every byte of the answer: :class:`HttpSensor` closes a connection at its deadline
however slowly the bytes drip). ``failures`` failures of the source in a row (no answer in
time, an error, an HTTP status that is not "no such entry") open a circuit breaker: for
``retry_s`` the source is not called at all (the sensor is unavailable at once), then one
call probes it. An answer without the id's values (no entry, a missing field) is the
source working, not failing.

What a client reads (``unavailable``) says what went wrong, never where: no host, port, URL
or key (those are internal); the server log has them, with the item's id.

``charge`` says what acquiring costs a request: ``"declared"`` (the bundle's declared cost
of the sensor) or ``"measured"`` (the acquisition's wall time in milliseconds, for bundles
whose cost unit is ``ms``; checked when the bundle loads).

The module stays whole (over 450 lines): both built-in acquirers are thin ``fetch`` methods
on :class:`SensorAcquirer`, which holds what every source must get the same way (given values
first, one deadline per call, the circuit breaker, and which failures a client is told of).
"""

from __future__ import annotations

import contextlib
import heapq
import http.client
import itertools
import json
import logging
import math
import socket
import threading
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import redis

from service.cache import CircuitBreaker
from service.extractors.base import FeatureUnavailable, FloatVector
from service.extractors.sensor import check_columns, given_vector

__all__ = ["CHARGES", "HttpSensor", "RedisHashSensor", "SensorAcquirer", "SourceFailed"]

log = logging.getLogger("budgetserve.sources")

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


def _failures(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
        raise ValueError(f"failures must be a whole number in [1, 1000], got {value!r}")
    return value


def _retry_s(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 3600:
        raise ValueError(f"retry_s must be a number of seconds in [0, 3600], got {value!r}")
    return float(value)


class SourceFailed(Exception):
    """The source did not work (no answer in time, an error): counted by the breaker.

    ``reason`` is for clients (what went wrong, never where); ``detail`` for the log."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


class NoValues(Exception):
    """The source answered, without the id's values (no entry, a missing or bad field)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


class _Breaker:
    """:class:`~service.cache.CircuitBreaker` for calls from several worker threads."""

    def __init__(self, failures: int, retry_s: float) -> None:
        self._breaker = CircuitBreaker(failures, retry_s)
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            return self._breaker.allow()

    def success(self) -> None:
        with self._lock:
            self._breaker.success()

    def failure(self) -> bool:
        """Count a failure; True when it opened the breaker."""
        with self._lock:
            trips = self._breaker.trips
            self._breaker.failure()
            return self._breaker.trips != trips

    @property
    def state(self) -> str:
        with self._lock:
            return self._breaker.state

    @property
    def failures(self) -> int:
        return self._breaker.failures

    @property
    def retry_s(self) -> float:
        return self._breaker.retry_s


class SensorAcquirer(ABC):
    """What the acquirers share: given values first, then :meth:`fetch` for the rest,
    behind a circuit breaker (``failures`` in a row open it for ``retry_s``)."""

    name: ClassVar[str] = "acquirer"
    version: ClassVar[str] = "1"
    item_kind: ClassVar[str] = "tabular"

    def __init__(
        self,
        *,
        columns: Sequence[str] = (),
        charge: str = "declared",
        failures: int = 3,
        retry_s: float = 5.0,
    ) -> None:
        self.columns = check_columns(columns)
        if charge not in CHARGES:
            raise ValueError(f"charge must be one of {CHARGES}, got {charge!r}")
        self.charge = charge
        self.breaker = _Breaker(_failures(failures), _retry_s(retry_s))

    @property
    def dims(self) -> int:
        return len(self.columns)

    @abstractmethod
    def fetch(self, item_id: str, columns: list[str]) -> Mapping[str, Any]:
        """The raw values of ``columns`` for ``item_id`` (a missing column may be absent or
        None); raise :class:`SourceFailed` when the source does not work, :class:`NoValues`
        (or :class:`FeatureUnavailable`) when it has nothing for the id."""

    @abstractmethod
    def describe(self, item_id: str) -> str:
        """Where ``item_id``'s values are looked up, for the server log only (no
        credentials): clients never see it."""

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
        try:
            return self._values(item, item_id, missing)
        except NoValues as exc:
            log.info("sensor source %s: %s", self.describe(item_id), exc.detail)
            raise FeatureUnavailable(exc.reason) from exc

    def _values(self, item: Any, item_id: str, missing: list[str]) -> FloatVector:
        raw = self._fetch_guarded(item_id, missing)
        absent = [c for c in missing if raw.get(c) is None]
        if absent:
            shown = ", ".join(map(repr, absent))
            raise NoValues(
                f"the {self.name} source has no value for {shown} for this id",
                f"no value for {shown}",
            )
        values: dict[str, float] = {}
        for column in missing:
            value = _number(raw[column])
            if value is None:
                what = f"holds {_show(raw[column])} for {column!r}, not a finite number"
                raise NoValues(f"the {self.name} source {what}", what)
            values[column] = value
        return np.asarray(
            [float(item[c]) if c in item else values[c] for c in self.columns], dtype=np.float32
        )

    def _fetch_guarded(self, item_id: str, columns: list[str]) -> Mapping[str, Any]:
        breaker = self.breaker
        if not breaker.allow():
            raise FeatureUnavailable(
                f"the {self.name} source is failing: it is not asked for "
                f"{breaker.retry_s:g} s after {breaker.failures} failures "
                "in a row"
            )
        try:
            raw = self.fetch(item_id, columns)
        except SourceFailed as exc:
            opened = breaker.failure()
            log.warning("sensor source %s failed: %s", self.describe(item_id), exc.detail)
            if opened:
                log.error(
                    "sensor source %s: circuit breaker open after %d failures in a row; "
                    "not called for %g s",
                    self.describe(item_id),
                    breaker.failures,
                    breaker.retry_s,
                )
            raise FeatureUnavailable(exc.reason) from exc
        except (NoValues, FeatureUnavailable):
            breaker.success()  # it answered: working, without this id's values
            raise
        breaker.success()
        return raw


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


def _is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError | socket.timeout | redis.TimeoutError)


class RedisHashSensor(SensorAcquirer):
    """The sensor's columns from the Redis hash at ``key`` (``{id}`` replaced by the item's
    id; e.g. ``patient:{id}``), one field per column: ``HMGET key column...``.

    ``url`` is a redis-py URL (``redis://host:port/db``, ``rediss://`` for TLS); every call
    waits at most ``timeout_ms`` (connecting included: one reply of a few fields), and a
    Redis that is down or slower makes the sensor unavailable for that request, never an
    error."""

    name: ClassVar[str] = "redis_hash"

    def __init__(
        self,
        *,
        columns: Sequence[str] = (),
        url: str = "",
        key: str = "",
        timeout_ms: float = 50.0,
        charge: str = "declared",
        failures: int = 3,
        retry_s: float = 5.0,
    ) -> None:
        super().__init__(columns=columns, charge=charge, failures=failures, retry_s=retry_s)
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url must be a redis://, rediss:// or unix:// URL, got {url!r}")
        self.key = _template(key, "key")
        timeout = _timeout(timeout_ms)
        self.timeout_ms = timeout * 1000.0
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
            detail = f"{type(exc).__name__}: {exc}"
            if _is_timeout(exc) or "Timeout" in type(exc).__name__:
                raise SourceFailed(
                    f"the {self.name} source did not answer within {self.timeout_ms:g} ms", detail
                ) from exc
            raise SourceFailed(
                f"the {self.name} source is unreachable ({type(exc).__name__})", detail
            ) from exc
        if all(v is None for v in found):
            raise NoValues(f"the {self.name} source has no entry for this id", "no such hash")
        return dict(zip(columns, found, strict=True))


#: Statuses that say "no entry for this id" (the source works): not counted as failures.
NOT_FOUND = frozenset({400, 404, 410, 422})

#: What an id must be percent-encoded beyond ``urllib.parse.quote``'s unreserved set: a dot
#: (``..`` is a path segment) is one; letters, digits, ``-``, ``_`` and ``~`` stay as they are.
_SAFE_ID = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_~")


def quote_id(item_id: str) -> str:
    """``item_id`` percent-encoded (UTF-8) so that it stays one path segment and changes no
    other part of a URL: every byte but letters, digits, ``-``, ``_`` and ``~`` (so ``/``,
    ``?``, ``#``, ``%``, ``.`` and control characters are all encoded)."""
    return "".join(
        c if c in _SAFE_ID else "".join(f"%{b:02X}" for b in c.encode("utf-8")) for c in item_id
    )


def _path_segments(item_id: str) -> bool:
    """Whether ``item_id`` holds a ``.`` or ``..`` path segment: an upstream that decodes
    percent-encoded slashes and dots before it resolves its path would still climb out."""
    return any(part in (".", "..") for part in item_id.replace("\\", "/").split("/"))


class _Deadlines:
    """One thread that shuts the socket of a connection down at its call's deadline, so a
    blocked read returns at once however slowly the bytes drip (a socket timeout bounds each
    read, not the call)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, socket.socket]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, deadline: float, sock: socket.socket) -> int:
        token = next(self._ids)
        with self._cond:
            heapq.heappush(self._heap, (deadline, token, sock))
            self._live.add(token)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="budgetserve-source-deadlines", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return token

    def done(self, token: int) -> None:
        with self._cond:
            self._live.discard(token)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                deadline, token, sock = self._heap[0]
                now = time.monotonic()
                if token in self._live and now < deadline:
                    self._cond.wait(deadline - now)
                    continue
                heapq.heappop(self._heap)
                expired = token in self._live
                self._live.discard(token)
            if expired:
                with contextlib.suppress(OSError):  # already closed
                    sock.shutdown(socket.SHUT_RDWR)


_DEADLINES = _Deadlines()


class HttpSensor(SensorAcquirer):
    """The sensor's columns from ``GET url`` (``{id}`` replaced by the percent-encoded item
    id, :func:`quote_id`; e.g. ``http://lab.internal/patients/{id}/glucose``), answering a
    JSON object of ``{column: number}`` (or ``{"values": {column: number}}``).

    The whole call (connecting, the request, the status, headers and body) takes at most
    ``timeout_ms``; the body at most ``max_bytes``. Connects directly (proxy variables are
    not used) and never follows a redirect: a 3xx is a failure, like a 5xx, a timeout, a
    refused connection or a body that is not such an object; 400, 404, 410 and 422 say the
    source has no entry for the id. An id with a ``.`` or ``..`` path segment is not looked
    up."""

    name: ClassVar[str] = "http"

    def __init__(
        self,
        *,
        columns: Sequence[str] = (),
        url: str = "",
        timeout_ms: float = 1000.0,
        charge: str = "declared",
        max_bytes: int = 1 << 20,
        failures: int = 3,
        retry_s: float = 5.0,
    ) -> None:
        super().__init__(columns=columns, charge=charge, failures=failures, retry_s=retry_s)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http:// or https:// URL, got {url!r}")
        self.url = _template(url, "url")
        parts = urllib.parse.urlsplit(self.url)
        if not parts.hostname or ID_FIELD in parts.netloc:
            raise ValueError(
                f"url must name a host, and hold {ID_FIELD!r} in its path or query only (an id "
                f"never picks the host), got {url!r}"
            )
        self.timeout = _timeout(timeout_ms)
        self.max_bytes = int(max_bytes)

    def _url(self, item_id: str) -> str:
        return self.url.replace(ID_FIELD, quote_id(item_id))

    def describe(self, item_id: str) -> str:
        return f"GET {_where(self._url(item_id))}"

    def fetch(self, item_id: str, columns: list[str]) -> Mapping[str, Any]:
        if _path_segments(item_id):
            raise NoValues(
                f"the {self.name} source is not asked for an id holding a '.' or '..' path segment",
                "id holds a dot path segment",
            )
        status, body = self._get(self._url(item_id))
        within = f"within {self.timeout * 1000:g} ms"
        if status in NOT_FOUND:
            raise NoValues(
                f"the {self.name} source has no entry for this id (HTTP {status})",
                f"HTTP {status}",
            )
        if 300 <= status < 400:
            raise SourceFailed(
                f"the {self.name} source answered a redirect (HTTP {status}), which is not "
                "followed",
                f"HTTP {status} (redirects are not followed)",
            )
        if status != 200:
            raise SourceFailed(f"the {self.name} source answered HTTP {status}", f"HTTP {status}")
        if body is None:
            raise SourceFailed(
                f"the {self.name} source answered more than {self.max_bytes} bytes {within}",
                f"body over {self.max_bytes} bytes",
            )
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise SourceFailed(
                f"the {self.name} source did not answer JSON", f"not JSON: {exc}"
            ) from exc
        if isinstance(data, dict) and isinstance(data.get("values"), dict):
            data = data["values"]
        if not isinstance(data, dict):
            what = f"a JSON {type(data).__name__}, expected an object of {{column: number}}"
            raise SourceFailed(f"the {self.name} source answered {what}", what)
        return data

    def _get(self, url: str) -> tuple[int, bytes | None]:
        """(status, body) of ``GET url`` within the deadline; body None when over
        ``max_bytes``. Raises :class:`SourceFailed` for no answer in time or an error."""
        deadline = time.monotonic() + self.timeout
        parts = urllib.parse.urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname or "", parts.port, timeout=self.timeout)
        token = None
        try:
            conn.connect()  # within the timeout; the socket is watched from then on
            # (the response may take the socket over: http.client then drops conn.sock)
            token = _DEADLINES.watch(deadline, conn.sock)
            conn.request("GET", target, headers={"Accept": "application/json"})
            response = conn.getresponse()
            status = response.status
            body = response.read(self.max_bytes + 1) if status == 200 else b""
        except (OSError, http.client.HTTPException) as exc:
            detail = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline or _is_timeout(exc):
                raise SourceFailed(
                    f"the {self.name} source did not answer within {self.timeout * 1000:g} ms",
                    f"no answer within the deadline ({detail})",
                ) from exc
            raise SourceFailed(
                f"the {self.name} source is unreachable ({type(exc).__name__})", detail
            ) from exc
        finally:
            if token is not None:
                _DEADLINES.done(token)
            conn.close()
        if time.monotonic() > deadline:  # the last byte came in just as the deadline passed
            raise SourceFailed(
                f"the {self.name} source did not answer within {self.timeout * 1000:g} ms",
                "no complete answer within the deadline",
            )
        return status, (body if len(body) <= self.max_bytes else None)
