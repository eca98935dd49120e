"""The built-in extractors: registration, shapes, determinism, robustness, invariance."""

from __future__ import annotations

import numpy as np
import pytest

from service.extractors import builtin
from service.extractors.base import (
    Extractor,
    ExtractorNotInstalled,
    ExtractorVersionMismatch,
    available_extractors,
    create_extractor,
)
from training.data.digits import digits_source, render_digit

EXPECTED = {
    "thumbnail": builtin.Thumbnail,
    "histogram": builtin.IntensityHistogram,
    "projection": builtin.Projections,
    "hog": builtin.HOG,
    "lbp": builtin.LBPTexture,
    "fft_bands": builtin.FFTBands,
    "gabor": builtin.GaborBank,
}
NAMES = sorted(EXPECTED)


@pytest.fixture(scope="module")
def extractors() -> dict[str, Extractor]:
    return {name: create_extractor(name, version="1") for name in NAMES}


def _check_vector(extractor: Extractor, vector: np.ndarray) -> None:
    assert vector.dtype == np.float32
    assert vector.ndim == 1
    assert vector.shape == (extractor.dims,)
    assert vector.flags.c_contiguous
    assert np.all(np.isfinite(vector))


def test_all_builtins_registered_under_their_names() -> None:
    registry = available_extractors()
    for name, cls in EXPECTED.items():
        assert registry[name] is cls
        assert cls.name == name
        assert cls.version == "1"
        assert cls.item_kind == "image"
        assert isinstance(cls(), Extractor)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_and_well_formed(name: str, extractors: dict[str, Extractor]) -> None:
    extractor = extractors[name]
    image = np.random.default_rng(1).random((48, 48), dtype=np.float32)
    first = extractor.extract(image)
    _check_vector(extractor, first)
    again = create_extractor(name).extract(image.copy())
    np.testing.assert_array_equal(first, again)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "kind",
    ["blank", "white", "constant", "noise", "tall", "wide", "tiny", "odd", "checker", "float64"],
)
def test_finite_on_awkward_images(name: str, kind: str, extractors: dict[str, Extractor]) -> None:
    rng = np.random.default_rng(2)
    images = {
        "blank": np.zeros((32, 32), np.float32),
        "white": np.ones((32, 32), np.float32),
        "constant": np.full((40, 40), 0.37, np.float32),
        "noise": rng.random((64, 64), dtype=np.float32),
        "tall": rng.random((100, 9), dtype=np.float32),
        "wide": rng.random((8, 77), dtype=np.float32),
        "tiny": rng.random((8, 8), dtype=np.float32),
        "odd": rng.random((37, 53), dtype=np.float32),
        "checker": (np.indices((30, 30)).sum(axis=0) % 2).astype(np.float32),
        "float64": rng.random((20, 20)),
    }
    _check_vector(extractors[name], extractors[name].extract(images[kind]))


@pytest.mark.parametrize("name", NAMES)
def test_rejects_non_images(name: str, extractors: dict[str, Extractor]) -> None:
    with pytest.raises(ValueError):
        extractors[name].extract(np.zeros((3, 8, 8), np.float32))
    with pytest.raises(ValueError):
        extractors[name].extract(np.zeros((2, 8), np.float32))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))


# Mean cosine similarity of the same digit at 16 px and 128 px (measured >= 0.92 for all).
@pytest.mark.parametrize("name", NAMES)
def test_size_invariance(name: str, extractors: dict[str, Extractor]) -> None:
    images, _ = digits_source()
    extractor = extractors[name]
    sims = [
        _cosine(
            extractor.extract(render_digit(images[i], 16)),
            extractor.extract(render_digit(images[i], 128)),
        )
        for i in range(8)
    ]
    assert np.mean(sims) > 0.85, sims
    assert min(sims) > 0.75, sims


@pytest.mark.parametrize("name", ["hog", "thumbnail", "gabor"])
def test_distinguishes_digits(name: str, extractors: dict[str, Extractor]) -> None:
    """Same digit across sizes is closer than different digits at the same size."""
    images, labels = digits_source()
    zero, one = int(np.flatnonzero(labels == 0)[0]), int(np.flatnonzero(labels == 1)[0])
    extractor = extractors[name]
    zero16 = extractor.extract(render_digit(images[zero], 16))
    zero64 = extractor.extract(render_digit(images[zero], 64))
    one64 = extractor.extract(render_digit(images[one], 64))
    assert _cosine(zero16, zero64) > _cosine(zero64, one64)


def test_histogram_is_a_distribution() -> None:
    vector = builtin.IntensityHistogram().extract(np.random.default_rng(3).random((50, 70)))
    assert vector.sum() == pytest.approx(1.0, abs=1e-5)
    assert np.all(vector >= 0)


def test_gabor_kernel_grows_with_the_image() -> None:
    gabor = builtin.GaborBank()
    assert gabor.kernel_size(16 * 16) == 5
    assert gabor.kernel_size(256 * 256) == 17
    assert gabor.kernel_size(2048 * 2048) == 33
    assert all(gabor.kernel_size(s * s) % 2 == 1 for s in range(8, 600, 7))


def test_params_are_keyword_and_change_dims() -> None:
    assert create_extractor("histogram", params={"bins": 8}).dims == 8
    assert create_extractor("projection", params={"bins": 10}).dims == 20
    vector = create_extractor("fft_bands", params={"angles": 2}).extract(np.ones((16, 16)))
    assert vector.shape == (12,)


def test_create_extractor_not_installed_names_it() -> None:
    with pytest.raises(ExtractorNotInstalled, match="no_such_extractor") as info:
        create_extractor("no_such_extractor")
    assert info.value.name == "no_such_extractor"
    assert "hog" in str(info.value)


def test_create_extractor_version_mismatch_names_it() -> None:
    with pytest.raises(ExtractorVersionMismatch, match="'gabor'") as info:
        create_extractor("gabor", version="99")
    assert info.value.name == "gabor"
    assert "99" in str(info.value)
