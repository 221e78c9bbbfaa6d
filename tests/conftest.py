"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
async def enginesim_server() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """A factory of live simulated replicas on 127.0.0.1 (free ports), stopped after the test.

    ``server = await enginesim_server("tiny", speed=50, flavor="sglang")`` takes the
    arguments of `enginesim.server.EngineServer`; ``speed`` defaults to 20 so tests run
    the virtual clock faster than wall time. ``server.url`` is the base URL and
    ``server.core`` the engine core, for assertions on its state.
    """
    from enginesim.server import EngineServer

    servers: list[EngineServer] = []

    async def factory(profile: Any = "tiny", **kwargs: Any) -> EngineServer:
        kwargs.setdefault("speed", 20.0)
        server = EngineServer(profile, **kwargs)
        await server.start()
        servers.append(server)
        return server

    yield factory
    for server in reversed(servers):
        await server.stop()


# The fast subset (`pytest -m "not slow"`, docs/development.md) leaves out the tests marked
# `slow`: those that take over about a second on 2 cores, or start processes, real engines
# or external tools. The files of tests/state, tests/loadtests, tests/deploy and
# tests/enginesim mark their own (`pytestmark`, `@pytest.mark.slow`); these rules mark the
# rest: by path (every test in a file or folder), then by test function (a slow test in an
# otherwise fast file, with all its parameters).
SLOW_PATHS = (
    "tests/realengine/",  # real llama.cpp and vLLM engines, the coding agents
    "tests/gateway/test_dns.py",  # dnsmasq
    "tests/test_types.py",  # mypy over the packages
    "tests/gateway/test_shutdown.py",  # `kvgate serve` processes and signals
    "tests/gateway/test_chaos.py",
    "tests/gateway/test_fuzz.py",
    "tests/gateway/test_limit_changes.py",
    "tests/gateway/test_patience.py",
    "tests/gateway/test_patience_stoppers.py",
    "tests/gateway/test_prefix_feedback.py",
    "tests/gateway/test_prefix_share.py",
    "tests/gateway/test_reload.py",
    "tests/gateway/test_retry_budget.py",
)
# Files whose every test is slow and marks itself so (`pytestmark`): with SLOW_PATHS, what
# the fast subset does not even import (their imports alone cost seconds).
SLOW_MODULES = (
    "tests/deploy/",
    "tests/loadtests/test_demo_losses.py",
    "tests/loadtests/test_locust.py",
    "tests/loadtests/test_sweep.py",
    "tests/state/test_processes.py",
    "tests/state/test_shared_replica.py",
)
SLOW_TESTS = {
    "tests/test_layering.py": {
        "test_the_gateway_packages_never_import_the_simulator_or_the_load_tools"
    },
    "tests/admission/test_fairness.py": {"test_a_flood_does_not_starve_a_trickle"},
    "tests/admission/test_in_time.py": {
        "test_the_demos_job_with_a_stated_timeout_loses_nothing_to_a_late_start",
        "test_the_sdk_at_32_completes_every_request_near_the_best_fixed_concurrency",
        "test_the_sdk_on_an_engine_slower_than_its_timeout_was_set_for_is_not_cut_below_it",
    },
    "tests/admission/test_limit.py": {
        "test_a_cold_replica_finds_the_sweeps_best_without_falling_off_the_cliff",
        "test_a_configured_cap_stays_an_upper_bound",
        "test_an_overstated_pool_is_corrected_from_the_engines_kv_usage",
        "test_clients_that_state_their_timeout_keep_it_through_a_slowdown",
        "test_the_limit_follows_a_slowdown_and_the_recovery",
    },
    "tests/admission/test_patience.py": {
        "test_clients_that_state_no_timeout_are_not_held_past_it_in_virtual_time"
    },
    "tests/admission/test_retry_after.py": {
        "test_the_sdk_at_32_with_a_timeout_under_a_second_completes_every_request"
    },
    "tests/admission/test_told_wait.py": {
        "test_clients_whose_timeout_counts_the_wait_they_are_told_get_the_fixed_proxys_share"
    },
    "tests/gateway/test_agent_apis.py": {
        "test_a_responses_streams_first_token_is_its_first_output_event",
        "test_the_anthropic_sdk_retries_a_529_after_retry_after_and_succeeds",
    },
    "tests/gateway/test_door.py": {"test_the_door_is_the_gateways_only_way_to_the_controller"},
    "tests/gateway/test_e2e_openai.py": {"test_shed_503_is_retried_by_the_sdk_and_succeeds"},
    "tests/gateway/test_failover.py": {
        "test_retries_after_a_sigkill_never_go_back_to_the_killed_engine"
    },
    "tests/gateway/test_failures.py": {
        "test_a_stream_longer_than_many_idle_windows_is_not_cut",
        "test_hung_replica_is_504_and_aborted",
        "test_stream_stalling_mid_way_hits_idle_timeout",
    },
    "tests/gateway/test_health.py": {
        "test_a_replica_slower_than_the_probe_timeout_from_the_start_still_joins",
        "test_a_slow_metrics_answer_still_arrives_and_keeps_the_replica_ready",
        "test_failed_probe_rounds_keep_a_single_replica_ready_until_threshold",
    },
    "tests/gateway/test_hotpath_bytes.py": {
        "test_fast_stream_path_equals_the_per_event_path",
        "test_patched_body_is_json_equivalent_to_the_reserialised_one",
    },
    "tests/gateway/test_keepalive.py": {
        "test_no_connection_idle_as_long_as_the_engines_close_is_reused"
    },
    "tests/gateway/test_llamacpp.py": {
        "test_abandoned_request_on_a_busy_server_is_held_while_it_generates",
        "test_kv_pressure_straight_fails_mid_stream_through_kvgate_completes",
    },
    "tests/gateway/test_lora.py": {"test_an_adapter_shares_its_replicas_running_cap_with_the_base"},
    "tests/gateway/test_not_ready.py": {
        "test_each_cause_is_named_on_admin_and_logged_once_at_warning"
    },
    "tests/gateway/test_queue.py": {
        "test_a_non_stream_request_that_asks_for_its_whole_bound_is_reserved_for_it",
        "test_requests_beyond_the_pool_wait_and_complete_in_order",
        "test_with_no_queue_timeout_set_only_what_a_client_states_bounds_its_wait",
    },
    "tests/gateway/test_routing.py": {"test_a_request_every_filter_rejects_does_not_block_others"},
    "tests/gateway/test_shutdown_connections.py": {
        "test_drain_closes_idle_keepalive_connections_and_answers_with_connection_close"
    },
    "tests/gateway/test_slow_clients.py": {
        "test_client_that_never_reads_its_stream_is_cut_and_released"
    },
    "tests/gateway/test_tenant_config.py": {"test_hash_key_cli"},  # a subprocess
}


def _relpath(path: Path, config: pytest.Config) -> str | None:
    try:
        rel = path.relative_to(config.rootpath).as_posix()
    except ValueError:
        return None
    return rel + "/" if path.is_dir() else rel


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under the fast subset's expression exactly, a file whose every test is slow is not
    collected: it would be deselected anyway, after an import that costs time."""
    if " ".join(config.getoption("markexpr").split()) != "not slow":
        return None
    rel = _relpath(collection_path, config)
    if rel is not None and rel.startswith(SLOW_PATHS + SLOW_MODULES):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        rel = _relpath(item.path, config)
        if rel is None:
            continue
        name = getattr(item, "originalname", item.name)
        if rel.startswith(SLOW_PATHS) or name in SLOW_TESTS.get(rel, ()):
            item.add_marker(pytest.mark.slow)
