"""What a client hanging up does to the engine's work."""

from __future__ import annotations

import json
import socket
import threading
import time

from tests.realengine.llama import LlamaServer, sse_events, user


def _wait_until_processing(server: LlamaServer, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(s["is_processing"] for s in server.slots()):
        assert time.monotonic() < deadline, "the request never reached a slot"
        time.sleep(0.01)


def test_stream_disconnect_frees_the_slot_at_once(engine: LlamaServer) -> None:
    max_tokens = engine.slot_ctx() - 50
    before = engine.metric("llamacpp:tokens_predicted_total")
    body = {"messages": user("hi"), "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with engine.open_stream(body) as (conn, resp):
        assert resp.status == 200
        assert len(sse_events(resp, limit=3)) == 3
        busy = [s for s in engine.slots() if s["is_processing"]]
        assert len(busy) == 1
        conn.sock.shutdown(socket.SHUT_RDWR)  # type: ignore[union-attr]
    t0 = time.monotonic()
    slots = engine.wait_idle(timeout=5.0)
    freed_after = time.monotonic() - t0
    generated = engine.metric("llamacpp:tokens_predicted_total") - before
    # The engine notices at its next write and cancels: a handful of tokens, not max_tokens.
    assert generated < max_tokens / 2, (generated, freed_after)
    [slot] = [s for s in slots if s["id"] == busy[0]["id"]]
    assert slot["is_processing"] is False


def _raw_chat(server: LlamaServer, body: dict[str, object]) -> socket.socket:
    """Send a chat request on a bare socket (no reader, so nothing notices the reply)."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
    )
    return sock


def test_non_stream_disconnect_cancels_only_after_a_quiet_second(unified: LlamaServer) -> None:
    """A non-stream request notices its client is gone only when its wait for results times
    out (1 s, HTTP_POLLING_SECONDS); we stay silent meanwhile (polling /slots would wake it)."""
    max_tokens = 4000  # about 8 s of decode on this machine
    before = unified.metric("llamacpp:tokens_predicted_total")
    sock = _raw_chat(
        unified, {"messages": user("hi"), "max_tokens": max_tokens, "ignore_eos": True}
    )
    _wait_until_processing(unified)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    time.sleep(2.0)  # the engine's own 1 s poll, plus margin; no request may touch it meanwhile
    assert not any(s["is_processing"] for s in unified.slots())
    assert unified.metric("llamacpp:tokens_predicted_total") - before < max_tokens


def test_non_stream_disconnect_is_not_noticed_while_other_results_flow(
    unified: LlamaServer,
) -> None:
    """Every result the server produces (another stream's tokens, a /slots or /metrics answer)
    restarts that 1 s wait, so on a busy server an abandoned non-stream request runs to its
    end. A gateway that must stop the engine's work on disconnect should stream upstream."""
    stream_tokens, abandoned_tokens = 1200, 800
    before = unified.metric("llamacpp:tokens_predicted_total")
    done = threading.Event()

    def keep_a_stream_running() -> None:
        body = {
            "messages": user("a stream"),
            "max_tokens": stream_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        with unified.open_stream(body) as (_, resp):
            sse_events(resp)
        done.set()

    thread = threading.Thread(target=keep_a_stream_running)
    thread.start()
    _wait_until_processing(unified)
    sock = _raw_chat(
        unified, {"messages": user("abandoned"), "max_tokens": abandoned_tokens, "ignore_eos": True}
    )
    time.sleep(0.1)
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    thread.join(timeout=30)
    assert done.is_set()
    unified.wait_idle()
    generated = unified.metric("llamacpp:tokens_predicted_total") - before
    assert generated == stream_tokens + abandoned_tokens
