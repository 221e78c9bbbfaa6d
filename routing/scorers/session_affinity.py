"""The ``session_affinity`` scorer: 1 for the replica that last served the request's
session (``x-session-id`` header, else the body's ``user``) within ``ttl_s``, else 0.

The table holds at most ``max_sessions`` sessions; expired ones are pruned on placement.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from routing.plugin import BatchScorer, HintHook, PlacementHook, PluginEnv, Scorer, params_of
from routing.types import Candidate, RouteRequest


class SessionAffinityScorer(Scorer, BatchScorer, PlacementHook, HintHook):
    """1 for the replica that last served the request's session within `ttl_s`."""

    name = "session_affinity"

    def __init__(self, ttl_s: float, max_sessions: int) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        # session -> (replica, expires at); in order of expiry (ttl is constant).
        self._table: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def hints(self, req: RouteRequest) -> list[str]:
        """The replica that last served the request's session, if any."""
        if req.session is None:
            return []
        got = self.replica_of(req.session, req.now)
        return [got] if got is not None else []

    def replica_of(self, session: str, now: float) -> str | None:
        got = self._table.get(session)
        if got is None or got[1] <= now:
            return None
        return got[0]

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        if req.session is None:
            return 0.0
        got = self._table.get(req.session)
        return 1.0 if got is not None and got[0] == candidate.name and got[1] > req.now else 0.0

    def scores(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[float]:
        """`score` of each candidate: the session's replica looked up once."""
        got = self._table.get(req.session) if req.session is not None else None
        if got is None or got[1] <= req.now:
            return [0.0] * len(candidates)
        name = got[0]
        return [1.0 if c.name == name else 0.0 for c in candidates]

    def placed(self, req: RouteRequest, candidate: Candidate, now: float) -> None:
        if req.session is None:
            return
        table = self._table
        table[req.session] = (candidate.name, now + self.ttl_s)
        table.move_to_end(req.session)
        while table and (len(table) > self.max_sessions or next(iter(table.values()))[1] <= now):
            table.popitem(last=False)


def factory(params: Mapping[str, Any], env: PluginEnv) -> SessionAffinityScorer:
    params_of(params, {"ttl_s": (int, float), "max_sessions": int})
    ttl = float(params.get("ttl_s", 600.0))
    most = int(params.get("max_sessions", 100_000))
    if ttl <= 0 or most <= 0:
        raise ValueError("ttl_s and max_sessions must be positive")
    return SessionAffinityScorer(ttl, most)
