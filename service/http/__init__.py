"""The HTTP layer: FastAPI app, routes, error mapping, middleware and request/response bodies.

- ``app``: :func:`create_app` and ``ROUTES``, the one list of routes (path, method,
  endpoint, documented responses), added to the app itself so ``app.routes`` lists them.
- ``state``: :class:`AppState`, the typed state the endpoints share (a FastAPI dependency).
- ``predict``, ``models``, ``health``: the endpoints, one module per area (``predict`` takes
  one item or a batch, ``service.batch``).
- ``v2``, ``v2_schemas``: the Open Inference Protocol (KServe v2 / Triton REST) routes.
- ``docs``: Swagger UI at ``/docs`` from packaged files.
- ``errors``: the one status table of the error taxonomy and the exception handlers.
- ``middleware``: :class:`BodyLimit` (413 over the size limit, 408 on a stalled body).
- ``schemas``: the bodies only HTTP uses (request, errors, readiness).

Nothing below ``service.http`` is imported by the core modules: the handler, registry and
strategies know nothing of HTTP.
"""

from service.http.app import create_app
from service.http.state import AppState

__all__ = ["AppState", "create_app"]
