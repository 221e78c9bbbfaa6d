"""bench/redis_load.py drives real gateways' lease loops against a real redis-server: a
tiny cell renews at about its interval, leaves one lease hash per replica and resource
with every gateway in it, reads the server's CPU, and cleans up its keys and its
server."""

from __future__ import annotations

import math
import socket

import pytest
import redis.asyncio as aioredis

from bench.redis_load import redis_server, run_cell, table

pytestmark = pytest.mark.slow  # starts a redis-server; about 3 s


async def test_a_tiny_cell_renews_at_its_interval_and_leaves_its_records() -> None:
    interval, seconds, n_gw, n_rep = 0.2, 1.0, 2, 10
    with redis_server() as server:
        cell = await run_cell(
            server.url, n_gw, n_rep, interval, "busy", seconds, load=0.5, settle_s=0.3
        )
        admin = aioredis.from_url(server.url)
        try:
            left = await admin.dbsize()
        finally:
            await admin.aclose()
        port = server.port
    # Each gateway renews every interval (its loop wakes every tick, 50 ms, so a round
    # comes up to a tick late, plus the round trip itself), and never fails.
    per_gw = cell.issued_per_s / n_gw
    assert 0.6 / interval <= per_gw <= 1 / interval + 1 / seconds
    assert cell.renewal_errors == 0 and cell.renewals_completed == cell.renewals_issued
    assert cell.round_trips_by_call["renew"] >= cell.renewals_issued  # one script each
    assert cell.max_gap_s < 3 * interval
    # The records were in Redis: a pool and a running hash per replica, each holding
    # both gateways; the busy gateways held requests through their doors.
    assert cell.lease_keys == 2 * n_rep
    assert cell.holders_per_key_min == n_gw
    assert cell.held_requests > 0
    # The server's side was read.
    assert math.isfinite(cell.redis_cpu_core) and cell.redis_cpu_core >= 0
    assert cell.redis_commands.get("evalsha", 0) >= cell.renewals_issued
    assert cell.redis_script_us_per_call > 0
    assert f"| {n_gw} | {n_rep} | {interval:g} | busy |" in table([cell])
    assert cell.queue_depth_mean == 0  # busy: no queue stands
    # The cell returned its leases and deleted its keys; the server is gone.
    assert left == 0
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
