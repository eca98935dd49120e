"""What every item decoder returns, and what the decoders share.

A decoder (``service.items``, ``service.letter_items``) turns a request's JSON ``item`` into a
:class:`DecodedItem`: the ``data`` extractors read, the item's size ``n`` and its cache
``key``. This module sits below all of them, so a decoder in its own module imports it and
``service.items`` imports every decoder, with no import cycle.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

__all__ = ["DecodedItem", "ItemDecoder", "content_key", "describe_errors"]


@dataclass(frozen=True, slots=True)
class DecodedItem:
    data: Any
    size: int
    key: str


class ItemDecoder(Protocol):
    def decode(self, item: Any) -> DecodedItem: ...

    def heavy(self, item: Any) -> bool:
        """Whether decoding ``item`` is worth a worker thread (off the event loop)."""
        ...

    def size_hint(self, item: Any) -> int | None:
        """``item``'s size read cheaply before decoding it (None: not known until then)."""
        ...

    def size_range(self) -> tuple[int, int, str]:
        """The smallest and largest size an item can have (what ``decode`` accepts), and
        the items those are, in words."""
        ...


def content_key(scheme: str, content: bytes, item_id: str | None) -> str:
    """``scheme:digest`` of ``content`` (BLAKE2b-256), plus ``:id:digest`` of the client's
    id when there is one: fixed-length, no client text in the key, and two different
    contents never share a key whatever their ids."""
    key = f"{scheme}:{hashlib.blake2b(content, digest_size=32).hexdigest()}"
    if item_id is not None:
        key += ":id:" + hashlib.blake2b(item_id.encode(), digest_size=16).hexdigest()
    return key


def describe_errors(exc: ValidationError) -> str:
    """A pydantic validation error of an item as one line: ``item.field: message; ...``."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in ("item", *err["loc"]))
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)
