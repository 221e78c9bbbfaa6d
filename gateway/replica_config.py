"""The replica sections of kvgate's config: one engine replica (`ReplicaConfig`), the
replicas found by DNS (`ReplicaGroupConfig`, gateway/fleet/dns.py) and its resolver
(`DnsConfig`); both kinds of replica entry share `ReplicaSettings`. gateway/config.py
assembles them into the whole file's model. The entries stay as written; the replicas
kvgate serves from them are `expand_data_parallel`'s."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Engine = Literal["vllm", "sglang", "llamacpp", "openai"]
PositiveFloat = Annotated[float, Field(gt=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class KVEventsSource(_Strict):
    """Where a vLLM started with ``--kv-events-config`` publishes its KV cache events
    (gateway/fleet/kvevents.py): its PUB ``endpoint`` (the engine binds ``tcp://*:PORT``;
    kvgate connects to ``tcp://HOST:PORT``), its ``replay_endpoint`` if it has one, and
    the ``topic`` it was given."""

    endpoint: Annotated[str, Field(pattern=r"^(tcp|ipc)://")]
    replay_endpoint: Annotated[str, Field(pattern=r"^(tcp|ipc)://")] | None = None
    topic: str = ""


class ReplicaSettings(_Strict):
    """What kvgate needs to know of an engine replica besides where it is: the fields a
    replica (`ReplicaConfig`) and a DNS group of them (`ReplicaGroupConfig`) share, with
    their rules, written once."""

    engine: Engine = "vllm"
    # Pinned KV pool size in tokens; wins over what the engine reports. Use it when the
    # engine does not expose its pool (llama.cpp, hosted OpenAI-compatible servers) or to
    # deliberately keep a replica below its real pool.
    pool_tokens: Annotated[int, Field(gt=0)] | None = None
    block_size: Annotated[int, Field(gt=0)] | None = None
    max_running: Annotated[int, Field(gt=0)] | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    # Bearer token kvgate sends to this replica (hosted OpenAI-compatible servers).
    api_key: str | None = None
    # llama.cpp only: the KV layout llama-server was started with, which it does not
    # report. auto: one pool of the reported per-slot context (the safe reading) until
    # the server's /slots prove its slots hold more; per_slot: `-np N` without
    # `--kv-unified` (pool = slots x per-slot context); unified: `--kv-unified` (one pool;
    # also for `-c` with a `--kv-unified-per-slot` below `-c / -np`, which auto misreads).
    # See routing/adapters/llamacpp.py. A pinned pool_tokens wins over any of them.
    kv_layout: Literal["auto", "per_slot", "unified"] = "auto"

    @model_validator(mode="after")
    def _openai_pool_is_pinned(self) -> ReplicaSettings:
        # Nothing in the OpenAI API reports a KV pool: without a pin the replica could
        # never be used (admission routes nothing to an unknown pool).
        if self.engine == "openai" and self.pool_tokens is None:
            raise ValueError(
                "pool_tokens: required with engine openai (a plain OpenAI server reports "
                "no KV pool; give its size in tokens)"
            )
        return self

    @model_validator(mode="after")
    def _layout_is_llamacpp(self) -> ReplicaSettings:
        if self.kv_layout != "auto" and self.engine != "llamacpp":
            raise ValueError(
                f"kv_layout: {self.kv_layout!r} applies to engine llamacpp only, "
                f"not {self.engine!r}"
            )
        return self

    @field_validator("labels", mode="before")
    @classmethod
    def _labels_as_strings(cls, v: Any) -> Any:
        # YAML turns `speculative: true` into a bool; labels are strings everywhere else.
        if isinstance(v, Mapping):
            return {
                str(k): (str(x).lower() if isinstance(x, bool) else str(x)) for k, x in v.items()
            }
        return v


class ReplicaConfig(ReplicaSettings):
    """One engine replica kvgate may send requests to."""

    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")]
    url: Annotated[str, Field(pattern=r"^https?://")]
    # vLLM only: a server started with `--data-parallel-size N` runs N engines, each with
    # its own KV pool, behind one URL. With N here the entry is served as N replicas
    # `<name>-dp<k>` (`expand_data_parallel`), one per engine rank, each with a ledger of
    # its own (its pool read from the metrics labelled engine="k"), and every request is
    # pinned to the rank it was admitted on with vLLM's `X-data-parallel-rank` header. `pool_tokens` and
    # `max_running` apply to each rank. Left at 1 on a DP server, the ranks' pools are
    # summed and vLLM's own balancer picks the rank (see docs/admission.md, data parallel).
    data_parallel_size: Annotated[int, Field(ge=1)] = 1
    # The engine rank this replica entry addresses (set by `expand_data_parallel`, or by
    # hand to address one rank of a DP server); None: the whole server.
    dp_rank: Annotated[int, Field(ge=0)] | None = None
    # vLLM only: its KV events, for the precise prefix index (routing/kvindex.py).
    kv_events: KVEventsSource | None = None

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, v: str) -> str:
        return v.rstrip("/")

    @model_validator(mode="after")
    def _data_parallel_is_vllm(self) -> ReplicaConfig:
        if (self.data_parallel_size > 1 or self.dp_rank is not None) and self.engine != "vllm":
            raise ValueError(
                f"data_parallel_size/dp_rank: apply to engine vllm only, not {self.engine!r}"
            )
        if self.dp_rank is not None and self.data_parallel_size > 1:
            if self.dp_rank >= self.data_parallel_size:
                raise ValueError(
                    f"dp_rank: {self.dp_rank} is not below data_parallel_size "
                    f"{self.data_parallel_size}"
                )
        return self


def expand_data_parallel(replicas: Iterable[ReplicaConfig]) -> list[ReplicaConfig]:
    """The replicas kvgate serves from the configured entries: an entry with
    ``data_parallel_size`` N and no ``dp_rank`` becomes N replicas ``<name>-dp<k>``, each
    addressing engine rank k; every other entry is served as written."""
    served: list[ReplicaConfig] = []
    for r in replicas:
        if r.data_parallel_size > 1 and r.dp_rank is None:
            served.extend(
                r.model_copy(update={"name": f"{r.name}-dp{k}", "dp_rank": k})
                for k in range(r.data_parallel_size)
            )
        else:
            served.append(r)
    return served


class ReplicaGroupConfig(ReplicaSettings):
    """Replicas found by DNS, as Envoy's strict-DNS clusters and Kubernetes headless
    Services work: every address `host` resolves to is one replica, re-resolved every
    ``resolve_interval_s`` (gateway/fleet/dns.py). A new address joins once its probe finds it
    ready; a vanished one takes no new request at once, and leaves when its running
    requests have ended.

    ``record: A`` (IPv4) or ``AAAA`` (IPv6) take the port from ``port``; ``SRV`` reads
    target and port from the records (``_http._tcp.vllm.ns.svc.cluster.local``). Each
    replica is named ``<name>-<address>:<port>`` and addressed by its IP. The other fields
    are a replica's (`ReplicaSettings`), applied to every address.
    """

    name: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")]
    host: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")]
    port: Annotated[int, Field(gt=0, le=65535)] | None = None
    record: Literal["A", "AAAA", "SRV"] = "A"
    scheme: Literal["http", "https"] = "http"
    resolve_interval_s: PositiveFloat = 5.0

    @model_validator(mode="after")
    def _port_or_srv(self) -> ReplicaGroupConfig:
        if self.record == "SRV" and self.port is not None:
            raise ValueError("port: SRV records carry the port; leave port out")
        if self.record != "SRV" and self.port is None:
            raise ValueError(f"port: required with record {self.record} (or use record SRV)")
        return self

    def replica(self, name: str, url: str) -> ReplicaConfig:
        """The replica at one resolved address."""
        fields = self.model_dump(include=set(ReplicaSettings.model_fields))
        return ReplicaConfig.model_validate({**fields, "name": name, "url": url})

    def describe(self) -> str:
        return f"{self.record} {self.host}" + (f" port {self.port}" if self.port else "")


class DnsConfig(_Strict):
    """The resolver of `replica_groups`: ``servers`` as ``host:port`` (or ``host``, port
    53); empty: the system's (/etc/resolv.conf)."""

    servers: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    timeout_s: PositiveFloat = 2.0
