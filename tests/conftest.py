"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
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
