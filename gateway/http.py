"""The HTTP server's own edges: limits enforced by the parser, errors in OpenAI's shape.

Policy, and why:

- **Limits before parsing.** aiohttp's HTTP parser enforces the request-line and header
  sizes (``limits.max_header_bytes`` per line, ``limits.max_headers`` lines) while it reads
  the head, so an oversized head costs kvgate at most those bytes and is never handed to
  the pipeline. The body limit (``limits.max_body_bytes``) is checked against
  Content-Length before a byte of the body is read, and while reading a chunked body.
- **A slow client cannot hold a connection.** A connection that has not sent a complete
  request head within ``limits.header_timeout_s`` of opening (or of its last answer) is
  closed (aiohttp's keep-alive timer: slowloris); a body must arrive within
  ``limits.body_timeout_s`` (408, `gateway.body`, and the connection is closed with it);
  a client that takes none of its
  answer for ``limits.client_write_timeout_s`` is cut (`gateway.upstream.relay`).
- **A client that stops reading costs a bounded buffer.** Linux grows a socket's send
  buffer up to ``net.ipv4.tcp_wmem``'s maximum (4 MiB by default): a stuck client would
  absorb a whole answer (a 2,000-token stream is ~400 KB) and keep its reservation while
  kvgate kept pulling tokens for nobody. Each connection's send buffer is pinned to
  ``limits.client_send_buffer_bytes`` (64 KiB, which the kernel doubles; token streams
  need far less), so a stuck client blocks kvgate's write after ~200 KB (kernel plus
  the transport's 64 KiB high-water mark), the relay stops reading from the engine,
  and the write timeout cuts it.
- **Every error a client sees is an OpenAI error object.** aiohttp answers a head it
  cannot parse (and an exception escaping a handler) itself, in plain text, bypassing
  the app and its middlewares. `install` swaps in a request handler whose
  ``handle_error`` answers ``{"error": {...}}`` instead: 431 for a head over the limits,
  400 for any other malformed request, 500 for the rest. The message names the limit,
  never an exception's text, a traceback or an upstream address; the details go to the
  log (a malformed request at info level without a traceback: it is the client's fault,
  and a traceback per bad request would let anyone flood the log). The ``Server`` header
  says ``kvgate``, not the Python and aiohttp versions.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import logging
import socket
import termios
from typing import Any

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler

from gateway.errors import CLOSE_AFTER, ApiError

log = logging.getLogger("kvgate.http")
SERVER = "kvgate"


def _is_head_too_large(exc: BaseException | None, message: str | None) -> bool:
    if isinstance(exc, http_exceptions.LineTooLong):
        return True
    text = f"{message or ''} {exc or ''}".lower()
    return "too many headers" in text or "header" in text and "too long" in text


class OpenAIErrorRequestHandler(RequestHandler):
    """aiohttp's connection handler, answering its own errors as OpenAI error objects,
    with a bounded kernel send buffer."""

    send_buffer_bytes: int | None = None
    # When the client's connection was lost, on the loop's clock, as the transport saw
    # it: the moment its client left (`connection_lost_at`).
    lost_at: float | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.send_buffer_bytes:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
                except OSError:  # pragma: no cover - a platform without the option
                    pass
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.lost_at is None:
            self.lost_at = self._loop.time()
        super().connection_lost(exc)

    def close_if_idle(self) -> bool:
        """Close the connection if it waits for its next request (aiohttp's own test of
        an idle keep-alive connection) and none has reached the kernel unread: closing
        on unread bytes resets the connection under the client's request. True if closed."""
        if self._force_close or self._messages or self._request_count == 0:
            return False  # busy, or new: its first request is on its way, to be answered
        if self._waiter is None or self._waiter.done():
            return False
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is not None:
            unread = array.array("i", [0])
            with contextlib.suppress(OSError):
                fcntl.ioctl(sock.fileno(), termios.FIONREAD, unread)
            if unread[0]:
                return False  # a request is arriving: it is answered (and then closed)
        self.force_close()
        return True

    def awaiting_first_request(self) -> bool:
        """Accepted, open, and no request read from it yet."""
        return self._request_count == 0 and not self._force_close and self.transport is not None

    async def finish_response(
        self, request: Any, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        out = await super().finish_response(request, resp, start_time)
        # `len` first: a response's `get` raises and catches a KeyError when the key is
        # absent (collections.abc), and it is absent from every answer but a 408's.
        if len(resp) and resp.get(CLOSE_AFTER) and not request.content.is_eof():
            # The 408 of a body that did not arrive: close now, once it is written,
            # instead of lingering (aiohttp's 10 s) to read a body nobody will use. Other
            # answers to unread bodies (a 413) linger as aiohttp does, so a client still
            # sending is not reset before it reads its answer.
            self.force_close()
        return out

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            # Bytes of an answer already went out: the connection is broken (aiohttp's own rule).
            raise ConnectionError("response already started; cannot send an error answer")
        if status == 400 and _is_head_too_large(exc, message):
            err = ApiError(
                431,
                "Request header fields too large: at most "
                f"{self._limits[0]} bytes per line and {self._limits[1]} header lines.",
                code="headers_too_large",
                type="invalid_request_error",
            )
            log.info("refused an oversized request head from %s: %s", request.remote, exc)
        elif 400 <= status < 500:
            err = ApiError(
                status,
                "Malformed HTTP request.",
                code="bad_http_request",
                type="invalid_request_error",
            )
            log.info("refused a malformed request from %s: %s", request.remote, exc)
        else:
            err = ApiError(500, "internal error in kvgate", code="internal_error")
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        resp = err.response({"Server": SERVER})
        resp.force_close()
        return resp

    @property
    def _limits(self) -> tuple[int, int]:
        return self.max_field_size, self.max_headers


def connection_lost_at(request: web.BaseRequest) -> float | None:
    """When `request`'s client connection was lost, on the loop's clock (None: it was
    not, or not under `OpenAIErrorRequestHandler`). This, not when its handler got round
    to the loss, is when its client left: a busy loop runs the cancelled handlers of a
    load generator's 32 closes over tens of milliseconds, which read as departures
    spread over time, not one close (admission/learned/patience.py)."""
    proto = request.protocol
    return proto.lost_at if isinstance(proto, OpenAIErrorRequestHandler) else None


class _Server(web.Server):
    send_buffer_bytes: int | None = None

    def __call__(self) -> RequestHandler:
        handler = OpenAIErrorRequestHandler(self, loop=self._loop, **self._kwargs)
        handler.send_buffer_bytes = self.send_buffer_bytes
        return handler


def install(runner: web.AppRunner, limits: Any) -> None:
    """Make `runner`'s server (after ``setup()``) use `OpenAIErrorRequestHandler`, with
    ``limits.client_send_buffer_bytes`` as each connection's kernel send buffer."""
    server = runner.server
    assert server is not None, "call runner.setup() first"
    # web.Server builds one RequestHandler per connection in __call__; only that changes.
    server.__class__ = _Server
    assert isinstance(server, _Server)
    server.send_buffer_bytes = limits.client_send_buffer_bytes


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    response.headers["Server"] = SERVER


def hide_server_version(app: web.Application) -> None:
    """Answer ``Server: kvgate`` instead of aiohttp's ``Python/3.x aiohttp/3.y``: the
    versions tell a scanner which known flaws to try."""
    app.on_response_prepare.append(_server_header)


def server_kwargs(limits: Any) -> dict[str, Any]:
    """aiohttp server options for the configured `limits` (``gateway.config.LimitsConfig``)."""
    return {
        "max_line_size": limits.max_header_bytes,
        "max_field_size": limits.max_header_bytes,
        "max_headers": limits.max_headers,
        "keepalive_timeout": limits.header_timeout_s,
    }
