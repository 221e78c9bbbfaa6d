"""The config stays as its file says; what a gateway serves from it is built where the
config becomes replicas and a router: a data-parallel entry as one replica per engine
rank (`expand_data_parallel`), the slo_itl filter in every profile while a tenant has an
ITL target (`routing_with_slo_filter`). At start and at a reload alike."""

from __future__ import annotations

from typing import Any

from gateway.config import config_from_mapping
from routing.scheduler import SchedulingRouter
from routing.scorers.prefix_cache import PrefixCacheScorer

# Nothing listens there: discovery probes it and finds it unready, which is all these need.
DOWN = "http://127.0.0.1:9"


def _filters(router: Any) -> set[tuple[str, ...]]:
    assert isinstance(router, SchedulingRouter)
    return {tuple(f.name for f in p.filters) for p in router.profiles()}


async def test_start_and_reload_serve_ranks_and_the_slo_filter(gateway) -> None:
    data: dict[str, Any] = {
        "replicas": [{"name": "big", "url": DOWN, "data_parallel_size": 2}],
        "discovery": {"refresh_interval_s": 0.2, "probe_timeout_s": 0.5},
        "tenants": [{"name": "a"}],
    }
    gw = await gateway(replicas=data["replicas"], tenants=data["tenants"])
    st = gw.state
    assert [r.name for r in st.config.replicas] == ["big"]
    assert set(st.discovery.watchers) == {"big-dp0", "big-dp1"}
    assert _filters(st.door.router) == {()}
    ranks = dict(st.discovery.watchers)

    # A tenant gains an ITL target: the routing section is unchanged, the router served
    # is rebuilt with the filter; the unchanged data-parallel entry keeps its watchers.
    with_target = {**data, "tenants": [{"name": "a", "slo": {"itl_s": 0.1}}]}
    await st.apply(config_from_mapping(with_target, env={}))
    assert st.config.routing.default_profile.filters == []
    assert _filters(st.door.router) == {("slo_itl",)}
    assert st.discovery.watchers == ranks

    # And loses it: the filter goes with it.
    await st.apply(config_from_mapping(data, env={}))
    assert _filters(st.door.router) == {()}
    assert st.discovery.watchers == ranks


async def test_a_reloaded_router_reads_the_engines_own_caches(gateway) -> None:
    # A replica that publishes its KV events: the precise prefix scorer reads the index
    # they fill. A reload that rebuilt the router without it lost the index for good.
    events = {"endpoint": "tcp://127.0.0.1:9"}
    replicas = [{"name": "v", "url": DOWN, "engine": "vllm", "kv_events": events}]
    data: dict[str, Any] = {
        "replicas": replicas,
        "discovery": {"refresh_interval_s": 0.2, "probe_timeout_s": 0.5},
    }
    gw = await gateway(replicas=replicas)
    st = gw.state
    assert st.kv_index is not None

    def indexes(router: Any) -> list[Any]:
        assert isinstance(router, SchedulingRouter)
        scorers = [s for p in router.profiles() for s, _ in p.scorers]
        return [s._kv for s in scorers if isinstance(s, PrefixCacheScorer)]

    routing = {"default_profile": {"scorers": [{"name": "prefix_cache"}]}}
    await st.apply(config_from_mapping({**data, "routing": routing}, env={}))
    assert indexes(st.door.router) == [st.kv_index]
