"""Live cost calibration on synthetic timing streams (no real timing, no wall-clock asserts)."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest

from service.bundle import CostPolynomial
from service.calibration import CostCalibrator

CURVE = CostPolynomial(coefficients=[0.1, 1e-4], quantile=0.95)
SIGMA = 0.2
NOISE_P95 = math.exp(1.645 * SIGMA)  # p95 of LogNormal(0, SIGMA)


def curve(n: float) -> float:
    return 0.1 + 1e-4 * n


def make(**kwargs: object) -> CostCalibrator:
    profiled = {"hog": CURVE, "lbp": CostPolynomial(coefficients=[0.5, 2e-4])}
    return CostCalibrator(profiled, **kwargs)  # type: ignore[arg-type]


def feed(
    cal: CostCalibrator,
    rng: np.random.Generator,
    count: int,
    scale: float,
    lo: int,
    hi: int,
    extractor: str = "hog",
) -> None:
    """``count`` timings at log-uniform sizes in [lo, hi): scale * c(n) * LogNormal(0, SIGMA)."""
    sizes = np.exp(rng.uniform(math.log(lo), math.log(hi), count)).astype(int)
    noise = rng.lognormal(0.0, SIGMA, count)
    for n, z in zip(sizes, noise, strict=True):
        cal.record(extractor, int(n), scale * curve(int(n)) * float(z))


def test_converges_to_scaled_p95_and_waits_for_min_samples() -> None:
    rng = np.random.default_rng(0)
    cal = make()
    assert not cal.active
    # below min_samples in one bucket (and overall): nothing changes
    for _ in range(29):
        cal.record("hog", 1000, 3.0 * curve(1000))
    assert cal.factor("hog", 1000) == 1.0 and cal.cost("hog", 1000) == pytest.approx(curve(1000))
    assert not cal.active
    cal.record("hog", 1000, 3.0 * curve(1000))
    assert cal.active and cal.factor("hog", 1000) == pytest.approx(3.0)

    cal.reset()
    assert not cal.active and cal.factor("hog", 1000) == 1.0
    feed(cal, rng, 1000, 3.0, 256, 4096)  # buckets 8..11, ~250 samples each
    expected = 3.0 * NOISE_P95
    for n in (300, 700, 1500, 3000, 4000):
        assert cal.factor("hog", n) == pytest.approx(expected, rel=0.10), n
        assert cal.cost("hog", n) == pytest.approx(curve(n) * expected, rel=0.10)
    # an unseen size uses the extractor-wide window, which has the same ratio distribution
    assert cal.factor("hog", 100_000) == pytest.approx(expected, rel=0.10)
    # the other extractor has no data: it takes the bundle-wide prior (the median of the
    # extractor-wide factors with data: here hog's), since a machine that is 3x slower is
    # 3x slower for extractors the planner stopped choosing too
    assert (
        cal.factor("lbp", 1000) == pytest.approx(cal.prior()) == pytest.approx(expected, rel=0.10)
    )
    assert cal.costs_at(1000)["lbp"] == pytest.approx((0.5 + 2e-4 * 1000) * cal.prior())


def test_a_few_hundred_requests_adapt_a_mis_scaled_bundle() -> None:
    """A bundle with costs scaled x0.3 (true cost = c / 0.3) adapts after ~300 requests."""
    rng = np.random.default_rng(1)
    cal = make()
    feed(cal, rng, 300, 1 / 0.3, 512, 2048)  # 2 buckets
    assert cal.factor("hog", 1000) == pytest.approx(NOISE_P95 / 0.3, rel=0.10)


def test_drift_is_forgotten_after_a_window() -> None:
    rng = np.random.default_rng(2)
    cal = make(window=256)
    feed(cal, rng, 600, 3.0, 1024, 2048)  # one bucket
    assert cal.factor("hog", 1500) == pytest.approx(3.0 * NOISE_P95, rel=0.10)
    feed(cal, rng, 300, 1.0, 1024, 2048)  # longer than the window
    assert cal.factor("hog", 1500) == pytest.approx(NOISE_P95, rel=0.10)
    assert cal.factor("hog", 10**6) == pytest.approx(NOISE_P95, rel=0.10)  # wide window too


def test_per_bucket_factors() -> None:
    rng = np.random.default_rng(3)
    cal = make()
    feed(cal, rng, 300, 1.0, 16, 64)  # buckets 4, 5: as profiled
    feed(cal, rng, 300, 3.0, 4096, 8192)  # bucket 12: 3x slow
    for n in (20, 40, 60):
        assert cal.factor("hog", n) == pytest.approx(NOISE_P95, rel=0.10)
    for n in (4100, 6000, 8000):
        assert cal.factor("hog", n) == pytest.approx(3.0 * NOISE_P95, rel=0.10)


def test_empty_or_thin_bucket_falls_back_to_extractor_window() -> None:
    cal = make(min_samples=30)
    for i in range(20):
        cal.record("hog", 1000 + i, 2.0 * curve(1000 + i))
    assert cal.factor("hog", 10) == 1.0  # extractor-wide window still too thin
    for i in range(20):
        cal.record("hog", 1000 + i, 2.0 * curve(1000 + i))
    # bucket 9 has 40 samples; the extractor window too
    assert cal.factor("hog", 1000) == pytest.approx(2.0)
    assert cal.factor("hog", 10) == pytest.approx(2.0)  # no bucket 3 data: fallback
    for _ in range(10):
        cal.record("hog", 10, 5.0 * curve(10))  # bucket 3 has data, but < min_samples
    assert cal.factor("hog", 10) == pytest.approx(5.0)  # p95 of the wide window (50 samples)
    snap = cal.snapshot([10, 1000])["extractors"]["hog"]
    sources = {b["bucket"]: b["source"] for b in snap["buckets"]}
    assert sources == {3: "extractor", 9: "bucket"}


def test_quantile_is_numpy_higher() -> None:
    rng = np.random.default_rng(4)
    for count in (30, 31, 100, 256, 700):
        cal = make(window=256, min_samples=30, refresh_every=1)
        ratios = rng.lognormal(0.0, 0.5, count)
        for r in ratios:
            cal.record("hog", 1000, float(r) * curve(1000))
        window = ratios[-256:]
        expected = float(np.quantile(window, 0.95, method="higher"))
        assert cal.factor("hog", 1000) == pytest.approx(expected, rel=1e-9), count


def test_cached_factor_refreshes_lazily() -> None:
    cal = make(window=64, min_samples=4, refresh_every=4)
    for _ in range(4):
        cal.record("hog", 100, 1.0 * curve(100))
    assert cal.factor("hog", 100) == pytest.approx(1.0)
    for _ in range(64):
        cal.record("hog", 100, 2.0 * curve(100))
    assert cal.factor("hog", 100) == pytest.approx(2.0)
    cal.record("hog", 100, 9.0 * curve(100))
    assert cal.factor("hog", 100) == pytest.approx(2.0)  # cached: < refresh_every new samples
    for _ in range(3):
        cal.record("hog", 100, 9.0 * curve(100))
    assert cal.factor("hog", 100) == pytest.approx(9.0)  # 4 new of 64 > 5 %: p95 moves


def test_concurrent_recording_loses_nothing() -> None:
    cal = make(window=128, min_samples=10)
    threads_n, per_thread = 8, 2000
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(seed: int) -> None:
        try:
            rng = np.random.default_rng(seed)
            name = "hog" if seed % 2 else "lbp"
            for n in rng.integers(1, 10_000, per_thread):
                cal.record(name, int(n), 1.5 * curve(int(n)))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            while not stop.is_set():
                cal.factors_at(500)
                cal.costs_at(5000)
                cal.snapshot([100, 1000])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads_n)]
    readers = [threading.Thread(target=reader) for _ in range(2)]
    for t in (*workers, *readers):
        t.start()
    for t in workers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors
    snap = cal.snapshot([1000])["extractors"]
    assert snap["hog"]["samples"] == snap["lbp"]["samples"] == threads_n // 2 * per_thread
    for name in ("hog", "lbp"):
        assert sum(b["samples"] for b in snap[name]["buckets"]) == threads_n // 2 * per_thread
    assert cal.factor("hog", 5000) == pytest.approx(1.5)


def test_disabled_calibrator_is_identity() -> None:
    cal = make(enabled=False)
    for _ in range(100):
        cal.record("hog", 1000, 10.0 * curve(1000))
    assert cal.factor("hog", 1000) == 1.0
    assert cal.cost("hog", 1000) == pytest.approx(curve(1000))
    assert not cal.active
    snap = cal.snapshot([1000])
    assert snap["enabled"] is False and snap["extractors"]["hog"]["samples"] == 0


def test_bad_inputs_are_ignored() -> None:
    cal = make(min_samples=1, refresh_every=1)
    for bad in (
        ("nope", 1000, 1.0),
        ("hog", 0, 1.0),
        ("hog", -5, 1.0),
        ("hog", 1000, float("nan")),
        ("hog", 1000, float("inf")),
        ("hog", 1000, -1.0),
    ):
        cal.record(*bad)
    assert not cal.active
    assert cal.snapshot([1000])["extractors"]["hog"]["samples"] == 0
    assert cal.factor("nope", 1000) == 1.0
    for n in (0.0, -1.0, float("nan")):
        assert cal.factor("hog", n) == 1.0
    with pytest.raises(KeyError):
        cal.cost("nope", 1000)
    with pytest.raises(ValueError):
        make(quantile=1.5)
    with pytest.raises(ValueError):
        make(window=10, min_samples=20)
    with pytest.raises(ValueError):
        make(bucket_base=1.0)


def test_bucket_boundaries() -> None:
    cal = make()
    assert [cal.bucket(n) for n in (1, 2, 3, 4, 7, 8, 1023, 1024)] == [0, 1, 1, 2, 2, 3, 9, 10]
    ten = make(bucket_base=10.0)
    assert [ten.bucket(n) for n in (9, 10, 999, 1000, 1001)] == [0, 1, 2, 3, 3]


def test_snapshot_is_json_ready() -> None:
    rng = np.random.default_rng(5)
    cal = make()
    feed(cal, rng, 200, 2.0, 512, 1024)
    snap = json.loads(json.dumps(cal.snapshot([64, 700, 4096])))
    assert {"quantile", "window", "min_samples", "enabled", "extractors"} <= set(snap)
    assert snap["quantile"] == 0.95 and snap["window"] == 256 and snap["min_samples"] == 30
    hog = snap["extractors"]["hog"]
    assert {"profiled", "calibrated", "samples", "buckets"} <= set(hog)
    assert hog["samples"] == 200
    assert set(hog["profiled"]) == {"64", "700", "4096"}
    assert hog["profiled"]["700"] == pytest.approx(curve(700))
    assert hog["calibrated"]["700"] == pytest.approx(curve(700) * 2.0 * NOISE_P95, rel=0.1)
    [bucket] = hog["buckets"]
    assert bucket["bucket"] == 9 and bucket["sizes"] == [512, 1024]
    assert bucket["samples"] == 200 and bucket["source"] == "bucket"
    assert snap["extractors"]["lbp"]["buckets"] == []


# --- a busy machine is not a slow extractor; forgetting ----------------------------------------


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_busy_machine_inflates_contention_not_the_extractor_factors() -> None:
    """Wall time 3x the thread CPU time (the thread waited for a CPU or the GIL): the
    extractor's own factor follows its CPU time (1x here), the machine-wide contention
    follows wall/CPU, and planning (``factors_at``) multiplies every curve by it alike."""
    clock = Clock()
    cal = make(clock=clock)
    for _ in range(300):
        n = 1000
        cal.record("hog", n, 3.0 * curve(n), cpu_ms=curve(n))
    assert cal.factor("hog", 1000) == pytest.approx(1.0)
    assert cal.contention() == pytest.approx(3.0, rel=0.01)
    assert cal.active
    factors = cal.factors_at(1000)
    assert factors["hog"] == pytest.approx(3.0, rel=0.01)
    assert factors["lbp"] == pytest.approx(factors["hog"])  # alike: lbp was never timed
    # Quiet again: within 50 extractions the contention is back within 5 % of none ...
    for _ in range(50):
        cal.record("hog", 1000, curve(1000), cpu_ms=curve(1000))
    assert cal.contention() < 1.05
    assert not cal.factors_at(1000)["lbp"] > 1.05
    # ... and with no extraction at all it decays with time (half-life 2 s).
    for _ in range(300):
        cal.record("hog", 1000, 3.0 * curve(1000), cpu_ms=curve(1000))
    clock.now += 20.0
    assert cal.contention() < 1.01
    assert cal.factors_at(1000) == pytest.approx({"hog": 1.0, "lbp": 1.0}, rel=0.02)


def test_contention_is_time_weighted_and_capped() -> None:
    """A 0.01 ms extraction that lost its CPU for 1 ms says little beside 1 ms ones that ran
    through (the ratio of mean wall to mean CPU time, ~2, not the mean of ratios, ~51), and no burst
    makes planning assume more than ``contention_max``."""
    cal = make(clock=Clock(), contention_max=4.0)
    for _ in range(100):
        cal.record("hog", 1000, 1.0, cpu_ms=1.0)
        cal.record("lbp", 1000, 1.01, cpu_ms=0.01)
    assert 1.5 < cal.contention() < 2.5  # (1 + 1.01) / (1 + 0.01)
    for _ in range(100):
        cal.record("hog", 1000, 100.0, cpu_ms=1.0)
    assert cal.contention() == 4.0


def test_wall_time_alone_keeps_the_old_estimator() -> None:
    """Without CPU times (an extractor waiting on I/O) wall time is the sample, as before."""
    cal = make(clock=Clock())
    for _ in range(40):
        cal.record("hog", 1000, 3.0 * curve(1000))
    assert cal.factor("hog", 1000) == pytest.approx(3.0)
    assert cal.contention() == 1.0


def test_an_unplanned_extractor_is_forgotten_then_probed() -> None:
    """The ratchet: lbp timed at x17 (a burst), then never planned again. Its factor decays
    toward the profile with time; a sample after ``forget_after_s`` restarts its window, and
    the fresh sample prices it at once (1x: back; 3x: still slow)."""
    clock = Clock()
    cal = make(clock=clock, half_life_s=30.0, forget_after_s=60.0)
    for _ in range(100):
        cal.record("lbp", 1000, 17.0 * (0.5 + 2e-4 * 1000))
    assert cal.factor("lbp", 1000) == pytest.approx(17.0)
    clock.now += 4.0  # a brief pause changes nothing
    assert cal.factor("lbp", 1000) == pytest.approx(17.0)
    clock.now += 1.0 + 30.0  # one half-life past the grace
    assert cal.factor("lbp", 1000) == pytest.approx(9.0)
    clock.now += 200.0
    assert cal.factor("lbp", 1000) < 1.1
    # a probe: the first fresh sample alone sets the factor (the old window is forgotten)
    cal.record("lbp", 1000, 1.0 * (0.5 + 2e-4 * 1000))
    assert cal.factor("lbp", 1000) == pytest.approx(1.0)
    clock.now += 200.0
    cal.record("lbp", 1000, 3.0 * (0.5 + 2e-4 * 1000))
    assert cal.factor("lbp", 1000) == pytest.approx(3.0)
    snap = cal.snapshot([1000])["extractors"]["lbp"]
    assert snap["samples"] == 102  # every sample ever, windows restarted or not
    for _ in range(28):  # the largest fresh sample while the window is thin
        cal.record("lbp", 1000, 2.0 * (0.5 + 2e-4 * 1000))
    assert cal.factor("lbp", 1000) == pytest.approx(3.0)
    cal.record("lbp", 1000, 2.0 * (0.5 + 2e-4 * 1000))  # min_samples: the p95 again
    assert cal.factor("lbp", 1000) == pytest.approx(2.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"half_life_s": 0.0},
        {"forget_after_s": -1.0},
        {"contention_half_life_s": 0.0},
        {"contention_weight": 0.0},
        {"contention_weight": 1.5},
        {"contention_max": 0.5},
    ],
)
def test_bad_forgetting_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        make(**kwargs)


def test_a_shared_step_that_lost_the_cpu_teaches_only_the_contention() -> None:
    """A step of two extractions (the request loop's ``Acquire.then``) whose thread had the
    CPU for 30 % of its time cannot say which of them waited: no extractor's ratio moves,
    the contention does. With its CPU the whole time, each extraction's ratio is recorded
    from its own wall time."""
    from service.execution import MeasuredCost

    cal = make(min_samples=1)
    meter = MeasuredCost(0.0, cal, 1000)
    slow = 3.0 * curve(1000) / 1000.0  # seconds: three times hog's profiled cost
    meter.charge_step([("hog", slow), ("lbp", 0.0001)], cpu_share=0.3)
    assert cal.factor("hog", 1000) == 1.0 and cal.factor("lbp", 1000) == 1.0
    assert cal.contention() > 1.0
    meter.charge_step([("hog", slow), ("lbp", 0.0001)], cpu_share=1.0)
    assert cal.factor("hog", 1000) == pytest.approx(3.0)
