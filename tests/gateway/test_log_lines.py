"""Log lines (issue 22, item 6): ISO 8601 timestamps, and the request id on every line
logged while a request is handled, not only on the access line."""

from __future__ import annotations

import io
import json
import logging
import re

import aiohttp

from gateway.logging import JsonFormatter
from tests.gateway.conftest import MODEL

ISO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


async def test_every_line_of_a_request_carries_its_id_and_an_iso_timestamp(
    replica, gateway
) -> None:
    srv = await replica()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("kvgate")
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.INFO)
    try:
        # A replica that dies after its probes found it ready: a request placed on it
        # fails over (a warning on the request path) and ejects it (another).
        dying = await replica()
        gw = await gateway(
            replicas=[{"name": "dying", "url": dying.url}, {"name": "live", "url": srv.url}],
            outlier={"consecutive_failures": 1, "max_ejection_percent": 100},
            discovery={"fail_threshold": 50},
        )
        await dying.stop()
        ids = set()
        async with aiohttp.ClientSession() as s:
            for _ in range(30):
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
                async with s.post(gw.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    ids.add(r.headers["x-request-id"])
                if "ejected" in stream.getvalue():
                    break
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert lines and all(ISO.match(x["ts"]) for x in lines)
    on_path = [x for x in lines if x["logger"] == "kvgate.pipeline"]
    assert on_path, [x["msg"] for x in lines]
    assert all(x.get("request_id") in ids for x in on_path)
    ejected = [x for x in lines if "ejected" in x["msg"]]
    assert ejected and ejected[0].get("request_id") in ids
    # Lines outside any request carry none.
    assert all("request_id" not in x for x in lines if x["logger"] == "kvgate.discovery")
