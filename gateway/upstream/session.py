"""The connection pool towards the engines and the failures it can report.

One `aiohttp.ClientSession` serves every replica: keep-alive connections are pooled per
host, so a request pays no TCP handshake once the pool is warm. The connector's limit
is sized for the gateway's concurrency (``upstream.max_connections``); there is no
per-host limit because admission already bounds what each replica receives.
"""

from __future__ import annotations

import aiohttp

from gateway.config import UpstreamConfig
from gateway.errors import ApiError

# What a client is told of each failure kind: never the exception's text, which can name
# the replica's address ("Connect call failed ('10.0.3.7', 8000)") or library internals;
# those go to the log.
_CLIENT_MESSAGES = {
    "connect": "the replica could not be reached",
    "dropped": "the replica dropped the connection",
    "timeout": "the replica timed out",
    "status_5xx": "the replica failed",
    "stream_error": "the replica ended the stream with an error",
}


class UpstreamFailure(Exception):
    """The engine could not give a usable answer.

    ``kind`` is a metric label: ``connect`` (refused, unreachable: the replica is down),
    ``timeout``, ``status_5xx``, ``dropped`` (connection lost mid-response), and, set on
    the request once its stream has started, ``stream_error`` (the engine ended the
    stream with an error event). ``retryable`` is True only while nothing has been sent
    to the client, so another replica can still answer the request cleanly. ``answer``
    is the engine's own error (status and message) when it gave one: what the client
    gets when the request is not retried.
    """

    def __init__(
        self,
        kind: str,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        answer: ApiError | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.status = status
        self.answer = answer

    @property
    def client_message(self) -> str:
        """The failure as a client may read it (no addresses, no exception text)."""
        if self.kind == "timeout":
            return self.message  # kvgate's own fixed wording ("... before the first token")
        return _CLIENT_MESSAGES.get(self.kind, "the replica failed")


# Engines' HTTP servers close a connection idle for 5 s (uvicorn under vLLM and SGLang,
# llama.cpp's httplib). A pooled connection kept longer can be reused just as the server
# closes it, and the request written on it is lost (seen with a real vLLM: "Can not write
# request body"). aiohttp never reuses a connection idle past this: ours close first.
KEEPALIVE_S = 4.0


def make_session(cfg: UpstreamConfig) -> aiohttp.ClientSession:
    """The shared pooled session. Timeouts other than connect are enforced by the relay
    (first byte, idle gap, total), which knows which phase a response is in."""
    connector = aiohttp.TCPConnector(
        limit=cfg.max_connections,
        limit_per_host=0,
        keepalive_timeout=KEEPALIVE_S,
        ttl_dns_cache=300,
        enable_cleanup_closed=False,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_s),
        # The gateway forwards bytes; it never needs aiohttp's cookie handling, and
        # auto-decompression would break byte-identical forwarding (and without an
        # Accept-Encoding header engines answer uncompressed, so usage stays readable).
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )


def classify_client_error(exc: BaseException, *, started: bool) -> UpstreamFailure:
    """Map an aiohttp exception to an UpstreamFailure. `started`: bytes already went to
    the client (then nothing is retryable)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        # No TCP connection within connect_s: as good as down (black-holed host).
        return UpstreamFailure("connect", "connecting to replica timed out", retryable=not started)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamFailure(
            "connect", f"cannot connect to replica: {exc.os_error or exc}", retryable=not started
        )
    if isinstance(exc, TimeoutError):
        return UpstreamFailure("timeout", "upstream timed out", retryable=False)
    return UpstreamFailure(
        "dropped", f"upstream connection lost: {type(exc).__name__}: {exc}", retryable=not started
    )
