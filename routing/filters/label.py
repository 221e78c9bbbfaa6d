"""The ``label`` filter: keeps replicas whose labels carry every ``key: value`` in params."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from routing.plugin import Filter, PluginEnv
from routing.types import Candidate, RouteRequest


class LabelFilter(Filter):
    """Keeps replicas whose labels carry every ``key: value`` in params."""

    name = "label"

    def __init__(self, wanted: Mapping[str, str]) -> None:
        self.wanted = dict(wanted)

    def filter(self, req: RouteRequest, candidates: Sequence[Candidate]) -> list[Candidate]:
        w = self.wanted.items()
        return [c for c in candidates if all(c.labels.get(k) == v for k, v in w)]


def factory(params: Mapping[str, Any], env: PluginEnv) -> LabelFilter:
    for key, value in params.items():
        if not isinstance(value, str):
            raise ValueError(f"label {key!r} must be a string, not {type(value).__name__}")
    return LabelFilter(params)
