"""The routing plugin interfaces: what a filter, a scorer and a picker are, the hooks any
of them may take, and the factory that builds one from its YAML ``params``.

This file imports no plugin: plugins import it (and `routing.types`), the wiring list
(`routing.wiring`) imports the plugins, and the registry reads the wiring list, so the
arrows point one way. How to add a plugin: docs/writing-a-plugin.md.

Kinds (the shapes of the Kubernetes inference gateway's scheduling plugins):

- `Filter`: ``filter(req, candidates)`` keeps a subset (empty: none can take it);
- `Scorer`: ``score(req, candidate)`` in [0, 1], higher is better (the profile clamps);
- `Picker`: ``choose(req, scored)`` returns one candidate of ``[(score, candidate), ...]``,
  never empty.

Hooks, each a protocol of its own: a plugin takes a hook by defining its method (built-in
plugins also name the protocol among their bases, so a type checker holds the
signature). `routing.scheduler.Profile` sorts its plugins into hooks once, when it is
built, never per request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from routing.types import Candidate, RouteRequest

KINDS = ("filter", "scorer", "picker")


@runtime_checkable
class Filter(Protocol):
    def filter(self, req: RouteRequest, candidates: Sequence[Candidate]) -> Sequence[Candidate]: ...


@runtime_checkable
class Scorer(Protocol):
    def score(self, req: RouteRequest, candidate: Candidate) -> float: ...


@runtime_checkable
class Picker(Protocol):
    def choose(self, req: RouteRequest, scored: Sequence[tuple[float, Candidate]]) -> Candidate: ...


@runtime_checkable
class BatchScorer(Protocol):
    """A scorer that also scores a decision's candidates in one call, the same numbers
    as `score` gives each: what depends on the request alone is computed once."""

    def scores(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[float]: ...


KIND_PROTOCOLS: dict[str, type] = {"filter": Filter, "scorer": Scorer, "picker": Picker}


@runtime_checkable
class PlacementHook(Protocol):
    """Admission reserved `candidate` for `req` (a prefix index, a session table learn)."""

    def placed(self, req: RouteRequest, candidate: Candidate, now: float) -> None: ...


@runtime_checkable
class ReleaseHook(Protocol):
    """The reservation of a request this plugin saw placed was freed."""

    def released(self, request_id: str, replica: str, now: float) -> None: ...


@runtime_checkable
class FirstTokenHook(Protocol):
    """The first token of a request this plugin saw placed left its replica: the
    prompt's prefill there is done (the relay sees it; for a non-stream request the
    release comes first and stands for it)."""

    def first_token(self, request_id: str, now: float) -> None: ...


@runtime_checkable
class PromptCachedHook(Protocol):
    """The engine said how many prompt tokens of a request this plugin saw placed it
    held cached (``usage.prompt_tokens_details.cached_tokens``), with that request's
    characters per engine token; before its release."""

    def prompt_cached(
        self, request_id: str, cached_tokens: int, chars_per_token: float, now: float
    ) -> None: ...


@runtime_checkable
class HintHook(Protocol):
    """Replicas to score for `req` whatever their headroom (admission adds them to its
    shortlist of the roomiest): a warm prefix, the session's replica, a speculating one."""

    def hints(self, req: RouteRequest) -> list[str]: ...


@runtime_checkable
class ExplainHook(Protocol):
    """The reason for `chosen` (kvgate_routing_decisions_total), or None for "score"."""

    def explain(self, req: RouteRequest, chosen: Candidate) -> str | None: ...


@runtime_checkable
class WarmHook(Protocol):
    """Replicas expected to hold part of the prompt cached, with those tokens, warmest
    first (admission weighs waiting for one against a cold start by expected TTFT)."""

    def warm(self, req: RouteRequest) -> list[tuple[str, int]]: ...


@runtime_checkable
class PrefixReader(Protocol):
    """A plugin that reads `RouteRequest.prefix_hashes` says so with ``needs_prefix =
    True``: the gateway hashes the prompt only when some profile has one."""

    needs_prefix: bool


def reads_prefix(plugin: object) -> bool:
    return isinstance(plugin, PrefixReader) and bool(plugin.needs_prefix)


# Characters per prefix block (routing.prefix): the default of ``routing.block_chars``,
# and what a plugin built without a config (a test, a bench) takes its prompts' blocks as.
BLOCK_CHARS = 64


@dataclass(slots=True, frozen=True)
class PluginEnv:
    """What every plugin factory may read besides its own params."""

    seed: int | None = None
    block_chars: int = BLOCK_CHARS  # characters per prefix block (routing.prefix)
    # The engines' own caches, from their KV events: a routing.kvindex.KVIndex (typed
    # Any so this file imports only routing.types); None: no engine publishes them.
    kv_index: Any = None


# ``factory(params, env)`` builds a plugin from its YAML ``params:``; ValueError or
# TypeError on a bad param, which config validation reports against the field.
Factory = Callable[[Mapping[str, Any], PluginEnv], Any]


def params_of(params: Mapping[str, Any], allowed: Mapping[str, type | tuple[type, ...]]) -> None:
    """Reject params a plugin does not know, or of the wrong type (ValueError)."""
    for key, value in params.items():
        if key not in allowed:
            raise ValueError(f"unknown param {key!r}; known: {', '.join(sorted(allowed))}")
        kind = allowed[key]
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise ValueError(f"param {key!r} has the wrong type ({type(value).__name__})")


def no_params(cls: Callable[[], Any]) -> Factory:
    """The factory of a plugin that takes no params."""

    def factory(params: Mapping[str, Any], env: PluginEnv) -> Any:
        params_of(params, {})
        return cls()

    return factory
