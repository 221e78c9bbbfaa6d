"""The reference contender of bench/overhead.py: a bare aiohttp + uvloop pass-through
proxy, what a user would write by hand in about 30 lines (round robin over the upstreams
given). No validation, admission, metrics or logging: the floor a Python gateway starts
from.

    python bench/bare_proxy.py LISTEN_PORT UPSTREAM_URL [UPSTREAM_URL...]
"""

import itertools
import sys

import aiohttp
import uvloop
from aiohttp import web

HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


async def proxy(request: web.Request) -> web.StreamResponse:
    session: aiohttp.ClientSession = request.app["session"]
    body = await request.read()
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    async with session.request(
        request.method, next(request.app["upstreams"]) + request.path_qs, data=body, headers=headers
    ) as up:
        out = {k: v for k, v in up.headers.items() if k.lower() not in HOP}
        resp = web.StreamResponse(status=up.status, headers=out)
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def app(upstreams: list[str]) -> web.Application:
    a = web.Application()
    a["upstreams"] = itertools.cycle(upstreams)
    a["session"] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
    )
    a.on_cleanup.append(lambda a: a["session"].close())
    a.router.add_route("*", "/{tail:.*}", proxy)
    return a


if __name__ == "__main__":
    uvloop.install()
    web.run_app(
        app(sys.argv[2:]), host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None
    )
