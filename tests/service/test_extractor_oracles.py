"""HOG, FFT bands and the thumbnail against their definitions: the fast code (a DFT at only
the frequencies the bands use; HOG's bins by one lookup in a table of cell and bin, its
histograms by two bincounts; the thumbnail's taps gathered by one precomputed index) must
give what the straightforward version 1 code gave (a full ``numpy.fft.rfft2``; the float
angle modulo pi; ``np.ix_`` and a four-axis mean), since bundles built with either are
served by the other. The oracles below are that code, kept verbatim."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from service.extractors import builtin
from service.extractors.base import Extractor
from tests.service.serving import fresh_python
from training.data.digits import digits_source, render_digit

FloatArray = npt.NDArray[np.float32]


def reference_hog(image: FloatArray, cells: int = 4, o: int = 8, clip: float = 0.2) -> FloatArray:
    image = builtin._as_image(image)
    step = max(1, min(round(builtin._side(image) / 32), (min(image.shape) - 1) // 2))
    inner = image[step:-step, step:-step]
    gx = image[step:-step, 2 * step :] - image[step:-step, : -2 * step]
    gy = image[2 * step :, step:-step] - image[: -2 * step, step:-step]
    magnitude = np.sqrt(gx * gx + gy * gy).ravel()
    angle = np.arctan2(gy, gx).ravel()
    position = (angle % np.pi) * np.float32(o / np.pi) - np.float32(0.5)
    lower = np.floor(position)
    upper_weight = position - lower
    bin0 = lower.astype(np.intp) % o
    bin1 = (bin0 + 1) % o
    c = cells
    cell = builtin._grid_index(inner.shape[0], inner.shape[1], c, c).ravel() * o
    size = c * c * o
    hist: npt.NDArray[np.float64] = np.asarray(
        np.bincount(cell + bin0, weights=magnitude * (1 - upper_weight), minlength=size),
        dtype=np.float64,
    )
    hist += np.bincount(cell + bin1, weights=magnitude * upper_weight, minlength=size)
    hist = hist.reshape(c, c, o)
    blocks = np.stack(
        [hist[i : i + 2, j : j + 2].ravel() for i in range(c - 1) for j in range(c - 1)]
    )
    return builtin._finish(builtin._l2_hys(blocks, clip))


def reference_fft_bands(
    image: FloatArray,
    radii: tuple[float, ...] = (0.5, 1.5, 2.5, 3.5, 4.5, 6.0, 8.0),
    angles: int = 4,
) -> FloatArray:
    image = builtin._as_image(image)
    h, w = image.shape
    spectrum = np.fft.rfft2(image - image.mean(dtype=np.float64))
    power = spectrum.real**2 + spectrum.imag**2
    fy = np.fft.fftfreq(h) * h
    fx = np.fft.rfftfreq(w) * w
    radius = np.sqrt(fy[:, None] ** 2 + fx[None, :] ** 2)
    angle = np.arctan2(fy[:, None], fx[None, :]) % np.pi
    radial_bins = len(radii) - 1
    ring = np.searchsorted(np.asarray(radii), radius, side="right") - 1
    sector = np.minimum((angle * (angles / np.pi)).astype(np.intp), angles - 1)
    inside = (ring >= 0) & (ring < radial_bins)
    band = ring[inside] * angles + sector[inside]
    totals = np.bincount(band, weights=power[inside], minlength=radial_bins * angles)
    share = totals / (totals.sum() + 1e-12)
    return builtin._finish(np.sqrt(share))


SHAPES = [(4, 4), (4, 9), (5, 5), (7, 16), (9, 9), (15, 17), (16, 16), (17, 33), (32, 32)]
SHAPES += [(33, 20), (64, 64), (100, 37), (128, 128), (200, 300), (512, 512)]


def reference_thumbnail(image: FloatArray, grid: int = 8, taps: int = 2) -> FloatArray:
    image = builtin._as_image(image)

    def positions(length: int) -> npt.NDArray[np.intp]:
        samples = grid * taps
        pos = ((np.arange(samples) + 0.5) * (length / samples)).astype(np.intp)
        return np.clip(pos, 0, length - 1)

    rows = positions(image.shape[0])
    cols = positions(image.shape[1])
    sampled = image[np.ix_(rows, cols)]
    cells = sampled.reshape(grid, taps, grid, taps).mean(axis=(1, 3))
    return builtin._finish(cells)


def images(shape: tuple[int, int], rng: np.random.Generator) -> dict[str, FloatArray]:
    h, w = shape
    stroke = np.zeros(shape, np.float32)
    stroke[h // 4 : 3 * h // 4, w // 3] = 1.0  # exact axis-aligned gradients: bin edges
    return {
        "noise": rng.random(shape, dtype=np.float32),
        "constant": np.full(shape, 0.3, np.float32),
        "stroke": stroke,
        "colour": rng.random((h, w, 3), dtype=np.float32),
        # a strided view and a column-major copy: layouts a gather by flat index must read
        "view": rng.random((2 * h, 2 * w), dtype=np.float32)[::2, 1::2],
        "fortran": np.asfortranarray(rng.random(shape, dtype=np.float32)),
    }


@pytest.mark.parametrize(
    ("extractor", "reference"),
    [
        (builtin.HOG(), reference_hog),
        (builtin.FFTBands(), reference_fft_bands),
        (builtin.Thumbnail(), reference_thumbnail),
    ],
    ids=["hog", "fft_bands", "thumbnail"],
)
def test_fast_code_gives_the_definitions_features(extractor: Extractor, reference: object) -> None:
    rng = np.random.default_rng(7)
    assert callable(reference)
    for shape in SHAPES:
        for kind, image in images(shape, rng).items():
            got, expected = extractor.extract(image), reference(image)
            assert got.dtype == expected.dtype and got.shape == expected.shape
            # Float rounding only (measured: 1.5e-6 for HOG, 1e-14 for the bands, 6e-8 for
            # the thumbnail).
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5, err_msg=f"{shape} {kind}")
    digits, _ = digits_source()
    for index in range(0, len(digits), 97):
        for side in (8, 24, 128):
            image = render_digit(digits[index], side)
            np.testing.assert_allclose(extractor.extract(image), reference(image), atol=1e-5)


def test_the_shape_plans_are_cached_and_read_only() -> None:
    """One plan per image shape, shared by every call (and so not writable)."""
    builtin._band_plan.cache_clear()
    bands = builtin.FFTBands()
    image = np.random.default_rng(0).random((40, 50), dtype=np.float32)
    bands.extract(image)
    bands.extract(image * 0.5)
    info = builtin._band_plan.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    for array in builtin._band_plan(40, 50, bands.radii, bands.angles):
        assert not array.flags.writeable
    builtin._thumbnail_taps.cache_clear()
    thumbnail = builtin.Thumbnail()
    thumbnail.extract(image)
    thumbnail.extract(np.asfortranarray(image))  # the same shape: the same taps
    info = builtin._thumbnail_taps.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    assert not builtin._thumbnail_taps((40, 50), 8, 2).flags.writeable
    builtin._hog_plan.cache_clear()
    hog = builtin.HOG()
    hog.extract(image)
    hog.extract(image[::-1])
    info = builtin._hog_plan.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    plan = builtin._hog_plan(8, 4, 38, 48)  # the gradients of a 40 x 50 image (step 1)
    assert builtin._hog_plan.cache_info().hits == 2
    for array in (plan.table, plan.columns, plan.blocks):
        assert not array.flags.writeable


SERVE_AND_REPORT_BLAS = """
import sys
from fastapi.testclient import TestClient
from threadpoolctl import threadpool_info
from service.http import create_app
from service.settings import Settings

def blas_threads():
    return sorted({p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"})

before = blas_threads()
with TestClient(create_app(Settings(models_dir=sys.argv[1]))) as client:
    assert client.get("/readyz").status_code == 200
    print(before, blas_threads())
"""


def test_the_service_runs_numpy_blas_on_one_thread(digits_bundle_dir: Path) -> None:
    """The bands' products run on the request's thread alone: a service started where BLAS
    has two threads has one once it serves (OpenBLAS's helpers would spin on other
    requests' cores). In a process of its own: the limit is process-wide."""
    out = fresh_python(
        SERVE_AND_REPORT_BLAS, str(digits_bundle_dir.parent), OPENBLAS_NUM_THREADS="2"
    )
    assert out.split("\n")[-2] == "[2] [1]", out
