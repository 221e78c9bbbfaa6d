"""Every built-in routing plugin, by the name a YAML profile gives it: one line each.

The registry (`routing.registry`) reads this list; a plugin module imports only the
interfaces (`routing.plugin`) and the types, never the registry, so nothing imports in a
circle. Adding a plugin: a module of its own and one line here
(docs/writing-a-plugin.md).
"""

from __future__ import annotations

from routing.filters import label, slo_itl
from routing.pickers import max_score
from routing.plugin import Factory
from routing.scorers import (
    engine_kv_usage,
    engine_queue,
    kv_headroom,
    label_match,
    prefix_cache,
    prefix_load,
    running_headroom,
    session_affinity,
    speculation,
)

# (kind, name, factory)
PLUGINS: tuple[tuple[str, str, Factory], ...] = (
    ("filter", "label", label.factory),
    ("filter", "slo_itl", slo_itl.factory),
    ("scorer", "kv_headroom", kv_headroom.factory),
    ("scorer", "running_headroom", running_headroom.factory),
    ("scorer", "engine_queue", engine_queue.factory),
    ("scorer", "engine_kv_usage", engine_kv_usage.factory),
    ("scorer", "prefix_cache", prefix_cache.factory),
    ("scorer", "prefix_load", prefix_load.factory),
    ("scorer", "session_affinity", session_affinity.factory),
    ("scorer", "speculation", speculation.factory),
    ("scorer", "label_match", label_match.factory),
    ("picker", "max_score", max_score.factory),
)
