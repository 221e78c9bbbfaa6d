"""kvgate's configuration: one YAML file validated by pydantic, then environment overrides.

Every model forbids unknown fields, so a typo (``refresh_intreval_s``) is an error that
names the field instead of a setting silently ignored. Secrets (API keys, the admin
token) and the listen address can come from the environment so a container image can
carry the same file everywhere:

- ``KVGATE_LISTEN``: ``host:port`` (or ``:port``)
- ``KVGATE_ADMIN_TOKEN``: bearer token for ``/admin/*``
- ``KVGATE_API_KEYS``: ``key:tenant,key2:tenant2`` (a key without ``:tenant`` maps to the
  tenant ``default``); replaces the file's ``auth.api_keys``. Plain keys are hashed when
  the gateway starts and never logged; prefer ``tenants[].keys_sha256`` in the file.
- ``KVGATE_LOG_LEVEL``: ``debug|info|warning|error``
- ``KVGATE_STATE_BACKEND``: ``memory|redis`` (``state.backend``)
- ``KVGATE_REDIS_URL``: ``redis://`` or ``rediss://`` (TLS) URL of the shared-state Redis
  (``state.redis_url``)
- ``KVGATE_REDIS_PASSWORD``: the Redis password (kept out of the file and the URL)
- ``KVGATE_REDIS_SENTINEL_PASSWORD``: the sentinels' password (``state.redis_sentinel``)
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    Field,
    FilePath,
    ValidationError,
    model_validator,
)

from admission.config import AdmissionConfig
from admission.tenants import TenantConfig
from gateway.replica_config import (  # noqa: F401 - re-exported: the config's own types
    DnsConfig,
    Engine,
    KVEventsSource,
    PositiveFloat,
    ReplicaConfig,
    ReplicaGroupConfig,
    _Strict,
    expand_data_parallel,
)
from routing.config import FilterRef, ProfileConfig, RoutingConfig


class ConfigError(Exception):
    """Invalid configuration; the message names every offending field."""


def _now_constant(name: str, module: str) -> str:
    return f"an internal of the algorithm, now the constant {name} in {module}"


_ESTIMATE = "admission/learned/estimate.py"
_LIMIT = "admission/learned/limit.py"
_SHEDDING = "admission/shedding.py"
_SCHEDULER = "routing/scheduler.py"

# Settings a config may no longer hold, by path (list positions left out), each with the
# reason: a file that still sets one is told what became of it, not "unknown field".
REMOVED_SETTINGS = {
    "admission.knee_efficiency": "the goodput knee is no longer fitted (docs/admission.md)",
    "admission.min_drain_samples": _now_constant("MIN_DRAIN_SAMPLES", _SHEDDING),
    "admission.cold_retry_after_s": _now_constant("COLD_RETRY_AFTER_S", _SHEDDING),
    "admission.min_output_samples": _now_constant("MIN_OUTPUT_SAMPLES", _ESTIMATE),
    "admission.min_prompt_samples": _now_constant("MIN_PROMPT_SAMPLES", _ESTIMATE),
    "admission.prompt_quantile": _now_constant("PROMPT_QUANTILE", _ESTIMATE),
    "admission.max_chars_per_token_growth": _now_constant("MAX_CHARS_PER_TOKEN_GROWTH", _ESTIMATE),
    "admission.estimator_window": _now_constant("ESTIMATOR_WINDOW", _ESTIMATE),
    "admission.drain_window_s": _now_constant("DRAIN_WINDOW_S", "admission/learned/drain.py"),
    "admission.retry_memory_entries": _now_constant("RETRY_MEMORY_ENTRIES", "admission/retries.py"),
    "admission.limit_window": _now_constant("LIMIT_WINDOW", _LIMIT),
    "admission.limit_probe_step": _now_constant("LIMIT_PROBE_STEP", _LIMIT),
    "admission.prefix_settle_s": _now_constant("PREFIX_SETTLE_S", "admission/ledger.py"),
    "routing.stale_after_intervals": _now_constant("STALE_AFTER_INTERVALS", _SCHEDULER),
    "routing.stale_score_factor": _now_constant("STALE_SCORE_FACTOR", _SCHEDULER),
    "counting.near_limit_margin": _now_constant("NEAR_LIMIT_MARGIN", "gateway/counting.py"),
}


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080


class UpstreamConfig(_Strict):
    """Timeouts towards the engines, in seconds.

    ``first_byte_s`` bounds the wait for the first event of a streamed response (prefill
    plus queueing inside the engine). A non-streamed response's first byte is its whole
    body, so only ``total_s`` bounds it. ``idle_s`` bounds the gap between two chunks of
    a stream. ``total_s`` bounds the whole exchange.
    """

    connect_s: PositiveFloat = 3.0
    first_byte_s: PositiveFloat = 60.0
    idle_s: PositiveFloat = 30.0
    total_s: PositiveFloat = 600.0
    max_connections: Annotated[int, Field(gt=0)] = 1024
    # Retry once on another replica when the chosen one refuses the connection or answers
    # 5xx before any byte reached the client.
    retry_once: bool = True
    # Bound of the one call to a replica's tokenize endpoint that counts a prompt near a
    # limit exactly (gateway/counting.py); past it the request goes on with its estimate.
    tokenize_timeout_s: PositiveFloat = 2.0


class CountingConfig(_Strict):
    """How prompt tokens are counted before admission (see gateway/counting.py).

    A prompt is estimated from its characters; when the estimate puts it within
    ``NEAR_LIMIT_MARGIN`` (gateway/counting.py) of a limit (the smallest ``max_model_len``
    serving its model, or the largest KV pool), kvgate asks a ready replica's own
    tokenize endpoint for the exact count, once. Media parts cannot be counted from
    characters: each is reserved at a fixed allowance and such a prompt is never refused
    on kvgate's count.
    """

    # Ask a replica's tokenize endpoint (vLLM, SGLang, llama.cpp) near a limit.
    replica_tokenize: bool = True
    # Exact counts remembered per (model, digest of the prompt or of one long message);
    # 0 disables the cache.
    cache_entries: Annotated[int, Field(ge=0)] = 4096
    # Tokens reserved per image part (also for video, file and unknown non-text parts).
    # 1,000 covers the fixed-size vision encoders (LLaVA-1.5 576, Gemma 3 256, a 1024x1024
    # high-detail image at OpenAI's tiling 765) and is below dynamic-resolution ones at
    # large images (Qwen2-VL ~1,300 at one megapixel): raise it for such models.
    image_part_tokens: Annotated[int, Field(ge=0)] = 1000
    # Tokens reserved per audio part: a 30 s clip (Whisper's window) at Qwen2-Audio's
    # 25 tokens a second.
    audio_part_tokens: Annotated[int, Field(ge=0)] = 750


class LimitsConfig(_Strict):
    """What one client may send and how slowly (enforced before anything is parsed)."""

    # A larger body is answered 413 (by Content-Length before reading, else while reading).
    max_body_bytes: Annotated[int, Field(gt=0)] = 4 * 1024 * 1024
    # One request line or header line longer than this, or more header lines than
    # `max_headers`, is answered 431 by the HTTP parser.
    max_header_bytes: Annotated[int, Field(ge=1024)] = 8190
    max_headers: Annotated[int, Field(ge=8)] = 128
    # A connection that has not sent a complete request head within this long of opening
    # (or of its last answer: the keep-alive idle time) is closed: slowloris.
    header_timeout_s: PositiveFloat = 60.0
    # The whole body must arrive within this long once the head has: else 408.
    body_timeout_s: PositiveFloat = 60.0
    # A client that takes no bytes of its answer for this long (its socket buffers full)
    # is cut as gone: the upstream request is aborted and its reservation freed.
    client_write_timeout_s: PositiveFloat = 60.0
    # Each client connection's kernel send buffer (SO_SNDBUF; Linux doubles it), so a
    # client that stops reading holds ~200 KB, not the 4 MiB autotuning allows. None:
    # the kernel's autotuning.
    client_send_buffer_bytes: Annotated[int, Field(ge=4096)] | None = 65536


class AuthConfig(_Strict):
    # API key -> tenant. Empty: no authentication, every request is tenant "default".
    # Deprecated: plain keys (hashed at start, never logged); use tenants[].keys_sha256.
    api_keys: dict[str, str] = Field(default_factory=dict, repr=False)
    admin_token: str | None = None


class DiscoveryConfig(_Strict):
    refresh_interval_s: PositiveFloat = 2.0
    probe_timeout_s: PositiveFloat = 2.0
    # Hysteresis: a ready replica becomes unready after this many failed (or timed out)
    # probe rounds in a row, and returns after `success_threshold` good rounds in a row.
    fail_threshold: Annotated[int, Field(ge=1)] = 3
    success_threshold: Annotated[int, Field(ge=1)] = 2


class OutlierConfig(_Strict):
    """Passive outlier ejection from the request path (admission/health.py)."""

    enabled: bool = True
    # Upstream failures in a row (5xx, refused connection, timeout before the first byte).
    consecutive_failures: Annotated[int, Field(ge=1)] = 5
    base_ejection_s: PositiveFloat = 30.0  # doubled on each repeat ejection...
    max_ejection_s: PositiveFloat = 300.0  # ...up to this
    # Eject only while at most this share of the replicas is ejected (one of one: never).
    max_ejection_percent: Annotated[float, Field(ge=0.0, le=100.0)] = 50.0


class ShutdownConfig(_Strict):
    # SIGTERM: /ready turns false, queued requests are shed (503), running ones get this
    # long to finish before they are cut (streams end with an error event).
    drain_grace_s: Annotated[float, Field(ge=0.0)] = 25.0
    # The listener stays open this long after SIGTERM (new requests get 503 with
    # Retry-After while load balancers notice /ready), then refuses new connections.
    listen_grace_s: Annotated[float, Field(ge=0.0)] = 2.0


class LoggingConfig(_Strict):
    level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = True


class SentinelConfig(_Strict):
    """A Redis whose primary Redis Sentinel watches: kvgate asks the sentinels where the
    primary ``master`` is, and again after a failover, so the gateways follow a promoted
    replica on their own."""

    # host:port of each sentinel; one answering is enough.
    addresses: Annotated[list[Annotated[str, Field(pattern=r"^[^:\s]+:\d+$")]], Field(min_length=1)]
    master: Annotated[str, Field(min_length=1)]  # the name the sentinels monitor it by
    db: Annotated[int, Field(ge=0)] = 0
    # The sentinels' own password, if they have one (set from KVGATE_REDIS_SENTINEL_PASSWORD);
    # the primary's is ``redis_password``.
    password: str | None = Field(default=None, repr=False)


class StateConfig(_Strict):
    """Where several gateway processes keep what they share (gateway/state): the
    per-replica pool and running-limit leases and the learned limits.

    ``memory`` (the default) shares nothing: one process owns every replica. ``redis``
    lets any number of processes and hosts on the same Redis and ``key_prefix`` act as
    one gateway. A lease lives ``lease_ttl_s`` without renewal (a dead process's share
    returns within it) and is renewed every ``renew_interval_s``. When Redis cannot be
    reached, ``fail-open`` keeps admitting from this process's slices, each cut to at most
    1/N of the replica (N: the processes last seen), and ``fail-closed`` answers 503 with
    Retry-After until Redis is back.
    """

    backend: Literal["memory", "redis"] = "memory"
    redis_url: Annotated[str, Field(pattern=r"^(redis|rediss|unix)://")] | None = None
    # A Redis Cluster: ``redis_url`` names one of its nodes (a prefix's keys share a slot).
    redis_cluster: bool = False
    # Or a primary that Redis Sentinel fails over, instead of ``redis_url``.
    redis_sentinel: SentinelConfig | None = None
    # Set from KVGATE_REDIS_PASSWORD; a password in the URL works too but lands in files.
    redis_password: str | None = Field(default=None, repr=False)
    key_prefix: Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")] = "kvgate"
    on_unreachable: Literal["fail-open", "fail-closed"] = "fail-open"
    lease_ttl_s: PositiveFloat = 3.0
    renew_interval_s: PositiveFloat = 0.5
    # Bound of one Redis round trip (connect, or a renewal).
    timeout_s: PositiveFloat = 0.5

    @model_validator(mode="after")
    def _coherent(self) -> StateConfig:
        if self.backend == "redis" and not (self.redis_url or self.redis_sentinel):
            raise ValueError(
                "redis_url: required with backend redis (or KVGATE_REDIS_URL), "
                "unless redis_sentinel names the sentinels"
            )
        if self.redis_url and self.redis_sentinel:
            raise ValueError("redis_sentinel: give it or redis_url, not both")
        if self.redis_cluster and not self.redis_url:
            raise ValueError("redis_cluster: needs redis_url, one node of the cluster")
        if self.renew_interval_s * 2 > self.lease_ttl_s:
            raise ValueError(
                f"renew_interval_s: {self.renew_interval_s} must be at most half of "
                f"lease_ttl_s ({self.lease_ttl_s}), or a live process's lease may lapse"
            )
        return self


class GatewayConfig(_Strict):
    listen: ListenConfig = Field(default_factory=ListenConfig)
    replicas: list[ReplicaConfig] = Field(default_factory=list)
    # Replicas found by DNS (a Kubernetes headless Service): gateway/fleet/dns.py.
    replica_groups: list[ReplicaGroupConfig] = Field(default_factory=list)
    dns: DnsConfig = Field(default_factory=DnsConfig)
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    counting: CountingConfig = Field(default_factory=CountingConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    outlier: OutlierConfig = Field(default_factory=OutlierConfig)
    shutdown: ShutdownConfig = Field(default_factory=ShutdownConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    state: StateConfig = Field(default_factory=StateConfig)
    # Model name -> local Hugging Face tokenizer.json: exact prompt counts for that model
    # instead of the learned chars-per-token estimate (see gateway/tokenizers.py).
    tokenizers: dict[str, FilePath] = Field(default_factory=dict)
    # Tenants: hashed API keys, limits, priority range, weight, models, SLO targets
    # (admission/tenants.py). Empty: one tenant "default" without limits.
    tenants: list[TenantConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_replica_names(self) -> GatewayConfig:
        # The names served are unique: a data-parallel entry's ranks' names included.
        seen: set[str] = set()
        for r in expand_data_parallel(self.replicas):
            if r.name in seen:
                raise ValueError(f"replicas: duplicate replica name {r.name!r}")
            seen.add(r.name)
        for g in self.replica_groups:
            if g.name in seen:
                raise ValueError(f"replica_groups: duplicate name {g.name!r}")
            seen.add(g.name)
        return self

    @model_validator(mode="after")
    def _tenants_consistent(self) -> GatewayConfig:
        names: set[str] = set()
        owner: dict[str, str] = {}
        for i, t in enumerate(self.tenants):
            if t.name in names:
                raise ValueError(f"tenants.{i}.name: duplicate tenant name {t.name!r}")
            names.add(t.name)
            for d in t.keys_sha256:
                if d in owner and owner[d] != t.name:
                    raise ValueError(
                        f"tenants.{i}.keys_sha256: a key of {t.name!r} is also {owner[d]!r}'s"
                    )
                owner[d] = t.name
        return self


def routing_with_slo_filter(config: GatewayConfig) -> RoutingConfig:
    """The routing a gateway serves `config` with: its ``routing`` section, and, when a
    tenant has an ITL target, the slo_itl filter (routing/filters/slo_itl.py) at the end
    of every profile that lacks it. The filter keeps every replica for requests without
    a target, so only the tenants with one see it."""
    routing = config.routing
    if not any(t.slo.itl_s is not None for t in config.tenants):
        return routing
    return routing.model_copy(
        update={
            "default_profile": _with_slo_filter(routing.default_profile),
            "profiles": {m: _with_slo_filter(p) for m, p in routing.profiles.items()},
            "workloads": {w: _with_slo_filter(p) for w, p in routing.workloads.items()},
        }
    )


def _with_slo_filter(profile: ProfileConfig) -> ProfileConfig:
    if any(f.name == "slo_itl" for f in profile.filters):
        return profile
    return profile.model_copy(update={"filters": [*profile.filters, FilterRef(name="slo_itl")]})


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(root)"
        msg = e["msg"].removeprefix("Value error, ")
        removed = _removed(e["loc"]) if e["type"] == "extra_forbidden" else None
        if removed is not None:
            loc = ".".join(str(p) for p in e["loc"][:-1]) or "(root)"
            msg = f"{e['loc'][-1]} was removed: {removed}; delete the setting"
        elif e["type"] == "extra_forbidden" and e["loc"]:
            msg = "unknown field"
            near = difflib.get_close_matches(
                str(e["loc"][-1]), _fields_at(e["loc"][:-1]), n=1, cutoff=0.6
            )
            if near:
                msg += f" (did you mean {near[0]!r}?)"
        lines.append(f"{loc}: {msg}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def _removed(loc: tuple[Any, ...]) -> str | None:
    """Why the setting at `loc` (a validation error's path) was removed, or None."""
    return REMOVED_SETTINGS.get(".".join(str(p) for p in loc if not isinstance(p, int)))


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the model at `loc` (a validation error's path), for a
    misspelt field's "did you mean"; [] where the path leaves the models."""
    model: type[BaseModel] = GatewayConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        if field is None:
            return []
        inner = _model_in(field.annotation)
        if inner is None:
            return []
        model = inner
    return list(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (itself, in a list, an Optional...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _parse_api_keys(value: str) -> dict[str, str]:
    keys: dict[str, str] = {}
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        key, _, tenant = item.partition(":")
        keys[key.strip()] = tenant.strip() or "default"
    return keys


def _apply_env(data: dict[str, Any], env: Mapping[str, str]) -> None:
    if listen := env.get("KVGATE_LISTEN"):
        host, sep, port = listen.rpartition(":")
        if not sep:
            raise ConfigError(f"KVGATE_LISTEN: expected host:port, got {listen!r}")
        try:
            port_num = int(port)
        except ValueError:
            raise ConfigError(f"KVGATE_LISTEN: port is not a number in {listen!r}") from None
        section = dict(data.get("listen") or {})
        if host:
            section["host"] = host.strip("[]")
        section["port"] = port_num
        data["listen"] = section
    auth = dict(data.get("auth") or {})
    if (token := env.get("KVGATE_ADMIN_TOKEN")) is not None:
        auth["admin_token"] = token or None
    if (keys := env.get("KVGATE_API_KEYS")) is not None:
        auth["api_keys"] = _parse_api_keys(keys)
    if auth:
        data["auth"] = auth
    state = dict(data.get("state") or {})
    if backend := env.get("KVGATE_STATE_BACKEND"):
        state["backend"] = backend.lower()
    if url := env.get("KVGATE_REDIS_URL"):
        state["redis_url"] = url
    if password := env.get("KVGATE_REDIS_PASSWORD"):
        state["redis_password"] = password
    if (password := env.get("KVGATE_REDIS_SENTINEL_PASSWORD")) and state.get("redis_sentinel"):
        state["redis_sentinel"] = {**state["redis_sentinel"], "password": password}
    if state:
        data["state"] = state
    if level := env.get("KVGATE_LOG_LEVEL"):
        data["logging"] = {**(data.get("logging") or {}), "level": level.lower()}


def config_from_mapping(
    data: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
) -> GatewayConfig:
    """Validate `data` (the parsed YAML) after applying environment overrides."""
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError("invalid configuration: the top level must be a mapping")
    merged: dict[str, Any] = dict(data or {})
    _apply_env(merged, os.environ if env is None else env)
    try:
        return GatewayConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


def _yaml_error(path: str | Path, e: yaml.YAMLError) -> str:
    """A YAML error as ``file:line:column: problem`` (PyYAML names ``<unicode string>``)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    context = getattr(e, "context", None)
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def load_config(path: str | Path | None, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """Read, validate and override a YAML config file. Raises ConfigError."""
    data: Any = None
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror or e}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(_yaml_error(path, e)) from None
    try:
        return config_from_mapping(data, env)
    except ConfigError as e:
        if path is None:
            raise
        raise ConfigError(f"{path}: {e}") from None
