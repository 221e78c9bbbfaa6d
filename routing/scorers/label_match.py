"""The ``label_match`` scorer: the share of the ``key: value`` labels in params that a
replica carries (1: all of them, 0: none).

A preference where the ``label`` filter is a rule: a profile that weights it above its
load scorer sends requests to the labelled replicas (a zone, a GPU type, a canary) while
they fit and spills to the others when the ledger finds them full, where the filter
would keep the request queued.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from routing.plugin import PluginEnv, Scorer
from routing.types import Candidate, RouteRequest


class LabelMatchScorer(Scorer):
    """Matched labels / wanted labels."""

    name = "label_match"

    def __init__(self, wanted: Mapping[str, str]) -> None:
        self.wanted = tuple(wanted.items())

    def score(self, req: RouteRequest, candidate: Candidate) -> float:
        matched = sum(candidate.labels.get(k) == v for k, v in self.wanted)
        return matched / len(self.wanted)


def factory(params: Mapping[str, Any], env: PluginEnv) -> LabelMatchScorer:
    if not params:
        raise ValueError("name at least one label (key: value) to prefer")
    for key, value in params.items():
        if not isinstance(value, str):
            raise ValueError(f"label {key!r} must be a string, not {type(value).__name__}")
    return LabelMatchScorer(params)
