"""A real llama.cpp llama-server process for the tests, and a small stdlib HTTP client for it.

The binary and the model come from `scripts/real-engine.sh`, which caches them outside the
repository; `scripts/test.sh` exports their paths as `KVGATE_LLAMA_SERVER`,
`KVGATE_LLAMA_MODEL` and `KVGATE_LLAMA_TOKENIZER`. Run alone, pytest falls back to the env
file the script leaves in the cache. Without them a test FAILS (never skips): a suite that
skips its real engine would pass having tested nothing.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

MODEL_ALIAS = "tiny-llama"
N_SLOTS = 4
N_CTX = 4096
START_TIMEOUT_S = 60.0


def cached_env(env_name: str) -> dict[str, str]:
    """The lines a set-up script wrote to the cache (``real-engine.env``, ``real-vllm.env``)."""
    cache = Path(os.environ.get("KVGATE_CACHE") or Path.home() / ".cache" / "kvgate")
    env_file = cache / env_name
    if not env_file.is_file():
        return {}
    lines = env_file.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def env_path(var: str, script: str, env_name: str) -> Path:
    """The path in environment variable `var` (or the env file `script` cached); fails,
    never skips, if absent."""
    value = os.environ.get(var) or cached_env(env_name).get(var)
    if not value:
        pytest.fail(
            f"{var} is not set and no env file is cached: run `bash scripts/{script}` "
            "(or the whole suite with `bash scripts/test.sh`)",
            pytrace=False,
        )
    path = Path(value)
    if not path.exists():
        pytest.fail(f"{var}={path} does not exist: run `bash scripts/{script}`", False)
    return path


def engine_file(var: str) -> Path:
    """A llama.cpp path of scripts/real-engine.sh (the server, the model, its tokenizer)."""
    return env_path(var, "real-engine.sh", "real-engine.env")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class LlamaServer:
    """One llama-server on 127.0.0.1: started, probed, stopped by its PID."""

    def __init__(self, name: str, args: list[str], log_path: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = log_path
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, binary: Path, model: Path) -> None:
        self.port = free_port()
        cmd = [
            str(binary),
            *("--model", str(model), "--alias", MODEL_ALIAS),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            # One thread: with two on this 2-core machine decode stalls at random.
            *("--threads", "1", "--threads-batch", "1"),
            *("--metrics", "--slots", "--no-webui"),
            *self.args,
        ]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"llama-server ({self.name}) exited with {self.proc.returncode}: "
                    f"{' '.join(cmd)}\n{self.log_tail()}",
                    pytrace=False,
                )
            with contextlib.suppress(OSError):
                if self.get("/health", timeout=1.0).status == 200:
                    return
            time.sleep(0.05)
        self.stop()
        pytest.fail(
            f"llama-server ({self.name}) not healthy after {START_TIMEOUT_S} s\n{self.log_tail()}",
            pytrace=False,
        )

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # --- HTTP -------------------------------------------------------------------------

    def connect(self, timeout: float = 30.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> Reply:
        conn = self.connect(timeout)
        try:
            payload = None if body is None else json.dumps(body)
            headers = {} if body is None else {"Content-Type": "application/json"}
            conn.request(method, path, body=payload, headers=headers)
            resp = conn.getresponse()
            return Reply(resp.status, dict(resp.getheaders()), resp.read())
        finally:
            conn.close()

    def get(self, path: str, timeout: float = 30.0) -> Reply:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body: Any, timeout: float = 30.0) -> Reply:
        return self.request("POST", path, body, timeout=timeout)

    @contextlib.contextmanager
    def open_stream(
        self, body: dict[str, Any], path: str = "/v1/chat/completions"
    ) -> Iterator[tuple[http.client.HTTPConnection, http.client.HTTPResponse]]:
        """POST `body` and hand back the connection and the unread response."""
        conn = self.connect()
        try:
            conn.request(
                "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
            )
            yield conn, conn.getresponse()
        finally:
            conn.close()

    # --- what the engine says about itself ---------------------------------------------

    def props(self) -> dict[str, Any]:
        return self.get("/props").json()

    def slot_ctx(self) -> int:
        return int(self.props()["default_generation_settings"]["n_ctx"])

    def slots(self) -> list[dict[str, Any]]:
        return self.get("/slots").json()

    def metric(self, name: str) -> float:
        for line in self.get("/metrics").body.decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"no metric {name}")

    def n_tokens(self, messages: list[dict[str, str]]) -> int:
        """Prompt tokens of a chat request, counted by the engine itself."""
        prompt = self.post("/apply-template", {"messages": messages}).json()["prompt"]
        return len(self.post("/tokenize", {"content": prompt}).json()["tokens"])

    def wait_idle(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Poll /slots until no slot is processing; returns the last answer."""
        deadline = time.monotonic() + timeout
        slots = self.slots()
        while any(s["is_processing"] for s in slots):
            if time.monotonic() > deadline:
                raise AssertionError(f"slots still busy after {timeout} s: {slots}")
            time.sleep(0.02)
            slots = self.slots()
        return slots


def sse_events(resp: http.client.HTTPResponse, limit: int | None = None) -> list[str]:
    """The `data:` payloads of an SSE response, up to `limit` events or the end."""
    events: list[str] = []
    while limit is None or len(events) < limit:
        line = resp.readline()
        if not line:
            break
        text = line.decode().rstrip("\r\n")
        if text.startswith("data: "):
            events.append(text[len("data: ") :])
    return events


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def words(n: int) -> str:
    """About n tokens of text ("the" is one token, " the" another)."""
    return " ".join(["the"] * n)
