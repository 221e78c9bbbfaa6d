"""Tenants (admission/tenants.py): keys, GCRA limits, priority clamp, shares, headers."""

from __future__ import annotations

import hashlib
import math

import pytest
from pydantic import ValidationError

from admission.retries import RetryMemory
from admission.tenants import (
    Gcra,
    KeyIndex,
    RateVerdict,
    TenantConfig,
    TenantLimiter,
    hash_key,
)
from gateway.ratelimit import go_duration, rate_limit_headers


def limiter(**tenant: object) -> TenantLimiter:
    cfg = TenantConfig(name="a", keys_sha256=[hash_key("sk-a")], **tenant)  # type: ignore[arg-type]
    return TenantLimiter.from_config([cfg])


def test_keys_are_looked_up_by_digest_and_only_digests_are_kept() -> None:
    lim = TenantLimiter.from_config(
        [TenantConfig(name="a", keys_sha256=[hash_key("sk-a")])], {"sk-legacy": "b"}
    )
    assert lim.authenticate("sk-a") == "a"
    assert lim.authenticate("sk-legacy") == "b"  # legacy plain key, hashed at load
    assert lim.authenticate("sk-b") is None
    assert lim.authenticate("") is None and lim.authenticate(None) is None
    assert lim.authenticate("sk-a ") is None  # no normalisation beyond the header's strip
    # Nothing in the index is the plain key.
    stored = repr(lim.keys._by_digest)
    assert "sk-legacy" not in stored and "sk-a" not in stored
    assert lim.tenants["b"].rpm is None  # a legacy-only tenant has no limits


def test_without_keys_everyone_is_default() -> None:
    lim = TenantLimiter.from_config([])
    assert not lim.auth_required
    assert lim.authenticate(None) == "default"


def test_one_key_for_two_tenants_is_refused() -> None:
    d = hash_key("sk-x")
    with pytest.raises(ValueError, match="two tenants"):
        TenantLimiter.from_config(
            [TenantConfig(name="a", keys_sha256=[d]), TenantConfig(name="b", keys_sha256=[d])]
        )
    idx = KeyIndex()
    idx.add_digest(d.upper().lower(), "a")
    assert idx.lookup("sk-x") == "a"


def test_config_validates_digests_and_priority_range() -> None:
    with pytest.raises(ValidationError, match="keys_sha256"):
        TenantConfig(name="a", keys_sha256=["sk-plain-key"])
    with pytest.raises(ValidationError, match="min <= default <= max"):
        TenantConfig(name="a", priority={"min": 0, "max": 5, "default": 9})  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="rpmm"):
        TenantConfig(name="a", rpmm=5)  # type: ignore[call-arg]
    upper = hashlib.sha256(b"k").hexdigest().upper()
    assert TenantConfig(name="a", keys_sha256=[upper]).keys_sha256 == [upper.lower()]


def test_gcra_allows_the_limit_per_minute_then_says_exactly_when() -> None:
    g = Gcra(60)  # one a second, a minute's worth of burst
    for _ in range(60):
        assert g.wait(1, 0.0) == 0.0
        g.charge(1, 0.0)
    assert g.remaining(0.0) == 0
    assert g.wait(1, 0.0) == pytest.approx(1.0)
    assert g.reset(0.0) == pytest.approx(60.0)
    # Half a second later half a cell has come back: the wait is the rest.
    assert g.wait(1, 0.5) == pytest.approx(0.5)
    assert g.wait(1, 1.0) == 0.0
    assert g.remaining(30.0) == 30
    assert g.wait(61, 100.0) == math.inf  # more than the whole budget never passes


def test_gcra_spent_cells_refill_at_the_refill_rate_after_the_share_shrinks() -> None:
    g = Gcra(600)  # ten a second
    g.charge(300, 0.0)  # spent half the minute's budget with the whole share
    g.set_share(0.25, 0.0, refill=0.5)  # now a quarter, the spent cells refill at half
    assert g.limit == 150 and g.remaining(0.0) == 0
    # 300 spent refill at 5 a second; it may admit again once under 150: after 30 s,
    # plus one cell's 0.2 s.
    assert g.wait(1, 0.0) == pytest.approx(30.2)
    assert g.used(30.2) == pytest.approx(149.0)
    # Refilling at the share alone (2.5 a second) would have taken twice as long.
    h = Gcra(600)
    h.charge(300, 0.0)
    h.set_share(0.25, 0.0)
    assert h.wait(1, 0.0) == pytest.approx(60.4)
    # The refill is never below the share.
    g.set_share(0.5, 40.0, refill=0.1)
    assert g.refill == 0.5


def test_gcra_refund_and_correction() -> None:
    g = Gcra(600)
    g.charge(500, 0.0)
    assert g.remaining(0.0) == 100
    g.refund(300, 0.0)  # the request used 200 of the 500 it was charged
    assert g.remaining(0.0) == 400
    g.refund(-100, 0.0)  # another used 100 more than estimated
    assert g.remaining(0.0) == 300
    g.refund(10_000, 0.0)  # never above full
    assert g.remaining(0.0) == 600


def test_limiter_check_names_the_limit_hit_and_the_true_wait() -> None:
    lim = limiter(rpm=2, tpm=1000)
    assert lim.check("a", 400, 0.0).limit is None
    c1 = lim.charge("a", 400, 0.0)
    assert lim.check("a", 700, 0.0).limit == "tokens"
    # 100 tokens over: at 1000/60 a second, 6 s.
    assert lim.check("a", 700, 0.0).retry_after == pytest.approx(6.0)
    lim.charge("a", 100, 0.0)
    v = lim.check("a", 10, 0.0)
    assert v.limit == "requests" and v.retry_after == pytest.approx(30.0)
    lim.correct(c1, 100, 0.0)  # usage: 100, not 400
    assert rate_limit_headers(lim, "a", 0.0)["x-ratelimit-remaining-tokens"] == "800"
    lim.correct(c1, 5, 0.0)  # settled once only
    assert rate_limit_headers(lim, "a", 0.0)["x-ratelimit-remaining-tokens"] == "800"


def test_refund_gives_back_the_request_and_tokens() -> None:
    lim = limiter(rpm=1, tpm=100)
    c = lim.charge("a", 50, 0.0)
    assert lim.check("a", 10, 0.0).limit == "requests"
    lim.refund(c, 0.0)
    assert lim.check("a", 100, 0.0).limit is None


def test_headers_are_openai_shaped_and_true() -> None:
    lim = limiter(rpm=60, tpm=6000)
    assert rate_limit_headers(lim, "a", 0.0) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "60",
        "x-ratelimit-reset-requests": "0s",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "6000",
        "x-ratelimit-reset-tokens": "0s",
    }
    lim.charge("a", 6000, 0.0)
    h = rate_limit_headers(lim, "a", 0.0)
    assert h["x-ratelimit-remaining-requests"] == "59"
    assert h["x-ratelimit-reset-requests"] == "1s"
    assert h["x-ratelimit-remaining-tokens"] == "0"
    assert h["x-ratelimit-reset-tokens"] == "1m0s"
    assert rate_limit_headers(limiter(), "a", 0.0) == {}  # no limits: no headers


def test_go_duration_format() -> None:
    assert [go_duration(x) for x in (0, 0.0004, 0.25, 1, 1.5, 59.9984, 59.9996, 360, 3723)] == [
        "0s",
        "1ms",
        "250ms",
        "1s",
        "1.5s",
        "59.999s",
        "1m0s",
        "6m0s",
        "1h2m3s",
    ]


def test_priority_is_clamped_to_the_tenant_range() -> None:
    st = limiter(priority={"min": -2, "max": 3, "default": 1}).get("a")
    assert st.clamp_priority(None) == 1
    assert st.clamp_priority(100) == 3
    assert st.clamp_priority(-100) == -2
    assert st.clamp_priority(2) == 2
    assert limiter().get("a").clamp_priority(9) == 0  # default range [0, 0]


def test_models_allowed() -> None:
    st = limiter(models=["m1"]).get("a")
    assert st.may_use("m1") and not st.may_use("m2")
    assert limiter().get("a").may_use("anything")


def test_set_share_scales_rates_and_concurrency() -> None:
    lim = limiter(rpm=60, tpm=6000, max_concurrent=8, max_queued=10)
    lim.set_share("a", 0.25, 0.0)
    st = lim.get("a")
    assert (st.max_concurrent, st.max_queued) == (2, 2)
    assert st.rpm is not None and st.rpm.limit == 15
    for _ in range(15):
        assert lim.check("a", 1, 0.0).limit is None
        lim.charge("a", 1, 0.0)
    assert lim.check("a", 1, 0.0).limit == "requests"
    # The headers tell the tenant's limit and what is left of it across processes: the
    # others reported 30 spent at the last renewal.
    st.rpm.set_others(30, 0.0)
    headers = rate_limit_headers(lim, "a", 0.0)
    assert headers["x-ratelimit-limit-requests"] == "60"
    assert headers["x-ratelimit-remaining-requests"] == "15"
    # Full again when this process's 15 have refilled at its quarter of the rate.
    assert headers["x-ratelimit-reset-requests"] == "1m0s"
    st.rpm.set_others(0, 0.0)  # alone again
    # A request over this process's share but within the total: a minute, not never.
    assert lim.check("a", 2000, 100.0) == RateVerdict("tokens", 60.0)
    lim.set_share("a", 1.0, 0.0)
    assert lim.get("a").max_concurrent == 8
    # What was used stays used: 15 of 60.
    assert rate_limit_headers(lim, "a", 0.0)["x-ratelimit-remaining-requests"] == "45"
    with pytest.raises(ValueError):
        lim.set_share("a", 1.5)


def test_retry_memory_is_per_tenant() -> None:
    mem = RetryMemory(ttl_s=100.0, max_entries=3)
    mem.remember("k", arrival=1.0, now=2.0, tenant="b")
    # Tenant a floods the memory with sheds: b's entry stays.
    for i in range(50):
        mem.remember(i, arrival=float(i), now=3.0, tenant="a")
    assert mem.tenant_len("a") == 3
    assert mem.recall("k", 4.0, tenant="b") == (1.0, 1)
    # The same key from another tenant is not a retry of b's.
    assert mem.recall("k", 4.0, tenant="a") is None
    mem.forget("k", tenant="a")
    assert mem.recall("k", 4.0, tenant="b") == (1.0, 1)
