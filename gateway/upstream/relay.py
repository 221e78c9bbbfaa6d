"""Relay one admitted request to its replica and the answer back to the client.

Streams are forwarded event by event as they arrive, byte-identical to what the engine
sent: kvgate splits the upstream bytes at SSE event boundaries (a blank line) only to
look at them, and writes the original bytes. Two things are looked at:

- the usage chunk. kvgate asks the engine for ``stream_options.include_usage`` so it
  learns the true token counts of every stream; when the client did not ask for usage,
  the ``usage`` field is taken off the usage chunk (``"choices": []``) again, and the
  chunk is dropped when nothing else is left on it (vLLM, SGLang), so the client sees
  exactly the stream it would have seen from the engine directly. Other fields the
  engine put there stay (llama.cpp moves its ``timings`` onto that chunk).
- error events. An engine that fails after its stream started (llama.cpp's unified pool
  overrun) sends ``data: {"error": ...}`` and ends the stream. The event is forwarded as
  an OpenAI error object (the engine's message, a string code) and the request counts as
  an upstream error (``ctx.upstream_error = "stream_error"``), not as a completion.
- the number of content events, a lower bound of the generated tokens (one event per
  engine step; speculative decoding can put several tokens in one). When a stream
  outgrows its reservation the relay asks admission to top it up. It never cuts a
  stream off: the engine's own scheduler is the last line of defence, not the gateway.

Error answers before any byte reached the client (non-stream bodies, a stream refused
with an error status) are OpenAI error objects with the engine's status and message
(`gateway.errors.upstream_error`); a 5xx is reported as an `UpstreamFailure` carrying
that answer, so the pipeline may retry it elsewhere first.

Backpressure: each write is awaited, so a slow client slows the read from the engine
instead of buffering the whole answer in the gateway.

Timeouts are phase-aware, with one re-armed deadline instead of a timer per chunk: the
first event must arrive within ``first_byte_s``, each later one within ``idle_s`` of the
previous, all within ``total_s``. Time spent writing to a slow client does not count
against ``idle_s``: backpressure from the client is not an engine stall. A client that
takes none of its stream for ``limits.client_write_timeout_s`` (its socket buffers full:
it stopped reading) is cut like a client that left: the engine's request is aborted and
the reservation freed, and kvgate never buffers more than the socket's buffers for it.
"""

from __future__ import annotations

import asyncio
import json
from enum import Enum
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web

from gateway.body import with_member
from gateway.config import UpstreamConfig
from gateway.context import RequestContext
from gateway.errors import ApiError, upstream_error
from gateway.outcome import CLIENT_DISCONNECT, CLIENT_STALLED, OK, End, Outcome, upstream
from gateway.upstream.session import UpstreamFailure, classify_client_error
from gateway.upstream.sse import record_usage, take_events, take_named_events
from gateway.upstream.watchdog import StreamWatchdog

# Endpoints whose streams are typed events (gateway/upstream/sse.py); the others (chat,
# completions, audio) stream ``data:`` chunks ending in ``[DONE]``.
_NAMED = frozenset({"responses", "messages"})
_SSE_HEADERS_BASE = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_INCLUDE_USAGE = b'"stream_options":{"include_usage":true}'


def with_include_usage(raw: bytes, body: dict[str, Any]) -> bytes:
    """`raw` (a JSON object, parsed as `body`) with ``stream_options.include_usage`` true.

    The common case, a body without ``stream_options``, is patched in its bytes: the
    member goes in right after the opening brace, and every byte the client sent stays
    as it was (no re-serialisation: numbers, escapes, key order, unknown fields all
    untouched). A body that has ``stream_options`` already (without ``include_usage``
    true) is rare and its member cannot be found without a JSON scan: it is parsed again
    with the standard library (which keeps big integers exact) and re-serialised with
    the member merged."""
    if "stream_options" not in body:
        patched = with_member(raw, _INCLUDE_USAGE)
        if patched is not None:
            return patched
    doc = json.loads(raw)
    opts = doc.get("stream_options")
    doc["stream_options"] = (
        {**opts, "include_usage": True} if isinstance(opts, dict) else {"include_usage": True}
    )
    try:
        return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate ("\ud800") is valid JSON, not UTF-8
        return json.dumps(doc, separators=(",", ":")).encode()


class ClientGone(Exception):
    """The client closed its connection while we were writing to it."""


def _error_answer(up: aiohttp.ClientResponse, body: bytes, ctx: RequestContext) -> ApiError:
    """The engine's error answer as an OpenAI error object, with its Retry-After if any."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        doc = None
    status = up.status
    err = upstream_error(status, doc, fallback=f"replica {ctx.replica} answered HTTP {status}")
    for name, scale in (("retry-after-ms", 1e-3), ("Retry-After", 1.0)):
        raw = up.headers.get(name)
        if raw is not None:
            try:
                err.retry_after = max(0.0, float(raw) * scale)
                break
            except ValueError:
                continue
    return err


async def _write(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except ConnectionError as e:  # includes aiohttp's ClientConnectionResetError
        raise ClientGone() from e


class Ended(Enum):
    """How a stream that was sent on ended."""

    DONE = "done"  # the engine ended it
    CLIENT_GONE = "client_gone"  # its client closed (after [DONE]: it had everything)
    CLIENT_STALLED = "client_stalled"  # its client stopped reading and was cut
    FAILED = "failed"  # the engine failed it or went silent


def stream_outcome(ended: Ended, done_out: bool, upstream_error: str | None) -> Outcome:
    """The outcome of a stream by how it ended: `done_out`, its [DONE] reached the
    client's socket; `upstream_error`, an error the engine sent or failed it with."""
    if ended is Ended.CLIENT_STALLED:
        return CLIENT_STALLED
    if ended is Ended.CLIENT_GONE:
        return OK if done_out and upstream_error is None else CLIENT_DISCONNECT
    # An error event from the engine ended it: an upstream error, not a completion.
    return OK if upstream_error is None else upstream(upstream_error)


class _Pumped:
    """What pumping a stream reached: the engine's response, the client's, whether
    [DONE] reached the client, whether the engine's stream was read to its end."""

    __slots__ = ("up", "resp", "done_out", "clean")

    def __init__(self) -> None:
        self.up: aiohttp.ClientResponse | None = None
        self.resp: web.StreamResponse | None = None
        self.done_out = False
        self.clean = False


class StreamHooks(Protocol):
    """What the relay reports of a running stream (gateway.stream_reservation)."""

    def first_token(self, ctx: RequestContext) -> None:
        """Its first event: the prompt's prefill on the replica is done."""

    def outgrew(self, ctx: RequestContext) -> None:
        """Its generated tokens passed ``ctx.topup_at``: top its reservation up."""


class Relay:
    """Forwards requests over the shared upstream session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        cfg: UpstreamConfig,
        hooks: StreamHooks,
        *,
        client_write_timeout_s: float,
    ) -> None:
        self._session = session
        self._cfg = cfg
        # A client that takes none of its stream for this long is cut (see _stream).
        self._write_timeout = client_write_timeout_s
        self._hooks = hooks

    # ------------------------------------------------------------------ request body
    @staticmethod
    def upstream_body(ctx: RequestContext) -> bytes:
        """The bytes sent to the engine: the client's own bytes, except that a stream
        that did not ask for usage gets ``include_usage`` added (`with_include_usage`)."""
        if not ctx.req.stream or ctx.client_wants_usage or ctx.body is None:
            return ctx.raw
        return with_include_usage(ctx.raw, ctx.body)

    # ------------------------------------------------------------------ entry point
    async def forward(
        self,
        request: web.Request,
        ctx: RequestContext,
        base_url: str,
        headers: dict[str, str],
        data: bytes,
    ) -> web.StreamResponse:
        """Send the request to `base_url` and answer the client.

        Raises UpstreamFailure while nothing was sent to the client (the caller may retry
        elsewhere or answer 502/504). Once a stream has started, failures end it with an
        in-stream error event and are reported through ``ctx.outcome``.
        """
        url = base_url + ctx.upstream_path
        if ctx.req.stream:
            return await self._stream(request, ctx, url, headers, data)
        return await self._unary(ctx, url, headers, data)

    async def _unary(
        self, ctx: RequestContext, url: str, headers: dict[str, str], data: bytes
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        up: aiohttp.ClientResponse | None = None
        done = False
        # Set while the engine has the request and kvgate has not had its answer: if
        # kvgate stops waiting then (client gone, timeout), the engine may go on.
        ctx.upstream_abandoned = True
        try:
            try:
                async with asyncio.timeout_at(loop.time() + self._cfg.total_s):
                    up = await self._session.post(url, data=data, headers=headers)
                    body = await up.read()
            except (
                aiohttp.ClientError
            ) as e:  # first: aiohttp's connect timeout is also a TimeoutError
                ctx.upstream_abandoned = False  # refused or dropped: the engine has none
                raise classify_client_error(e, started=False) from e
            except TimeoutError:
                raise UpstreamFailure("timeout", "upstream timed out", retryable=False) from None
            ctx.upstream_abandoned = False
            done = True
            status = up.status
            if status >= 500:
                raise UpstreamFailure(
                    "status_5xx",
                    f"replica answered HTTP {status}",
                    retryable=True,
                    status=status,
                    answer=_error_answer(up, body, ctx),
                )
            ctx.status = status
            if status != 200:
                err = _error_answer(up, body, ctx)
                ctx.outcome = err.outcome
                return err.response({"x-request-id": ctx.request_id}, ctx.dialect)
            if body.find(b'"usage"') >= 0:  # no parse for an answer without usage
                try:
                    doc = orjson.loads(body)
                    record_usage(ctx, doc.get("usage"))
                    if ctx.kind == "responses" and isinstance(doc.get("id"), str):
                        ctx.response_id = doc["id"]
                except (ValueError, AttributeError):
                    pass
            if ctx.kind == "responses" and (ctx.body or {}).get("background") is True:
                # Answered at once, generated on in the engine: its reservation is held
                # as a request kvgate stopped waiting for is (until the engine idles).
                ctx.upstream_abandoned = True
            ctx.outcome = OK
            return web.Response(
                status=status,
                body=body,
                headers={
                    "Content-Type": up.headers.get("Content-Type", "application/json"),
                    "x-request-id": ctx.request_id,
                },
            )
        finally:
            _hand_back(up, done)

    async def _stream(
        self,
        request: web.Request,
        ctx: RequestContext,
        url: str,
        headers: dict[str, str],
        data: bytes,
    ) -> web.StreamResponse:
        """Pump the engine's stream to the client, then end it by how it ended
        (`_finish`). Raises UpstreamFailure while nothing reached the client."""
        loop = asyncio.get_running_loop()
        cfg = self._cfg
        total_deadline = loop.time() + cfg.total_s
        # A timeout while writing (wd.writing) is the client's stall, not the engine's.
        wd = StreamWatchdog(
            loop,
            min(loop.time() + cfg.first_byte_s, total_deadline),
            cfg.idle_s,
            total_deadline,
            self._write_timeout,
        )
        s = _Pumped()
        failure: UpstreamFailure | None = None
        try:
            try:
                try:
                    refused = await self._pump(request, ctx, url, headers, data, wd, s)
                    if refused is not None:
                        return refused
                    ended = Ended.DONE
                except asyncio.CancelledError:
                    if wd.expired():
                        raise TimeoutError from None
                    task = asyncio.current_task()
                    if not (s.done_out and ctx.upstream_error is None and task is not None):
                        raise
                    # aiohttp cancels the handler when its client closes; one that closes
                    # after [DONE] had its whole answer: a completion.
                    task.uncancel()
                    ended = Ended.CLIENT_GONE
            except TimeoutError:
                if wd.writing and loop.time() < total_deadline:
                    ended = Ended.CLIENT_STALLED  # its socket stayed full: it reads nothing
                else:
                    # Before the first byte the client has seen nothing: the request may
                    # be retried on another replica (this one's is aborted as the
                    # connection closes, so no replica does the work twice).
                    ended = Ended.FAILED
                    failure = UpstreamFailure(
                        "timeout",
                        "upstream timed out"
                        + (" between stream chunks" if s.resp else " before the first token"),
                        retryable=s.resp is None,
                    )
            except ClientGone:
                ended = Ended.CLIENT_GONE
            except aiohttp.ClientError as e:
                ended, failure = Ended.FAILED, classify_client_error(e, started=s.resp is not None)
            except UpstreamFailure as e:
                ended, failure = Ended.FAILED, e
            if failure is not None and s.resp is None:
                raise failure
            return await self._finish(request, ctx, s, ended, failure)
        finally:
            wd.close()
            _hand_back(s.up, s.clean)

    async def _pump(
        self,
        request: web.Request,
        ctx: RequestContext,
        url: str,
        headers: dict[str, str],
        data: bytes,
        wd: StreamWatchdog,
        s: _Pumped,
    ) -> web.StreamResponse | None:
        """Send the request and copy its stream, event by event, to the client until the
        engine ends it; the answer to a refusal (an error status before streaming), else
        None. What it reached is left in `s`."""
        loop = asyncio.get_running_loop()
        try:
            s.up = up = await self._session.post(url, data=data, headers=headers)
        except aiohttp.ClientError as e:
            raise classify_client_error(e, started=False) from e
        if up.status != 200:
            return await self._stream_refused(ctx, up)
        buf = b""
        # Typed-event streams open with events that precede any output (the Responses
        # API's response.created while the prompt is prefilled): the first token, and the
        # end of the first-byte phase, is the first output event there.
        named = ctx.kind in _NAMED
        take = take_named_events if named else take_events
        async for chunk in up.content.iter_any():
            buf = buf + chunk if buf else chunk
            out, buf = take(ctx, buf)
            if out:
                # The idle bound is for the engine, not for a slow client: while writing
                # (backpressure) only the total bound applies. A client that takes
                # nothing for client_write_timeout_s is cut.
                wd.begin_write(loop.time())
                if s.resp is None:
                    s.resp = await self._start_client_stream(request, ctx, up)
                await _write(s.resp, out)
                # [DONE] reached the client's socket: a client that closes after it has
                # its whole answer (it need not wait for the chunked body's last bytes).
                s.done_out = ctx.done_seen
                wd.writing = False
                now = loop.time()
                if ctx.first_byte_at is None and (not named or ctx.events or ctx.done_seen):
                    ctx.first_byte_at = now
                    self._hooks.first_token(ctx)
                ctx.last_event_at = now
                if ctx.generated + ctx.req.prompt_tokens > ctx.topup_at:
                    self._hooks.outgrew(ctx)
            if not named or ctx.events or ctx.done_seen:
                wd.last = loop.time()
        if buf:  # trailing bytes without a final blank line: pass them on
            if s.resp is None:
                s.resp = await self._start_client_stream(request, ctx, up)
            await _write(s.resp, buf)
        if s.resp is None:
            raise UpstreamFailure("dropped", "replica closed an empty stream", retryable=True)
        s.clean = True
        return None

    async def _finish(
        self,
        request: web.Request,
        ctx: RequestContext,
        s: _Pumped,
        ended: Ended,
        failure: UpstreamFailure | None,
    ) -> web.StreamResponse:
        """End a stream that reached its client, by how it ended: the engine's end
        written out, an in-stream error event for a failure (the OpenAI SDKs raise
        APIError on it, rather than see a silent truncation), a stalled client dropped."""
        resp = s.resp
        assert resp is not None or ended is Ended.CLIENT_GONE or ended is Ended.CLIENT_STALLED
        if ended is Ended.FAILED:
            assert failure is not None and resp is not None
            ctx.upstream_error = failure.kind
            err = ApiError(
                504 if failure.kind == "timeout" else 502,
                failure.client_message,
                code=f"upstream_{failure.kind}",
            )
            try:
                named = ctx.kind == "responses"
                if not await self._end(request, resp, err.sse_event(ctx.dialect, named)):
                    ended = Ended.CLIENT_STALLED
            except ConnectionError:
                pass
        elif ended is Ended.DONE:
            assert resp is not None
            try:
                if not await self._end(request, resp):
                    ended = Ended.CLIENT_STALLED
            except ConnectionError:
                ended = Ended.CLIENT_GONE
        elif ended is Ended.CLIENT_STALLED:
            if request.transport is not None:
                request.transport.abort()
        ctx.outcome = stream_outcome(ended, s.done_out, ctx.upstream_error)
        if ctx.outcome.end in (End.CLIENT_DISCONNECT, End.CLIENT_STALLED):
            ctx.status = 499
        # Nobody reads the response of a client that left; aiohttp drops it.
        return resp if resp is not None else web.Response(status=499)

    async def _end(self, request: web.Request, resp: web.StreamResponse, last: bytes = b"") -> bool:
        """Write `last` and end the stream. A client that takes none of it within the
        write timeout (its buffers were already full) is dropped like a stalled one, so
        the end of a stream cannot hold the request either; returns False then."""
        try:
            async with asyncio.timeout(self._write_timeout):
                if last:
                    await resp.write(last)
                await resp.write_eof()
            return True
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            return False

    async def _stream_refused(
        self, ctx: RequestContext, up: aiohttp.ClientResponse
    ) -> web.Response:
        """A streamed request the engine answered with an error status before streaming."""
        body = await up.read()
        err = _error_answer(up, body, ctx)
        if up.status >= 500:
            raise UpstreamFailure(
                "status_5xx",
                f"replica answered HTTP {up.status}",
                retryable=True,
                status=up.status,
                answer=err,
            )
        ctx.status = up.status
        ctx.outcome = err.outcome
        return err.response({"x-request-id": ctx.request_id}, ctx.dialect)

    async def _start_client_stream(
        self, request: web.Request, ctx: RequestContext, up: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200,
            headers={
                **_SSE_HEADERS_BASE,
                "Content-Type": up.headers.get("Content-Type", "text/event-stream"),
                "x-request-id": ctx.request_id,
            },
        )
        try:
            await resp.prepare(request)
        except ConnectionError as e:
            raise ClientGone() from e
        ctx.status = 200
        ctx.client_stream = resp
        return resp


def _hand_back(up: aiohttp.ClientResponse | None, done: bool) -> None:
    """Return an engine connection whose answer was read to its end to the pool; close
    any other: closing is how an engine learns to abort the request (vLLM and SGLang
    abort on client disconnect) and free its KV blocks."""
    if up is None:
        return
    if done:
        up.release()
    else:
        up.close()
