"""The digits data: scikit-learn's bundled 8x8 digits rendered as grayscale images.

``load_digits`` ships with scikit-learn (no download). Each 8x8 digit (16 intensity
levels) is rendered at a chosen side by a smooth bicubic affine upscale, with a little
seeded jitter (sub-pixel shift, scale, contrast and pixel noise) so that sizes are not
trivially identical. Rendering is deterministic: the jitter of sample ``index`` at side
``side`` depends only on ``(seed, index, side)``, never on iteration order.

Images are produced lazily (:func:`load_digit_images` is a generator), so a dataset at
256 px is never held in memory at once unless the caller collects it.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from PIL import Image

__all__ = [
    "NO_JITTER",
    "DigitSample",
    "Jitter",
    "data_fingerprint",
    "digits_source",
    "from_png",
    "load_digit_images",
    "render_digit",
    "sample_plan",
    "to_png",
]

FloatImage = npt.NDArray[np.float32]

#: Source grid side and intensity levels of scikit-learn's digits.
SOURCE_SIDE = 8
SOURCE_LEVELS = 16
#: Rendering version: bump when the rendering changes (it enters the fingerprint).
RENDER_VERSION = 1


@dataclass(frozen=True)
class Jitter:
    """Amplitudes of the random perturbations applied when rendering.

    ``shift`` is a fraction of the side (uniform in ±shift on each axis), ``scale`` a
    relative change of the digit size (uniform in ±scale), ``contrast`` a relative change
    of the ink intensity, ``noise`` the std of additive Gaussian pixel noise.
    """

    shift: float = 0.05
    scale: float = 0.08
    contrast: float = 0.1
    noise: float = 0.02


NO_JITTER = Jitter(shift=0.0, scale=0.0, contrast=0.0, noise=0.0)


class DigitSample(NamedTuple):
    image: FloatImage
    label: int
    side: int
    source_index: int


@lru_cache(maxsize=1)
def _source() -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    from sklearn.datasets import load_digits

    bunch: Any = load_digits()
    images = (np.asarray(bunch.images, dtype=np.float32) / SOURCE_LEVELS).astype(np.float32)
    labels = np.asarray(bunch.target, dtype=np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def digits_source() -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """The 1797 source digits as (N, 8, 8) float32 in [0, 1] and their labels (read-only)."""
    return _source()


def render_digit(
    pixels: npt.ArrayLike,
    side: int,
    rng: np.random.Generator | None = None,
    jitter: Jitter | None = None,
) -> FloatImage:
    """Render an 8x8 digit as a ``side`` x ``side`` float32 image in [0, 1].

    ``pixels`` holds intensities either in [0, 1] or, as in ``load_digits``, in [0, 16]
    (detected by its maximum). Without ``rng`` the rendering is the plain bicubic
    upscale; with one, ``jitter`` (default :class:`Jitter`) perturbations are drawn from it.
    """
    if side < 1:
        raise ValueError(f"side must be >= 1, got {side}")
    source = np.asarray(pixels, dtype=np.float32).reshape(SOURCE_SIDE, SOURCE_SIDE)
    if float(source.max(initial=0.0)) > 1.0:
        source = (source / SOURCE_LEVELS).astype(np.float32)
    j = (jitter or Jitter()) if rng is not None else NO_JITTER
    if rng is not None:
        dx, dy = rng.uniform(-j.shift, j.shift, size=2) * side
        scale = 1.0 + rng.uniform(-j.scale, j.scale)
        gain = 1.0 + rng.uniform(-j.contrast, j.contrast)
    else:
        dx = dy = 0.0
        scale = gain = 1.0
    # Pad with a zero border so the bicubic upscale fades to black at the digit's edges.
    border = 2
    padded = np.pad(np.clip(source, 0.0, 1.0), border).astype(np.float32)
    centre = SOURCE_SIDE / 2 + border
    step = SOURCE_SIDE / (side * scale)  # source pixels per output pixel
    # PIL maps output (x, y) to input (a x + b y + c, d x + e y + f), pixel-centre aware.
    data = (step, 0.0, centre - (side / 2 + dx) * step, 0.0, step, centre - (side / 2 + dy) * step)
    rendered = Image.fromarray(padded).transform(
        (side, side),
        Image.Transform.AFFINE,
        data,
        resample=Image.Resampling.BICUBIC,
        fillcolor=0.0,
    )
    image = np.asarray(rendered, dtype=np.float32) * np.float32(gain)
    if rng is not None and j.noise > 0:
        image = image + rng.normal(0.0, j.noise, size=image.shape).astype(np.float32)
    return np.ascontiguousarray(np.clip(image, 0.0, 1.0), dtype=np.float32)


def to_png(image: npt.ArrayLike) -> bytes:
    """Encode an image in [0, 1] as an 8-bit grayscale PNG (values rounded to 1/255)."""
    array = np.asarray(image, dtype=np.float32)
    if array.ndim != 2:
        raise ValueError(f"expected a 2-D image, got shape {array.shape}")
    quantised = np.round(np.clip(array, 0.0, 1.0) * 255.0).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(quantised).save(buffer, format="PNG")
    return buffer.getvalue()


def from_png(data: bytes) -> FloatImage:
    """Decode a PNG (any mode, converted to 8-bit grayscale) to float32 in [0, 1]."""
    with Image.open(io.BytesIO(data)) as img:
        gray = img.convert("L")
        array = np.asarray(gray, dtype=np.float32)
    return np.ascontiguousarray(array / np.float32(255.0), dtype=np.float32)


def sample_plan(
    sides: Sequence[int],
    per_size: int | None = None,
    seed: int = 0,
    *,
    mixed: bool = False,
) -> list[tuple[int, int]]:
    """The (source index, side) pairs :func:`load_digit_images` renders, in order.

    Default: every side gets ``per_size`` source digits (all 1797 when None), drawn by a
    seeded permutation. ``mixed``: each source digit is rendered once, at a side drawn
    uniformly from ``sides``; ``per_size`` then caps the total at ``per_size * len(sides)``.
    """
    if not sides:
        raise ValueError("at least one side is required")
    total = len(_source()[1])
    rng = np.random.default_rng([seed, 0x5EED])
    order = rng.permutation(total)
    if mixed:
        count = total if per_size is None else min(total, per_size * len(sides))
        chosen = np.sort(order[:count])
        drawn = rng.choice(np.asarray(sides, dtype=np.int64), size=count)
        return [(int(i), int(s)) for i, s in zip(chosen, drawn, strict=True)]
    count = total if per_size is None else min(total, per_size)
    chosen = np.sort(order[:count])
    return [(int(i), int(s)) for s in sides for i in chosen]


def load_digit_images(
    sides: Sequence[int],
    per_size: int | None = None,
    seed: int = 0,
    *,
    mixed: bool = False,
    jitter: Jitter | None = None,
) -> Iterator[DigitSample]:
    """Lazily render the digits dataset (see :func:`sample_plan` for what is rendered).

    Each sample's jitter comes from ``default_rng([seed, index, side])``. Pass
    ``jitter=NO_JITTER`` for plain upscales.
    """
    images, labels = _source()
    for index, side in sample_plan(sides, per_size, seed, mixed=mixed):
        rng = np.random.default_rng([seed, index, side])
        image = render_digit(images[index], side, rng, jitter)
        yield DigitSample(image, int(labels[index]), side, index)


def data_fingerprint(
    sides: Sequence[int],
    per_size: int | None = None,
    seed: int = 0,
    *,
    mixed: bool = False,
    jitter: Jitter | None = None,
) -> str:
    """sha256 of the source digits and every rendering parameter, as ``sha256:<hex>``."""
    images, labels = _source()
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(images).tobytes())
    digest.update(np.ascontiguousarray(labels).tobytes())
    params = {
        "render_version": RENDER_VERSION,
        "sides": [int(s) for s in sides],
        "per_size": per_size,
        "seed": seed,
        "mixed": mixed,
        "jitter": asdict(jitter or Jitter()),
    }
    digest.update(json.dumps(params, sort_keys=True).encode())
    return f"sha256:{digest.hexdigest()}"
