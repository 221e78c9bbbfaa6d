"""The aiohttp application and the embeddable `Gateway`.

`build_app(config)` returns a `web.Application` whose start-up context creates, in
order: the upstream session, the admission door (the only holder of the controller), the relay
and pipeline, and discovery (whose first round completes before the app serves, so
``/ready`` is truthful from the first request). Shutdown undoes them in reverse.

`Gateway` runs that app on a TCP socket with ``handler_cancellation=True``: when a
client disconnects, aiohttp cancels its handler, which is how a non-streamed request's
upstream call is aborted; its reservation is held until the engine shows it stopped
(an engine may notice the closed connection late: see `Pipeline.release`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from admission.report import AdmissionReport
from gateway import connections as conns
from gateway.checks import exposure_warning
from gateway.config import GatewayConfig, expand_data_parallel
from gateway.context import Kind
from gateway.counting import PromptCounter
from gateway.door import AdmissionDoor
from gateway.endpoints import UPSTREAM_PATHS
from gateway.errors import ApiError, Dialect
from gateway.fleet.discovery import Discovery
from gateway.fleet.dns import DnsGroups
from gateway.fleet.kvevents import start_kv_events
from gateway.forward import Forwarder
from gateway.gateway_state import GatewayState
from gateway.http import hide_server_version, server_kwargs
from gateway.http import install as install_error_handler
from gateway.kvtokens import PromptTokenIds
from gateway.metrics import GatewayMetrics
from gateway.models_api import ModelsApi
from gateway.operations_api import OperationsApi
from gateway.pipeline import TENANT_KEY, Pipeline
from gateway.ratelimit import rate_limit_headers
from gateway.reload import Reloader
from gateway.scaling import DesiredReplicas
from gateway.shutdown import log_pending_tasks, wait_until
from gateway.state import StateBackend
from gateway.state.collector import StateCollector
from gateway.state.sharing import StateSync, make_backend
from gateway.stream_reservation import StreamReservation
from gateway.upstream.relay import Relay
from gateway.upstream.session import make_session
from routing.types import Router

log = logging.getLogger("kvgate")


STATE_KEY = web.AppKey("kvgate_state", GatewayState)


def build_app(
    config: GatewayConfig,
    *,
    picker: Router | None = None,
    state_backend: StateBackend | None = None,
    workers_hint: int = 1,
    config_path: str | None = None,
) -> web.Application:
    """The kvgate aiohttp application for `config` (not yet started).

    `picker` chooses among the replicas a request fits on (default: the router the
    config's ``routing`` profiles describe, `routing.scheduler.build_router`).
    `state_backend` overrides the configured shared state (``state.backend``; tests share
    one `MemoryBackend` between gateways); `workers_hint` is the number of processes
    started together (``--workers``), the least N for the fail-open share.
    """
    app = web.Application(client_max_size=config.limits.max_body_bytes)
    hide_server_version(app)
    st = GatewayState(config, picker)
    app[STATE_KEY] = st

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        session = make_session(config.upstream)
        st.door.start()
        report = st.door.report
        st.discovery = Discovery(
            expand_data_parallel(config.replicas), session, st.door, config.discovery
        )
        st.metrics = GatewayMetrics(
            report.replica_usage,
            st.queue_depths,
            lambda: report.top_up_failures,
        )
        # Read through the door at each scrape: a reload may replace the router.
        choices = report.ttft_choices
        st.metrics.watch_routing(lambda: {**st.door.router.decision_counts(), **choices})
        st.metrics.watch_route_decisions(lambda: st.door.router.route_decision_counts())
        st.metrics.watch_engines(lambda: [w.state for w in st.discovery.watchers.values()])
        st.metrics.watch_patience(report.patience_readings)
        st.metrics.watch_retry_budget(report.retry_budget_readings)
        relay = Relay(
            session,
            config.upstream,
            StreamReservation(st.door),
            client_write_timeout_s=config.limits.client_write_timeout_s,
        )
        counter = PromptCounter(
            config, st.estimator, st.discovery, st.door.report, st.metrics, session
        )
        st.pipeline = Pipeline(
            config,
            st.estimator,
            st.door,
            st.discovery,
            relay,
            st.metrics,
            counter=counter,
            tenants=st.tenants,
        )
        forwarder.append(
            Forwarder(
                config,
                lambda: st.tenants,
                st.discovery,
                session,
                lambda: st.pipeline.stored,
                st.metrics,
            )
        )
        await st.discovery.start()
        if st.kv_index is not None:
            st.kv_subscribers = start_kv_events(config, st.kv_index, st.discovery)
            st.pipeline.prompt_token_ids = PromptTokenIds(
                config, st.discovery, session, st.kv_index
            )
        st.dns = DnsGroups(config.replica_groups, config.dns, st.discovery)
        await st.dns.start()
        if config_path is not None:  # live reload: SIGHUP, or the file changed
            st.reloader = Reloader(st.apply, config_path, st.metrics.registry, workers=workers_hint)
            st.reloader.start()
        backend = state_backend if state_backend is not None else make_backend(config.state)
        if backend is not None:
            st.sync = StateSync(
                config.state,
                backend,
                st.door,
                workers_hint=workers_hint,
                tenants=st.tenants,
                set_tenant_share=st.set_tenant_share,
            )
            await st.sync.start()
            st.pipeline.stored.share(backend)  # stored responses, for every process
            st.pipeline.state_gate = st.sync.gate
        st.metrics.registry.register(DesiredReplicas(report))
        st.metrics.registry.register(
            StateCollector(
                config.state.backend if backend is None else backend.name, st.sync, report
            )
        )
        try:
            yield
        finally:
            st.pipeline.close()
            for subscriber in st.kv_subscribers:
                await subscriber.stop()
            if st.sync is not None:
                await st.sync.stop()
            if st.reloader is not None:
                await st.reloader.stop()
            await st.dns.stop()
            await st.discovery.stop()
            await st.door.stop()
            await session.close()

    app.cleanup_ctx.append(lifecycle)

    async def prepare_answer(request: web.Request, response: web.StreamResponse) -> None:
        # One hook, not one per concern: aiohttp awaits each hook on every answer.
        add_rate_limit_headers(request, response)
        conns.close_when_draining(response, st.pipeline.draining)

    def add_rate_limit_headers(request: web.Request, response: web.StreamResponse) -> None:
        # OpenAI's x-ratelimit-* headers on every answer to an authenticated request,
        # with the values as they stand when the answer starts.
        tenant = request.get(TENANT_KEY)
        if tenant is not None:
            response.headers.update(
                rate_limit_headers(st.tenants, tenant, asyncio.get_running_loop().time())
            )
        if response.status == 429 and "Retry-After" not in response.headers:
            # A request larger than the tenant's whole budget: retrying cannot help (the
            # openai SDKs read this header).
            response.headers["x-should-retry"] = "false"

    app.on_response_prepare.append(prepare_answer)

    # ------------------------------------------------------------------ OpenAI surface
    async def chat(request: web.Request) -> web.StreamResponse:
        return await st.pipeline.handle(request, "chat")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await st.pipeline.handle(request, "completion")

    def admitted(kind: Kind) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await st.pipeline.handle(request, kind)

        return handle

    forwarder: list[Forwarder] = []  # built with the upstream session at start-up

    def forwarded(
        path: str, dialect: Dialect
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await forwarder[0].by_model(request, path, dialect)

        return handle

    async def stored_response(request: web.Request) -> web.StreamResponse:
        return await forwarder[0].stored_response(request)

    models = ModelsApi(
        lambda: st.tenants, st.door.report.models, lambda m: st.discovery.bases_of(m)
    )

    ops = OperationsApi(st)

    known_paths = set(UPSTREAM_PATHS.values()) | {
        "/rerank",
        "/v2/rerank",
        "/score",
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
        "/admin/replicas",
        "/admin/state",
    }

    async def fallback(request: web.Request) -> web.Response:
        # Anthropic's clients get Anthropic's error objects under its paths.
        dialect: Dialect = "anthropic" if request.path.startswith("/v1/messages") else "openai"
        if request.path in known_paths:
            return ApiError(
                405,
                f"Method {request.method} not allowed on {request.path}.",
                code="method_not_allowed",
            ).response(None, dialect)
        return ApiError(404, f"Unknown path {request.path}.", code="not_found").response(
            None, dialect
        )

    handlers: list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]] = [
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/completions", completions),
        ("POST", "/v1/responses", admitted("responses")),
        ("GET", "/v1/responses/{response_id}", stored_response),
        ("DELETE", "/v1/responses/{response_id}", stored_response),
        ("GET", "/v1/responses/{response_id}/input_items", stored_response),
        ("POST", "/v1/responses/{response_id}/cancel", stored_response),
        ("POST", "/v1/messages", admitted("messages")),
        ("POST", "/v1/embeddings", admitted("embeddings")),
        *(("POST", path, admitted("rerank")) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
        *(("POST", path, admitted("score")) for path in ("/score", "/v1/score")),
        ("POST", "/classify", admitted("classify")),
        ("POST", "/pooling", admitted("pooling")),
        ("POST", "/v1/audio/transcriptions", admitted("transcription")),
        ("POST", "/v1/audio/translations", admitted("translation")),
        ("POST", "/v1/messages/count_tokens", forwarded("/v1/messages/count_tokens", "anthropic")),
        ("POST", "/tokenize", forwarded("/tokenize", "openai")),
        ("POST", "/detokenize", forwarded("/detokenize", "openai")),
        ("GET", "/v1/models", models.list),
        ("GET", "/v1/models/{model}", models.get),
        ("GET", "/health", ops.health),
        ("GET", "/ready", ops.ready),
        ("GET", "/metrics", ops.metrics),
        ("GET", "/admin/replicas", ops.admin_replicas),
        ("GET", "/admin/state", ops.admin_state),
    ]
    for method, path, handler in handlers:
        app.router.add_route(method, path, handler)
    app.router.add_route("*", "/{tail:.*}", fallback)
    return app


_RUNNER_SHUTDOWN_S = 2.0
_STUCK_REPORT_S = 6.0  # a stop this long logs where it waits
_STOP_LIMIT_S = 10.0  # and this long is given up on


class Gateway:
    """An embeddable kvgate: ``async with Gateway(config) as gw: gw.url, gw.report``."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        host: str | None = None,
        port: int | None = None,
        picker: Router | None = None,
        state_backend: StateBackend | None = None,
        workers_hint: int = 1,
        reuse_port: bool = False,
        config_path: str | None = None,
    ) -> None:
        self.config = config
        self.host = host if host is not None else config.listen.host
        self.port = port if port is not None else config.listen.port
        self.reuse_port = reuse_port  # SO_REUSEPORT: several processes on one port
        self.app = build_app(
            config,
            picker=picker,
            state_backend=state_backend,
            workers_hint=workers_hint,
            config_path=config_path,
        )
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    @property
    def state(self) -> GatewayState:
        return self.app[STATE_KEY]

    async def reload(self, why: str = "SIGHUP") -> bool:
        """Reload the config file it was started with (gateway/reload.py)."""
        reloader = self.state.reloader
        if reloader is None:
            log.warning("kvgate: %s, but there is no config file to reload", why)
            return False
        return await reloader.reload(why)

    @property
    def door(self) -> AdmissionDoor:
        """Where admission is changed (every change returns what it caused)."""
        return self.state.door

    @property
    def report(self) -> AdmissionReport:
        """Every read of admission: ledger, queue, learned limits."""
        return self.state.door.report

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def runner(self) -> web.AppRunner:
        assert self._runner is not None, "gateway not started"
        return self._runner

    async def start(self) -> None:
        self._runner = web.AppRunner(
            self.app,
            handler_cancellation=True,
            access_log=None,
            # aiohttp's own wait for handlers at cleanup (default 60 s, twice over): ours
            # has already drained and cut them by then (shutdown), so a handler that still
            # runs is stuck and must not hold the process for minutes.
            shutdown_timeout=_RUNNER_SHUTDOWN_S,
            **server_kwargs(self.config.limits),
        )
        await self._runner.setup()
        install_error_handler(self._runner, self.config.limits)
        self._site = web.TCPSite(
            self._runner,
            self.host,
            self.port,
            backlog=1024,
            reuse_address=True,
            reuse_port=self.reuse_port or None,
        )
        await self._site.start()
        socks = conns.listening_sockets(self._site)  # the only way to learn port 0's pick
        if socks:
            self.port = socks[0].getsockname()[1]
        log.info("kvgate listening on %s", self.url, extra={"fields": {"url": self.url}})
        if (warning := exposure_warning(self.config, self.host)) is not None:
            log.warning(warning, extra={"fields": {"host": self.host}})

    async def drain(self, limit_s: float = 10.0) -> bool:
        """Wait until no request is in flight and no abandoned request's reservation is
        held (at most ``admission.abandoned_hold_s``); False if `limit_s` passed first."""
        try:
            async with asyncio.timeout(limit_s):
                await self.state.pipeline.idle.wait()
                # The sans-IO controller sets no event; holds end within a discovery
                # round or abandoned_hold_s, so a short poll at shutdown is enough.
                while self.report.held():  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
            return True
        except TimeoutError:
            return False

    async def shutdown(
        self, grace_s: float | None = None, *, fast: asyncio.Event | None = None
    ) -> dict[str, int | bool]:
        """Graceful shutdown: ``/ready`` turns false and new requests get 503 at once,
        queued requests are shed (503 with Retry-After), running ones get `grace_s`
        (default ``shutdown.drain_grace_s``) to finish, or until `fast` is set; then they
        are cut (streams end with an error event) and the gateway stops.

        The listener stays open ``shutdown.listen_grace_s`` (at most the drain grace), so
        a load balancer that has not yet seen ``/ready`` turn false gets a 503 with
        Retry-After, not a refused connection; then new connections are refused. Even a
        gateway with nothing in flight waits that long before it stops (unless `fast`)."""
        grace = self.config.shutdown.drain_grace_s if grace_s is None else grace_s
        listen_grace = min(self.config.shutdown.listen_grace_s, grace)
        pipeline = self.state.pipeline
        loop = asyncio.get_running_loop()
        shed = pipeline.begin_shutdown()
        conns.close_idle(self.runner.server)  # now, while it listens (gateway/connections.py)
        log.info("kvgate shutting down", extra={"fields": {"shed": shed, "grace_s": grace}})
        close_at = loop.time() + listen_grace
        closer = asyncio.ensure_future(self._close_listener_at(close_at, fast))
        waits = [asyncio.ensure_future(pipeline.idle.wait())]
        if fast is not None:
            waits.append(asyncio.ensure_future(fast.wait()))
        try:
            await asyncio.wait(waits, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
            if fast is None or not fast.is_set():
                # Drained early: keep answering 503 until the listen grace is over.
                await asyncio.wait([closer], timeout=max(0.0, close_at - loop.time()))
        finally:
            for w in waits:
                w.cancel()
            closer.cancel()
        await self._close_listener()
        await conns.answer_first_requests(self.runner.server)
        drained = pipeline.idle.is_set()
        cut = 0
        if not drained:
            cut = pipeline.cut_running()
            # Cut handlers answer at once; bound the wait anyway.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5.0):
                    await pipeline.idle.wait()
        # Every request is answered by now. If stopping overruns, say what it waits for
        # (the stacks of the tasks left), and give up on it after a bound: a cleanup that
        # hangs must not keep a drained process from exiting.
        report = loop.call_later(_STUCK_REPORT_S, log_pending_tasks, asyncio.current_task())
        try:
            async with asyncio.timeout(_STOP_LIMIT_S):
                if self.state.sync is not None:
                    # Leases first (bounded by the backend's timeout), so the others get
                    # this process's slices at once even if the rest of the stop hangs.
                    await self.state.sync.stop()
                await self.stop()
        except TimeoutError:
            log.error("kvgate: stopping took over %.1f s; exiting without it", _STOP_LIMIT_S)
        finally:
            report.cancel()
        return {"shed": shed, "cut": cut, "drained": drained}

    async def _close_listener_at(self, when: float, fast: asyncio.Event | None) -> None:
        await wait_until(when, fast)
        await self._close_listener()

    async def _close_listener(self) -> None:
        """Stop accepting connections; open ones (running requests) go on, and the ones
        the kernel had queued are accepted first (gateway/connections.py)."""
        if self._site is not None and self._runner is not None:
            site, self._site = self._site, None
            server = self.runner.server
            assert server is not None  # set up in start()
            queued = await conns.stop_accepting(site, server)
            log.info("kvgate stopped accepting connections", extra={"fields": {"queued": queued}})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
            self._site = None

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
