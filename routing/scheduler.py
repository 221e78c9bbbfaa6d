"""The routing pipeline: per-model profiles of filter -> score -> pick, built from config.

A `Profile` runs its filters in order over the candidates admission found able to take
the request now, scores the survivors as the weighted sum of its scorers (each clamped
to [0, 1]), multiplies the score of a replica whose engine view is older than
``stale_after_s`` by ``stale_factor`` (a stale view lowers a score; it never makes a
replica look free: room is the ledger's call), and lets its picker choose. Filters that
leave nothing return None: admission keeps the request queued without holding anything up.

`SchedulingRouter` picks the profile of the request's model, else of its workload class
(routing.config: the built-in class profiles when the config names no default), else the
default, and forwards admission's ``placed`` / ``released`` (and ``hints``, ``warm``,
``first_token``, ``prompt_cached``) to the plugins that take those hooks (routing.plugin). It counts its
decisions by reason and by (workload, scoring), and keeps each placed request's route
until it is released, so the gateway's access line can say how it was placed.
"""

from __future__ import annotations

from collections.abc import Sequence

from routing.config import ProfileConfig, RoutingConfig
from routing.plugin import (
    BatchScorer,
    ExplainHook,
    Filter,
    FirstTokenHook,
    HintHook,
    Picker,
    PlacementHook,
    PluginEnv,
    PromptCachedHook,
    ReleaseHook,
    Scorer,
    WarmHook,
    reads_prefix,
)
from routing.registry import build
from routing.types import Candidate, Router, RouteRequest

# A replica's engine view older than this many discovery intervals is stale: two probe
# rounds in a row brought nothing new, more than one slow probe explains.
STALE_AFTER_INTERVALS = 3.0
# A stale replica's score is multiplied by this: a view that stopped moving makes the
# replica less preferred, never excluded (whether it fits is the ledger's call).
STALE_SCORE_FACTOR = 0.5


class Profile(Router):
    """One filter -> score -> pick pipeline (module docstring), and its plugins' hooks."""

    def __init__(
        self,
        name: str,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
        *,
        stale_after_s: float = float("inf"),
        stale_factor: float = STALE_SCORE_FACTOR,
        scoring: str | None = None,
    ) -> None:
        self.name = name
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.picker = picker
        self.stale_after_s = stale_after_s
        self.stale_factor = stale_factor
        # What scores this profile's requests, for the decision counter and the log.
        self.scoring = (
            scoring
            or "+".join(str(getattr(s, "name", type(s).__name__)) for s, _ in self.scorers)
            or "none"
        )
        # Each hook's bound methods, sorted out once here: a request pays only for the
        # hooks its profile's plugins take.
        plugins: list[object] = [*self.filters, *(s for s, _ in self.scorers), picker]
        self.placed_hooks = tuple(p.placed for p in plugins if isinstance(p, PlacementHook))
        self.released_hooks = tuple(p.released for p in plugins if isinstance(p, ReleaseHook))
        self.hint_hooks = tuple(p.hints for p in plugins if isinstance(p, HintHook))
        self.explain_hooks = tuple(p.explain for p in plugins if isinstance(p, ExplainHook))
        self.warm_hooks = tuple(p.warm for p in plugins if isinstance(p, WarmHook))
        self.first_token_hooks = tuple(
            p.first_token for p in plugins if isinstance(p, FirstTokenHook)
        )
        self.prompt_cached_hooks = tuple(
            p.prompt_cached for p in plugins if isinstance(p, PromptCachedHook)
        )
        self.needs_prefix = any(reads_prefix(p) for p in plugins)
        # Every scorer as one call over the candidates, where every one has `scores`
        # (a mix pays more for the calls than it saves: per candidate then).
        batch = tuple((s.scores, w) for s, w in self.scorers if isinstance(s, BatchScorer))
        self._batch = batch if batch and len(batch) == len(self.scorers) else None

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        total = 0.0
        for scorer, weight in self.scorers:
            s = scorer.score(req, candidate)
            total += weight * (0.0 if s < 0.0 else 1.0 if s > 1.0 else s)
        if candidate.view_age_s > self.stale_after_s:
            total *= self.stale_factor
        return total

    def pick(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        kept: Sequence[Candidate] = candidates
        for f in self.filters:
            kept = f.filter(req, kept)
            if not kept:
                return None
        if not kept:
            return None
        if len(kept) == 1 and not self.scorers:
            return kept[0]
        if self._batch is None:
            return self.picker.choose(req, [(self.score(req, c), c) for c in kept])
        # `score` for every candidate, a scorer at a time (the same sums, in its order;
        # the first scorer's start from its own terms, as 0.0 + x is x).
        totals: list[float] | None = None
        for scores, weight in self._batch:
            got = scores(req, kept)
            if totals is None:
                totals = [weight * (0.0 if s < 0.0 else 1.0 if s > 1.0 else s) for s in got]
            else:
                totals = [
                    t + weight * (0.0 if s < 0.0 else 1.0 if s > 1.0 else s)
                    for t, s in zip(totals, got, strict=True)
                ]
        if totals is None or len(totals) != len(kept):
            raise ValueError(f"a scorer of profile {self.name!r} did not score every candidate")
        stale = self.stale_after_s
        for cand in kept:  # a loop, not any(...): on every decision
            if cand.view_age_s > stale:
                totals = [
                    t * self.stale_factor if c.view_age_s > stale else t
                    for t, c in zip(totals, kept, strict=True)
                ]
                break
        return self.picker.choose(req, list(zip(totals, kept, strict=True)))


class SchedulingRouter(Router):
    """Profiles by model, by workload class and a default, and the plugins' hooks."""

    def __init__(
        self,
        default: Profile,
        per_model: dict[str, Profile] | None = None,
        per_workload: dict[str, Profile] | None = None,
    ) -> None:
        self.default = default
        self.per_model = dict(per_model or {})
        self.per_workload = dict(per_workload or {})
        self._owner: dict[str, Profile] = {}  # request id -> profile with release hooks
        # Decisions by reason (kvgate_routing_decisions_total): the first plugin whose
        # ``explain(req, chosen)`` names one, else "score"; "rejected" when none passed.
        self.decisions: dict[str, int] = {}
        # Decisions by (workload, the profile's scoring): kvgate_route_decisions_total.
        self.route_decisions: dict[tuple[str, str], int] = {}
        # The last pick's (request id, route), and each placed request's route until its
        # release: "<workload>/<scoring>/<reason>" for the access line.
        self._last: tuple[str, str] = ("", "")
        self._routes: dict[str, str] = {}
        self.needs_prefix = any(p.needs_prefix for p in self.profiles())

    def profile_for(self, model: str, workload: str = "chat") -> Profile:
        got = self.per_model.get(model)
        if got is None:
            got = self.per_workload.get(workload, self.default)
        return got

    def profiles(self) -> list[Profile]:
        return [self.default, *self.per_model.values(), *self.per_workload.values()]

    def pick(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Candidate | None:
        profile = self.profile_for(req.model, req.workload)
        chosen = profile.pick(req, candidates)
        reason = "rejected" if chosen is None else "score"
        if chosen is not None:
            for explain in profile.explain_hooks:
                why = explain(req, chosen)
                if why:
                    reason = why
                    break
        self.decisions[reason] = self.decisions.get(reason, 0) + 1
        key = (req.workload, profile.scoring)
        self.route_decisions[key] = self.route_decisions.get(key, 0) + 1
        self._last = (req.request_id, f"{req.workload}/{profile.scoring}/{reason}")
        return chosen

    def decision_counts(self) -> dict[str, int]:
        return self.decisions

    def route_decision_counts(self) -> dict[tuple[str, str], int]:
        return self.route_decisions

    def route_of(self, request_id: str) -> str | None:
        """How a placed request was routed ("<workload>/<scoring>/<reason>"), until it
        is released."""
        return self._routes.get(request_id)

    def hints(self, req: RouteRequest) -> list[str]:
        """Replicas the plugins want scored for `req` whatever their headroom (warm
        prefix, session, speculating): admission adds them to its shortlist."""
        hooks = self.profile_for(req.model, req.workload).hint_hooks
        if not hooks:
            return []
        if len(hooks) == 1:
            return hooks[0](req)
        out: list[str] = []
        for hook in hooks:
            out.extend(hook(req))
        return out

    def warm(self, req: RouteRequest) -> list[tuple[str, int]]:
        """Replicas expected to hold part of the prompt cached, with those tokens, warmest
        first (admission's expected-TTFT choice reads it; empty without a prefix
        plugin)."""
        for hook in self.profile_for(req.model, req.workload).warm_hooks:
            return hook(req)
        return []

    def placed(self, req: RouteRequest, candidate: Candidate, now: float) -> None:
        profile = self.profile_for(req.model, req.workload)
        for hook in profile.placed_hooks:
            hook(req, candidate, now)
        if profile.released_hooks or profile.first_token_hooks or profile.prompt_cached_hooks:
            self._owner[req.request_id] = profile
        rid, route = self._last
        if rid == req.request_id:
            self._routes[rid] = route

    def first_token(self, request_id: str, now: float) -> None:
        """A placed request's first token left its replica: its prefill is done."""
        profile = self._owner.get(request_id)
        if profile is not None:
            for hook in profile.first_token_hooks:
                hook(request_id, now)

    def prompt_cached(
        self, request_id: str, cached_tokens: int, chars_per_token: float, now: float
    ) -> None:
        """The engine held `cached_tokens` of a placed request's prompt (its answer's
        usage): the prefix plugins correct their expectations (routing.prefixfeedback)."""
        profile = self._owner.get(request_id)
        if profile is not None:
            for hook in profile.prompt_cached_hooks:
                hook(request_id, cached_tokens, chars_per_token, now)

    def released(self, request_id: str, replica: str, now: float) -> None:
        self._routes.pop(request_id, None)
        profile = self._owner.pop(request_id, None)
        if profile is not None:
            for hook in profile.released_hooks:
                hook(request_id, replica, now)


def build_profile(
    name: str,
    cfg: ProfileConfig,
    env: PluginEnv,
    *,
    stale_after_s: float = float("inf"),
    stale_factor: float = STALE_SCORE_FACTOR,
) -> Profile:
    return Profile(
        name,
        [build("filter", f.name, f.params, env) for f in cfg.filters],
        [(build("scorer", s.name, s.params, env), s.weight) for s in cfg.scorers],
        build("picker", cfg.picker.name, cfg.picker.params, env),
        stale_after_s=stale_after_s,
        stale_factor=stale_factor,
    )


def build_router(
    cfg: RoutingConfig | None = None,
    *,
    discovery_interval_s: float = 2.0,
    seed: int | None = None,
    env: PluginEnv | None = None,
) -> SchedulingRouter:
    """The router a config describes (None: no ``routing:`` section, so each workload
    class gets its built-in profile, routing.config.workload_profiles). `env` overrides
    the plugins' environment (the engines' own caches, routing.kvindex)."""
    cfg = cfg if cfg is not None else RoutingConfig()
    if env is None:
        env = PluginEnv(seed=seed, block_chars=cfg.block_chars)
    stale = STALE_AFTER_INTERVALS * discovery_interval_s
    kw = {"stale_after_s": stale, "stale_factor": STALE_SCORE_FACTOR}
    return SchedulingRouter(
        build_profile("default", cfg.default_profile, env, **kw),
        {m: build_profile(m, p, env, **kw) for m, p in cfg.profiles.items()},
        {w: build_profile(w, p, env, **kw) for w, p in cfg.workloads.items()},
    )


def default_profile(seed: int | None = None) -> Profile:
    """The profile of an empty routing config (most free KV fraction, seeded ties) on its
    own: no staleness penalty and no hooks. A test or a bench hands it to admission as
    its router."""
    return build_profile("default", ProfileConfig(), PluginEnv(seed=seed))
