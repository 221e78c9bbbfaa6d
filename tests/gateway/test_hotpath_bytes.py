"""The byte-level fast paths of the hot path equal the slow paths they replace.

- ``with_include_usage`` patches a streamed body's bytes instead of re-serialising it:
  the result must parse to the body with ``stream_options.include_usage`` true, for any
  body, written any way JSON allows (whitespace, escapes, duplicate keys, an existing
  ``stream_options``), and keep the client's bytes otherwise.
- ``gateway.upstream.sse.take_events`` finds the usage chunk and counts content events by byte tests
  over a whole buffer: forwarded bytes, counts and usage must equal the per-event path's
  (``take_each``) for any stream and any chunking, including content that mentions
  ``"usage"``, ``data:`` or ``[DONE]``.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.context import RequestContext
from gateway.upstream import sse as sse_module
from gateway.upstream.relay import Relay, with_include_usage
from gateway.upstream.sse import take_each, take_events

# ----------------------------------------------------------------- body patching
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
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
stream_options = st.none() | st.dictionaries(
    st.sampled_from(["include_usage", "continuous_usage_stats", "x"]),
    st.booleans() | st.none(),
    max_size=3,
)


def _expected(body: dict) -> dict:
    want = dict(body)
    opts = body.get("stream_options")
    want["stream_options"] = (
        {**opts, "include_usage": True} if isinstance(opts, dict) else {"include_usage": True}
    )
    return want


@settings(max_examples=300, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    extra=st.dictionaries(st.text(max_size=10), json_values, max_size=5),
    opts=stream_options,
    has_opts=st.booleans(),
    ensure_ascii=st.booleans(),
    indent=st.sampled_from([None, 0, 2]),
    lead=st.sampled_from(["", " ", "\n\t "]),
)
@pytest.mark.slow
def test_patched_body_is_json_equivalent_to_the_reserialised_one(
    extra, opts, has_opts, ensure_ascii, indent, lead
):
    body = {**extra, "model": "m", "stream": True}
    if has_opts:
        body["stream_options"] = opts
    else:
        body.pop("stream_options", None)
    raw = (lead + json.dumps(body, ensure_ascii=ensure_ascii, indent=indent)).encode(
        "utf-8", "surrogatepass"
    )
    out = with_include_usage(raw, json.loads(raw))
    assert json.loads(out) == _expected(body)
    if "stream_options" not in body:
        # Patched in place: the client's bytes are all still there, in order.
        member = b'"stream_options":{"include_usage":true}'
        assert out.replace(member + b",", b"", 1).replace(member, b"", 1) == raw


def test_patch_on_odd_but_valid_json():
    cases = [
        # whitespace everywhere
        b' \n{ \t"model" : "m" ,\r\n "stream":true }\n',
        # unicode escapes and raw UTF-8, a lone surrogate (valid JSON, not UTF-8)
        b'{"model":"m\\u00e9","stream":true,"user":"caf\xc3\xa9","x":"\\ud800"}',
        # duplicate keys: the last wins, for the patched body as for the parsed one
        b'{"model":"a","model":"m","stream":false,"stream":true}',
        # big integers and exotic numbers stay as the client wrote them
        b'{"model":"m","stream":true,"seed":123456789012345678901234567890,"t":1.0E+2}',
        # the words "stream_options" and "usage" inside strings are not members
        b'{"model":"m","stream":true,"messages":[{"role":"user",'
        b'"content":"\\"stream_options\\": {\\"usage\\": 1}"}]}',
    ]
    for raw in cases:
        body = json.loads(raw)
        out = with_include_usage(raw, body)
        assert json.loads(out) == _expected(body), raw
        assert raw[raw.index(b"{") + 1 :] in out  # patched, not re-serialised


def test_existing_stream_options_are_merged():
    for raw in (
        b'{"model":"m","stream":true,"stream_options":{"continuous_usage_stats":true}}',
        b'{"model":"m","stream":true,"stream_options":{"include_usage":false}}',
        b'{"model":"m","stream":true,"stream_options":null}',
        b'{"model":"m","stream_options":{"include_usage":false},"stream":true,'
        b'"stream_options":{"x":1}}',  # duplicate: the last one is the one merged
        b'{"model":"m","stream":true,"stream_options":{},"seed":123456789012345678901234567890}',
    ):
        body = json.loads(raw)
        assert json.loads(with_include_usage(raw, body)) == _expected(body), raw
    big = b'{"model":"m","stream":true,"stream_options":{},"seed":123456789012345678901234567890}'
    assert b"123456789012345678901234567890" in with_include_usage(big, json.loads(big))


def test_the_pipeline_sends_the_patched_body():
    c = RequestContext(request_id="t", kind="chat", upstream_path="/", arrival=0.0)
    c.req.stream = True
    c.raw = b'{"model":"m","stream":true,"top_k":3}'
    c.body = json.loads(c.raw)
    assert Relay.upstream_body(c) == (
        b'{"stream_options":{"include_usage":true},"model":"m","stream":true,"top_k":3}'
    )


# ----------------------------------------------------------------- stream relay
def _chunk(content: str, usage: str = "") -> bytes:
    obj = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    text = json.dumps(obj, separators=(",", ":"))
    if usage:
        text = text[:-1] + f',"usage":{usage}}}'
    return b"data: " + text.encode() + b"\n\n"


USAGE = (
    b'data: {"id":"c","object":"chat.completion.chunk","choices":[],'
    b'"usage":{"prompt_tokens":11,"completion_tokens":5,"total_tokens":16}}\n\n'
)
ERROR = b'data: {"error":{"code":500,"message":"Context size has been exceeded."}}\n\n'
tricky_text = st.sampled_from(
    [
        " tok",
        'the "usage": {"prompt_tokens": 1} field',
        "data: [DONE]",
        "\n\ndata: x",
        "usage",
        '{"error": 1}',
        "caf\u00e9 \u2603",
    ]
)
events = st.one_of(
    tricky_text.map(_chunk),
    tricky_text.map(lambda t: _chunk(t, usage="null")),  # SGLang: usage null on each chunk
    st.just(b": keep-alive\n\n"),
    st.just(b"\n\n"),
    st.just(b"\n"),  # a stray newline: three in a row somewhere
    st.just(b"\ndata: {}\n\n"),
    st.just(b"event: x\ndata: {}\n\n"),
    st.just(b"data:{}\n\n"),
)


def _ctx(wants_usage: bool) -> RequestContext:
    c = RequestContext(request_id="t", kind="chat", upstream_path="/", arrival=0.0)
    c.req.stream = True
    c.client_wants_usage = wants_usage
    return c


def _run(take, data: bytes, cuts: list[int]) -> tuple[bytes, bytes]:
    out, buf, at = b"", b"", 0
    for cut in [*sorted(set(cuts)), len(data)]:
        piece = data[at:cut]
        at = cut
        if not piece:
            continue
        buf = buf + piece if buf else piece
        fwd, buf = take(buf)
        out += fwd
    return out, buf


@settings(max_examples=300, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=st.lists(events, max_size=12),
    tail=st.sampled_from([USAGE + b"data: [DONE]\n\n", b"data: [DONE]\n\n", ERROR, b""]),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=8),
    wants_usage=st.booleans(),
)
@pytest.mark.slow
def test_fast_stream_path_equals_the_per_event_path(body, tail, cuts, wants_usage):
    data = b"".join(body) + tail
    cuts = [c % (len(data) + 1) for c in cuts]
    slow_ctx = _ctx(wants_usage)
    slow = _run(lambda b: take_each(slow_ctx, b, b"\r" in b), data, cuts)
    saved = sse_module._FAST_MIN_BYTES
    for threshold in (0, saved):  # the fast path on every buffer, and as configured
        sse_module._FAST_MIN_BYTES = threshold
        try:
            fast_ctx = _ctx(wants_usage)
            fast = _run(lambda b, c=fast_ctx: take_events(c, b), data, cuts)
        finally:
            sse_module._FAST_MIN_BYTES = saved
        assert fast == slow
        for field in ("events", "generated", "usage_prompt", "usage_completion", "upstream_error"):
            assert getattr(fast_ctx, field) == getattr(slow_ctx, field), field


def test_content_mentioning_usage_is_not_the_usage_chunk():
    data = _chunk('{"usage": {"prompt_tokens": 99}}') + _chunk('"usage": 1') + b"data: [DONE]\n\n"
    c = _ctx(wants_usage=False)
    saved, sse_module._FAST_MIN_BYTES = sse_module._FAST_MIN_BYTES, 0
    try:
        out, rest = _run(lambda b: take_events(c, b), data, [])
    finally:
        sse_module._FAST_MIN_BYTES = saved
    assert out == data and rest == b""
    assert c.usage_prompt is None and c.generated == 2


def test_tune_gc_freezes_startup_objects_and_raises_the_young_threshold():
    import gc

    from gateway.runtime import GEN0_THRESHOLD, tune_gc

    saved = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold()[0] == GEN0_THRESHOLD
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*saved)
