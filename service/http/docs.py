"""``GET /docs``: Swagger UI served from the files of the ``swagger-ui-bundle-v2`` package
(Swagger UI 5, Apache-2.0), so the page works without internet access (FastAPI's own loads
it from a CDN)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path

DOCS_PATH = "/docs"
ASSETS_PATH = "/docs/assets"
OAUTH2_REDIRECT_PATH = "/docs/oauth2-redirect"


def install_docs(app: FastAPI) -> None:
    """Serve Swagger UI at ``/docs`` with its files at ``/docs/assets`` (the app must be
    created with ``docs_url=None``)."""
    app.mount(ASSETS_PATH, StaticFiles(directory=str(swagger_ui_path)), name="swagger-ui")

    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PATH}/favicon-32x32.png",
            oauth2_redirect_url=OAUTH2_REDIRECT_PATH,
        )

    async def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    app.add_api_route(DOCS_PATH, docs, methods=["GET"], include_in_schema=False)
    app.add_api_route(
        OAUTH2_REDIRECT_PATH, oauth2_redirect, methods=["GET"], include_in_schema=False
    )
