"""Locust users that speak the OpenAI API: `ChatUser`, `CodingUser`, `AgenticUser`,
`BatchJsonUser`.

Each user is one client in a closed loop (no think time, as seed 001's batch client:
concurrency is the number of users). Every request streams, with
``stream_options.include_usage`` so the engine's own token counts come back, and is
reported to Locust as request events:

- ``POST <workload>``: the whole request, from its first attempt to its last byte (so it
  includes time spent honouring Retry-After); its size is the output tokens. A failure
  is one of `RequestTimeout`, `ShedTooOften`, `HTTPStatusError`, `StreamError`.
- ``TTFT <workload>``: first attempt to the first token, for completed requests.
- ``ITL <workload>``: the request's mean gap between tokens after the first, for
  completed requests that streamed more than one token.
- ``RETRY <workload>``: a 429/503 answer honoured; its time is the wait.

Retries follow the openai SDK (v1): a 429 or 503 is retried after ``retry-after-ms``,
else ``Retry-After``, when that is more than 0 and at most 60 s, else after the SDK's
backoff (0.5 s doubling, at most 8 s, less up to 25% jitter), at most `max_retries`
times (the SDK's default 2). Every attempt sends the SDK's ``x-stainless-read-timeout``
and ``x-stainless-retry-count`` headers. A timeout is the SDK's read timeout (to the
first byte, then between chunks) and counts as a failure at once: it is what seed 001
recorded, and it is not retried (the SDK would retry it). Other statuses count as
failures and are not retried either. After a failure that is not a timeout the user
pauses 0.1 s, so a target that refuses at once is not hammered in a hot loop.

Options come from the locustfile's command line (`add_arguments`), or from a
`LoadConfig` set on the environment as ``environment.kvgate_load`` (the sweep does so).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from typing import Any, ClassVar

import gevent
import locust  # noqa: F401  (first: Locust patches the process before requests loads ssl)
import requests
from locust import User, constant, task
from locust.env import Environment
from urllib3.exceptions import ReadTimeoutError

from loadtests.workloads import Dist, LoadConfig, RequestSpec, Workload, make_workload


class RequestTimeout(Exception):
    """No byte within the read timeout (to the first byte, or between chunks)."""


class ShedTooOften(Exception):
    """Still shed (429/503) after the last allowed retry."""


class HTTPStatusError(Exception):
    """An answer other than 200, 429 or 503."""


class StreamError(Exception):
    """The stream broke: a connection error, an error event, no ``[DONE]``."""


def retry_after_s(headers: Any) -> float | None:
    """Seconds the server asked for: ``retry-after-ms`` first (as the SDK reads it), then
    an integer or decimal ``Retry-After``; None when neither parses."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            return float(raw) * scale
        except ValueError:
            continue
    return None


def sdk_backoff(retries_so_far: int, rng: random.Random) -> float:
    """The openai SDK's delay when the server's Retry-After is missing or not usable."""
    return min(0.5 * 2.0**retries_so_far, 8.0) * (1.0 - 0.25 * rng.random())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The locustfile's own options, on Locust's parser (so the web UI shows them under
    its custom parameters; a group's options would not show)."""
    g = parser
    g.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    g.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="client read timeout in the target's seconds (to the first byte, then between "
        "chunks, as the openai SDK's)",
    )
    g.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="the target's clock runs this many times faster than the wall clock (an "
        "enginesim replica's --speed); the timeout is divided by it",
    )
    g.add_argument("--max-retries", type=int, default=2, help="retries of a 429/503 (SDK: 2)")
    g.add_argument("--api-key", default="", help="sent as a bearer token", is_secret=True)
    g.add_argument(
        "--prompt-tokens",
        default="",
        help="prompt length for every user class: fixed:N, uniform:LO,HI or "
        "lognormal:MEDIAN,SIGMA[,LO,HI] (default: each class's own)",
    )
    g.add_argument("--output-tokens", default="", help="output length, same forms")
    g.add_argument(
        "--prompt-file",
        default="",
        help='JSONL of real requests, one a line: {"messages": [...]} or {"prompt": "..."}, '
        'optional "max_tokens" and "tools"',
    )
    g.add_argument(
        "--no-ignore-eos",
        action="store_true",
        default=False,
        help="do not send ignore_eos (outputs end where the model stops, not at max_tokens)",
    )
    g.add_argument(
        "--system-tokens", type=int, default=3000, help="AgenticUser: shared system prompt"
    )
    g.add_argument("--turns", default="uniform:3,8", help="AgenticUser: turns per session")
    g.add_argument(
        "--max-context", type=int, default=8192, help="AgenticUser: longest session history"
    )
    g.add_argument("--steps", default="1,2,4,8,16,32,64", help="StaircaseShape: users at each step")
    g.add_argument(
        "--hold", type=float, default=60.0, help="StaircaseShape / MixedShape: seconds per step"
    )
    g.add_argument(
        "--phases",
        default="8:chat+coding,24:batch-json,32:agentic",
        help="MixedShape: TOTAL_USERS:CLASS+CLASS per phase, the classes of the phase's new "
        "users (chat, coding, agentic, batch-json, all); earlier users keep running",
    )


def config_from_options(opts: argparse.Namespace) -> LoadConfig:
    speed = float(getattr(opts, "speed", 1.0) or 1.0)
    return LoadConfig(
        model=getattr(opts, "model", "") or None,
        timeout_s=float(getattr(opts, "timeout", 60.0)) / speed,
        max_retries=int(getattr(opts, "max_retries", 2)),
        api_key=getattr(opts, "api_key", "") or None,
        prompt_tokens=Dist.parse(opts.prompt_tokens)
        if getattr(opts, "prompt_tokens", "")
        else None,
        output_tokens=Dist.parse(opts.output_tokens)
        if getattr(opts, "output_tokens", "")
        else None,
        prompt_file=getattr(opts, "prompt_file", "") or None,
        ignore_eos=not getattr(opts, "no_ignore_eos", False),
        system_tokens=int(getattr(opts, "system_tokens", 3000)),
        turns=Dist.parse(getattr(opts, "turns", "uniform:3,8")),
        max_context=int(getattr(opts, "max_context", 8192)),
    )


def load_config(env: Environment) -> LoadConfig:
    """The run's `LoadConfig`: the one the sweep set, else built from the options (again
    when they change, as they do when the web UI starts a new run with other values)."""
    fixed = getattr(env, "kvgate_load", None)
    if fixed is not None:
        return fixed
    opts = env.parsed_options or argparse.Namespace()
    key = repr(sorted(vars(opts).items()))
    cached = getattr(env, "_kvgate_load_cache", None)
    if cached is None or cached[0] != key:
        cached = (key, config_from_options(opts))
        env._kvgate_load_cache = cached  # type: ignore[attr-defined]
    return cached[1]


def discover_model(host: str, cfg: LoadConfig) -> str:
    """The first model the target lists at /v1/models."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    r = requests.get(host.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


_user_ids = itertools.count(1)


class OpenAIUser(User):
    """One streaming OpenAI client in a closed loop. Subclasses name their `workload`."""

    abstract = True
    wait_time = constant(0)
    workload: ClassVar[str] = ""

    def on_start(self) -> None:
        self.cfg = load_config(self.environment)
        if not self.cfg.model:
            self.cfg.model = discover_model(self.host, self.cfg)
        self.uid = next(_user_ids)
        seed = self.cfg.seed
        self.rng = random.Random(None if seed is None else seed * 100_003 + self.uid)
        self.work: Workload = make_workload(self.workload, self.cfg, self.rng, self.uid)
        self.http = requests.Session()
        self.url = self.host.rstrip("/") + "/v1/chat/completions"
        self.base_headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.cfg.api_key:
            self.base_headers["Authorization"] = f"Bearer {self.cfg.api_key}"

    def on_stop(self) -> None:
        self.http.close()

    @task
    def one_request(self) -> None:
        spec = self.work.next()
        text = self.send(spec)
        if text is None:
            self.work.failed(spec)
        else:
            self.work.answered(spec, text)

    # -- one request, its retries and its events ----------------------------------------

    def _fire(
        self,
        kind: str,
        seconds: float,
        *,
        length: int = 0,
        exception: Exception | None = None,
        context: dict[str, Any] | None = None,
    ) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=self.workload,
            response_time=seconds * 1000.0,
            response_length=length,
            exception=exception,
            context=context or {},
        )

    def send(self, spec: RequestSpec) -> str | None:
        """Send `spec` until it completes or fails; fire its events; return the text."""
        cfg = self.cfg
        assert cfg.model
        payload = json.dumps(spec.body(cfg.model, ignore_eos=cfg.ignore_eos)).encode()
        first = time.perf_counter()
        attempt = 0
        while True:
            headers = {
                **self.base_headers,
                "x-stainless-read-timeout": f"{cfg.timeout_s:g}",
                "x-stainless-retry-count": str(attempt),
            }
            try:
                outcome = self._attempt(payload, headers, first)
            except Exception as e:  # a failure: the request ends here
                ctx = {"failure": _failure_kind(e), "attempts": attempt + 1}
                self._fire("POST", time.perf_counter() - first, exception=e, context=ctx)
                if not isinstance(e, RequestTimeout):
                    gevent.sleep(0.1)
                return None
            if isinstance(outcome, float):  # shed: wait and retry, as the SDK does
                server = outcome
                wait = server if 0 < server <= 60 else sdk_backoff(attempt, self.rng)
                if attempt >= cfg.max_retries:
                    e = ShedTooOften(f"shed {attempt + 1} times")
                    ctx = {"failure": "shed", "attempts": attempt + 1}
                    self._fire("POST", time.perf_counter() - first, exception=e, context=ctx)
                    return None
                self._fire("RETRY", wait, context={"retry_after": server})
                gevent.sleep(wait)
                attempt += 1
                continue
            text, ctx = outcome
            ctx["attempts"] = attempt + 1
            self._fire("POST", ctx["latency"], length=ctx["output_tokens"], context=ctx)
            self._fire("TTFT", ctx["ttft"], context=ctx)
            if ctx["itl"] is not None:
                self._fire("ITL", ctx["itl"], context=ctx)
            return text

    def _attempt(
        self, payload: bytes, headers: dict[str, str], first: float
    ) -> float | tuple[str, dict[str, Any]]:
        """One attempt: the server's Retry-After (-1 when absent) if shed, else the
        streamed text and what to report. Raises the failure otherwise."""
        cfg = self.cfg
        try:
            resp = self.http.post(
                self.url,
                data=payload,
                headers=headers,
                stream=True,
                timeout=(cfg.connect_timeout_s, cfg.timeout_s),
            )
        except requests.exceptions.Timeout as e:
            raise RequestTimeout(f"no answer within {cfg.timeout_s:g} s") from e
        except requests.exceptions.RequestException as e:
            raise StreamError(f"connection: {e}") from e
        with resp:
            if resp.status_code in (429, 503):
                ra = retry_after_s(resp.headers)
                return -1.0 if ra is None else ra
            if resp.status_code != 200:
                body = resp.raw.read(300, decode_content=True) or b""
                raise HTTPStatusError(f"HTTP {resp.status_code}: {body[:300]!r}")
            try:
                return self._read_stream(resp, first)
            except requests.exceptions.ConnectionError as e:
                if _is_read_timeout(e):
                    raise RequestTimeout(f"no chunk within {cfg.timeout_s:g} s") from e
                raise StreamError(f"stream broke: {e}") from e
            except requests.exceptions.RequestException as e:
                raise StreamError(f"stream broke: {e}") from e

    def _read_stream(self, resp: requests.Response, first: float) -> tuple[str, dict[str, Any]]:
        t_first = t_last = None
        chunks = 0
        parts: list[str] = []
        usage: dict[str, Any] = {}
        done = False
        for line in resp.iter_lines(chunk_size=None):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            try:
                obj = json.loads(data)
            except ValueError as e:
                raise StreamError(f"not JSON: {data[:100]!r}") from e
            if "error" in obj:
                raise StreamError(f"error event: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices") or ():
                delta = choice.get("delta") or {}
                piece = delta.get("content") or choice.get("text") or ""
                if piece or delta.get("tool_calls"):
                    now = time.perf_counter()
                    if t_first is None:
                        t_first = now
                    t_last = now
                    chunks += 1
                    parts.append(piece)
        if not done:
            raise StreamError("the stream ended without [DONE]")
        end = time.perf_counter()
        out_tokens = int(usage.get("completion_tokens") or chunks)
        decode_s = (t_last - t_first) if t_first is not None and t_last is not None else 0.0
        per_user = (out_tokens - 1) / decode_s if out_tokens > 1 and decode_s > 0 else None
        ctx = {
            "latency": end - first,
            "ttft": (t_first if t_first is not None else end) - first,
            "itl": decode_s / (out_tokens - 1) if out_tokens > 1 and decode_s > 0 else None,
            "per_user_tps": per_user,
            "output_tokens": out_tokens,
            "prompt_tokens": int(usage.get("prompt_tokens") or 0),
        }
        return "".join(parts), ctx


def _is_read_timeout(e: BaseException) -> bool:
    """requests wraps a read timeout inside a stream as a ConnectionError."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ReadTimeoutError | requests.exceptions.ReadTimeout):
            return True
        if any(isinstance(a, ReadTimeoutError) for a in cur.args):
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def _failure_kind(e: BaseException) -> str:
    if isinstance(e, RequestTimeout):
        return "timeout"
    if isinstance(e, ShedTooOften):
        return "shed"
    return "error"


class ChatUser(OpenAIUser):
    """Chat: a short system prompt, prose questions, medium answers."""

    workload = "chat"


class CodingUser(OpenAIUser):
    """Coding: a fenced source file to refactor, longer answers."""

    workload = "coding"


class AgenticUser(OpenAIUser):
    """Agent sessions: a large shared system prompt and tool schema, several turns that
    resend the growing history (assistant answer, tool call, tool result)."""

    workload = "agentic"


class BatchJsonUser(OpenAIUser):
    """Seed 001's batch job: large documents in, small JSON objects out."""

    workload = "batch-json"


USER_CLASSES: dict[str, type[OpenAIUser]] = {
    u.workload: u for u in (ChatUser, CodingUser, AgenticUser, BatchJsonUser)
}
