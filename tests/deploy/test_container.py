"""The service image, checked without a Docker engine.

docker/Dockerfile is parsed here, so these tests follow it: the runtime stage's ENTRYPOINT + CMD
run with the stage's ENV (HOST/PORT moved to a free loopback port, MODELS_DIR at the
repository's models/) as PID 1 of a new PID namespace, as a container runtime starts it, with
every package that the runtime stage does not install (the `train` and `dev` extras) made
unimportable. Then: /healthz, a real /predict, the HEALTHCHECK command as written, and SIGTERM
while a request is in flight (the request completes, the process exits 0).

Not run: the image build itself (pip, useradd, COPY), and the image's USER — the venv's
interpreter lives under the developer's home, which that uid cannot reach; USER and the
ownership of /models are checked statically instead.

Why one module over 450 lines: the tests share the parsed Dockerfile and the PID-1 harness
that starts the runtime stage (namespaces, socket inodes, the blocked extras); split, each
part would need that harness.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.conftest import DIGITS_BUNDLE, ROOT, digit_image, free_port, png_b64
from tests.deploy.support import Image, load_image, settings_env_names, settings_from

DOCKERIGNORE = ROOT / "docker" / "Dockerfile.dockerignore"
VENV_BIN = Path(sys.executable).parent


# --- the Dockerfile ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def image() -> Image:
    return load_image()


def test_runtime_stage_shape(image: Image, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(image.stages) >= 2, "multi-stage: wheels are built in a stage of their own"
    for stage in image.stages:
        if stage.base in {s.name for s in image.stages}:
            continue
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", stage.base), (
            f"base image not pinned to a full version tag: {stage.base}"
        )
    assert image.uid != 0, "the image must not run as root"
    assert image.runtime.last("STOPSIGNAL") in (None, "SIGTERM")
    # Every BUDGETSERVE_ variable the image sets is a real setting, with a valid value.
    settings = settings_from(image.env, monkeypatch, "Dockerfile ENV")
    assert str(settings.models_dir) == "/models"
    assert image.exposed() == {settings.port, settings.grpc_port}, (
        "EXPOSE differs from BUDGETSERVE_PORT and BUDGETSERVE_GRPC_PORT"
    )
    # The models are baked where BUDGETSERVE_MODELS_DIR says, owned by the image's user.
    copies = [
        a
        for a in image.runtime.all("COPY")
        if (a.split()[-1].rstrip("/") + "/").startswith("/models/")
    ]
    assert copies, "no COPY into BUDGETSERVE_MODELS_DIR"
    assert f"--chown={image.uid}:{image.gid}" in copies[0].split(), (
        "bundles built by budgetserve-train are mode 0700: the image's user must own /models"
    )
    # Only the service's dependencies: no extras in any pip install of the runtime stage.
    for run in image.runtime.all("RUN"):
        assert not re.search(r"\[[\w,\s-]+\]", run), f"extras installed in the runtime: {run}"


def dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Whether a context path is excluded (last matching pattern wins; a match on a parent
    folder applies to what is inside it)."""

    def regex(pattern: str) -> re.Pattern[str]:
        out = ""
        for part in re.split(r"(\*\*|\*|\?)", pattern.strip("/")):
            out += {"**": ".*", "*": "[^/]*", "?": "[^/]"}.get(part, re.escape(part))
        return re.compile(out)

    parents = [path[:i] for i, c in enumerate(path) if c == "/"] + [path]
    excluded = False
    for raw in patterns:
        negated = raw.startswith("!")
        if any(regex(raw.lstrip("!")).fullmatch(p) for p in parents):
            excluded = not negated
    return excluded


def test_build_context_holds_what_the_image_copies(image: Image) -> None:
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for stage in image.stages:
        for args in stage.all("COPY"):
            if "--from=" in args:
                continue
            sources = [a for a in args.split()[:-1] if not a.startswith("--")]
            for source in sources:
                assert (ROOT / source).exists(), f"COPY source missing: {source}"
                assert not dockerignore_excludes(source, patterns), f"ignored: {source}"
                if (ROOT / source).is_dir():
                    inside = next(p for p in (ROOT / source).rglob("*") if p.is_file())
                    rel = inside.relative_to(ROOT).as_posix()
                    assert not dockerignore_excludes(rel, patterns), f"ignored: {rel}"
    for heavy in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        "service/__pycache__/api.cpython-311.pyc",
        "models/.digits-tmp/x.onnx",
    ):
        assert dockerignore_excludes(heavy, patterns), f"sent to the build context: {heavy}"


def test_wheel_carries_the_service(image: Image, tmp_path: Path) -> None:
    """The wheel the build stage makes, from the files that stage copies: the entrypoint is
    its console script, and every data file of the packages (schema, py.typed) is inside."""
    (build,) = [s for s in image.stages if any("pip wheel" in r for r in s.all("RUN"))]
    src = tmp_path / "src"
    src.mkdir()
    for args in build.all("COPY"):
        *sources, dest = [a for a in args.split() if not a.startswith("--")]
        for source in sources:
            target = src / dest / Path(source).name if dest.endswith("/") else src / dest
            if (ROOT / source).is_dir():
                shutil.copytree(
                    ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__", ".*")
                )
            else:
                shutil.copy(ROOT / source, target)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "--wheel-dir",
            str(tmp_path),
            str(src),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = tmp_path.glob("budgetserve-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        scripts = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        entry_points = zf.read(scripts).decode()
    assert re.search(rf"^{re.escape(image.argv[0])}\s*=", entry_points, re.M), (
        f"ENTRYPOINT {image.argv[0]} is not a console script of the wheel"
    )
    for package in ("service", "training"):
        for path in (src / package).rglob("*"):
            rel = path.relative_to(src).as_posix()
            if path.is_file() and path.suffix != ".pyc":
                assert rel in names, f"{rel} is not in the wheel (package data?)"


# --- running the entrypoint -------------------------------------------------------------------


def runtime_closure() -> set[str]:
    """Normalised names of the distributions `pip install budgetserve` (no extras) brings."""

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    seen: set[str] = set()
    todo = ["budgetserve"]
    while todo:
        name = norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for spec in requires:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def blocked_modules() -> list[str]:
    """Top-level modules in this venv that the runtime image does not have."""
    allowed = runtime_closure() | {"pip", "setuptools", "wheel"}
    blocked = set()
    for module, dists in metadata.packages_distributions().items():
        if not any(re.sub(r"[-_.]+", "-", d).lower() in allowed for d in dists):
            blocked.add(module)
    blocked.discard("_distutils_hack")
    return sorted(blocked)


SITECUSTOMIZE = """\
import importlib.abc
import sys

BLOCKED = frozenset({blocked!r})


class NotInImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} is not installed in the service image", name=name)
        return None


sys.meta_path.insert(0, NotInImage())
"""


def proc_children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = proc_children(todo.pop())
        found += kids
        todo += kids
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def tcp_inodes(local_port: int, remote_port: int | None = None) -> set[int]:
    """Inodes of IPv4 TCP sockets on 127.0.0.1:local_port (LISTEN ones when no remote)."""
    out = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        local, remote, state, inode = cols[1], cols[2], cols[3], int(cols[9])
        if int(local.split(":")[1], 16) != local_port or inode == 0:
            continue
        wanted = (
            state == "0A" if remote_port is None else int(remote.split(":")[1], 16) == remote_port
        )
        if wanted:
            out.add(inode)
    return out


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    pid1: int
    port: int
    env: dict[str, str]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_for(self, what: str, check: Callable[[], bool], while_running: bool = True) -> None:
        """Poll ``check`` (bounded; fails with the server's log rather than hanging)."""
        for _ in range(3000):
            if check():
                return
            if while_running and self.proc.poll() is not None:
                pytest.fail(f"{what}: the server exited ({self.proc.returncode})\n{self.log()}")
            time.sleep(0.05)
        pytest.fail(f"{what}: still not the case after many tries\n{self.log()}")

    def holders(self) -> list[int]:
        """Processes of the server that hold its listening socket."""
        listener = tcp_inodes(self.port)
        return [p for p in [self.pid1, *descendants(self.pid1)] if socket_inodes(p) & listener]

    def owner(self, conn: socket.socket) -> int:
        """The server process that accepted this client connection."""
        inodes = tcp_inodes(self.port, conn.getsockname()[1])
        owners = [p for p in [self.pid1, *descendants(self.pid1)] if socket_inodes(p) & inodes]
        assert len(owners) == 1, f"connection owned by {owners}"
        return owners[0]


def as_pid1(argv: list[str]) -> list[str]:
    """Run argv as PID 1 of a new PID namespace, as in a container: a PID 1 ignores signals it
    has no handler for, and re-raising SIGTERM after the graceful shutdown is one of them."""
    userns = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    return ["unshare", *userns, "--pid", "--fork", "--kill-child", *argv]


@pytest.fixture
def start(image: Image, tmp_path: Path) -> Iterator[Callable[[dict[str, str]], Served]]:
    started: list[Served] = []
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE.format(blocked=blocked_modules()))
    # Skipped only outside CI (a developer's unprivileged container); CI must run it.
    skip = pytest.fail if os.environ.get("CI") else pytest.skip
    if shutil.which("unshare") is None:
        skip("unshare (util-linux) is needed to run the entrypoint as PID 1")
    probe = subprocess.run(as_pid1(["true"]), capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        skip(f"no new PID namespace here, so no PID 1 to run: {probe.stderr.strip()}")

    def _start(overrides: dict[str, str]) -> Served:
        port = free_port()
        env = {
            # The python base image's PATH, with this venv's scripts where /usr/local/bin is.
            "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "LANG": "C.UTF-8",
            **image.env,
            "BUDGETSERVE_HOST": "127.0.0.1",
            "BUDGETSERVE_PORT": str(port),
            "BUDGETSERVE_GRPC_PORT": str(free_port()),
            "BUDGETSERVE_MODELS_DIR": str(DIGITS_BUNDLE.parent),
            **overrides,
        }
        log_path = tmp_path / f"server-{port}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                as_pid1(image.argv),
                # ROOT: this checkout's service, whichever checkout the venv was installed from
                env={**env, "PYTHONPATH": f"{site}:{ROOT}"},
                cwd="/",
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        served = Served(proc, 0, port, env, log_path)
        started.append(served)
        served.wait_for("the namespace's PID 1 started", lambda: bool(proc_children(proc.pid)))
        (served.pid1,) = proc_children(proc.pid)
        served.wait_for("/healthz answers", lambda: get(port, "/healthz")[0] == 200)
        return served

    yield _start
    for served in started:
        if served.proc.poll() is None:
            served.proc.kill()  # unshare --kill-child takes the namespace down with it
        served.proc.wait(timeout=60)


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


def predict_body(index: int) -> bytes:
    """A request these tests hold back (headers sent, body later): its budget counts the work
    only, since under the default deadline accounting the seconds the test holds the body
    are charged and the answer would come from the prior."""
    item = {"png_base64": png_b64(digit_image(index, 64))}
    body = {"model": "digits", "item": item, "budget": 50, "accounting": "work"}
    return json.dumps(body).encode()


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    if int(status_line.split()[1]) != 100:
        while len(body) < int(headers.get("content-length", "0")):
            chunk = sock.recv(65536)
            assert chunk, "connection closed inside the response body"
            body += chunk
    return int(status_line.split()[1]), headers, body


def healthcheck(image: Image, served: Served) -> int:
    return subprocess.run(
        image.healthcheck,
        env=served.env,
        cwd="/",
        timeout=120,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ).returncode


@pytest.mark.parametrize("workers", [None, "2"], ids=["image-default-workers", "workers-2"])
def test_entrypoint_serves_and_drains_on_sigterm(
    image: Image, start: Callable[[dict[str, str]], Served], workers: str | None
) -> None:
    served = start({"BUDGETSERVE_WORKERS": workers} if workers else {})
    n_workers = int(served.env["BUDGETSERVE_WORKERS"])
    port = served.port

    assert healthcheck(image, served) == 0, "HEALTHCHECK fails against a healthy server"
    served.wait_for("/readyz", lambda: get(port, "/readyz")[0] == 200)
    status, body = http_predict(port, predict_body(3))
    assert status == 200, body
    answer = json.loads(body)
    assert answer["prediction"] == "3" and answer["cost"]["spent"] > 0, answer
    metrics = get(port, "/metrics")[1].decode()
    assert 'budgetserve_requests_total{model="digits",status="ok"}' in metrics
    # gRPC (the image sets BUDGETSERVE_GRPC_PORT) answers beside HTTP, from every worker
    # (each binds it with SO_REUSEPORT: a fresh channel per call reaches any of them)
    import tritonclient.grpc as triton_grpc

    for _ in range(3):
        rpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{served.env['BUDGETSERVE_GRPC_PORT']}")
        try:
            assert rpc.is_server_ready() and rpc.is_model_ready("digits")
        finally:
            rpc.close()

    holders = served.holders()
    workers_pids = [p for p in holders if p != served.pid1] if n_workers > 1 else holders
    assert len(workers_pids) == n_workers, f"{holders} serve, expected {n_workers} workers"
    if n_workers > 1:
        seen: set[int] = set()
        for _ in range(500):  # the kernel hands each connection to one worker; see both
            with socket.create_connection(("127.0.0.1", port)) as conn:
                conn.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
                assert read_response(conn)[0] == 200
                seen.add(served.owner(conn))
            if seen == set(workers_pids):
                break
        assert seen == set(workers_pids), f"only {seen} of {workers_pids} answered"

    # A request in flight: headers sent, body held back. Its worker asks for the body
    # (100 Continue) only once the app is handling it.
    request = predict_body(7)
    conn = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        conn.sendall(
            b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(request)
        )
        assert read_response(conn)[0] == 100
        owner = served.owner(conn)
        client_port = conn.getsockname()[1]
        listener = tcp_inodes(port)
        os.kill(served.pid1, signal.SIGTERM)  # what `docker stop` / the kubelet sends
        # The worker holding the request has begun its shutdown: it closed its listener.
        served.wait_for("the worker stopped listening", lambda: not socket_inodes(owner) & listener)
        conn.sendall(request)
        status, _, body = read_response(conn)
        closed = conn.recv(1) == b""  # the server closes the connection after the response
    finally:
        conn.close()
    assert status == 200, body
    assert json.loads(body)["prediction"] == "7"
    assert closed
    served.wait_for(
        "the server exited", lambda: served.proc.poll() is not None, while_running=False
    )
    assert served.proc.returncode == 0, served.log()
    # The log agrees: shutdown began before the request was answered (its one line, which
    # the service writes once the response is sent).
    log = served.log()
    answered = log.find(f"client=127.0.0.1:{client_port} method=POST path=/predict status=200")
    assert '"POST /predict HTTP/1.1"' not in log, "uvicorn's access line beside the request's"
    assert 0 <= log.find("Shutting down") < answered, log
    assert healthcheck(image, served) != 0, "HEALTHCHECK passes with nothing listening"


def test_two_workers_answer_fast_and_refuse_new_connections_once_draining(
    start: Callable[[dict[str, str]], Served],
) -> None:
    """Several workers: the listening socket has TCP_NODELAY (else every response on a
    reused connection waits ~40 ms for the client's delayed ACK), and after SIGTERM no new
    connection is left hanging in the accept queue: it is refused (or answered) at once,
    while a request in flight completes."""
    served = start({"BUDGETSERVE_WORKERS": "2"})
    port = served.port
    small = json.dumps(
        {"model": "digits", "item": {"png_base64": png_b64(digit_image(5, 32))}, "budget": 1}
    ).encode()
    request = (
        b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(small), small)
    )
    times = []
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        for _ in range(21):
            t0 = time.perf_counter()
            conn.sendall(request)
            status, _, body = read_response(conn)
            times.append(time.perf_counter() - t0)
            assert status == 200, body
    p50 = sorted(times[1:])[len(times) // 2]
    assert p50 < 0.025, f"p50 {p50 * 1e3:.1f} ms on a reused connection (Nagle: ~40 ms)"

    held = predict_body(4)
    conn = socket.create_connection(("127.0.0.1", port), timeout=60)
    try:
        conn.sendall(
            b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(held)
        )
        assert read_response(conn)[0] == 100
        os.kill(served.pid1, signal.SIGTERM)
        served.wait_for("no process listens any more", lambda: not served.holders())
        # New connections: refused at once, or answered; never left in an accept queue.
        for _ in range(5):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as late:
                    late.sendall(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
                    late.recv(1)  # a response or a reset; socket.timeout fails the test
            except (ConnectionRefusedError, ConnectionResetError):
                pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        conn.sendall(held)  # the request in flight completes
        status, _, body = read_response(conn)
    finally:
        conn.close()
    assert status == 200, body
    assert json.loads(body)["prediction"] == "4"
    served.wait_for(
        "the server exited", lambda: served.proc.poll() is not None, while_running=False
    )
    assert served.proc.returncode == 0, served.log()


def http_predict(port: int, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        conn.request("POST", "/predict", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_runtime_closure_excludes_the_extras() -> None:
    """The set of packages the entrypoint test leaves importable is the runtime image's."""
    closure = runtime_closure()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {Requirement(r).name.lower() for r in project["dependencies"]}
    assert runtime <= closure
    for extra in ("train", "dev"):
        for spec in project["optional-dependencies"][extra]:
            name = Requirement(spec).name.lower()
            if name not in runtime:
                assert name not in closure, f"{name} ({extra}) would be in the image"
    blocked = blocked_modules()
    assert {"sklearn", "yaml", "typer", "pytest"} <= set(blocked)
    assert not {"fastapi", "uvicorn", "onnxruntime", "numpy", "service"} & set(blocked)


def test_container_doc_lists_every_setting(image: Image) -> None:
    """docs/deploy-container.md's table of variables follows service/settings.py."""
    doc = (ROOT / "docs" / "deploy-container.md").read_text()
    names = settings_env_names()
    assert {"BUDGETSERVE_WORKERS", "BUDGETSERVE_MODELS_DIR", "REDIS_URL"} <= names
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"docs/deploy-container.md does not document {missing}"
    assert image.stages[0].base in doc, "the doc names another base image"
