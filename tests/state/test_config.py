"""The ``state:`` section: validation that names the field, and the environment."""

from __future__ import annotations

import pytest

from gateway.config import ConfigError, config_from_mapping


def test_defaults_are_the_memory_backend() -> None:
    c = config_from_mapping({}, env={})
    assert c.state.backend == "memory" and c.state.on_unreachable == "fail-open"


def test_redis_needs_a_url() -> None:
    with pytest.raises(ConfigError, match="redis_url"):
        config_from_mapping({"state": {"backend": "redis"}}, env={})


def test_renewal_must_fit_twice_in_the_ttl() -> None:
    with pytest.raises(ConfigError, match="renew_interval_s"):
        config_from_mapping({"state": {"lease_ttl_s": 1.0, "renew_interval_s": 0.6}}, env={})


@pytest.mark.parametrize(
    "field,value",
    [
        ("backend", "etcd"),
        ("on_unreachable", "ignore"),
        ("redis_url", "http://x"),
        ("key_prefix", "has space"),
        ("lease_ttl_s", 0),
        ("bogus", 1),
    ],
)
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"state.{field}"):
        config_from_mapping({"state": {field: value}}, env={})


def test_environment_overrides_and_the_password_stays_out_of_repr() -> None:
    c = config_from_mapping(
        {"state": {"redis_url": "redis://file:6379/0"}},
        env={
            "KVGATE_STATE_BACKEND": "redis",
            "KVGATE_REDIS_URL": "rediss://prod.example:6380/1",
            "KVGATE_REDIS_PASSWORD": "s3cret-pass",
        },
    )
    assert c.state.backend == "redis"
    assert c.state.redis_url == "rediss://prod.example:6380/1"
    assert c.state.redis_password == "s3cret-pass"
    assert "s3cret-pass" not in repr(c.state) and "s3cret-pass" not in repr(c)


SENTINEL = {"addresses": ["10.0.0.1:26379", "sentinel-2:26379"], "master": "kvgate"}


def test_a_sentinel_stands_for_the_url_and_takes_its_password_from_the_environment() -> None:
    state = {"backend": "redis", "redis_sentinel": SENTINEL}
    env = {"KVGATE_REDIS_SENTINEL_PASSWORD": "s3", "KVGATE_REDIS_PASSWORD": "p4"}
    c = config_from_mapping({"state": state}, env=env).state
    assert c.redis_url is None and c.redis_sentinel is not None
    assert c.redis_sentinel.master == "kvgate" and c.redis_sentinel.db == 0
    assert (c.redis_sentinel.password, c.redis_password) == ("s3", "p4")
    assert "s3" not in repr(c)


@pytest.mark.parametrize(
    "state,error",
    [
        ({"redis_url": "redis://r:6379/0", "redis_sentinel": SENTINEL}, "not both"),
        ({"redis_sentinel": {**SENTINEL, "addresses": []}}, "redis_sentinel.addresses"),
        ({"redis_sentinel": {**SENTINEL, "addresses": ["no-port"]}}, "redis_sentinel.addresses"),
        ({"redis_sentinel": {"addresses": SENTINEL["addresses"]}}, "redis_sentinel.master"),
        ({"redis_sentinel": SENTINEL, "redis_cluster": True}, "redis_cluster: needs redis_url"),
    ],
)
def test_a_sentinel_configuration_is_checked(state: dict, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        config_from_mapping({"state": {"backend": "redis", **state}}, env={})
