"""Clients' connections while the gateway stops: none is closed under a request.

A request is lost at shutdown when its bytes reach a connection the gateway is closing:
the client sees the connection drop with no answer (``Server disconnected``, a reset).
Three places did that, and each is closed off here:

- **Idle keep-alive connections** were closed at the end, after the listener: a client
  that reused one then lost its request and its retry was refused. They are closed when
  the drain starts (`close_idle`), while the listener still answers a retry with 503 and
  Retry-After.
- **Answers during the drain** kept their connection alive, to be closed at the end
  under the client's next request. Each says ``Connection: close`` and its connection
  closes after it (`close_when_draining`), as Envoy's drain does for HTTP/1.1.
- **Connections the kernel had queued** but the event loop had not yet accepted were
  reset when the listening socket closed (a loaded loop accepts late). `stop_accepting`
  accepts them first, from a duplicate of the socket, then closes it; they are answered
  like any other (503 ``shutting_down``).
- **Connections accepted just before the listener closed** were closed at the end before
  their first request arrived. The stop waits for those requests (a second at most,
  `answer_first_requests`) before it closes anything.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket

from aiohttp import web

from gateway.http import OpenAIErrorRequestHandler

log = logging.getLogger("kvgate")


def close_when_draining(response: web.StreamResponse, draining: bool) -> None:
    """Called as every answer starts (``on_response_prepare``): while draining, it closes
    its connection."""
    if draining:
        response.force_close()  # closed after this answer
        response.headers["Connection"] = "close"  # aiohttp wrote its headers before hooks


def close_idle(server: web.Server | None) -> int:
    """Close every connection that waits for its next request; returns how many."""
    if server is None:
        return 0
    return sum(
        1
        for conn in server.connections
        if isinstance(conn, OpenAIErrorRequestHandler) and conn.close_if_idle()
    )


def listening_sockets(site: web.BaseSite) -> list[socket.socket]:
    """The sockets `site` listens on ([] when it is not listening)."""
    listening = site._server  # the loop's server (asyncio or uvloop); aiohttp names no other
    # aiohttp types it asyncio.AbstractServer, which declares no `sockets`: both loops'
    # servers (asyncio.Server, uvloop's Server) have them.
    if listening is None:
        return []
    found = listening.sockets  # type: ignore[attr-defined]  # see above
    return list(found) if found else []


async def stop_accepting(site: web.BaseSite, server: web.Server) -> int:
    """Stop `site` listening without resetting what the kernel queued on it: those
    connections are accepted and handed to `server`. Returns how many there were."""
    socks = listening_sockets(site)
    # A duplicate keeps the kernel's socket (and its queue) alive past the loop's close.
    dups = [socket.socket(fileno=os.dup(s.fileno())) for s in socks]
    await site.stop()  # synchronous inside: nothing is accepted between this and below
    queued: list[socket.socket] = []
    for dup in dups:
        dup.setblocking(False)
        try:
            while True:
                conn, _ = dup.accept()
                conn.setblocking(False)
                queued.append(conn)
        except (BlockingIOError, InterruptedError):
            pass  # the queue is empty
        except OSError as e:
            log.warning("kvgate: accepting queued connections at shutdown: %s", e)
        finally:
            dup.close()  # from here new connections are refused (nothing sent: retryable)
    loop = asyncio.get_running_loop()
    for conn in queued:
        try:
            await loop.connect_accepted_socket(server, sock=conn)
        except OSError:
            conn.close()  # the client left already
    return len(queued)


async def answer_first_requests(server: web.Server | None, limit_s: float = 1.0) -> None:
    """Wait (at most `limit_s`) until every connection accepted before the listener
    closed has sent its first request (to be answered): closing one at the end would drop
    a request that was on its way."""
    if server is None:
        return
    loop = asyncio.get_running_loop()
    end = loop.time() + limit_s

    def waiting() -> bool:
        return any(
            isinstance(c, OpenAIErrorRequestHandler) and c.awaiting_first_request()
            for c in server.connections
        )

    while waiting() and loop.time() < end:  # noqa: ASYNC110 - aiohttp signals no request
        await asyncio.sleep(0.01)
