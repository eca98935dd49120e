"""What every bundle builder shares: a staging folder that replaces the bundle at once (or is
removed on failure), the bundle's version (date + digest of its ONNX files) and its provenance.
A new bundle kind gets a builder module beside :mod:`training.bundles.digits` that writes into
:func:`staging` and stamps :func:`bundle_version` and :func:`provenance`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import platform
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from service.bundle import CappedNumbers, Provenance


@contextmanager
def staging(out_dir: Path) -> Iterator[Path]:
    """A fresh folder beside ``out_dir`` to write a bundle into: on success it replaces
    ``out_dir`` at once; on any failure it is removed, so a failed build never leaves a
    half-written bundle where the service would load it. Missing parent folders are made
    (a build of many minutes must not fail at the last step on a folder not yet there)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        yield tmp
        # mkdtemp makes the folder private (0700); a bundle is read by the service, which
        # may run as another user (the image's uid 10001 reading a mounted folder).
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.replace(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def bundle_version(folder: Path, extra: bytes = b"") -> str:
    """A bundle's version: today's date and a digest of its ONNX files (and ``extra``)."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.onnx")):
        digest.update(path.read_bytes())
    digest.update(extra)
    return f"{_dt.date.today():%Y.%m.%d}-{digest.hexdigest()[:10]}"


def provenance(data_fingerprint: str, parameters: dict[str, Any]) -> Provenance:
    """Where a bundle came from: now, the data, the build parameters, libraries, host."""
    return Provenance(
        created_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        data_fingerprint=data_fingerprint,
        parameters=parameters,
        libraries=library_versions(),
        host={"platform": platform.platform(), "machine": platform.machine()},
    )


def library_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("numpy", "scikit-learn", "skl2onnx", "onnx", "onnxruntime", "pillow", "scipy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out


def capped_numbers(
    caps: Iterable[float], evaluate: Callable[[float], tuple[float, float]]
) -> list[CappedNumbers]:
    """An adaptive point's validation numbers with every walk stopped at each cap
    (``evaluate(cap) -> (accuracy, mean cost)``): the service chooses by them, since its
    budget is a per-item hard cap. ``caps``: the costs at which a walk can stop (every
    cumulative cost along the validation walks), the longest walk's last."""
    out = []
    for cap in sorted({float(c) for c in caps}):
        accuracy, mean_cost = evaluate(cap)
        out.append(CappedNumbers(cap=cap, accuracy=accuracy, mean_cost=mean_cost))
    return out
