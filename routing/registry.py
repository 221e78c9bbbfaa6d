"""Routing plugins by name: the factories of `routing.wiring`, looked up by kind and name.

A YAML profile names its plugins; `build` makes one from its ``params`` mapping and the
shared `PluginEnv` (routing.plugin), checking that it has the method of its kind. A
factory raises ValueError or TypeError on bad params, which config validation reports
against the field. `register` adds a plugin from outside the package (a test, an
embedding program); the built-in ones are the wiring list's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from routing.plugin import KIND_PROTOCOLS, KINDS, Factory, PluginEnv
from routing.wiring import PLUGINS


def _table() -> dict[str, dict[str, Factory]]:
    table: dict[str, dict[str, Factory]] = {kind: {} for kind in KINDS}
    for kind, name, factory in PLUGINS:
        if kind not in table:
            raise ValueError(f"routing.wiring: {name!r} has unknown kind {kind!r}")
        if name in table[kind]:
            raise ValueError(f"routing.wiring: {kind} {name!r} is listed twice")
        table[kind][name] = factory
    return table


_REGISTRY = _table()


def register(kind: str, name: str) -> Callable[[Factory], Factory]:
    """Decorator: register `factory` as the `kind` plugin called `name` (replacing one of
    that name), for plugins outside the wiring list."""
    if kind not in _REGISTRY:
        raise ValueError(f"unknown plugin kind {kind!r}; expected one of {KINDS}")

    def deco(factory: Factory) -> Factory:
        _REGISTRY[kind][name] = factory
        return factory

    return deco


def names(kind: str) -> list[str]:
    return sorted(_REGISTRY[kind])


def build(kind: str, name: str, params: Mapping[str, Any], env: PluginEnv) -> Any:
    """A new `kind` plugin `name` built from `params`; KeyError naming the known ones,
    TypeError when the factory returns no `kind` (e.g. a scorer without ``score``)."""
    try:
        factory = _REGISTRY[kind][name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY[kind]))
        raise KeyError(f"unknown {kind} {name!r}; known: {known}") from None
    plugin = factory(params, env)
    interface = KIND_PROTOCOLS[kind]
    if not isinstance(plugin, interface):
        raise TypeError(f"{type(plugin).__name__} is no {interface.__name__} (routing.plugin)")
    return plugin
