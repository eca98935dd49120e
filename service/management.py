"""Model management: load, reload and unload bundles while the service runs.

:class:`ModelManager` loads a top-level folder of ``models_dir`` (one bundle, or its
``<version>/`` subfolders) in a worker thread, then swaps the result into the
:class:`~service.registry.Registry` on the event loop (:meth:`Registry.install`): a request
that already took a bundle finishes on it, the next one gets the new bundle. A version that
fails to load keeps its previous bundle serving; the failure is reported (``GET /models``,
``/readyz``) until a later load of that folder succeeds.

Each worker process has its own registry. The admin endpoints (``service.http.admin``)
reload the worker that received the request; :meth:`ModelManager.watch` (enabled by
``BUDGETSERVE_WATCH_INTERVAL_S``) polls the folder in every worker, so with several
workers, watching is what reloads them all.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.to_thread

from service.errors import InvalidRequest
from service.registry import (
    MAX_MANIFEST_BYTES,
    CalibrationSettings,
    FolderLoad,
    Registry,
    bundle_folders,
    load_folder,
)
from service.sources import SensorSources

log = logging.getLogger("budgetserve.models")

Fingerprint = tuple[tuple[str, int, int], ...]


@dataclass
class ReloadReport:
    """What a reload did: the versions now served from the folders it loaded, the versions
    that failed (with the old one kept serving when ``serving``), and the names unloaded."""

    loaded: list[dict[str, str]] = field(default_factory=list)
    failed: list[dict[str, str | bool]] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)


#: Most entries one folder's fingerprint holds, and how deep it walks: a bundle folder holds a
#: manifest and its ONNX files (versions one level down), so these bound only what should
#: never be there (a symlink farm, a copied data set) — past either, the walk stops and says so.
FINGERPRINT_MAX_ENTRIES = 10_000
FINGERPRINT_MAX_DEPTH = 8


def fingerprint(folder: Path) -> Fingerprint:
    """(relative path, size, mtime ns) of every file under ``folder`` (following links):
    it changes when a bundle in it is written, replaced or removed.

    Each directory is walked once, whatever links lead to it again (a symlink loop is a
    cycle, recorded as ``(path, -2, -2)``, not followed), at most
    :data:`FINGERPRINT_MAX_DEPTH` deep and for at most :data:`FINGERPRINT_MAX_ENTRIES`
    entries: the walk of any folder ends, and quickly."""
    entries: list[tuple[str, int, int]] = []
    walked: set[tuple[int, int]] = set()
    pending: list[tuple[Path, int]] = [(folder, 0)]
    while pending and len(entries) < FINGERPRINT_MAX_ENTRIES:
        directory, depth = pending.pop()
        relative = str(directory.relative_to(folder))
        try:
            st = directory.stat()
            if (st.st_dev, st.st_ino) in walked:
                entries.append((relative + "/", -2, -2))  # a link back: a cycle
                continue
            walked.add((st.st_dev, st.st_ino))
            with os.scandir(directory) as scan:
                children = sorted(scan, key=lambda e: e.name)
        except OSError:  # removed while walking, unreadable, a symlink loop
            entries.append((relative + "/", -1, -1))
            continue
        for child in children:
            path = Path(child.path)
            try:
                is_dir = child.is_dir(follow_symlinks=True)  # False for a dangling link
            except OSError:  # a link to itself (ELOOP): the stat below records it
                is_dir = False
            if is_dir:
                if depth + 1 > FINGERPRINT_MAX_DEPTH:
                    entries.append((str(path.relative_to(folder)) + "/", -3, -3))
                else:
                    pending.append((path, depth + 1))
                continue
            try:
                st = path.stat()
            except OSError:  # removed while walking, or a dangling link
                entries.append((str(path.relative_to(folder)), -1, -1))
                continue
            entries.append((str(path.relative_to(folder)), st.st_size, st.st_mtime_ns))
    if pending or len(entries) > FINGERPRINT_MAX_ENTRIES:
        entries = entries[:FINGERPRINT_MAX_ENTRIES]
        entries.append(("…", -4, len(pending)))  # stopped: more than the limit
    return tuple(sorted(entries))


def snapshot(models_dir: Path) -> dict[str, Fingerprint]:
    """The fingerprint of every bundle folder of ``models_dir``."""
    return {folder: fingerprint(models_dir / folder) for folder in bundle_folders(models_dir)}


#: Longest model name the admin endpoints take (a bundle's name is at most 128 characters).
MAX_NAME_CHARS = 128


def check_model_name(name: str) -> str:
    """``name`` if a bundle folder could have it (1-128 printable characters): else
    :class:`InvalidRequest` (422). A NUL byte reaching the file system would raise
    ``ValueError`` there, a control character would only ever be a typo or an attack."""
    if not 0 < len(name) <= MAX_NAME_CHARS or not name.isprintable():
        shown = repr(name[:40]) + ("…" if len(name) > 40 else "")
        raise InvalidRequest(
            f"model name {shown} cannot name a bundle folder: names are 1-{MAX_NAME_CHARS} "
            "printable characters (no NUL, control characters or line breaks)",
            length=len(name),
        )
    return name


class ModelManager:
    """Loads folders of ``models_dir`` into ``registry``; ``on_change`` runs after each
    change (the app updates readiness and metrics there). One change at a time."""

    def __init__(
        self,
        registry: Registry,
        models_dir: Path,
        max_pixels: int,
        calibration: CalibrationSettings | None = None,
        sources: SensorSources | None = None,
        on_change: Callable[[], None] = lambda: None,
        max_manifest_bytes: int = MAX_MANIFEST_BYTES,
    ) -> None:
        self.registry = registry
        self.max_manifest_bytes = max_manifest_bytes
        self.models_dir = models_dir
        self.max_pixels = max_pixels
        self.calibration = calibration
        self.sources = sources
        self.on_change = on_change
        self.lock = anyio.Lock()
        self.seen: dict[str, Fingerprint] = {}

    def folder_of(self, name: str) -> str:
        """The folder that serves ``name``, else the folder of that name."""
        return self.registry.owners.get(name, name)

    async def _load(self, folder: str) -> FolderLoad:
        self.seen[folder] = await anyio.to_thread.run_sync(fingerprint, self.models_dir / folder)
        return await anyio.to_thread.run_sync(
            load_folder,
            self.models_dir,
            folder,
            self.max_pixels,
            self.calibration,
            self.sources,
            self.max_manifest_bytes,
        )

    def _install(self, load: FolderLoad, report: ReloadReport) -> None:
        before = {n for n, f in self.registry.owners.items() if f == load.folder}
        self.registry.install(load)
        after = {n for n, f in self.registry.owners.items() if f == load.folder}
        for label, bundle in load.bundles:
            if self.registry.versions.get(bundle.name, {}).get(label) is bundle:
                report.loaded.append({"name": bundle.name, "version": label, "folder": load.folder})
        for failure in load.failures:
            report.failed.append(
                {
                    "name": failure.name,
                    "folder": failure.folder,
                    "error": failure.reason,
                    "serving": failure.name in self.registry.bundles,
                }
            )
        report.unloaded.extend(sorted(before - after))

    async def reload(self, name: str) -> ReloadReport:
        """Load the folder serving ``name`` (or named ``name``) again; a name that cannot be
        a bundle folder's (hidden, or with a path separator) loads nothing, and one that
        cannot be a name at all (:func:`check_model_name`) is refused."""
        report = ReloadReport()
        folder = self.folder_of(check_model_name(name))
        if folder.startswith(".") or "/" in folder or "\\" in folder:
            return report
        async with self.lock:
            self._install(await self._load(folder), report)
            self.on_change()
        return report

    async def reload_all(self, only_changed: bool = False) -> ReloadReport:
        """Load every bundle folder again (with ``only_changed``: those whose files changed
        since they were last loaded); unload the names whose folder is gone."""
        report = ReloadReport()
        # What changed is seen before the lock is taken: a change made meanwhile is seen
        # next time, and a slow folder (a network mount) never holds up a reload by name.
        now = await anyio.to_thread.run_sync(snapshot, self.models_dir) if only_changed else {}
        async with self.lock:
            folders = await anyio.to_thread.run_sync(bundle_folders, self.models_dir)
            for folder in folders:
                if only_changed and folder in now and self.seen.get(folder) == now[folder]:
                    continue
                self._install(await self._load(folder), report)
            # Gone: folders that served, and folders whose failure is still reported.
            failed = {f.folder.split("/", 1)[0] for f in self.registry.failures}
            for folder in (set(self.registry.owners.values()) | failed) - set(folders):
                self._install(FolderLoad(folder), report)
                self.seen.pop(folder, None)
            if report.loaded or report.failed or report.unloaded:
                self.on_change()
        return report

    async def unload(self, name: str) -> bool:
        """Stop serving ``name`` until its folder is loaded again (a reload, or a change
        that the watcher sees)."""
        check_model_name(name)
        async with self.lock:
            found = self.registry.unload(name)
            if found:
                self.on_change()
        return found

    def remember(self, seen: dict[str, Fingerprint]) -> None:
        """Take the fingerprints of the folders as they were before the registry was
        loaded (:func:`snapshot`): a change made while it loaded is then seen."""
        self.seen = dict(seen)

    async def watch(self, interval_s: float) -> None:
        """Every ``interval_s``, reload the folders whose files changed (forever)."""
        # Polling, not watchfiles' inotify: the deploy defaults mount network volumes
        # (ReadWriteMany), where other clients' writes raise no inotify event.
        while True:
            await anyio.sleep(interval_s)
            try:
                report = await self.reload_all(only_changed=True)
            except Exception:  # never let the watcher die: log and try again
                log.exception("watching %s failed", self.models_dir)
                continue
            for entry in report.loaded:
                log.info("reloaded %s version %s", entry["name"], entry["version"])
            for failure in report.failed:
                log.error(
                    "bundle folder %s failed to load (%s): %s",
                    failure["folder"],
                    "previous version still serving" if failure["serving"] else "not serving",
                    failure["error"],
                )
            for name in report.unloaded:
                log.info("unloaded %s (its folder is gone)", name)
