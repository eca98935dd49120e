"""The extractor plugin contract and its entry-point registry.

An extractor turns a decoded item into a float32 vector. It carries a ``name`` and a
``version``; a bundle records both, and a bundle whose extractor is missing or at another
version fails to load with a message naming it. Extractors are discovered through the
``budgetserve.extractors`` entry-point group; the built-ins register the same way
(see ``pyproject.toml``).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any, ClassVar, Protocol, runtime_checkable

from service.types import FloatVector

ENTRY_POINT_GROUP = "budgetserve.extractors"

__all__ = [
    "ENTRY_POINT_GROUP",
    "Extractor",
    "ExtractorBroken",
    "ExtractorNotInstalled",
    "ExtractorVersionMismatch",
    "FeatureUnavailable",
    "FloatVector",
    "available_extractors",
    "create_extractor",
    "reads_colour",
]


@runtime_checkable
class Extractor(Protocol):
    """A deterministic feature extractor.

    ``item_kind`` names the decoded item it accepts ("image": a 2-D float32 array with
    values in [0, 1], or (H, W, 3) RGB in a bundle whose ``item.channels`` is ``rgb``).
    ``extract`` returns a 1-D float32 vector of length ``dims``. An image extractor that
    reads colour says so with a class attribute ``channels = "rgb"`` (see
    :func:`reads_colour`); a bundle built with one decodes its items to three channels.
    """

    name: ClassVar[str]
    version: ClassVar[str]
    item_kind: ClassVar[str]

    @property
    def dims(self) -> int: ...

    def extract(self, item: Any) -> FloatVector: ...


class FeatureUnavailable(Exception):
    """The feature cannot be had for this item right now: a sensor whose values the request
    did not send and that no acquirer could fetch (none configured, the store down, no entry
    for the item's id, an HTTP error or timeout).

    Not the client's fault and not a server bug: the request loop answers from the features
    in hand and names this feature as the one to collect next (``next_sensor``). ``reason``
    says what happened (the response carries it under ``unavailable``), without secrets:
    name the store and key, never credentials."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ExtractorNotInstalled(LookupError):
    """The bundle names an extractor that no installed plugin provides."""

    def __init__(self, name: str, available: list[str]) -> None:
        self.name = name
        super().__init__(
            f"extractor {name!r} is not installed (installed: {', '.join(available) or 'none'}); "
            f"install the package that registers it in the {ENTRY_POINT_GROUP!r} entry-point group"
        )


class ExtractorVersionMismatch(LookupError):
    """The installed extractor has another version than the bundle was trained with."""

    def __init__(self, name: str, required: str, installed: str) -> None:
        self.name = name
        super().__init__(
            f"extractor {name!r} is installed at version {installed}, but the bundle requires "
            f"version {required}; install that version or rebuild the bundle"
        )


class ExtractorBroken(LookupError):
    """The plugin is registered but cannot be imported or instantiated."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        super().__init__(f"extractor {name!r} is installed but unusable: {reason}")


def reads_colour(extractor: Any) -> bool:
    """Whether an image extractor (class or instance) asks for colour items
    (``channels = "rgb"``); the built-ins read gray."""
    return getattr(extractor, "channels", "gray") == "rgb"


def available_extractors(
    broken: dict[str, str] | None = None,
) -> dict[str, type[Extractor]]:
    """Every extractor class registered in the entry-point group, by entry-point name.

    A plugin that fails to import is left out (and its error recorded in ``broken``), so one
    bad package cannot take down bundles that do not use it.
    """
    found: dict[str, type[Extractor]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            found[ep.name] = ep.load()
        except Exception as exc:  # any import-time failure of third-party code
            if broken is not None:
                broken[ep.name] = f"{type(exc).__name__}: {exc}"
    return found


def create_extractor(
    name: str,
    version: str | None = None,
    params: Mapping[str, Any] | None = None,
    registry: Mapping[str, type[Extractor]] | None = None,
) -> Extractor:
    """Instantiate the plugin ``name`` (checking ``version`` when given) with ``params``."""
    broken: dict[str, str] = {}
    registry = available_extractors(broken) if registry is None else registry
    cls = registry.get(name)
    if cls is None:
        if name in broken:
            raise ExtractorBroken(name, broken[name])
        raise ExtractorNotInstalled(name, sorted(registry))
    if version is not None and cls.version != version:
        raise ExtractorVersionMismatch(name, version, cls.version)
    try:
        return cls(**dict(params or {}))
    except (TypeError, ValueError) as exc:
        raise ExtractorBroken(
            name, f"cannot be created with params {dict(params or {})}: {exc}"
        ) from exc
