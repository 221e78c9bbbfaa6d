"""OpenAI's rate-limit headers and durations, from a tenant's limits (`admission.tenants`).

The headers carry true values: ``x-ratelimit-limit-*`` the tenant's configured limit,
``-remaining-*`` what this moment leaves of it, ``-reset-*`` when it is whole again, for
requests (rpm) and tokens (tpm); a tenant with no limit of a kind sends no headers of
that kind. With several gateway processes sharing a tenant's budget (the Redis state
backend) they describe the whole budget, not this process's leased share: the others'
spending is the one the shared state reported at the last lease renewal (`Gcra.fleet_used`).
"""

from __future__ import annotations

import math

from admission.tenants import TenantLimiter


def rate_limit_headers(limiter: TenantLimiter, tenant: str, now: float) -> dict[str, str]:
    """OpenAI's rate-limit headers for `tenant`, with this moment's true values."""
    st = limiter.tenants.get(tenant)
    out: dict[str, str] = {}
    if st is None:
        return out
    for kind, g in (("requests", st.rpm), ("tokens", st.tpm)):
        if g is None:
            continue
        out[f"x-ratelimit-limit-{kind}"] = str(g.total)
        out[f"x-ratelimit-remaining-{kind}"] = str(g.fleet_remaining(now))
        out[f"x-ratelimit-reset-{kind}"] = go_duration(g.fleet_reset(now))
    return out


def go_duration(seconds: float) -> str:
    """A duration as Go prints it, the format of OpenAI's reset headers: ``0s``,
    ``250ms``, ``1s``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if seconds <= 0:
        return "0s"
    if seconds < 1.0:
        ms = math.ceil(seconds * 1000)
        return "1s" if ms >= 1000 else f"{ms}ms"
    ms_total = math.ceil(seconds * 1000)
    h, rest = divmod(ms_total, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s = rest / 1000
    s_text = f"{s:.3f}".rstrip("0").rstrip(".")
    if h:
        return f"{h}h{m}m{s_text}s"
    if m:
        return f"{m}m{s_text}s"
    return f"{s_text}s"
