"""``GET /docs`` serves Swagger UI from packaged files: every file the page loads comes from
this app (it works offline), and the bundle is Swagger UI 5 (OpenAPI 3.1, as FastAPI's
schema)."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from service.cache import InProcessCache
from service.http import create_app
from service.settings import Settings


def test_docs_page_loads_only_local_files(digits_bundle_dir: Path) -> None:
    app = create_app(Settings(models_dir=digits_bundle_dir.parent), cache=InProcessCache(1 << 20))
    with TestClient(app) as client:
        page = client.get("/docs")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "/openapi.json" in page.text
        # nothing from another host: no absolute URL at all in the page
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", page.text), page.text
        assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert {Path(a).name for a in assets} >= {"swagger-ui-bundle.js", "swagger-ui.css"}
        for asset in assets:
            assert asset.startswith("/docs/assets/"), asset
            r = client.get(asset)
            assert r.status_code == 200 and len(r.content) > 500, asset
        bundle = client.get("/docs/assets/swagger-ui-bundle.js").text
        assert "SwaggerUIBundle" in bundle
        version = re.search(r'"?version"?\s*[:=]\s*"(5\.\d+\.\d+)"', bundle)
        assert version is not None, "the bundled Swagger UI is not 5.x (OpenAPI 3.1)"
        assert client.get("/docs/oauth2-redirect").status_code == 200
        # the docs routes stay out of the API schema
        assert not any(p.startswith("/docs") for p in client.get("/openapi.json").json()["paths"])
        # FastAPI's ReDoc page would load its script from a CDN: it is not served
        redoc = client.get("/redoc")
        assert redoc.status_code == 404 and "error" in redoc.json()
