"""Session-wide llama-server processes, both `-np 4 -c 4096 --threads 1` on free loopback
ports, stopped by PID when the session ends:

- `per_slot`: the layout llama-server picks when `-np` is given: each slot owns
  n_ctx / n_slots = 1,024 tokens of KV (`kv_unified = false`);
- `unified`: `--kv-unified`: the four slots share one 4,096-token pool and each may use all
  of it.

`engine` runs a test once against each.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.realengine.llama import N_CTX, N_SLOTS, LlamaServer, engine_file

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


@pytest.fixture(autouse=True)
def _idle_after() -> Iterator[None]:
    """Every test leaves every running server with no slot processing."""
    yield
    for server in _running:
        server.wait_idle()
