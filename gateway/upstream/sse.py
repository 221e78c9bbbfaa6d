"""What kvgate reads in an engine's SSE stream, without changing what it forwards.

The relay (`gateway.upstream.relay`) hands each read to `take_events`, which splits complete
events off the buffer at their blank line (LF, CRLF or CR framing), counts content
events (a lower bound of the generated tokens), records the usage chunk's counts,
takes the usage off again when only kvgate asked for it, and turns an engine's error
event into an OpenAI error object. Everything else is forwarded as the engine's bytes.
"""

from __future__ import annotations

import json

from gateway.context import RequestContext
from gateway.errors import upstream_error

# Fields of a chunk that say nothing by themselves: a usage chunk left with only these
# once its usage is taken off is dropped.
_ENVELOPE = frozenset(
    {"id", "object", "created", "model", "system_fingerprint", "choices", "service_tier"}
)


def _event_end(buf: bytes, start: int) -> tuple[int, int]:
    """The first event boundary at or after `start` in any of SSE's three line endings:
    (index, length of the separator), or (-1, 0)."""
    best, size = -1, 0
    for sep in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        i = buf.find(sep, start)
        if i >= 0 and (best < 0 or i < best):
            best, size = i, len(sep)
    return best, size


# Below this a buffer holds a few events (an engine's one chunk per step): looking at
# each costs fewer calls than the whole-buffer scans.
_FAST_MIN_BYTES = 768


def _content_events(buf: bytes) -> tuple[int, int, bool] | None:
    """The fast path of `take_events` for LF-framed SSE: (end of the events it
    took, how many of them are content events, whether it stopped early at a usage
    chunk), or None when an event needs a closer look (the per-event path then runs).

    A handful of byte scans over the whole buffer instead of a loop per event: the
    events it takes are all one ``data:`` line each (the buffer starts with ``data:``
    and has exactly two newlines per ``\\n\\ndata:`` boundary; no raw newline can
    occur inside a JSON line), none is an error event, and every ``"usage"`` key among
    them is followed by ``null`` (a key cannot occur inside a JSON string, whose quotes
    would be escaped). It stops before the first event with a real ``"usage"``: the
    per-event path reads that one. Content events are the events that are not
    ``[DONE]``."""
    last = buf.rfind(b"\n\n")
    if last < 0:
        return 0, 0, False
    end = last + 2
    stop = False
    u = buf.find(b'"usage"', 0, end)
    while u >= 0:
        if buf.find(b"null", u + 7, u + 14) < 0:
            end = buf.rfind(b"\n\n", 0, u) + 2  # the start of the usage chunk's event
            if end < 2:
                return 0, 0, True
            stop = True
            break
        u = buf.find(b'"usage"', u + 7, end)
    events = buf.count(b"\n\ndata:", 0, end) + 1
    if not buf.startswith(b"data:") or buf.count(b"\n", 0, end) != 2 * events:
        return None
    if buf.find(b'{"error"', 0, end) >= 0:
        return None
    if buf.find(b"[DONE]", 0, end) >= 0:
        events -= buf.count(b"\n\ndata: [DONE]", 0, end) + buf.count(b"\n\ndata:[DONE]", 0, end)
        if buf.startswith(b"data: [DONE]") or buf.startswith(b"data:[DONE]"):
            events -= 1
    return end, events, stop


def record_usage(ctx: RequestContext, usage: object) -> None:
    """The engine's token counts (and prefix hits) from a usage object, onto `ctx`: chat
    and completions' ``prompt_tokens`` / ``completion_tokens``, the Responses API's
    ``input_tokens`` / ``output_tokens``, or Anthropic's, whose ``input_tokens`` leave out
    the prompt tokens read from or written to its cache."""
    if not isinstance(usage, dict):
        return
    p = usage.get("prompt_tokens", usage.get("input_tokens"))
    c = usage.get("completion_tokens", usage.get("output_tokens"))
    cache_read = usage.get("cache_read_input_tokens")
    if isinstance(p, int) and ctx.dialect == "anthropic":
        for extra in (cache_read, usage.get("cache_creation_input_tokens")):
            if isinstance(extra, int):
                p += extra
    if isinstance(p, int):
        ctx.usage_prompt = p
    if isinstance(c, int):
        ctx.usage_completion = c
    details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        ctx.usage_cached = details["cached_tokens"]
    elif isinstance(cache_read, int):
        ctx.usage_cached = cache_read


# ------------------------------------------------------------------ named-event streams
# The Responses API and Anthropic's Messages API stream typed events (an ``event:`` line
# naming the type, the JSON on ``data:``). Per type: what counts as generated output,
# what carries usage, what ends the stream. Events are parsed only where they carry
# something kvgate keeps (an id, usage, an error); deltas are recognised by their name.
_DELTAS = frozenset(
    {
        b"response.output_text.delta",
        b"response.function_call_arguments.delta",
        b"response.reasoning_text.delta",
        b"response.reasoning_summary_text.delta",
        b"response.refusal.delta",
        b"content_block_delta",
    }
)
_ENDS = frozenset({b"response.completed", b"response.incomplete", b"message_stop"})
_PARSED = frozenset(
    {
        b"response.created",
        b"response.completed",
        b"response.incomplete",
        b"response.failed",
        b"message_start",
        b"message_delta",
        b"error",
    }  # fmt: skip
)


def _event_type(event: bytes) -> tuple[bytes, bytes]:
    """(type, JSON data) of one event: the ``event:`` line's name, else the data's
    ``type`` member."""
    name = b""
    data: list[bytes] = []
    for line in event.splitlines():
        if line.startswith(b"event:"):
            name = line[6:].strip()
        elif line.startswith(b"data:"):
            data.append(line[6:] if line.startswith(b" ", 5) else line[5:])
    payload = b"\n".join(data)
    if not name and payload:
        i = payload.find(b'"type"')
        if i >= 0:
            q = payload.find(b'"', payload.find(b":", i) + 1)
            e = payload.find(b'"', q + 1)
            if q > 0 and e > q:
                name = payload[q + 1 : e]
    return name, payload


def take_named_events(ctx: RequestContext, buf: bytes) -> tuple[bytes, bytes]:
    """`take_events` for the Responses and Messages streams: every byte is forwarded as
    the engine sent it; kvgate reads the response id, usage, the end and errors."""
    start = 0
    while True:
        i, sep = _event_end(buf, start)
        if i < 0:
            break
        end = i + sep
        name, payload = _event_type(buf[start:i])
        if name in _DELTAS:
            ctx.events += 1
            ctx.generated += 1
        elif name in _PARSED:
            _read_named(ctx, name, payload)
        if name in _ENDS:
            ctx.done_seen = True
        start = end
    return buf[:start], buf[start:]


def _read_named(ctx: RequestContext, name: bytes, payload: bytes) -> None:
    try:
        doc = json.loads(payload)
    except ValueError:
        return
    if not isinstance(doc, dict):
        return
    if name == b"error":
        ctx.upstream_error = "stream_error"
        return
    if name == b"message_start":
        msg = doc.get("message")
        if isinstance(msg, dict):
            record_usage(ctx, msg.get("usage"))
        return
    if name == b"message_delta":
        usage = doc.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("output_tokens"), int):
            ctx.usage_completion = usage["output_tokens"]
        return
    response = doc.get("response")
    if not isinstance(response, dict):
        return
    if isinstance(response.get("id"), str):
        ctx.response_id = response["id"]
    if name == b"response.failed":
        ctx.upstream_error = "stream_error"
    record_usage(ctx, response.get("usage"))


def take_events(ctx: RequestContext, buf: bytes) -> tuple[bytes, bytes]:
    """Split complete events off `buf`; return (bytes to forward, remainder).

    Forwarded bytes are slices of what the engine sent, except an unrequested usage
    chunk (left out, or without its usage) and an error event (in OpenAI's shape).
    """
    # SSE lines end in LF, CRLF or CR; an event ends at an empty line. LF framing is
    # the common case; a buffer with a CR takes the general path.
    crlf = b"\r" in buf
    if crlf or len(buf) < _FAST_MIN_BYTES:
        return take_each(ctx, buf, crlf)
    fast = _content_events(buf)
    if fast is None:
        return take_each(ctx, buf, False)
    end, n, stop = fast
    ctx.events += n
    ctx.generated += n
    if not stop:
        return buf[:end], buf[end:]
    out, rest = take_each(ctx, buf[end:], False)
    return (buf[:end] + out if end else out), rest


def take_each(ctx: RequestContext, buf: bytes, crlf: bool) -> tuple[bytes, bytes]:
    """`take_events` one event at a time (what the fast path must equal)."""
    start = 0
    kept: list[bytes] | None = None  # only materialised once something changes
    while True:
        if crlf:
            i, sep = _event_end(buf, start)
        else:
            i, sep = buf.find(b"\n\n", start), 2
        if i < 0:
            break
        end = i + sep
        other = _inspect(ctx, buf, start, end)
        if other is None:
            if kept is not None:
                kept.append(buf[start:end])
        else:
            if kept is None:
                kept = [buf[:start]]
            if other:
                kept.append(other)
        start = end
    if start == 0:
        return b"", buf
    out = buf[:start] if kept is None else b"".join(kept)
    return out, buf[start:]


def _inspect(ctx: RequestContext, buf: bytes, start: int, end: int) -> bytes | None:
    """Account one event; None to forward it as is, else the bytes to forward
    instead (empty: leave it out)."""
    if not buf.startswith(b"data:", start):
        return None  # comments, keep-alives, other fields: pass through
    at = start + 6 if buf.startswith(b" ", start + 5) else start + 5
    if buf.startswith(b"[DONE]", at):
        ctx.done_seen = True
        return None
    if buf.startswith(b'{"error"', at):
        try:
            obj = json.loads(buf[at:end])
        except ValueError:
            obj = None
        if isinstance(obj, dict) and "error" in obj and "choices" not in obj:
            ctx.upstream_error = "stream_error"
            inner = obj["error"]
            status = inner.get("code") if isinstance(inner, dict) else None
            if not isinstance(status, int) or not 400 <= status <= 599:
                status = 500
            fallback = "the replica ended the stream with an error"
            return upstream_error(status, obj, fallback=fallback).sse_event()
    usage_at = buf.find(b'"usage"', start, end)
    if usage_at >= 0 and buf.find(b"null", usage_at + 7, usage_at + 14) < 0:
        try:
            obj = json.loads(buf[at:end])
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
            record_usage(ctx, obj["usage"])
            if not obj.get("choices"):
                if ctx.client_wants_usage:
                    return None
                del obj["usage"]  # kvgate asked for it, the client did not
                if obj.keys() <= _ENVELOPE:
                    return b""
                return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    ctx.events += 1
    ctx.generated += 1
    return None
