"""RecentMost: the most of recent samples per size bucket, halving with time."""

from __future__ import annotations

import pytest

from service.strategies.recent import RecentMost


def test_the_most_of_recent_samples_halves_every_half_life() -> None:
    now = [100.0]
    most = RecentMost(half_life_s=2.0, clock=lambda: now[0])
    assert most.at(10) == 0.0  # nothing seen
    most.note(10, 4.0)
    most.note(10, 1.0)  # smaller: the most stays
    assert most.at(10) == 4.0
    assert most.at(12) == 4.0 and most.at(8) == 4.0  # one bucket: 8-15
    assert most.at(7) == 0.0 and most.at(16) == 0.0  # others have their own
    now[0] += 2.0
    assert most.at(10) == pytest.approx(2.0)
    now[0] += 4.0
    assert most.at(10) == pytest.approx(0.5)
    most.note(10, 1.0)  # above what is left of 4: it is the most now, from now
    assert most.at(10) == 1.0
    now[0] += 2.0
    assert most.at(10) == pytest.approx(0.5)
    most.note(10, float("nan"))  # ignored
    assert most.at(10) == pytest.approx(0.5)
    most.clear()
    assert most.at(10) == 0.0


@pytest.mark.parametrize("half_life", [0.0, -1.0, float("inf"), float("nan")])
def test_a_half_life_must_be_a_positive_number(half_life: float) -> None:
    with pytest.raises(ValueError, match="half_life_s must be a finite number > 0"):
        RecentMost(half_life_s=half_life)
