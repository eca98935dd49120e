"""Real servers for tests: the app under a real uvicorn (in a thread of this process), a
redis-server of a test's own that it may stop, kill and restart, and a script in a Python
process of its own (for what is process-wide: BLAS threads, the allocator)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
import uvicorn
from fastapi import FastAPI

from service.server import uvicorn_options
from tests.conftest import free_port


def fresh_python(script: str, *args: str, **env: str) -> str:
    """The standard output of ``script`` run with ``args`` by this interpreter in a process
    of its own, with ``env`` added to this one's environment; a failure fails the test
    with the script's error."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@contextmanager
def uvicorn_thread(app: FastAPI, **config: Any) -> Iterator[int]:
    """Serve ``app`` with uvicorn on a free loopback port, as ``budgetserve-serve`` does
    (``service.server.uvicorn_options``, which ``config`` may override); yields the port."""
    port = free_port()
    options = {**uvicorn_options(), **config}
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **options)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(600):
            if server.started:
                break
            if not thread.is_alive():
                raise RuntimeError("uvicorn exited during start-up")
            time.sleep(0.05)
        else:
            raise RuntimeError("uvicorn did not start within 30 s")
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def post_json(
    port: int, path: str, body: dict[str, Any], timeout: float = 60
) -> tuple[int, dict[str, str], dict[str, Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        payload = response.read()
        headers = {k.lower(): v for k, v in response.getheaders()}
        return response.status, headers, json.loads(payload)
    finally:
        conn.close()


def metric(text: str, sample: str) -> float:
    """The value of one sample (name with its labels, as exposed) in a text exposition."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise KeyError(f"{sample} is not in the exposition")


class RedisProcess:
    """A redis-server of one test's own, on a fixed loopback port across restarts."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="bs-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=1)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING in 10 s")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(timeout=30)


def read_one(conn: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, data
        data += chunk
    raw_head, _, payload = data.partition(b"\r\n\r\n")
    lines = raw_head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(payload) < int(headers["content-length"]):
        chunk = conn.recv(65536)
        assert chunk, payload
        payload += chunk
    return int(lines[0].split()[1]), headers, payload
