"""Helpers shared by the deployment tests (container image and Kubernetes manifests)."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pydantic import AliasChoices, ValidationError

from service.settings import Settings
from tests.conftest import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"


def settings_env_names() -> set[str]:
    """Every environment variable that service/settings.py reads (upper case)."""
    prefix = str(Settings.model_config.get("env_prefix", ""))
    names: set[str] = set()
    for field_name, info in Settings.model_fields.items():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names.update(c for c in alias.choices if isinstance(c, str))
        elif isinstance(alias, str):
            names.add(alias)
        else:
            names.add(prefix + field_name)
    return {n.upper() for n in names}


def settings_from(env: Mapping[str, str], monkeypatch: pytest.MonkeyPatch, what: str) -> Settings:
    """The Settings a process with exactly these (relevant) variables would get."""
    known = settings_env_names()
    unknown = sorted(k for k in env if k.startswith("BUDGETSERVE_") and k.upper() not in known)
    assert not unknown, f"{what}: not settings of service/settings.py: {unknown}"
    for name in known:
        monkeypatch.delenv(name, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        return Settings()
    except ValidationError as exc:
        pytest.fail(f"{what}: the service would refuse these settings: {exc}")


# --- docker/Dockerfile, parsed ----------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str | None:
        found = self.all(keyword)
        return found[-1] if found else None


def parse_dockerfile(path: Path) -> list[Stage]:
    """Stages of a Dockerfile: (KEYWORD, arguments) per instruction, continuations joined."""
    stages: list[Stage] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments inside a continuation are dropped, as Docker does
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        pending = ""
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            parts = args.split()
            named = len(parts) >= 3 and parts[1].upper() == "AS"
            stages.append(Stage(base=parts[0], name=parts[2] if named else None))
        else:
            assert stages, f"{path}: {keyword} before FROM"
            stages[-1].instructions.append((keyword, args))
    assert not pending, f"{path}: ends inside a line continuation"
    return stages


def exec_form(args: str, what: str) -> list[str]:
    """A JSON-array (exec form) argument list; the shell form would put /bin/sh at PID 1."""
    try:
        argv = json.loads(args)
    except json.JSONDecodeError:
        argv = None
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), (
        f"{what} must use the exec form (a JSON array), got: {args}"
    )
    return argv


def env_pairs(args: str) -> dict[str, str]:
    tokens = shlex.split(args)
    if tokens and "=" not in tokens[0]:  # legacy `ENV KEY value`
        return {tokens[0]: " ".join(tokens[1:])}
    return dict(t.split("=", 1) for t in tokens)


def stage_chain(stages: list[Stage], stage: Stage) -> list[Stage]:
    """The stage and the earlier stages it is built FROM, outermost first."""
    by_name = {s.name: s for s in stages if s.name}
    chain = [stage]
    while chain[0].base in by_name:
        chain.insert(0, by_name[chain[0].base])
    return chain


@dataclass
class Image:
    stages: list[Stage]
    runtime: Stage
    env: dict[str, str]
    argv: list[str]
    healthcheck: list[str]
    uid: int
    gid: int

    def exposed(self) -> set[int]:
        return {int(p.split("/")[0]) for a in self.runtime.all("EXPOSE") for p in a.split()}


def load_image() -> Image:
    stages = parse_dockerfile(DOCKERFILE)
    runtime = stages[-1]
    chain = stage_chain(stages, runtime)
    env: dict[str, str] = {}
    for stage in chain:
        for args in stage.all("ENV"):
            env.update(env_pairs(args))
    entrypoint = runtime.last("ENTRYPOINT")
    cmd = runtime.last("CMD")
    argv = (exec_form(entrypoint, "ENTRYPOINT") if entrypoint else []) + (
        exec_form(cmd, "CMD") if cmd else []
    )
    assert argv, "the runtime stage has no ENTRYPOINT or CMD"
    check = runtime.last("HEALTHCHECK")
    assert check, "the runtime stage has no HEALTHCHECK"
    match = re.fullmatch(r"((?:--\S+\s+)*)CMD\s+(.+)", check)
    assert match, f"HEALTHCHECK must be `[--options] CMD [...]`, got: {check}"
    user = runtime.last("USER")
    assert user and re.fullmatch(r"\d+(:\d+)?", user), (
        f"USER must be numeric (uid[:gid]) so that runAsNonRoot can verify it, got: {user}"
    )
    uid, _, gid = user.partition(":")
    return Image(
        stages,
        runtime,
        env,
        argv,
        exec_form(match.group(2), "HEALTHCHECK CMD"),
        int(uid),
        int(gid or uid),
    )
