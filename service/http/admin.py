"""Model management over HTTP: ``POST /-/reload`` (every folder, like Prometheus's
``/-/reload``), ``POST /models/{name}/reload``, ``DELETE /models/{name}``.

Each call must send ``Authorization: Bearer <token>``, the token being
``BUDGETSERVE_ADMIN_TOKEN``: a call without it is a 401 (RFC 9110: the credentials are
missing; the message says when management is disabled), a call with another token too. While
the token is unset, model management is disabled: a call that sends a bearer token is a 403.
A blank token is refused at start (``service.settings``).
A call changes the worker process that receives it; with ``BUDGETSERVE_WORKERS`` > 1 the
answer says so (``scope``), and folder watching (``BUDGETSERVE_WATCH_INTERVAL_S``) is what
reloads every worker.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service import errors
from service.http.state import AppState, app_state
from service.management import ModelManager, ReloadReport

State = Annotated[AppState, Depends(app_state)]


def _manager(state: AppState, credentials: HTTPAuthorizationCredentials | None) -> ModelManager:
    token = state.settings.admin_token
    if credentials is None:
        raise errors.AdminUnauthorized(enabled=token is not None)
    if token is None:
        raise errors.AdminDisabled()
    if not hmac.compare_digest(credentials.credentials.encode(), token.get_secret_value().encode()):
        raise errors.AdminUnauthorized()
    if state.manager is None:
        raise errors.ServiceNotReady()
    return state.manager


def _scope(state: AppState) -> dict[str, Any]:
    workers = state.settings.workers or 1  # 0 (auto) outside budgetserve-serve: this process
    scope: dict[str, Any] = {"pid": os.getpid(), "workers": workers}
    if workers > 1:
        scope["note"] = (
            f"this changed 1 worker process of {workers}; set BUDGETSERVE_WATCH_INTERVAL_S "
            "so that every worker reloads the models folder when it changes"
        )
    return scope


def _answer(state: AppState, report: ReloadReport) -> dict[str, Any]:
    return {**asdict(report), "scope": _scope(state)}


# Documented as the OpenAPI security scheme of these routes; checked in _manager.
AuthHeader = Annotated[
    HTTPAuthorizationCredentials | None,
    Depends(
        HTTPBearer(
            auto_error=False,
            scheme_name="admin token",
            description="Authorization: Bearer <BUDGETSERVE_ADMIN_TOKEN>",
        )
    ),
]


async def reload_all(state: State, authorization: AuthHeader = None) -> dict[str, Any]:
    """Load every bundle folder again; unload names whose folder is gone. A version that
    fails to load keeps its previous bundle serving (``failed[].serving``)."""
    return _answer(state, await _manager(state, authorization).reload_all())


async def reload_model(name: str, state: State, authorization: AuthHeader = None) -> dict[str, Any]:
    """Load the folder of ``name`` again (every version in it); also loads a new folder of
    that name."""
    manager = _manager(state, authorization)
    report = await manager.reload(name)
    if not (report.loaded or report.failed or report.unloaded):
        raise errors.ModelNotFound(name, sorted(manager.registry.bundles))
    return _answer(state, report)


async def unload_model(name: str, state: State, authorization: AuthHeader = None) -> dict[str, Any]:
    """Stop serving ``name`` (every version) in this worker, until its folder is loaded
    again; remove the folder to keep it out for good."""
    manager = _manager(state, authorization)
    if not await manager.unload(name):
        raise errors.ModelNotFound(name, sorted(manager.registry.bundles))
    return {"unloaded": [name], "scope": _scope(state)}
