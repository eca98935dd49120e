"""Issue 27, the second outside probe: what a real ``budgetserve-serve`` does at its edges.

Each test reproduces one defect the probe found against the real server (a subprocess, a
real uvicorn, the real app): requests queued at SIGTERM, start-up errors, forged log lines,
path parameters a file system cannot take, the published request schema.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import uvicorn
from fastapi.testclient import TestClient

from service.http import create_app
from service.http.requestlog import configure_logging
from service.server import DrainingServer, listening_socket, uvicorn_options
from service.settings import Settings
from tests.conftest import ROOT, digit_image, png_b64
from tests.service.test_serve_workers import _read_response

SERVE = Path(sys.executable).with_name("budgetserve-serve")


def _env(**settings: str) -> dict[str, str]:
    base = {
        k: v for k, v in os.environ.items() if not k.startswith("BUDGETSERVE_") and k != "REDIS_URL"
    }
    return {**base, "PYTHONPATH": str(ROOT), **settings}


def test_connections_queued_when_shutdown_begins_are_answered_not_reset(
    tiny_bundle_dir: Path,
) -> None:
    """Issue 27: with 2 workers under overload, requests that had connected (their
    connection waiting in the listening socket's accept queue, the event loop being busy)
    when SIGTERM came ended in a read error the server never logged: closing a listening
    socket resets what is queued on it. Here 12 clients connect and send while shutdown
    begins, before the socket closes (a real uvicorn and app in this process); every one of
    them must get an HTTP answer, and the socket must then be closed."""
    body = json.dumps(
        {"model": "tiny", "item": {"png_base64": png_b64(digit_image(3, 32))}, "budget": 5.0}
    ).encode()
    request = (
        b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    sock = listening_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    clients: list[socket.socket] = []

    class Probed(DrainingServer):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # On the event loop, which accepts nothing meanwhile: the kernel queues them.
            for _ in range(12):
                conn = socket.create_connection(("127.0.0.1", port), timeout=30)
                conn.sendall(request)
                clients.append(conn)
            await super().shutdown(sockets)

    app = create_app(Settings(models_dir=tiny_bundle_dir.parent))
    config = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=30, **uvicorn_options()
    )
    server = Probed(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(600):
            if server.started:
                break
            time.sleep(0.05)
        assert server.started, "uvicorn did not start"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    statuses: list[int | str] = []
    for conn in clients:
        with conn:
            try:
                statuses.append(_read_response(conn)[0])
            except OSError as exc:  # a reset: what the probe saw
                statuses.append(type(exc).__name__)
    assert len(statuses) == 12 and all(s in (200, 503) for s in statuses), statuses
    with pytest.raises(ConnectionRefusedError):  # nothing listens any more
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


NASTY_NAMES = ["\x00", "a\x00b", "x\ny", "\r\n2026-11-27 ERROR forged", "..", "%", "é" * 200]


def test_no_path_parameter_value_gives_a_5xx(tiny_bundle_dir: Path) -> None:
    """Issue 27: POST /models/%00/reload answered 500 (the NUL reached the file system).
    Every route with path parameters, every parameter set to a NUL, a line break, '..', a
    long or non-ASCII name: a 4xx, never a 5xx; the admin routes refuse a name no bundle
    folder can have with a clear 422."""
    app = create_app(
        Settings(models_dir=tiny_bundle_dir.parent, admin_token="t0k"),  # type: ignore[arg-type]
    )
    auth = {"Authorization": "Bearer t0k"}
    with TestClient(app) as client:
        paths = client.get("/openapi.json").json()["paths"]
        templated = [(p, m) for p, methods in paths.items() if "{" in p for m in methods]
        assert len(templated) >= 10, templated
        seen = 0
        for path, method in templated:
            for value in NASTY_NAMES:
                url = re.sub(r"\{[^}]+\}", quote(value, safe="").replace("\\", "\\\\"), path)
                body: dict[str, Any] | None = {"inputs": []} if method == "post" else None
                r = client.request(method.upper(), url, headers=auth, json=body)
                assert r.status_code < 500, (method, path, value, r.text)
                seen += 1
        for value in ("\x00", "a\x00b", "x\ny"):
            for method, url in (("POST", "/models/{}/reload"), ("DELETE", "/models/{}")):
                r = client.request(method, url.format(quote(value, safe="")), headers=auth)
                assert r.status_code == 422, r.text
                assert "cannot name a bundle folder" in r.json()["error"]["message"]
    assert seen == len(templated) * len(NASTY_NAMES)


FORGED = "2026-11-27 08:00:00,000 ERROR budgetserve.api [-] FORGED"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_client_strings_never_start_a_log_line(
    tiny_bundle_dir: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 27: GET /models/x%0a<a log line> wrote a forged ERROR line to the text log (the
    request line logs the decoded path). Paths, model names, strategies, versions and ids,
    with line breaks, NEL, U+2028 and quotes in them, through the real app: every line of
    the log is one of its own records (JSON: one object per line), and the forged text is
    there only escaped, inside the record that carried it."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    configure_logging(fmt)
    try:
        app = create_app(Settings(models_dir=tiny_bundle_dir.parent))
        with TestClient(app) as client:
            for sep in ("\n", "\r\n", "\x85", "\u2028"):
                client.get("/models/x" + quote(sep + FORGED))
                body = {
                    "model": "tiny" + sep + FORGED,
                    "strategy": 'a "b"=c' + sep + FORGED,
                    "version": "v" + sep + FORGED,
                    "item": {"png_base64": png_b64(digit_image(1, 16)), "id": sep + FORGED},
                    "budget": 1.0,
                }
                client.post("/predict", json=body)
        logged = capsys.readouterr().err
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    lines = logged.splitlines()  # splits at \r, \x85 and \u2028 too
    assert len(lines) > 8 and "FORGED" in logged
    for line in lines:
        assert not line.startswith("2026-11-27 08:00:00"), line
        if fmt == "json":
            json.loads(line)
        else:
            assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ", line), line
    assert "\\n2026-11-27 08:00:00,000 ERROR" in logged  # escaped, in its own record


@pytest.mark.parametrize(
    ("env", "says"),
    [
        (
            {"BUDGETSERVE_SENSOR_SOURCES": '{"pima": {"*": {"plugin": "http",}}}'},
            'BUDGETSERVE_SENSOR_SOURCES=\'{"pima": {"*": {"plugin": "http",}}}\': '
            "Value error, not valid JSON (Expecting property name enclosed in double quotes "
            "at line 1 column 34)",
        ),
        (
            {"REDIS_URL": "http://cache:6379/0"},
            "REDIS_URL='http://cache:6379/0': Value error, must",
        ),
        ({"BUDGETSERVE_ADMIN_TOKEN": " "}, "BUDGETSERVE_ADMIN_TOKEN=' ': Value error, is blank"),
        ({"BUDGETSERVE_HOST": "nohost.invalid"}, "the host does not resolve"),
        ({"BUDGETSERVE_PORT": "in use"}, "the port is in use by another process"),
    ],
)
def test_start_up_problems_are_one_readable_line_and_exit_2(
    tiny_bundle_dir: Path,
    env: dict[str, str],
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Issue 27: invalid JSON in BUDGETSERVE_SENSOR_SOURCES (a 42-line traceback), a
    REDIS_URL that is not Redis's, a port in use and a host that does not resolve were
    tracebacks; a blank BUDGETSERVE_ADMIN_TOKEN was taken, locking admin for good. Each is
    now one line naming the setting, and exit status 2, before anything starts."""
    from service.__main__ import main

    for name in list(os.environ):
        if name.startswith("BUDGETSERVE_") or name == "REDIS_URL":
            monkeypatch.delenv(name)
    # A setting must fail before the folder is even looked at: with no folder, a setting
    # taken (a regression) ends in the folder's own error, not in a server that serves.
    binding = "BUDGETSERVE_HOST" in env or "BUDGETSERVE_PORT" in env
    folder = tiny_bundle_dir.parent if binding else tiny_bundle_dir / "no-such-folder"
    monkeypatch.setenv("BUDGETSERVE_MODELS_DIR", str(folder))
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    if env.get("BUDGETSERVE_PORT") == "in use":
        env = {"BUDGETSERVE_PORT": str(holder.getsockname()[1])}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        with pytest.raises(SystemExit) as exited:
            main([])
    finally:
        holder.close()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    [line] = err.strip().splitlines()
    assert line.startswith("budgetserve-serve: ") and says in line, line


def test_the_schema_says_exactly_one_of_budget_and_total_budget(tiny_bundle_dir: Path) -> None:
    """Issue 27: schemathesis sent batch bodies valid by the published schema, with both
    'budget' and 'total_budget' (or neither), and got 422: the schema did not say "exactly
    one". It does now, and the server and the schema agree on every combination."""
    import jsonschema

    app = create_app(Settings(models_dir=tiny_bundle_dir.parent))
    item = {"png_base64": png_b64(digit_image(2, 16))}
    with TestClient(app) as client:
        spec = client.get("/openapi.json").json()
        body_schema = spec["paths"]["/predict"]["post"]["requestBody"]["content"]
        schema = {**body_schema["application/json"]["schema"], "components": spec["components"]}
        validator = jsonschema.Draft202012Validator(schema)
        combinations: list[tuple[dict[str, float | None], bool]] = [
            ({"budget": 1.0}, True),
            ({"total_budget": 1.0}, True),
            ({"budget": 1.0, "total_budget": None}, True),
            ({"budget": None, "total_budget": 1.0}, True),
            ({"budget": 1.0, "total_budget": 1.0}, False),
            ({}, False),
            ({"budget": None, "total_budget": None}, False),
        ]
        for budgets, valid in combinations:
            body: dict[str, Any] = {"model": "tiny", "items": [item, item], **budgets}
            assert validator.is_valid(body) is valid, budgets
            r = client.post("/predict", json=body)
            assert r.status_code == (200 if valid else 422), (budgets, r.text)


def test_v2_tabular_ids_alone_are_items_and_values_columns_are_named_once(
    router_bundle_dir: Path,
) -> None:
    """Issue 27: a tabular v2 request carrying only ID got 400 where POST /predict takes
    {"id": ...}; VALUES with a column named twice was taken silently (the last one won)."""
    app = create_app(Settings(models_dir=router_bundle_dir.parent))
    ids = {"name": "ID", "datatype": "BYTES", "shape": [2], "data": ["p-1", "p-2"]}
    with TestClient(app) as client:
        r = client.post(
            "/v2/models/router/infer", json={"inputs": [ids], "parameters": {"budget": 6.0}}
        )
        assert r.status_code == 200, r.text
        answers = next(o for o in r.json()["outputs"] if o["name"] == "RESPONSE")["data"]
        single = client.post(
            "/predict", json={"model": "router", "item": {"id": "p-1"}, "budget": 6.0}
        ).json()
        for raw in answers:
            answer = json.loads(raw)
            assert answer["answered_by"] == single["answered_by"] == "prior"
            assert answer["next_sensor"] == single["next_sensor"] == "r"
        values = {
            "name": "VALUES",
            "datatype": "FP32",
            "shape": [1, 2],
            "parameters": {"columns": "r, r"},
            "data": [0.5, -0.5],
        }
        r = client.post(
            "/v2/models/router/infer", json={"inputs": [values], "parameters": {"budget": 6.0}}
        )
        assert r.status_code == 400, r.text
        assert "names 'r' more than once" in r.json()["error"]
