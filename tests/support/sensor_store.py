"""Rows of a tabular data set kept in a real Redis, one hash per row (one field per column),
the layout the ``redis_hash`` sensor acquirer reads: the test-side twin of an online
feature store."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import redis
from fastapi.testclient import TestClient

from service.sources import SensorSource


class SensorStore:
    """Writes rows under ``<prefix><id>`` (a fresh prefix per store, so tests sharing one
    Redis never see each other's rows) and builds the items and settings that use them."""

    def __init__(self, url: str, columns: Sequence[str]) -> None:
        self.url = url
        self.columns = list(columns)
        self.prefix = f"entity-{uuid.uuid4().hex[:8]}:"
        self.client = redis.Redis.from_url(url)

    @property
    def key(self) -> str:
        return self.prefix + "{id}"

    def source(self, **extra: Any) -> SensorSource:
        """A ``redis_hash`` source reading this store (``BUDGETSERVE_SENSOR_SOURCES``)."""
        return SensorSource.model_validate(
            {"plugin": "redis_hash", "url": self.url, "key": self.key, **extra}
        )

    def put(self, row: np.ndarray | Sequence[float], item_id: str | None = None) -> str:
        """Store ``row`` and return its id: ``item_id``, or one derived from the values (the
        same row always gets the same id, as an item sent by content would)."""
        values = np.asarray(row, dtype=np.float64)
        if item_id is None:
            item_id = "row-" + hashlib.blake2b(values.tobytes(), digest_size=8).hexdigest()
        mapping = {c: repr(float(v)) for c, v in zip(self.columns, values, strict=True)}
        self.client.hset(self.prefix + item_id, mapping=mapping)  # type: ignore[arg-type]
        return item_id

    def item(self, row: np.ndarray | Sequence[float], item_id: str | None = None) -> dict[str, Any]:
        """An item that carries only its id: every sensor is acquired from the store."""
        return {"id": self.put(row, item_id)}


class StoreClient(TestClient):
    """A test client of an app whose tabular sensors are acquired from ``store``."""

    store: SensorStore
