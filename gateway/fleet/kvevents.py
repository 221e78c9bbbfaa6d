"""The ZMQ side of the precise prefix index: one SUB socket per replica whose vLLM
publishes its KV cache events (``replicas[].kv_events``), feeding routing's sans-IO
index (routing.kvindex) with what routing.kvevents decodes.

- The engine binds its PUB endpoint; kvgate connects (ZMQ reconnects by itself when
  the engine restarts, and the index sees the sequence start over).
- A gap in the sequence is filled from the engine's replay socket (a DEALER to its
  ROUTER: ask for the first missing number, read until the end marker), within
  ``REPLAY_TIMEOUT_S``; without one, or when the engine no longer buffers what is
  missing, the index starts over from the message at hand (`EngineBlocks.resync`).
- A subscription that stays silent while the engine serves prompts (its prefix-cache
  query counter moves) is stale: the scorer stops trusting it and this loop subscribes
  again, at most once a stale period (`EngineBlocks.silent`).

pyzmq and msgpack are the optional extra ``kvgate[kvevents]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from gateway.config import GatewayConfig, KVEventsSource, expand_data_parallel
from gateway.fleet.discovery import Discovery
from gateway.tasks import cancel_all
from routing.kvevents import END_SEQ, BadMessage, decode
from routing.kvindex import GAP, EngineBlocks, KVIndex

log = logging.getLogger("kvgate.kvevents")

REPLAY_TIMEOUT_S = 2.0
POLL_MS = 1000  # how often a silent subscription is checked for staleness
DRAIN_MAX = 256  # messages read in one go before the loop's other tasks run


class KVEventSubscriber:
    """One replica's event stream into its `EngineBlocks` (module docstring)."""

    def __init__(
        self,
        source: KVEventsSource,
        blocks: EngineBlocks,
        queries: Callable[[], float | None],
    ) -> None:
        self.source = source
        self.blocks = blocks
        self._queries = queries  # the engine's prefix-cache query counter, as discovered
        self.messages = self.bad = self.replayed = self.subscriptions = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kvgate-kvevents-{self.blocks.name}"
        )

    async def stop(self) -> None:
        await cancel_all([self._task])
        self._task = None

    async def _run(self) -> None:
        import zmq
        import zmq.asyncio

        zctx = zmq.asyncio.Context.instance()
        loop = asyncio.get_running_loop()
        while True:
            sub = zctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
            sub.connect(self.source.endpoint)
            # The same socket without asyncio: what is queued is read at once, since an
            # await per message costs the loop more than decoding and applying it.
            now_queued: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
            self.subscriptions += 1
            subscribed_at = loop.time()
            try:
                while True:
                    if await sub.poll(POLL_MS):
                        for _ in range(DRAIN_MAX):
                            try:
                                frames = now_queued.recv_multipart(zmq.NOBLOCK)
                            except zmq.Again:
                                break
                            await self._on_message(frames, loop.time())
                        else:
                            await asyncio.sleep(0)  # a full batch: let the others run
                    elif (
                        loop.time() - subscribed_at > self.blocks.stale_after_s
                        and self.blocks.silent(loop.time(), self._queries())
                    ):  # at most once a stale period: a new socket may miss messages
                        log.warning(
                            "kv events of %s are stale: subscribing again", self.blocks.name
                        )
                        break
            finally:
                sub.close(linger=0)

    async def _on_message(self, frames: list[bytes], now: float) -> None:
        try:
            seq, events = decode(frames)
        except BadMessage as e:
            self.bad += 1
            log.warning("kv events of %s: %s", self.blocks.name, e)
            return
        self.messages += 1
        blocks = self.blocks
        if blocks.apply(seq, events, now, queries_total=self._queries()) != GAP:
            return
        want = (blocks.last_seq or 0) + 1
        if self.source.replay_endpoint is not None:
            with contextlib.suppress(Exception):  # a failed replay falls back to resync
                await asyncio.wait_for(self._replay(want, now), REPLAY_TIMEOUT_S)
        if blocks.last_seq is not None and blocks.last_seq >= seq - 1:
            blocks.apply(seq, events, now, replay=True, queries_total=self._queries())
        else:
            log.warning(
                "kv events of %s: messages %d..%d are lost: the index starts over",
                blocks.name, want, seq - 1,
            )  # fmt: skip
            blocks.resync(seq, events, now)

    async def _replay(self, start: int, now: float) -> None:
        """Ask the replay socket for every batch from `start` and apply them in order."""
        import zmq
        import zmq.asyncio

        assert self.source.replay_endpoint is not None
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.connect(self.source.replay_endpoint)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3 and int.from_bytes(frames[1], "big", signed=True) == END_SEQ:
                    return
                seq, events = decode(frames)
                self.replayed += 1
                got = self.blocks.apply(seq, events, now, replay=True)
                if got == GAP:
                    return  # the engine no longer buffers what is missing
        finally:
            sock.close(linger=0)


def start_kv_events(
    config: GatewayConfig, kv: KVIndex, discovery: Discovery
) -> list[KVEventSubscriber]:
    """One running subscriber per replica with ``kv_events``."""
    out = []
    for rc in expand_data_parallel(config.replicas):
        if rc.kv_events is None:
            continue
        watcher = discovery.watchers.get(rc.name)

        def queries(w: object = watcher) -> float | None:
            return getattr(getattr(w, "state", None), "prefix_cache_queries_total", None)

        sub = KVEventSubscriber(rc.kv_events, kv.replica(rc.name), queries)
        sub.start()
        out.append(sub)
    return out
