"""The application state the endpoints share, typed (built by the lifespan in ``app``)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from service import errors
from service.cache import FeatureCache
from service.handler import PredictHandler
from service.management import ModelManager
from service.metrics import Metrics
from service.registry import Registry
from service.settings import Settings


@dataclass
class AppState:
    """What one app holds. ``registry``, ``cache`` and ``handler`` are None until the lifespan
    has loaded the bundles; ``ready`` is True while at least one bundle serves."""

    settings: Settings
    metrics: Metrics
    registry: Registry | None = None
    cache: FeatureCache | None = None
    handler: PredictHandler | None = None
    ready: bool = False
    manager: ModelManager | None = None

    def loaded_registry(self) -> Registry:
        """The registry, or :class:`~service.errors.ServiceNotReady` while starting."""
        if self.registry is None:
            raise errors.ServiceNotReady()
        return self.registry

    def loaded_handler(self) -> PredictHandler:
        """The predict handler, or :class:`~service.errors.ServiceNotReady` while starting."""
        if self.handler is None:
            raise errors.ServiceNotReady()
        return self.handler


async def app_state(request: Request) -> AppState:
    """FastAPI dependency: the state of the app serving ``request``. (``async``: FastAPI
    runs a plain ``def`` dependency in its thread pool, a hand-off per request for a
    look-up.)"""
    state: AppState = request.app.state.core
    return state
