"""An extractor plugin that reads colour, registered in tests as if its package were installed
(:func:`registered`): the mean R, G and B of an image. It refuses a gray item, so a test that
serves it proves colour reached it."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import Any, ClassVar

import numpy as np
import pytest

from service.extractors import base as extractor_base
from service.extractors.base import ENTRY_POINT_GROUP
from service.types import FloatVector


class MeanColour:
    name: ClassVar[str] = "mean_colour"
    version: ClassVar[str] = "1"
    item_kind: ClassVar[str] = "image"
    channels: ClassVar[str] = "rgb"

    @property
    def dims(self) -> int:
        return 3

    def extract(self, item: Any) -> FloatVector:
        image = np.asarray(item, dtype=np.float32)
        if image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"mean_colour reads (H, W, 3) colour items, got {image.shape}")
        return np.ascontiguousarray(image.mean(axis=(0, 1)), dtype=np.float32)


def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``mean_colour`` an installed plugin of the ``budgetserve.extractors`` group."""
    point = EntryPoint(
        name=MeanColour.name,
        value=f"{__name__}:{MeanColour.__name__}",
        group=ENTRY_POINT_GROUP,
    )

    def with_plugin(*, group: str) -> list[EntryPoint]:
        found = list(entry_points(group=group))
        return [*found, point] if group == ENTRY_POINT_GROUP else found

    monkeypatch.setattr(extractor_base, "entry_points", with_plugin)
