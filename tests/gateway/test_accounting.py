"""The account stage's own rules (gateway/accounting.py), on hand-built request contexts:
the one ITL formula and its edge cases, what an ended request tells admission about its
replica, and that the request metrics and the tenant's SLO read the same ITL."""

from __future__ import annotations

import math

import pytest

from admission.learned.estimate import TokenEstimator
from admission.tenants import TenantLimiter
from gateway.accounting import Accounting, completion, inter_token_latency
from gateway.config import config_from_mapping
from gateway.context import RequestContext
from gateway.metrics import GatewayMetrics
from gateway.outcome import CLIENT_DISCONNECT, OK, denied, shed, upstream

MODEL = "tiny-llm"


def ctx(**fields: object) -> RequestContext:
    c = RequestContext(
        request_id="kvg-test-1", kind="chat", upstream_path="/v1/chat/completions", arrival=10.0
    )
    for name, value in fields.items():
        # Request facts (model, stream, counts) live on the one request object.
        setattr(c if name in RequestContext.__dataclass_fields__ else c.req, name, value)
    return c


def streamed(events: int, first: float = 10.5, last: float = 12.5, **fields: object):
    return ctx(
        stream=True,
        model=MODEL,
        admitted_at=10.25,
        first_byte_at=first,
        last_event_at=last,
        events=events,
        outcome=OK,
        status=200,
        **fields,
    )


# ---------------------------------------------------------------- the ITL formula
@pytest.mark.parametrize(
    ("events", "first", "last", "expected"),
    [
        (5, 1.0, 3.0, 0.5),  # four gaps over two seconds
        (2, 1.0, 1.25, 0.25),  # one gap: the gap itself
        (3, 2.0, 2.0, 0.0),  # events in one instant: no wait between them, not None
        (1, 1.0, 1.0, None),  # one event: no gap
        (0, None, None, None),  # nothing streamed
        (4, None, 3.0, None),  # no first byte recorded
        (4, 1.0, None, None),  # no last event recorded
    ],
)
def test_inter_token_latency_is_the_mean_gap_after_the_first_event(events, first, last, expected):
    got = inter_token_latency(ctx(events=events, first_byte_at=first, last_event_at=last))
    assert got == expected if expected is None else math.isclose(got, expected)


# ---------------------------------------------------------------- what admission hears
def test_a_completed_stream_reports_ttft_from_admission_and_the_same_itl():
    c = streamed(5, usage_prompt=30, usage_completion=4)
    done = completion(c, now=13.0)
    assert done is not None and done.ok
    assert done.ttft_s == pytest.approx(0.25)  # first byte 10.5 - admitted 10.25
    assert done.itl_s == inter_token_latency(c) == pytest.approx(0.5)
    assert done.service_s == pytest.approx(2.75)
    assert (done.prompt_tokens, done.completion_tokens) == (30, 4)


def test_a_non_stream_reports_no_ttft_or_itl_and_counts_its_own_tokens_without_usage():
    c = ctx(model=MODEL, admitted_at=10.0, outcome=OK, prompt_tokens=12, generated=7)
    done = completion(c, now=11.0)
    assert done is not None and done.ok
    assert (done.ttft_s, done.itl_s) == (None, None)
    assert (done.prompt_tokens, done.completion_tokens) == (12, 7)


def test_a_request_never_admitted_says_nothing():
    assert completion(ctx(outcome=shed("queue_full")), now=11.0) is None


@pytest.mark.parametrize("how", ["stream_error", "timeout", "status_5xx"])
def test_a_load_failure_is_a_failure_of_the_replica(how):
    done = completion(ctx(admitted_at=10.0, outcome=upstream("x"), upstream_error=how), 11.0)
    assert done is not None and not done.ok


def test_a_refused_connection_is_not_about_load():
    assert (
        completion(ctx(admitted_at=10.0, outcome=denied("x"), upstream_error="connect"), 11.0)
        is None
    )


def test_a_client_that_leaves_at_its_declared_timeout_counts_against_the_replica():
    left = dict(admitted_at=10.0, outcome=CLIENT_DISCONNECT, latency_budget=10.0)
    early = completion(ctx(**left), now=10.0 + 8.9)  # arrival 10.0: left at 89 % of 10 s
    assert early is None  # it simply left
    late = completion(ctx(**left), now=10.0 + 9.0)
    assert late is not None and not late.ok and late.latency_budget == 10.0


# ---------------------------------------------------------------- the account stage
def _accounting(itl_target: float) -> tuple[Accounting, GatewayMetrics]:
    cfg = config_from_mapping(
        {
            "replicas": [{"name": "r0", "url": "http://127.0.0.1:9"}],
            "tenants": [{"name": "a", "slo": {"itl_s": itl_target, "ttft_s": 1.0}}],
        },
        env={},
    )
    tenants = TenantLimiter.from_config(cfg.tenants, cfg.auth.api_keys)
    metrics = GatewayMetrics(lambda: [], lambda: {}, lambda: 0)
    metrics.set_tenant_names(tenants.tenants)
    return Accounting(TokenEstimator(cfg.admission), tenants, metrics, {MODEL}), metrics


def _value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(("target", "met"), [(0.6, 1.0), (0.4, 0.0)])
def test_the_itl_histogram_and_the_tenant_slo_judge_the_same_itl(target, met):
    accounting, m = _accounting(itl_target=target)
    c = streamed(5, tenant="a")  # ITL 0.5 s
    accounting.account(c, now=13.0)
    assert _value(m, "kvgate_itl_seconds_sum") == pytest.approx(0.5)
    assert _value(m, "kvgate_itl_seconds_count") == 1
    assert _value(m, "kvgate_tenant_slo_total", tenant="a", target="itl") == 1
    assert _value(m, "kvgate_tenant_slo_met_total", tenant="a", target="itl") == met
    assert _value(m, "kvgate_tenant_slo_met_total", tenant="a", target="ttft") == 1
    ok = {"model": MODEL, "outcome": "ok"}
    assert _value(m, "kvgate_requests_total", **ok) == 1


def test_a_one_event_stream_has_no_itl_to_judge():
    accounting, m = _accounting(itl_target=0.1)
    accounting.account(streamed(1, last=10.5, tenant="a"), now=13.0)
    assert _value(m, "kvgate_itl_seconds_count") == 0
    assert _value(m, "kvgate_tenant_slo_total", tenant="a", target="itl") == 0
    assert _value(m, "kvgate_tenant_slo_total", tenant="a", target="ttft") == 1


def test_a_failed_stream_misses_the_itl_target_and_a_client_error_is_not_judged():
    accounting, m = _accounting(itl_target=10.0)
    accounting.account(ctx(stream=True, tenant="a", outcome=upstream("x"), status=502), 11.0)
    assert _value(m, "kvgate_tenant_slo_total", tenant="a", target="itl") == 1
    assert _value(m, "kvgate_tenant_slo_met_total", tenant="a", target="itl") == 0
    accounting.account(ctx(stream=True, tenant="a", outcome=denied("bad"), status=400), 11.0)
    assert _value(m, "kvgate_tenant_slo_total", tenant="a", target="itl") == 1  # unchanged


def test_a_model_no_replica_serves_is_counted_as_unknown():
    accounting, m = _accounting(itl_target=1.0)
    accounting.account(ctx(model="made-up", outcome=denied("model_not_found"), status=404), 11.0)
    labels = {"model": "_unknown", "outcome": "model_not_found"}
    assert _value(m, "kvgate_requests_total", **labels) == 1
    assert _value(m, "kvgate_requests_total", model="made-up", outcome="model_not_found") == 0
