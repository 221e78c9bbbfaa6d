"""What ``kvgate serve`` checks before it serves, shared word for word with ``--check``.

The schema (gateway/config.py) holds what one file can say; these are the rules of
running it: the replicas to serve, what ``--workers`` needs, the tokenizer files. A
problem is a line naming its field; ``serve`` and ``serve --check`` print the same
lines and exit 2. `exposure_warning` is the one warning both print: a gateway reachable
beyond loopback that asks no API key. ``--check --probe`` (`probe_report`) contacts each
replica once and prints what kvgate would learn from it, or why it is not ready.
"""

from __future__ import annotations

import ipaddress

from gateway.config import ConfigError, GatewayConfig, expand_data_parallel


def serve_problems(config: GatewayConfig, workers: int = 1) -> list[str]:
    """Every reason `config` cannot be served with `workers` processes ([]: none)."""
    problems: list[str] = []
    if not config.replicas and not config.replica_groups:
        problems.append("replicas: at least one replica (or a replica_groups entry) is required")
    if workers > 1:
        if config.state.backend != "redis":
            problems.append(
                "state.backend: --workers N > 1 needs the redis backend, so the processes "
                "share each replica's pool (set state.backend: redis and state.redis_url, "
                "or KVGATE_STATE_BACKEND=redis and KVGATE_REDIS_URL)"
            )
        if config.listen.port == 0:
            problems.append("listen.port: --workers N > 1 needs a fixed port, not 0")
    from gateway.tokenizers import load_token_counters

    try:
        load_token_counters(config.tokenizers)
    except ConfigError as e:
        problems.append(str(e))
    return problems


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name or a wildcard ("", 0.0.0.0, ::): assume it is reachable


def auth_required(config: GatewayConfig) -> bool:
    return bool(config.auth.api_keys) or any(t.keys_sha256 for t in config.tenants)


def exposure_warning(config: GatewayConfig, host: str | None = None) -> str | None:
    """The warning of a gateway that listens beyond loopback with no API key."""
    host = config.listen.host if host is None else host
    if is_loopback(host) or auth_required(config):
        return None
    return (
        f"listen.host {host or '(all addresses)'} is not loopback and no API key is "
        "configured: anyone who reaches it can send requests (give tenants keys_sha256, "
        "see `kvgate hash-key --new`)"
    )


async def probe_report(config: GatewayConfig, out: list[str]) -> int:
    """Probe every configured replica once; append one line each to `out`. Returns 0
    when every replica is ready, else 1."""
    import asyncio

    import aiohttp

    from gateway.fleet.discovery import new_state, probe_once
    from routing.adapters import adapter_for

    timeout = config.discovery.probe_timeout_s
    status = 0
    async with aiohttp.ClientSession() as session:
        replicas = expand_data_parallel(config.replicas)
        states = [new_state(rc) for rc in replicas]
        errors = await asyncio.gather(
            *(
                probe_once(
                    rc, adapter_for(rc.engine, kv_layout=rc.kv_layout), st, session, timeout, 0.0
                )
                for rc, st in zip(replicas, states, strict=True)
            )
        )
    for rc, st, error in zip(replicas, states, errors, strict=True):
        if error is not None:
            status = 1
            out.append(f"{rc.name} ({rc.engine}, {rc.url}): NOT READY: {error}")
            continue
        pool = rc.pool_tokens or st.capacity_tokens
        facts = [
            f"models {', '.join(st.models)}",
            f"pool {pool} tokens" + (" (pinned)" if rc.pool_tokens else ""),
            f"block {rc.block_size or st.block_size}",
        ]
        if st.max_model_len:
            facts.append(f"context {st.max_model_len}")
        running = rc.max_running or st.max_running
        facts.append(f"running cap {running}" if running else "running cap: learned")
        if st.shares_prefix:
            facts.append("shares prefixes")
        out.append(f"{rc.name} ({rc.engine}, {rc.url}): ready: " + "; ".join(facts))
    for group in config.replica_groups:
        out.append(f"{group.name}: replicas from DNS {group.describe()} (resolved when serving)")
    return status
