"""The scaling signal (admission/scaling.py) on a virtual clock: Little's law over the
window, demand that is shed still counts, and it falls back when demand does."""

from __future__ import annotations

from admission.scaling import ScalingSignal


def drive(sig: ScalingSignal, start: float, seconds: int, rate: int, service_s: float) -> float:
    """`rate` arrivals a second, each served `service_s`, for `seconds`."""
    t = start
    for s in range(seconds):
        for i in range(rate):
            now = start + s + i / rate
            sig.arrived("m", now)
            sig.served("m", service_s, 100, now)
        t = start + s + 1
    return t


def test_little_law_over_the_window_and_back() -> None:
    sig = ScalingSignal(window_s=30.0)
    two = [(4, 10_000), (4, 10_000)]  # two replicas, 4 running each
    t = drive(sig, 0.0, 40, 8, 1.0)  # 8/s x 1 s = 8 running: what two serve
    assert sig.desired("m", t, two) == 2
    t = drive(sig, t, 40, 16, 1.0)  # doubled: four
    assert sig.desired("m", t, two) == 4
    t = drive(sig, t, 40, 4, 1.0)  # halved: one
    assert sig.desired("m", t, two) == 1
    assert sig.desired("m", t + 31, two) == 0  # no demand in the window


def test_shed_demand_counts_and_a_pool_bounds_uncapped_replicas() -> None:
    sig = ScalingSignal(window_s=10.0)
    for s in range(10):
        for i in range(20):
            sig.arrived("m", s + i / 20)  # 20/s offered
        for i in range(8):
            sig.served("m", 1.0, 1000, s + i / 8)  # 8/s served, 1,000 tokens each
    # No running cap: a pool of 4,000 tokens holds 4 such requests.
    assert sig.desired("m", 10.0, [(None, 4000), (None, 4000)]) == 5  # 20 x 1 / 4
    # A running allowance above what the pool holds: the pool binds.
    assert sig.desired("m", 10.0, [(8, 4000), (8, 4000)]) == 5
    assert sig.desired("other", 10.0, []) is None
