"""Routing plugins by name: filters, scorers and pickers, as named in the YAML profiles.

A plugin is built by a factory ``factory(params, env)`` from its ``params`` mapping (the
YAML ``params:`` of its entry) and the shared `PluginEnv`; a factory raises ValueError
or TypeError on bad params, which config validation reports against the field.

Shapes (duck-typed, like the Kubernetes inference gateway's scheduling plugins):

- filter: ``filter(req, candidates) -> list[Candidate]`` (keeps a subset);
- scorer: ``score(req, candidate) -> float`` in [0, 1] (higher is better; clamped);
- picker: ``choose(req, scored) -> Candidate`` from ``[(score, candidate), ...]``, non-empty.

Any plugin may also define the hooks ``placed(req, candidate, now)`` (admission reserved
`candidate` for `req`) and ``released(request_id, replica, now)`` (that reservation was
freed), and ``needs_prefix = True`` when it reads ``RouteRequest.prefix_hashes`` (the
gateway then computes them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("filter", "scorer", "picker")


@dataclass(slots=True, frozen=True)
class PluginEnv:
    """What every plugin factory may read besides its own params."""

    seed: int | None = None
    block_chars: int = 64  # characters per prefix block (routing.prefix)


Factory = Callable[[Mapping[str, Any], PluginEnv], Any]

_REGISTRY: dict[str, dict[str, Factory]] = {kind: {} for kind in KINDS}
_loaded = False


def register(kind: str, name: str) -> Callable[[Factory], Factory]:
    """Decorator: register `factory` as the `kind` plugin called `name`."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown plugin kind {kind!r}; expected one of {KINDS}")

    def deco(factory: Factory) -> Factory:
        _REGISTRY[kind][name] = factory
        return factory

    return deco


def _builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        import routing.plugins  # noqa: F401  (registers the built-in plugins)
        import routing.prefix  # noqa: F401
        import routing.slo  # noqa: F401


def names(kind: str) -> list[str]:
    _builtins()
    return sorted(_REGISTRY[kind])


def build(kind: str, name: str, params: Mapping[str, Any], env: PluginEnv) -> Any:
    """A new `kind` plugin `name` built from `params`; KeyError naming the known ones."""
    _builtins()
    try:
        factory = _REGISTRY[kind][name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY[kind]))
        raise KeyError(f"unknown {kind} {name!r}; known: {known}") from None
    return factory(params, env)


def params_of(params: Mapping[str, Any], allowed: Mapping[str, type | tuple[type, ...]]) -> None:
    """Reject params a plugin does not know, or of the wrong type (ValueError)."""
    for key, value in params.items():
        if key not in allowed:
            raise ValueError(f"unknown param {key!r}; known: {', '.join(sorted(allowed))}")
        kind = allowed[key]
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise ValueError(f"param {key!r} has the wrong type ({type(value).__name__})")
