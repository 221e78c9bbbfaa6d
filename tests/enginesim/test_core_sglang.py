"""The SGLang-shaped scheduler: reservation-based admission, ratio decay, retraction."""

from __future__ import annotations

from enginesim.core import EngineCore
from enginesim.profiles import load_profile
from enginesim.types import EventKind, Flavor, SimRequest


def _core() -> EngineCore:
    return EngineCore(load_profile("tiny"), flavor=Flavor.SGLANG, seed=0)


def test_prefill_and_decode_run_in_separate_steps() -> None:
    core = _core()
    core.add_request(SimRequest("a", list(range(300, 400)), max_tokens=50, ignore_eos=True), 0.0)
    first = core.step(0.0)
    core.add_request(
        SimRequest("b", list(range(500, 600)), max_tokens=50, ignore_eos=True), first.end
    )
    second = core.step(first.end)  # b's prefill runs alone: a does not decode in it
    assert second.num_prefill_tokens == 100 and second.num_decode_tokens == 0
    third = core.step(second.end)
    assert third.num_prefill_tokens == 0 and third.num_decode_tokens == 2


def test_admission_reserves_max_new_tokens() -> None:
    """A request whose max_tokens reservation does not fit waits although its prompt fits."""

    def run(flavor: Flavor) -> int:
        core = EngineCore(load_profile("tiny"), flavor=flavor, seed=0)
        for i in range(3):
            core.add_request(
                SimRequest(
                    f"r{i}",
                    list(range(300 + 1000 * i, 900 + 1000 * i)),
                    max_tokens=1400,
                    ignore_eos=True,
                ),
                0.0,
            )
        now = 0.0
        for _ in range(6):  # prefill chunks of 512 and a few decode steps
            now = core.step(now).end
        # 3 x 600 prompt tokens would fit the 4096-token pool with room to spare.
        assert core.stats().blocks_in_use * core.block_size < 4096 - 600
        return core.stats().num_waiting

    assert run(Flavor.VLLM) == 0
    assert run(Flavor.SGLANG) == 1  # 2 x (600 + 0.7 x 1400) reserved leaves < 600 + 980


def test_ratio_decays_then_rises_on_retraction() -> None:
    core = _core()
    start = core.new_token_ratio
    for i in range(8):
        core.add_request(
            SimRequest(f"r{i}", list(range(300 + i, 700 + i)), max_tokens=1600, ignore_eos=True),
            0.0,
        )
    now, low, retracted = 0.0, start, False
    while core.has_work():
        res = core.step(now)
        core.check_invariants()
        low = min(low, core.new_token_ratio)
        if any(e.kind is EventKind.PREEMPTED for e in res.events):
            retracted = True
            assert core.new_token_ratio > low  # the ratio jumps back up after a retraction
        now = res.end
    assert low < start
    assert retracted and core.stats().num_preemptions > 0
    assert core.stats().num_finished == 8 and core.stats().blocks_in_use == 0
