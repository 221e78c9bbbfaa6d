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


class RedisClusterOfThree:
    """Three redis-server nodes in cluster mode, their slots split by ``redis-cli --cluster
    create``; stopped by PID."""

    def __init__(self, folder: Path) -> None:
        self.nodes = [
            RedisServer(
                args=["--cluster-enabled", "yes", "--dir", str(folder)]
                + ["--cluster-config-file", f"nodes-{i}.conf", "--cluster-node-timeout", "2000"]
                # The bus port: by default the port + 10,000, past 65,535 for a free port
                # drawn from the top of the ephemeral range.
                + ["--cluster-port", str(free_port())]
            )
            for i in range(3)
        ]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> None:
        cli = shutil.which("redis-cli")
        assert cli, "redis-cli is required (scripts/test.sh installs it)"
        for n in self.nodes:
            n.start()
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            info = subprocess.run(
                [cli, "-p", str(self.nodes[0].port), "cluster", "info"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout
            if "cluster_state:ok" in info:
                return
            time.sleep(0.1)
        raise RuntimeError("the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterOfThree]:
    cluster = RedisClusterOfThree(tmp_path_factory.mktemp("redis-cluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
