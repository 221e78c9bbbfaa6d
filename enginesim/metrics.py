"""Prometheus metrics of a simulated replica, under the names the real engines use.

kvgate's engine adapters read vLLM's and SGLang's own metric names, so the simulator must
expose exactly those (names, label sets, units), and nothing else needs to know them.

Gauges and counters are not kept twice: a custom collector reads the core's
`EngineStats` at scrape time, so the exposition can never drift from what the core did.
Only latency histograms are observed as requests progress (by the driver, in simulated
seconds), because the core has no notion of request latency as a client sees it.

Each server owns its `CollectorRegistry`, so several replicas can live in one process
(tests, the demo, benches) without their series colliding.

llama.cpp's `/metrics` is rendered by hand, as llama-server writes it (`llamacpp:` names,
`# HELP`/`# TYPE` lines naming the full metric, values printed as C++ streams print a
double): it has no histograms and no labels, and its two throughput gauges average over
the window since the previous scrape, so each scrape starts a new window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from enginesim.types import EngineStats, Flavor, LlamaCppStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket boundaries as vLLM V1 publishes them (seconds).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class _StatsCollector(Collector):
    """Gauges and counters rendered from the core's stats at scrape time."""

    def __init__(
        self,
        *,
        flavor: Flavor,
        model_name: str,
        stats: Callable[[], EngineStats],
        speculative: bool,
        max_running_requests: int,
    ) -> None:
        self._flavor = flavor
        self._model = model_name
        self._stats = stats
        self._speculative = speculative
        self._max_running = max_running_requests

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        if self._flavor is Flavor.SGLANG:
            yield from self._sglang(s)
        else:
            yield from self._vllm(s)

    def _vllm(self, s: EngineStats) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        values = [self._model, "0"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            s.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            s.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            s.kv_usage,
        )
        # vLLM publishes the cache config as an info-style gauge without model_name.
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size", "cache_dtype", "enable_prefix_caching", "engine",
                "num_cpu_blocks", "num_gpu_blocks", "prefix_caching_hash_algo",
            ],
        )  # fmt: skip
        info.add_metric(
            [
                str(s.block_size),
                "auto",
                str(s.enable_prefix_caching),
                "0",
                "None",
                str(s.num_gpu_blocks),
                "sha256",
            ],  # fmt: skip
            1.0,
        )
        yield info
        yield counter(
            "vllm:num_preemptions",
            "Cumulative number of preemptions from the engine.",
            s.num_preemptions,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_cache_hits,
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens)
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            s.generation_tokens,
        )
        if self._speculative:
            yield counter(
                "vllm:spec_decode_num_drafts",
                "Number of spec decoding drafts.",
                s.spec_num_drafts,
            )
            yield counter(
                "vllm:spec_decode_num_draft_tokens",
                "Number of draft tokens.",
                s.spec_num_draft_tokens,
            )
            yield counter(
                "vllm:spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
                s.spec_num_accepted_tokens,
            )
            per_pos = CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted tokens per draft position.",
                labels=[*labels, "position"],
            )
            for pos, n in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([*values, str(pos)], n)
            yield per_pos

    def _sglang(self, s: EngineStats) -> Iterator[Metric]:
        labels = ["model_name"]
        values = [self._model]
        pool_tokens = s.num_gpu_blocks * s.block_size

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            return c

        yield gauge("sglang:num_running_reqs", "The number of running requests.", s.num_running)
        yield gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue.", s.num_waiting
        )
        yield gauge(
            "sglang:num_used_tokens", "The number of used tokens.", s.blocks_in_use * s.block_size
        )
        yield gauge("sglang:token_usage", "The token usage.", s.kv_usage)
        yield gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            pool_tokens,
        )
        yield gauge(
            "sglang:max_running_requests",
            "Maximum number of concurrently running requests.",
            self._max_running,
        )
        # SGLang reports the hit rate of recent prefills; the simulator reports the
        # lifetime ratio, which is what an adapter smoothing the gauge converges to.
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate)
        # Accept length counts the bonus token, as SGLang's does: tokens emitted per
        # verification step. 0 while speculation is off or has not run.
        accept_len = (
            1.0 + s.spec_num_accepted_tokens / s.spec_num_drafts
            if self._speculative and s.spec_num_drafts
            else 0.0
        )
        yield gauge("sglang:spec_accept_length", "The average acceptance length.", accept_len)
        yield counter(
            "sglang:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens
        )
        yield counter(
            "sglang:generation_tokens",
            "Number of generation tokens processed.",
            s.generation_tokens,
        )
        yield counter(
            "sglang:num_requests", "Number of requests processed.", s.num_finished + s.num_aborted
        )
        # SGLang calls preemption "retraction": a running request gives its KV back.
        yield counter(
            "sglang:num_retracted_reqs",
            "Number of retracted (preempted) requests.",
            s.num_preemptions,
        )


def render_llamacpp(s: LlamaCppStats, kv_cache_metrics: bool = False) -> str:
    """llama-server's `/metrics` text for `s`.

    Names and help strings are those of llama.cpp's `server_task_result_metrics`. With
    `kv_cache_metrics` the two KV gauges that builds before llama.cpp PR #13660 (May
    2025) exported are added; current builds do not export them.
    """
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
         s.prompt_tokens_processed),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
         s.prompt_tokens_cached),
        ("prompt_seconds_total", "Total time spent processing prompts", s.prompt_seconds),
        ("tokens_predicted_total", "Number of generation tokens processed", s.tokens_predicted),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens",
         s.tokens_predicted_seconds),
        ("n_decode_total", "Total number of llama_decode() calls, excluding speculative "
         "decoding and multimodal decoding", s.n_decode),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)",
         s.n_tokens_max),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated",
         s.spec_num_draft_tokens),
        ("spec_decode_num_accepted_tokens_total",
         "Speculative: Total draft tokens accepted by the target model",
         s.spec_num_accepted_tokens),
        ("spec_decode_num_drafts_total",
         "Speculative: Total speculative decoding verification steps", s.spec_num_drafts),
    ]  # fmt: skip
    prompt_rate = (
        s.prompt_bucket_tokens / s.prompt_bucket_seconds if s.prompt_bucket_seconds else 0.0
    )
    predict_rate = (
        s.predict_bucket_steps / s.predict_bucket_seconds if s.predict_bucket_seconds else 0.0
    )
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt_rate),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
         predict_rate),
    ]  # fmt: skip
    if kv_cache_metrics:
        held = s.blocks_in_use + s.cached_free_blocks
        gauges += [
            ("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.",
             held / s.num_gpu_blocks if s.num_gpu_blocks else 0.0),
            ("kv_cache_tokens", "KV-cache tokens.", held),
        ]  # fmt: skip
    gauges += [
        ("requests_processing", "Number of requests processing", s.num_running),
        ("requests_deferred", "Number of requests deferred", s.num_waiting),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         s.n_busy_slots / max(s.n_decode, 1)),
    ]  # fmt: skip
    lines = []
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, doc, value in items:
            lines += [
                f"# HELP llamacpp:{name} {doc}",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {float(value):g}",
            ]
    return "\n".join(lines) + "\n"


class EngineMetrics:
    """The metric registry of one simulated replica.

    `stats` is read on every scrape. The driver calls the `observe_*` methods with
    simulated seconds.
    """

    def __init__(
        self,
        *,
        flavor: Flavor,
        model_name: str,
        stats: Callable[[], EngineStats],
        speculative: bool,
        max_running_requests: int,
        on_scrape: Callable[[], None] | None = None,
        kv_cache_metrics: bool = False,
    ) -> None:
        self.flavor = flavor
        self.model_name = model_name
        self._stats = stats
        self._on_scrape = on_scrape
        self._kv_cache_metrics = kv_cache_metrics
        self.registry = CollectorRegistry()
        self._success: Counter | None = None
        self._ttft: Histogram | None = None
        self._itl: Histogram | None = None
        self._e2e: Histogram | None = None
        if flavor is Flavor.LLAMACPP:
            return  # rendered by hand from the stats; llama-server has no histograms
        self.registry.register(
            _StatsCollector(
                flavor=flavor,
                model_name=model_name,
                stats=stats,
                speculative=speculative,
                max_running_requests=max_running_requests,
            )
        )
        prefix = "sglang" if flavor is Flavor.SGLANG else "vllm"
        labels = ["model_name"] if flavor is Flavor.SGLANG else ["model_name", "engine"]
        values = [model_name] if flavor is Flavor.SGLANG else [model_name, "0"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"{prefix}:{name}", doc, labels, buckets=buckets, registry=self.registry
            ).labels(*values)

        self._ttft = histogram(
            "time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self._itl = histogram(
            "inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            ITL_BUCKETS,
        )
        self._e2e = histogram(
            "e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds.",
            E2E_BUCKETS,
        )
        if flavor is Flavor.VLLM:
            self._success = Counter(
                "vllm:request_success",
                "Count of successfully processed requests.",
                ["model_name", "engine", "finished_reason"],
                registry=self.registry,
            )
            for reason in ("stop", "length", "abort"):
                self._success.labels(model_name, "0", reason)

    def observe_first_token(self, seconds: float) -> None:
        if self._ttft is not None:
            self._ttft.observe(max(0.0, seconds))

    def observe_inter_token(self, seconds: float) -> None:
        if self._itl is not None:
            self._itl.observe(max(0.0, seconds))

    def observe_finished(self, e2e_seconds: float, finish_reason: str) -> None:
        """A request ended inside the engine (stop or length), after `e2e_seconds`."""
        if self._e2e is not None:
            self._e2e.observe(max(0.0, e2e_seconds))
        if self._success is not None:
            self._success.labels(self.model_name, "0", finish_reason).inc()

    def observe_aborted(self) -> None:
        """A request was aborted (client gone, or the engine gave up on it)."""
        if self._success is not None:
            self._success.labels(self.model_name, "0", "abort").inc()

    def render(self) -> bytes:
        if self.flavor is Flavor.LLAMACPP:
            stats = self._stats()
            assert isinstance(stats, LlamaCppStats)
            text = render_llamacpp(stats, self._kv_cache_metrics)
            if self._on_scrape is not None:
                self._on_scrape()
            return text.encode()
        return generate_latest(self.registry)
