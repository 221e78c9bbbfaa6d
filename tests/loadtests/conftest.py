"""The gateway fixtures (with their check that reservations return to zero) for the load
test tests, and a slow-stepping variant of the tiny replica profile."""

from __future__ import annotations

import pytest

from enginesim.profiles import Profile, load_profile
from tests.gateway.conftest import gateway, replica  # noqa: F401  (fixtures)


@pytest.fixture
def slow_tiny() -> Profile:
    """`tiny` (4,096-token pool, 16-token blocks) with 20 ms steps: a request's service
    lasts long enough that Locust's client overhead does not set the throughput."""
    p = load_profile("tiny")
    return p.model_copy(update={"perf": p.perf.model_copy(update={"step_overhead_ms": 20.0})})
