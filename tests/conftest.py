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
# or external tools. A test marks itself (`@pytest.mark.slow`), a file whose every test is
# slow says so once (`pytestmark = pytest.mark.slow`); tests/realengine/ is slow as a whole.
SLOW_FOLDER = "tests/realengine/"
_ALL_SLOW = "\npytestmark = pytest.mark.slow\n"


def _in_slow_folder(path: Path, config: pytest.Config) -> bool:
    try:
        rel = path.relative_to(config.rootpath).as_posix()
    except ValueError:
        return False
    return (rel + "/").startswith(SLOW_FOLDER)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under the fast subset's expression exactly, a file whose every test is slow is not
    collected: it would be deselected anyway, after an import that costs time (its text
    says so, which is cheap to read)."""
    if " ".join(config.getoption("markexpr").split()) != "not slow":
        return None
    if _in_slow_folder(collection_path, config):
        return True
    if collection_path.suffix == ".py" and _ALL_SLOW in collection_path.read_text():
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _in_slow_folder(item.path, config):
            item.add_marker(pytest.mark.slow)
