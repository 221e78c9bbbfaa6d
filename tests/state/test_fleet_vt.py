"""bench/fleet_vt.py runs the gateway's own admission and lease code in virtual time: a
small cell keeps its invariants (no pool overcommitted, every request accounted for) and
its gateways do renew through `StateSync`."""

from __future__ import annotations

from bench.fleet_vt import Engines, run_cell


def test_a_small_fleet_keeps_every_pool_and_accounts_for_every_request() -> None:
    one = run_cell(1, 10, 10.0, 0.8, seed=3)
    three = run_cell(3, 10, 10.0, 0.8, seed=3)
    assert one.offered == three.offered > 100
    for r in (one, three):
        assert r.max_overcommit_tokens == 0
        assert r.served + r.lost == r.offered
    assert one.round_trips_per_s == 0  # one gateway leases nothing
    # Three renew at least every interval each (and earlier while requests queue).
    assert three.round_trips_per_s >= 3 / 0.5
    assert three.killed > 0  # gateway 0 died with requests in flight; they were sent again


def test_engine_replicas_serve_seed_001s_requests_without_a_preemption() -> None:
    """With enginesim's engines as replicas (bench/fleet_real.py's cells), requests run
    through real engine cores: served ones finished there, late ones were aborted at
    their client's deadline, and admission's view of the pools kept every engine from
    preempting."""
    engines = Engines("seed2-8b-16gb", speed=5.0)
    one = run_cell(1, 2, 10.0, 0.8, seed=3, engines=engines)
    two = run_cell(2, 2, 10.0, 0.8, seed=3, engines=engines)
    assert one.offered == two.offered > 30
    for r in (one, two):
        assert r.max_overcommit_tokens == 0
        assert r.preemptions == 0
        assert r.served + r.lost == r.offered
        assert r.served > 0.9 * r.offered
    # At twice the load the engines cannot serve everything in time: some are lost.
    over = run_cell(1, 2, 10.0, 2.0, seed=3, engines=engines)
    assert over.lost > 0 and over.preemptions == 0


def test_a_retry_is_known_by_the_gateway_that_shed_it_through_its_own_retry_memory() -> None:
    """The clients say which attempt they send (as the openai SDKs do), and the gateway's
    own retry memory, not the harness, knows a retry for one: behind one gateway every
    retry is back where it was shed; behind several, one the balancer sends elsewhere is
    new there."""
    one = run_cell(1, 2, 10.0, 2.0, seed=3)
    assert one.retries > 0 and one.retries_known == one.retries
    three = run_cell(3, 2, 10.0, 2.0, seed=3, kill=False)
    assert 0 < three.retries_known < three.retries
