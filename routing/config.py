"""Validated routing settings: profiles of named plugins, per model and a default.

Plugin names are checked against `routing.registry` (the wiring list, `routing.wiring`) and each entry is built once at
validation, so an unknown name or a bad param is a config error that names the field
(e.g. ``routing.default_profile.scorers.1.name``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from routing import registry
from routing.classify import WORKLOADS
from routing.plugin import BLOCK_CHARS, PluginEnv


class _PluginRef(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: ClassVar[str] = "filter"

    name: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        kind = cls.kind
        if v not in registry.names(kind):
            known = ", ".join(registry.names(kind))
            raise ValueError(f"unknown {kind} {v!r}; known: {known}")
        return v

    @model_validator(mode="after")
    def _buildable(self) -> _PluginRef:
        kind = self.kind
        try:
            registry.build(kind, self.name, self.params, PluginEnv())
        except (ValueError, TypeError) as e:
            raise ValueError(f"{kind} {self.name!r} params: {e}") from None
        return self


class FilterRef(_PluginRef):
    kind: ClassVar[str] = "filter"


class ScorerRef(_PluginRef):
    kind: ClassVar[str] = "scorer"

    weight: float = Field(1.0, ge=0.0, description="Weight of this scorer in the sum.")


class PickerRef(_PluginRef):
    kind: ClassVar[str] = "picker"


class ProfileConfig(BaseModel):
    """filter -> score -> pick for one model (or the default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    filters: list[FilterRef] = Field(default_factory=list)
    scorers: list[ScorerRef] = Field(default_factory=lambda: [ScorerRef(name="kv_headroom")])
    picker: PickerRef = Field(default_factory=lambda: PickerRef(name="max_score"))


def _ref(kind: type[_PluginRef], name: str, **kw: Any) -> Any:
    return kind(name=name, **kw)


def workload_profiles() -> dict[str, ProfileConfig]:
    """The scoring each workload class gets when the config names no default profile:
    coding goes to speculating replicas while speculation pays there, then to the least
    loaded; agentic trades the prompt's cached prefix against the prefill and decode work
    waiting on each replica (``prefix_load``) and keeps a session where its history is;
    chat takes the most KV headroom."""
    return {
        "coding": ProfileConfig(
            scorers=[
                _ref(ScorerRef, "speculation", weight=2.0),
                _ref(ScorerRef, "running_headroom", weight=1.0),
                _ref(ScorerRef, "kv_headroom", weight=1.0),
            ]
        ),
        # The session's own replica holds its whole history: stay there unless the
        # prefix trade says otherwise (the affinity raised the hit rate on
        # bench/agentic_prefix.py's tuning seed; measured: docs/benchmarks-agentic.md).
        "agentic": ProfileConfig(
            scorers=[_ref(ScorerRef, "prefix_load"), _ref(ScorerRef, "session_affinity")]
        ),
        "chat": ProfileConfig(),
    }


class RoutingConfig(BaseModel):
    """Profiles per model, else per workload class, else the default.

    A request's profile is its model's (``profiles``), else its workload class's
    (``workloads``), else ``default_profile``. Without a ``routing:`` section (or with
    one that names no ``default_profile``) ``workloads`` holds the built-in class
    profiles (`workload_profiles`); a config that names a ``default_profile`` means it
    for every class, so ``workloads`` is then empty unless it is given too."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_profile: ProfileConfig = Field(default_factory=ProfileConfig)
    profiles: dict[str, ProfileConfig] = Field(
        default_factory=dict, description="Model name -> its profile (others: the default)."
    )
    workloads: dict[str, ProfileConfig] = Field(
        default_factory=workload_profiles,
        description="Workload class -> its profile, for models without their own.",
    )
    block_chars: int = Field(
        BLOCK_CHARS, gt=0, description="Characters per prefix block hashed by the gateway."
    )
    max_prefix_blocks: int = Field(
        512, gt=0, description="Most prefix blocks hashed per request (the prompt's head)."
    )

    @model_validator(mode="before")
    @classmethod
    def _default_means_every_class(cls, data: Any) -> Any:
        if isinstance(data, dict) and "default_profile" in data and "workloads" not in data:
            return {**data, "workloads": {}}
        return data

    @field_validator("workloads")
    @classmethod
    def _known_classes(cls, v: dict[str, ProfileConfig]) -> dict[str, ProfileConfig]:
        unknown = sorted(set(v) - set(WORKLOADS))
        if unknown:
            raise ValueError(f"unknown workload {unknown[0]!r}; known: {', '.join(WORKLOADS)}")
        return v
