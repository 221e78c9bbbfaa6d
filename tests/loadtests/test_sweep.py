"""`kvgate sweep` end to end: a short staircase straight at a simulated replica whose
ceiling is known, and through kvgate in front of the same kind of replica.

Locust patches the process it runs in with gevent, so the sweep runs as a subprocess
(`kvgate sweep`, as a user runs it) while the replica and the gateway serve from this
test's event loop.
"""

from __future__ import annotations

import asyncio
import csv
import json
import math
import struct
import sys
from pathlib import Path

import pytest

# `kvgate sweep` (Locust) as a subprocess, for seconds per step.
pytestmark = pytest.mark.slow

# Prompts of about 900 tokens and 32 output tokens reserve about 60 of the pool's 256
# blocks each: four run at once, the fifth waits.
PROMPT, OUTPUT = 900, 32
STEPS = [1, 2, 4, 8]
SPEED = 4.0


def ceiling(profile, prompt_tokens: float) -> int:  # type: ignore[no-untyped-def]
    """Requests the replica's KV pool holds at once, from the prompt length it counted."""
    block = profile.engine.block_size
    need = math.ceil((prompt_tokens + OUTPUT) / block)
    return profile.pool_tokens // block // need


async def sweep(target: str, out: Path, *extra: str) -> tuple[str, str]:
    cmd = [
        sys.executable, "-m", "gateway.cli", "sweep",
        "--target", target, "--workload", "chat",
        "--prompt-tokens", f"fixed:{PROMPT}", "--output-tokens", f"fixed:{OUTPUT}",
        "--steps", ",".join(map(str, STEPS)), "--hold", "8", "--speed", str(SPEED),
        "--timeout", "0.5", "--max-retries", "20", "--out", str(out), *extra,
        # About 27 completions a step at the ceiling: one more or less is 4%, so a short
        # run asks for a 20% gain where the default asks for 10%. (At 5 s a step, about
        # 17, a step slowed by the rest of the suite once read as still climbing.)
        "--plateau-gain", "0.2",
    ]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    return stdout.decode(), stderr.decode()


def steps(out: Path) -> list[dict[str, str]]:
    with (out / "steps.csv").open() as f:
        return list(csv.DictReader(f))


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


async def test_sweep_straight_finds_the_replicas_ceiling(enginesim_server, slow_tiny, tmp_path):
    srv = await enginesim_server(slow_tiny, speed=SPEED)
    out = tmp_path / "straight"
    stdout, stderr = await sweep(srv.url, out, "--label", "straight")
    rows = steps(out)
    assert [int(r["concurrency"]) for r in rows] == STEPS
    assert all(int(r["ended"]) > 0 for r in rows)
    result = json.loads((out / "sweep.json").read_text())[0]
    counted = max(s["prompt_tokens_mean"] for s in result["steps"])
    assert ceiling(slow_tiny, counted) == 4
    # The plateau is the simulator's ceiling, and past it requests time out.
    assert "plateau: c=4;" in stdout
    assert "failure point: c=8;" in stdout
    top = rows[-1]
    assert int(top["timed_out"]) > 0 and float(top["valid_fraction"]) < 0.95
    assert math.isclose(result["speed"], SPEED)
    for name in ("throughput.png", "latency.png"):
        w, h = png_size(out / name)
        assert w > 300 and h > 200
    report = (out / "report.md").read_text()
    assert "![throughput](throughput.png)" in report and "| 8 |" in report
    assert "step 4/4 c=8" in stderr  # the progress line


async def test_sweep_through_kvgate_holds_the_plateau(
    enginesim_server, gateway, slow_tiny, tmp_path, monkeypatch
):
    srv = await enginesim_server(slow_tiny, speed=SPEED)
    # Retry-After floors in the replica's time, as `kvgate demo` sets them; the cold
    # Retry-After (before any release) too, which is a constant of admission.
    monkeypatch.setattr("admission.shedding.COLD_RETRY_AFTER_S", 0.2)
    gw = await gateway(srv, admission={"min_retry_after_s": 0.05})
    out = tmp_path / "kvgate"
    stdout, stderr = await sweep(gw.url, out, "--label", "through kvgate")
    rows = steps(out)
    assert [int(r["concurrency"]) for r in rows] == STEPS
    assert "failure point: -;" in stdout
    assert all(float(r["valid_fraction"]) >= 0.95 for r in rows)
    assert all(r["limit_max"] for r in rows)  # kvgate's learned limit, read from /metrics
