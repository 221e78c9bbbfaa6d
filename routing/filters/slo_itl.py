"""The ``slo_itl`` filter: keep replicas predicted to hold the tenant's ITL target.

A tenant's inter-token latency target (``tenants[].slo.itl_s``) reaches routing as
`RouteRequest.itl_target_s`; admission fills each candidate's `predicted_itl_s`, the
replica's expected inter-token gap with this request added (admission/learned/itl.py: a fit of
the gap against the running count). The filter keeps a candidate whose prediction is
within the target, or unknown (no evidence yet: the first streams teach the model). A
request without a target passes untouched. When no candidate is kept, routing rejects
them all and admission leaves the request queued, blocking nobody, until a replica
meets the target or its deadline passes: it waits rather than break the target.

The gateway adds this filter to every routing profile when some tenant has an ITL
target (gateway/config.py), so it need not be named in YAML; naming it is harmless.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routing.plugin import Filter, PluginEnv, params_of
from routing.types import Candidate, RouteRequest


class SloItlFilter(Filter):
    """Keeps candidates whose predicted ITL is unknown or within the request's target."""

    name = "slo_itl"

    def __init__(self, slack: float = 1.0) -> None:
        self.slack = slack

    def filter(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Sequence[Candidate]:
        target = req.itl_target_s
        if target is None:
            return candidates
        bound = target * self.slack
        return [c for c in candidates if c.predicted_itl_s is None or c.predicted_itl_s <= bound]


def factory(params: Mapping[str, Any], env: PluginEnv) -> SloItlFilter:
    params_of(params, {"slack": (int, float)})
    slack = float(params.get("slack", 1.0))
    if slack <= 0:
        raise ValueError("param 'slack' must be positive (1.0: the target itself)")
    return SloItlFilter(slack)
