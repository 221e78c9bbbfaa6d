"""The coding agents through kvgate, end to end: the Codex CLI (the Responses API) and
Claude Code (Anthropic's Messages API), installed from npm (scripts/coding-agents.sh),
each run non-interactively against a real vLLM behind kvgate to a clean exit, their
requests in kvgate's access log under the tenant of the key they were given.

The vLLM here serves the tiny model's brief variant (its replies end after a few tokens,
as an agent needs its model's turns to end) with a context the agents' prompts fit in
(Claude Code's is ~49k of the tiny tokenizer's tokens) and the tool-call flags these
agents are run with. Without the agents installed the tests fail, never skip.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from admission.tenants import hash_key
from gateway.app import Gateway
from gateway.config import config_from_mapping
from gateway.logging import access_log
from tests.realengine import boot
from tests.realengine.llama import env_path
from tests.realengine.test_through_kvgate import until
from tests.realengine.vllm import MODEL_NAME, VllmServer

KEY = "sk-coding-agents-test"
CONTEXT = 65536
POOL_BYTES = 96 << 20  # 1 KiB a token: a pool of 98,304 tokens, one full context and more
AGENT_TIMEOUT_S = 300.0


def agent(var: str) -> Path:
    return env_path(var, "coding-agents.sh", "coding-agents.env")


def _agents(folder: Path) -> VllmServer:
    extra = [
        *("--max-model-len", str(CONTEXT), "--kv-cache-memory-bytes", str(POOL_BYTES)),
        *("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    ]
    return VllmServer("agents", extra, folder / "vllm.log")


boot.declare("agents_vllm", _agents, model_var="KVGATE_VLLM_BRIEF_MODEL")


@pytest.fixture(scope="module")
def agents_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    server = boot.take("agents_vllm", tmp_path_factory.mktemp("agents"))
    try:
        yield server
    finally:
        server.stop()


class AccessLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None)
        if fields is not None:
            self.lines.append(fields)


@pytest.fixture
async def gateway_log(agents_vllm: VllmServer) -> AsyncIterator[tuple[Gateway, AccessLines]]:
    data = {
        "replicas": [{"name": "agents", "url": agents_vllm.url, "engine": "vllm"}],
        "tenants": [{"name": "coders", "keys_sha256": [hash_key(KEY)]}],
        "upstream": {"first_byte_s": 120.0, "idle_s": 60.0, "total_s": 240.0},
        "discovery": {"refresh_interval_s": 1.0, "probe_timeout_s": 2.0},
        "logging": {"access_log": True},
    }
    lines = AccessLines()
    old, old_level = access_log.disabled, access_log.level
    access_log.addHandler(lines)
    access_log.setLevel(logging.INFO)
    gw = Gateway(config_from_mapping(data, env={}), host="127.0.0.1", port=0)
    await gw.start()
    access_log.disabled = False
    try:
        assert await until(lambda: gw.report.replica_usage()[0].ready, 30.0)
        yield gw, lines
        assert await gw.drain(15.0)
        assert gw.report.reserved_tokens() == 0
    finally:
        await gw.stop()
        access_log.removeHandler(lines)
        access_log.disabled = old
        access_log.setLevel(old_level)


async def run(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """Run an agent as a child process (the gateway keeps serving on this loop)."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), AGENT_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(errors="replace")


def base_env(home: Path) -> dict[str, str]:
    keep = ("PATH", "LANG", "TMPDIR")
    return {k: os.environ[k] for k in keep if k in os.environ} | {"HOME": str(home)}


async def test_codex_exec_runs_through_kvgate_to_a_clean_exit(
    gateway_log: tuple[Gateway, AccessLines], tmp_path: Path
) -> None:
    gw, log = gateway_log
    provider = (
        f'model_providers.kvgate={{name="kvgate",base_url="{gw.url}/v1",'
        'wire_api="responses",env_key="KVGATE_TEST_KEY"}'
    )
    env = base_env(tmp_path) | {"CODEX_HOME": str(tmp_path / "codex"), "KVGATE_TEST_KEY": KEY}
    (tmp_path / "codex").mkdir()
    rc, out = await run(
        [str(agent("KVGATE_CODEX")), "exec", "--skip-git-repo-check",
         "-c", "model_provider=kvgate", "-c", provider, "-m", MODEL_NAME, "say hi"],
        env,
        tmp_path,
    )  # fmt: skip
    assert rc == 0, out[-3000:]
    mine = [x for x in log.lines if x.get("kind") == "responses"]
    assert mine, log.lines
    assert all(x["tenant"] == "coders" for x in mine)
    assert any(x["outcome"] == "ok" and x["stream"] for x in mine), mine
    # An agent with tools is coding or agentic work, not chat.
    assert {x["workload"] for x in mine} <= {"coding", "agentic"}, mine


async def test_claude_code_print_mode_runs_through_kvgate_to_a_clean_exit(
    gateway_log: tuple[Gateway, AccessLines], tmp_path: Path
) -> None:
    gw, log = gateway_log
    env = base_env(tmp_path) | {
        "ANTHROPIC_BASE_URL": gw.url,
        "ANTHROPIC_API_KEY": KEY,
        # Every model Claude Code asks for is the one the replica serves.
        "ANTHROPIC_MODEL": MODEL_NAME,
        "ANTHROPIC_SMALL_FAST_MODEL": MODEL_NAME,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL_NAME,
        # Its default output bound and its prompt would not fit the 64k context together.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024",
        # Nothing leaves loopback: no telemetry, error reports or update checks.
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    rc, out = await run(
        [str(agent("KVGATE_CLAUDE")), "-p", "say hi", "--model", MODEL_NAME], env, tmp_path
    )
    assert rc == 0, out[-3000:]
    mine = [x for x in log.lines if x.get("kind") == "messages"]
    assert mine, log.lines
    assert all(x["tenant"] == "coders" for x in mine)
    assert any(x["outcome"] == "ok" for x in mine), mine
    assert {x["workload"] for x in mine} <= {"coding", "agentic"}, mine
