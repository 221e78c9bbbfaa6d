"""The session's vLLM servers, booted ahead of the tests that use them.

A vLLM start costs 30-40 s, mostly one core of Python importing and warming up, and the
suite needs four of them (the session's, the pooling one, the speculating one, the coding
agents'). Booted when its first test asks, each start is idle time for the suite; booted
from the moment the tests are collected, it overlaps the tests that come before it. One
server boots at a time, in the order the tests will ask for them, so that the machine's
other core stays with the tests.

A test module declares its server with `declare(fixture, make)` at import (collection
imports it before any test runs); its fixture then calls `take(fixture)` and stops the
server when done. A server no selected test asks for is not started.
"""

from __future__ import annotations

import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.realengine.vllm import START_TIMEOUT_S, VllmServer, vllm_path


@dataclass
class _Boot:
    make: Callable[[Path], VllmServer]  # the server, given a folder for its log
    model_var: str
    timeout: float
    server: VllmServer | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, folder: Path) -> None:
        try:
            self.server = self.make(folder)
            self.server.launch(vllm_path("KVGATE_VLLM_PYTHON"), vllm_path(self.model_var))
            self.server.wait_healthy(self.timeout)
        except BaseException as e:  # pytest.fail raises a BaseException: the test re-raises it
            self.error = e
        finally:
            self.done.set()


_declared: dict[str, _Boot] = {}
_started: list[_Boot] = []
_lock = threading.Lock()
_closed = threading.Event()  # the session ended: boot nothing more


def declare(
    fixture: str,
    make: Callable[[Path], VllmServer],
    model_var: str = "KVGATE_VLLM_MODEL",
    timeout: float = START_TIMEOUT_S,
) -> None:
    """The server the fixture named `fixture` takes: `make(folder)` builds it (not started),
    `model_var` names the model's path (scripts/real-vllm.sh's env)."""
    _declared[fixture] = _Boot(make, model_var, timeout)


def ahead(fixtures_per_test: list[list[str]]) -> None:
    """Boot, one after another in a background thread, the declared servers the tests
    (their fixture names, in the order they run) ask for, first asked first."""
    order: list[_Boot] = []
    for names in fixtures_per_test:
        for name in names:
            boot = _declared.get(name)
            if boot is not None and boot not in order:
                order.append(boot)
    if not order:
        return
    folder = Path(tempfile.mkdtemp(prefix="kvgate-vllm-"))

    def run_all() -> None:
        for boot in order:
            with _lock:
                if boot in _started or _closed.is_set():  # taken before its turn, or late
                    continue
                _started.append(boot)
            boot.run(folder)

    threading.Thread(target=run_all, name="vllm-boot", daemon=True).start()


def take(fixture: str, folder: Path) -> VllmServer:
    """The server declared for `fixture`, healthy: booted ahead, else now (in `folder`)."""
    boot = _declared[fixture]
    with _lock:
        mine = boot not in _started
        if mine:
            _started.append(boot)
    if mine:
        boot.run(folder)
    boot.done.wait()
    if boot.error is not None:
        raise boot.error
    assert boot.server is not None
    return boot.server


def stop_all() -> None:
    """Stop every server started here that is still running (by its process group)."""
    with _lock:
        _closed.set()
    for boot in _started:
        boot.done.wait(timeout=5.0)
        if boot.server is not None:
            boot.server.stop()
