"""`enginesim serve` as a real process: start, answer, stop on SIGTERM, exit on a crash."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from enginesim.cli import build_parser, main
from tests.enginesim.helpers import CHAT, chat_body

ROOT = Path(__file__).resolve().parents[2]


async def _spawn(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start `python -m enginesim serve ...` on a free port; wait for its ready line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "enginesim", "serve", "--port", "0", "--log-level", "WARNING",
        *args,
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(20):
            line = (await proc.stdout.readline()).decode()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    if not line.startswith("enginesim ready "):
        proc.kill()
        err = await proc.stderr.read() if proc.stderr else b""
        await proc.wait()
        raise AssertionError(f"no ready line: {line!r} {err.decode()[-2000:]}")
    return proc, line.split()[-1]


@pytest.mark.slow  # a real `enginesim serve` process
async def test_serve_answers_and_stops_on_sigterm():
    proc, url = await _spawn("--profile", "tiny", "--speed", "20", "--flavor", "sglang")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(url + "/health") as r:
                assert r.status == 200
            async with s.get(url + "/server_info") as r:
                assert (await r.json())["page_size"] == 16
            async with s.post(url + CHAT, json=chat_body(max_tokens=4, ignore_eos=True)) as r:
                assert (await r.json())["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.slow  # a real `enginesim serve` process
async def test_crash_fault_exits_the_process():
    proc, url = await _spawn(
        "--profile", "tiny", "--speed", "20", "--fault", "crash", "--fault-after-tokens", "5"
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            async with s.get(url + "/admin/faults") as r:
                assert (await r.json())["mode"] == "crash"
            body = chat_body(max_tokens=200, ignore_eos=True, stream=True)
            with pytest.raises(aiohttp.ClientError):
                async with s.post(url + CHAT, json=body) as r:
                    await r.read()
        async with asyncio.timeout(10):
            assert await proc.wait() == 1
        assert proc.stderr is not None
        assert b"injected crash" in await proc.stderr.read()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--profile", "no-such-profile"])
    assert exc.value.code == 2
    assert "no-such-profile" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--profile", "tiny", "--fault", "error", "--fault-status", "404"])
    assert "5xx" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--profile", "tiny", "--fault-factor", "3"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--profile", "tiny", "--speed", "0"])


def test_cli_lists_profiles(capsys):
    assert main(["profiles"]) == 0
    assert "tiny" in capsys.readouterr().out.split()
