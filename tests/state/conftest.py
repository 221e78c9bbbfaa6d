"""Fixtures for the shared-state tests: a real redis-server (the one scripts/test.sh
started, named by KVGATE_REDIS_URL, or one this session starts on a free port and stops
by PID), and a fresh key prefix per test so tests never see each other's keys."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server this test owns: started on a port, stopped and restarted by PID."""

    def __init__(
        self, port: int | None = None, args: Sequence[str] = (), conf: Path | None = None
    ) -> None:
        """`args`: more options (``--replicaof``); `conf`: a config file to start from (a
        sentinel's, which it rewrites as it learns)."""
        self.port = port or free_port()
        self.args = list(args)
        self.conf = conf
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is required (scripts/test.sh installs it)"
        self.proc = subprocess.Popen(
            [
                exe,
                *([str(self.conf)] if self.conf else []),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                *self.args,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not listen on {self.port}")

    def kill(self) -> None:
        """SIGKILL: a crash, nothing flushed or handed over."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("KVGATE_REDIS_URL")
    if url:
        yield url
        return
    server = RedisServer()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def own_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, to stop and restart mid-test."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def prefix() -> str:
    return f"kvgate-test-{uuid.uuid4().hex[:12]}"


ROOT = Path(__file__).resolve().parents[2]
