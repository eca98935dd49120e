"""Rendering the bundled digits, PNG round trips, dataset plans and fingerprints."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from training.data.digits import (
    NO_JITTER,
    Jitter,
    data_fingerprint,
    digits_source,
    from_png,
    load_digit_images,
    render_digit,
    sample_plan,
    to_png,
)


def test_source_shapes() -> None:
    images, labels = digits_source()
    assert images.shape == (1797, 8, 8)
    assert labels.shape == (1797,)
    assert images.min() >= 0.0 and images.max() <= 1.0
    assert set(labels.tolist()) == set(range(10))


@pytest.mark.parametrize("side", [8, 16, 33, 64, 256])
def test_render_shape_range(side: int) -> None:
    images, _ = digits_source()
    image = render_digit(images[5], side, np.random.default_rng(0))
    assert image.shape == (side, side)
    assert image.dtype == np.float32
    assert image.min() >= 0.0 and image.max() <= 1.0
    assert image.max() > 0.5  # the digit is there


def test_render_accepts_raw_0_16_pixels() -> None:
    images, _ = digits_source()
    np.testing.assert_allclose(render_digit(images[2] * 16, 32), render_digit(images[2], 32))


def test_render_is_deterministic_for_a_seed() -> None:
    images, _ = digits_source()
    a = render_digit(images[7], 48, np.random.default_rng(11))
    b = render_digit(images[7], 48, np.random.default_rng(11))
    c = render_digit(images[7], 48, np.random.default_rng(12))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    plain = render_digit(images[7], 48)
    np.testing.assert_array_equal(plain, render_digit(images[7], 48, None))
    np.testing.assert_array_equal(
        plain, render_digit(images[7], 48, np.random.default_rng(1), NO_JITTER)
    )


def test_sizes_look_alike() -> None:
    images, _ = digits_source()
    small = render_digit(images[0], 16)
    large = Image.fromarray(render_digit(images[0], 128)).resize((16, 16), Image.Resampling.BOX)
    assert np.abs(small - np.asarray(large)).mean() < 0.08


@pytest.mark.parametrize("shape", [(16, 16), (8, 30), (257, 100)])
def test_png_round_trip_exact_to_one_level(shape: tuple[int, int]) -> None:
    image = np.random.default_rng(4).random(shape, dtype=np.float32)
    data = to_png(image)
    assert data.startswith(b"\x89PNG")
    with Image.open(io.BytesIO(data)) as decoded:
        assert decoded.mode == "L"
    back = from_png(data)
    assert back.shape == shape and back.dtype == np.float32
    assert np.abs(back - image).max() <= 0.5 / 255 + 1e-6
    np.testing.assert_array_equal(from_png(to_png(back)), back)


def test_from_png_converts_other_modes() -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (5, 4), (255, 255, 255)).save(buffer, format="PNG")
    back = from_png(buffer.getvalue())
    assert back.shape == (4, 5)
    np.testing.assert_allclose(back, 1.0)


def test_load_digit_images_per_size() -> None:
    samples = list(load_digit_images([16, 32], per_size=5, seed=3))
    assert len(samples) == 10
    assert [s.side for s in samples] == [16] * 5 + [32] * 5
    assert [s.source_index for s in samples[:5]] == [s.source_index for s in samples[5:]]
    _, labels = digits_source()
    for sample in samples:
        assert sample.image.shape == (sample.side, sample.side)
        assert sample.label == labels[sample.source_index]
    again = list(load_digit_images([16, 32], per_size=5, seed=3))
    for a, b in zip(samples, again, strict=True):
        np.testing.assert_array_equal(a.image, b.image)


def test_load_digit_images_mixed() -> None:
    plan = sample_plan([16, 24, 32], per_size=20, seed=0, mixed=True)
    assert len(plan) == 60
    assert len({i for i, _ in plan}) == 60
    assert {s for _, s in plan} <= {16, 24, 32}
    assert len(sample_plan([16, 24], seed=0, mixed=True)) == 1797
    first = next(load_digit_images([16, 24, 32], per_size=20, seed=0, mixed=True))
    assert (first.source_index, first.side) == plan[0]


def test_fingerprint_depends_on_parameters() -> None:
    base = data_fingerprint([16, 32], 10, 0)
    assert base.startswith("sha256:") and len(base) == 7 + 64
    assert base == data_fingerprint([16, 32], 10, 0)
    assert base != data_fingerprint([16, 32], 10, 1)
    assert base != data_fingerprint([16, 64], 10, 0)
    assert base != data_fingerprint([16, 32], 10, 0, mixed=True)
    assert base != data_fingerprint([16, 32], 10, 0, jitter=Jitter(noise=0.0))
