"""Property-based fuzzing of kvgate's HTTP surface (hypothesis), over real loopback HTTP.

One kvgate in front of one enginesim replica per test; hypothesis draws request bodies
and heads (mutated valid requests, arbitrary JSON, raw bytes, invalid UTF-8, deeply
nested arrays, duplicate keys, huge numbers, wrong types, odd and oversized headers),
sends each over a raw socket (so nothing in a client library tidies it up first) and
checks the properties that hold for every input:

- never a 5xx from kvgate itself: a 2xx answer, or a 4xx whose body is exactly an
  OpenAI error object (``{"error": {"message", "type", "param", "code"}}``);
- nothing stays reserved, queued or in flight once the answer is in;
- the connection is usable or closed cleanly (the answer is a well-formed HTTP answer).

Examples are bounded and derandomized (the same inputs every run) to keep the suite's
time budget; the fixture's end-of-test check (reservations 0, engine KV 0) holds too.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import MODEL, wait_for

FUZZ = settings(
    max_examples=120,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
LIMITS = {"max_header_bytes": 4096, "max_headers": 32, "max_body_bytes": 64 * 1024}
ERROR_FIELDS = {"message", "type", "param", "code"}


# ---------------------------------------------------------------------- raw HTTP client
pytestmark = pytest.mark.slow


async def raw_request(
    port: int,
    body: bytes,
    *,
    path: str = "/v1/chat/completions",
    headers: list[tuple[bytes, bytes]] | None = None,
    content_length: bool = True,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request over a fresh connection (``Connection: close``); returns
    (status, headers lower-cased, body). Bytes go out exactly as given."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
        for k, v in headers or []:
            head.append(k + b": " + v)
        if content_length:
            head.append(b"Content-Length: " + str(len(body)).encode())
        writer.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        await writer.drain()
        async with asyncio.timeout(30):
            raw = await reader.read()  # until the server closes
    finally:
        writer.close()
    head_end = raw.find(b"\r\n\r\n")
    assert head_end > 0, f"no HTTP answer: {raw[:200]!r}"
    lines = raw[:head_end].decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        hdrs[k.strip().lower()] = v.strip()
    rest = raw[head_end + 4 :]
    if hdrs.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return status, hdrs, rest


def _dechunk(data: bytes) -> bytes:
    out, i = b"", 0
    while True:
        j = data.index(b"\r\n", i)
        size = int(data[i:j].split(b";")[0], 16)
        if size == 0:
            return out
        out += data[j + 2 : j + 2 + size]
        i = j + 2 + size + 2


def check_answer(status: int, hdrs: dict[str, str], body: bytes) -> None:
    assert status < 500, f"kvgate answered {status}: {body[:300]!r}"
    if status >= 400:
        assert hdrs.get("content-type", "").startswith("application/json"), hdrs
        doc = json.loads(body)
        assert set(doc) == {"error"}, doc
        err = doc["error"]
        assert set(err) == ERROR_FIELDS, err
        assert isinstance(err["message"], str) and err["message"]
        assert "Traceback" not in err["message"]
        assert "http://" not in err["message"], err  # no upstream URL
    else:
        assert status == 200, status
        if hdrs.get("content-type", "").startswith("text/event-stream"):
            events = [e for e in body.replace(b"\r\n", b"\n").split(b"\n\n") if e.strip()]
            assert events, "empty stream"
            assert events[-1] == b"data: [DONE]" or events[-1].startswith(b'data: {"error"')
        else:
            doc = json.loads(body)
            assert doc["object"] in ("chat.completion", "text_completion", "list"), doc


def run_property(test: Any) -> Any:
    """Hypothesis drives examples synchronously: run it in a worker thread, each example's
    coroutine on the test's event loop (where kvgate and the replica live)."""
    loop = asyncio.get_running_loop()

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=120)

    return asyncio.to_thread(test, on_loop)


async def settled(gw: Any) -> None:
    """Nothing in flight, reserved or queued (the answer is in, so it must settle)."""
    assert await wait_for(lambda: gw.state.pipeline.inflight == 0, within=10.0)
    assert await wait_for(lambda: gw.report.reserved_tokens() == 0, within=10.0)
    assert gw.report.queue_depth() == 0


# ---------------------------------------------------------------------- strategies
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "n",
    "stop",
    "user",
    "tools",
    "logprobs",
    "seed",
    "prompt",
]


def valid_chat() -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@st.composite
def mutated_chat(draw: st.DrawFn) -> dict[str, Any]:
    """A valid small request with some fields replaced by arbitrary JSON, some removed,
    some added: wrong types, huge numbers, nested junk."""
    body = valid_chat()
    if draw(st.booleans()):
        body["stream"] = True
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        action = draw(st.sampled_from(["set", "drop"]))
        if action == "drop":
            body.pop(field, None)
        else:
            body[field] = draw(json_values)
    msg_mutation = draw(st.sampled_from(["none", "role", "content", "extra"]))
    msgs = body.get("messages")
    if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict):
        if msg_mutation == "role":
            msgs[0]["role"] = draw(json_values)
        elif msg_mutation == "content":
            msgs[0]["content"] = draw(json_values)
        elif msg_mutation == "extra":
            msgs[0][draw(st.text(max_size=6))] = draw(json_values)
    # Keep what can be generated small: a fuzz run is about shapes, not long outputs.
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 16:
            body[key] = 16
    return body


def _nested(depth: int, open_: bytes, close: bytes) -> bytes:
    return open_ * depth + close * depth


raw_bodies = st.one_of(
    st.binary(max_size=200),
    # invalid UTF-8 inside an otherwise valid request
    st.binary(min_size=1, max_size=8).map(
        lambda b: b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "'
        + b"\xff\xfe"
        + b + b'"}], "max_tokens": 4}'
    ),
    # deeply nested JSON (arrays, objects), at and far past the parser's recursion limit
    st.integers(min_value=1, max_value=200_000).map(lambda n: _nested(n, b"[", b"]")),
    st.integers(min_value=1, max_value=50_000).map(
        lambda n: b'{"model": "tiny-llm", "messages": ' + _nested(n, b"[", b"]") + b"}"
    ),
    st.integers(min_value=1, max_value=20_000).map(lambda n: _nested(n, b'{"a":', b"}")),
    # huge numbers (past float range, past Python's int-digit limit), NaN and Infinity
    st.sampled_from(["1e999", "-1e999", "9" * 5000, "NaN", "Infinity", "-Infinity", "1" * 300]).map(
        lambda num: (
            b'{"model": "tiny-llm", "messages": [{"role": "user", "content": "hi"}], '
            b'"max_tokens": ' + num.encode() + b"}"
        )
    ),
    # duplicate keys: the last one wins, as in the engine's own parser
    st.sampled_from([b'"stream": true, "stream": false', b'"model": 1, "model": "tiny-llm"',
                     b'"max_tokens": 4, "max_tokens": "x"', b'"model": "tiny-llm", "model": "nope"']).map(
        lambda dup: b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, ' + dup + b"}"
    ),
)  # fmt: skip


# ---------------------------------------------------------------------- tests
async def test_fuzz_json_bodies(replica, gateway):
    srv = await replica(speed=200.0)
    gw = await gateway(srv, limits=LIMITS)

    @FUZZ
    @given(body=mutated_chat(), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    def prop(run: Any, body: dict[str, Any], path: str) -> None:
        status, hdrs, data = run(
            raw_request(
                gw.port,
                json.dumps(body).encode(),
                path=path,
                headers=[(b"Content-Type", b"application/json")],
            )
        )
        check_answer(status, hdrs, data)
        run(settled(gw))

    await run_property(prop)


async def test_fuzz_raw_bodies(replica, gateway):
    srv = await replica(speed=200.0)
    gw = await gateway(srv, limits=LIMITS)
    seen: set[int] = set()

    @FUZZ
    @given(body=raw_bodies)
    def prop(run: Any, body: bytes) -> None:
        status, hdrs, data = run(raw_request(gw.port, body))
        check_answer(status, hdrs, data)
        seen.add(status)
        run(settled(gw))

    await run_property(prop)
    assert 413 in seen  # the deep nests past max_body_bytes
    assert 400 in seen


header_names = st.sampled_from(
    [b"x-kvgate-queue-timeout", b"x-kvgate-priority", b"x-stainless-read-timeout",
     b"x-stainless-retry-count", b"x-session-id", b"x-workload", b"Authorization",
     b"Content-Type", b"Accept", b"X-Whatever", b"Content-Encoding", b"Expect"]
) | st.from_regex(rb"\A[A-Za-z0-9-]{1,20}\Z")  # fmt: skip
header_values = st.one_of(
    st.sampled_from(
        [b"nan", b"inf", b"-inf", b"-1", b"0", b"1e309", b"99999999999999999999999", b"",
         b"Bearer ", b"Bearer \xff", b"gzip", b"100-continue", b"coding", b"\xff\xfe\xfd"]
    ),
    st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b and b"\0" not in b),
    # oversized: past limits.max_header_bytes
    st.integers(min_value=4000, max_value=70_000).map(lambda n: b"a" * n),
)  # fmt: skip


async def test_fuzz_headers(replica, gateway):
    srv = await replica(speed=200.0)
    gw = await gateway(srv, limits=LIMITS)
    seen: set[int] = set()

    @FUZZ
    @given(
        headers=st.lists(st.tuples(header_names, header_values), max_size=6),
        many=st.integers(min_value=0, max_value=80),
        stream=st.booleans(),
    )
    def prop(run: Any, headers: list[tuple[bytes, bytes]], many: int, stream: bool) -> None:
        body = {**valid_chat(), "stream": stream}
        extra = [(b"x-filler-%d" % i, b"1") for i in range(many)]
        status, hdrs, data = run(
            raw_request(gw.port, json.dumps(body).encode(), headers=headers + extra)
        )
        check_answer(status, hdrs, data)
        seen.add(status)
        run(settled(gw))

    await run_property(prop)
    assert 431 in seen  # oversized values and too many header lines
    assert 200 in seen


async def test_fuzz_methods_and_paths(replica, gateway):
    """Any method on any path: a known answer (200 for the open GET endpoints, 401 for
    the admin API without a token) or a 404/405 error object; never a 5xx."""
    srv = await replica(speed=200.0)
    gw = await gateway(srv, limits=LIMITS, auth={"admin_token": "t0ken"})
    known = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/ready",
             "/metrics", "/admin/replicas", "/admin", "/v1", "/"]  # fmt: skip
    seen: set[int] = set()

    async def one(method: bytes, path: bytes) -> tuple[int, dict[str, str], bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
        try:
            writer.write(method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                         b"Content-Length: 0\r\n\r\n")  # fmt: skip
            await writer.drain()
            async with asyncio.timeout(30):
                raw = await reader.read()
        finally:
            writer.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        hdrs = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        if hdrs.get("transfer-encoding") == "chunked":
            body = _dechunk(body)
        return int(lines[0].split()[1]), hdrs, body

    @FUZZ
    @given(
        method=st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"HEAD"]),
        path=st.one_of(
            st.sampled_from(known).map(str.encode),
            st.from_regex(rb"\A/[A-Za-z0-9._~%/?=&-]{0,60}\Z"),
        ),
    )
    def prop(run: Any, method: bytes, path: bytes) -> None:
        status, hdrs, body = run(one(method, path))
        assert status < 500, (method, path, status, body[:200])
        seen.add(status)
        if status >= 400 and method != b"HEAD":
            check_answer(status, hdrs, body)
        run(settled(gw))

    await run_property(prop)
    assert {404, 405} <= seen
    status, hdrs, body = await one(b"GET", b"/admin/replicas")  # no token
    assert status == 401
    check_answer(status, hdrs, body)
