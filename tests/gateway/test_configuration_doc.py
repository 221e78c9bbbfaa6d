"""docs/configuration.md is the reference of every setting: each config model has a table
there listing exactly its fields, each with the model's default. A field added, removed
or given another default without the page fails here, so the page cannot drift."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from admission.config import AdmissionConfig, LatencyTargets
from admission.tenants import PriorityRange, TenantConfig
from gateway.config import (
    AuthConfig,
    CountingConfig,
    DiscoveryConfig,
    DnsConfig,
    GatewayConfig,
    KVEventsSource,
    LimitsConfig,
    ListenConfig,
    LoggingConfig,
    OutlierConfig,
    ReplicaConfig,
    ReplicaGroupConfig,
    SentinelConfig,
    ShutdownConfig,
    StateConfig,
    UpstreamConfig,
    _model_in,
)
from routing.config import FilterRef, PickerRef, ProfileConfig, RoutingConfig, ScorerRef

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# The heading over each table -> the models whose fields it lists.
TABLES: dict[str, tuple[type[BaseModel], ...]] = {
    "`listen`": (ListenConfig,),
    "`replicas`": (ReplicaConfig,),
    "`replicas[].kv_events`": (KVEventsSource,),
    "`replica_groups`": (ReplicaGroupConfig,),
    "`dns`": (DnsConfig,),
    "`admission`": (AdmissionConfig,),
    "`routing`": (RoutingConfig,),
    "A routing profile": (ProfileConfig,),
    "A plugin entry": (FilterRef, ScorerRef, PickerRef),
    "`upstream`": (UpstreamConfig,),
    "`counting`": (CountingConfig,),
    "`limits`": (LimitsConfig,),
    "`auth`": (AuthConfig,),
    "`discovery`": (DiscoveryConfig,),
    "`outlier`": (OutlierConfig,),
    "`shutdown`": (ShutdownConfig,),
    "`logging`": (LoggingConfig,),
    "`state`": (StateConfig,),
    "`state.redis_sentinel`": (SentinelConfig,),
    "`tenants`": (TenantConfig,),
    "`tenants[].priority`": (PriorityRange,),
    "Latency targets": (LatencyTargets,),
}

Row = tuple[list[str], str]  # the field names in its first cell, its default cell


def _reference() -> tuple[list[str], dict[str, list[Row]]]:
    """The headings of the page's reference, and the rows of each one's field table."""
    text = DOC.read_text(encoding="utf-8").split("\n## Reference\n", 1)[1]
    headings: list[str] = []
    tables: dict[str, list[Row]] = {}
    rows: list[Row] | None = None
    for line in text.splitlines():
        if heading := re.match(r"#{3,4} (.+)$", line):
            headings.append(heading[1])
            rows = None
        elif line == "| field | default | meaning |":
            rows = tables.setdefault(headings[-1], [])
        elif rows is not None and line.startswith("| ") and not line.startswith("| ---"):
            first, default = (cell.strip() for cell in line.split(" | ")[:2])
            rows.append((re.findall(r"`([a-z_0-9]+)`", first), default))
        elif not line.startswith("|"):
            rows = None
    return headings, tables


def _models(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[type[BaseModel]]:
    seen.add(model)
    for field in model.model_fields.values():
        inner = _model_in(field.annotation)
        if inner is not None and inner not in seen:
            _models(inner, seen)
    return seen


def _fields(models: tuple[type[BaseModel], ...]) -> dict[str, FieldInfo]:
    return {name: f for m in models for name, f in m.model_fields.items()}


def _written(field: FieldInfo) -> str | None:
    """How the page writes `field`'s default (None: a built default it describes)."""
    if field.default_factory is not None:
        built: Any = field.default_factory()
        return {"{}": "`{}`", "[]": "`[]`"}.get(repr(built))
    default = field.default
    if default is PydanticUndefined:
        return "required"
    if default is None:
        return "none"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if default == "":
        return '`""`'
    return f"`{default}`"


def test_every_section_and_model_of_the_config_has_its_table() -> None:
    headings, tables = _reference()
    for section in GatewayConfig.model_fields:
        assert f"`{section}`" in headings, section
    documented = {m for models in TABLES.values() for m in models}
    assert _models(GatewayConfig, set()) - {GatewayConfig} == documented
    assert set(TABLES) <= set(tables), set(TABLES) - set(tables)


@pytest.mark.parametrize("heading", sorted(TABLES))
def test_a_table_lists_exactly_its_fields_with_their_defaults(heading: str) -> None:
    rows = _reference()[1][heading]
    fields = _fields(TABLES[heading])
    listed = [name for names, _ in rows for name in names]
    assert sorted(listed) == sorted(fields), heading
    for names, default in rows:
        if len(names) != 1:
            continue  # several settings described together ("as `replicas`")
        written = _written(fields[names[0]])
        if written is not None:
            assert default.startswith(written), (heading, names[0], default, written)
