"""The Locust file as users run it: headless against kvgate, and its load shapes.

Locust patches the process it runs in with gevent, so it runs as a subprocess here.
"""

from __future__ import annotations

import asyncio
import csv
import os
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest

# Locust as a subprocess, for seconds.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LOCUSTFILE = ROOT / "loadtests" / "locustfile.py"
LOCUST = Path(sys.executable).with_name("locust")


async def run(*cmd: str, env: dict[str, str] | None = None, limit: float = 60) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), limit)
    return proc.returncode or 0, out.decode()


async def test_users_run_headless_against_kvgate(replica, gateway, tmp_path):
    srv = await replica(speed=50)
    gw = await gateway(srv)
    # One user of each class (equal weights) for a few seconds; lengths sized for the
    # tiny profile's 2,048-token context.
    rc, out = await run(
        str(LOCUST), "-f", str(LOCUSTFILE), "--headless", "--host", gw.url,
        "-u", "4", "-r", "4", "-t", "4s", "--only-summary", "--csv", str(tmp_path / "run"),
        "--prompt-tokens", "lognormal:150,0.5,20,400", "--output-tokens", "fixed:24",
        "--system-tokens", "300", "--max-context", "1500", "--timeout", "20",
    )  # fmt: skip
    assert rc == 0, out[-3000:]  # Locust exits 1 when any request failed
    with (tmp_path / "run_stats.csv").open() as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    for workload in ("chat", "coding", "agentic", "batch-json"):
        post = rows[("POST", workload)]
        assert int(post["Request Count"]) > 0 and int(post["Failure Count"]) == 0, post
        assert int(rows[("TTFT", workload)]["Request Count"]) == int(post["Request Count"])
        assert ("ITL", workload) in rows
    # ignore_eos with max_tokens: every chat answer is exactly 24 tokens (the size column).
    assert float(rows[("POST", "chat")]["Average Content Size"]) == 24


async def test_the_web_ui_shows_the_options_and_runs_a_swarm(replica, gateway, unused_port):
    """The same file in the web UI: its options are in the start form, and a swarm
    started from the UI with them set runs against kvgate without failures."""
    srv = await replica(speed=50)
    gw = await gateway(srv)
    ui = f"http://127.0.0.1:{unused_port}"
    proc = await asyncio.create_subprocess_exec(
        str(LOCUST), "-f", str(LOCUSTFILE), "--web-host", "127.0.0.1",
        "--web-port", str(unused_port), "--host", gw.url, "--class-picker",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            page = ""
            for _ in range(100):  # up to ~10 s for Locust to listen
                try:
                    async with s.get(ui + "/") as r:
                        page = await r.text()
                        break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.1)
            for option in ("prompt_tokens", "output_tokens", "prompt_file", "timeout", "steps"):
                assert f'"{option}": {{' in page, option
            form = {
                "user_count": "2", "spawn_rate": "2", "host": gw.url,
                "prompt_tokens": "fixed:100", "output_tokens": "fixed:8", "timeout": "20",
                "user_classes": "ChatUser",
            }  # fmt: skip
            async with s.post(ui + "/swarm", data=form) as r:
                assert (await r.json())["success"]
            stats: dict = {}
            for _ in range(60):  # until a few requests are in (bounded)
                await asyncio.sleep(0.1)
                async with s.get(ui + "/stats/requests") as r:
                    stats = await r.json()
                posts = [x for x in stats["stats"] if x.get("method") == "POST"]
                if posts and posts[0]["num_requests"] >= 5:
                    break
            async with s.post(ui + "/stop") as r:
                assert r.status == 200
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)
    assert posts and posts[0]["name"] == "chat" and posts[0]["num_requests"] >= 5
    assert stats["fail_ratio"] == 0


@pytest.fixture
def unused_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


SHAPES = textwrap.dedent(
    """
    from types import SimpleNamespace
    from loadtests.shapes import MixedShape, StaircaseShape, parse_steps
    from loadtests.users import AgenticUser, ChatUser

    assert parse_steps("x8") == [1, 2, 4, 8] and parse_steps("x6") == [1, 2, 4, 6]
    opts = SimpleNamespace(steps="1,2,4", hold=10.0, phases="2:chat,6:chat+agentic")
    runner = SimpleNamespace(environment=SimpleNamespace(parsed_options=opts))
    for cls in (StaircaseShape, MixedShape):
        cls.abstract = False
    stair, mixed = StaircaseShape(), MixedShape()
    stair.runner = mixed.runner = runner
    ticks = {}
    for t in (0, 9.9, 10, 25, 30):
        stair.get_run_time = mixed.get_run_time = lambda t=t: t
        ticks[t] = (stair.tick(), mixed.tick())
    assert [s for s, _ in ticks.values()] == [(1, 1.0), (1, 1.0), (2, 2.0), (4, 4.0), None]
    assert ticks[0][1] == (2, 2.0, [ChatUser])
    assert ticks[10][1] == (6, 6.0, [ChatUser, AgenticUser])
    assert ticks[30][1] is None
    print("ok")
    """
)


async def test_shapes_step_through_their_schedule():
    rc, out = await run(sys.executable, "-c", SHAPES, limit=30)
    assert rc == 0 and out.strip().endswith("ok"), out


@pytest.mark.parametrize(
    ("shape", "options"),
    [
        ("staircase", ["--steps", "1,2", "--hold", "1", "ChatUser"]),
        ("mixed", ["--phases", "1:chat,3:coding+agentic", "--hold", "1"]),
    ],
)
async def test_a_shape_drives_a_headless_run_and_ends_it(replica, shape, options, tmp_path):
    srv = await replica(speed=50)
    rc, out = await run(
        str(LOCUST), "-f", str(LOCUSTFILE), "--headless", "--host", srv.url,
        "--only-summary", "--csv", str(tmp_path / "run"), *options,
        "--prompt-tokens", "fixed:100", "--output-tokens", "fixed:8",
        "--system-tokens", "200", "--max-context", "1000",
        env={"KVGATE_SHAPE": shape}, limit=30,
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    assert "Shape test stopping" in out  # the shape ended the run, not a time limit
    with (tmp_path / "run_stats.csv").open() as f:
        names = {r["Name"] for r in csv.DictReader(f) if r["Type"] == "POST"}
    assert names == ({"chat"} if shape == "staircase" else {"chat", "coding", "agentic"})


async def test_an_unknown_shape_is_refused():
    rc, out = await run(
        str(LOCUST), "-f", str(LOCUSTFILE), "--list", env={"KVGATE_SHAPE": "nonsense"}, limit=30
    )
    assert rc != 0 and "expected staircase or mixed" in out
