"""``GET /metrics``: what a Prometheus server scrapes from each ``kvshelf serve`` node.

One registry per app (never prometheus-client's global one), so several servers in one
process (tests, an embedding application) keep their own figures. What is exported:

* ``kvshelf_http_requests_total{method,route,status}`` and
  ``kvshelf_http_errors_total{route,status}`` (every answer with a 4xx or 5xx status);
  a route is the endpoint's template (``/v1/agents/{id}``), never an agent id, so the
  number of series stays fixed however many agents there are;
* ``kvshelf_time_to_first_token_seconds{cache}`` and ``kvshelf_time_per_output_token_seconds``
  histograms, over every answered turn (``cache`` is hot, warm, cold or none);
* ``kvshelf_prompt_tokens_total`` and ``kvshelf_cached_tokens_total`` (rate them in
  PromQL for a window) and ``kvshelf_cached_token_ratio``, their ratio since start;
* ``kvshelf_agents_resident`` / ``kvshelf_resident_bytes`` (in this node's RAM) and
  ``kvshelf_store_agents`` / ``kvshelf_store_bytes`` (records in the store: on a shared
  store, every node's), read when scraped;
* the store's own counters (round trips, failures, ownership takeovers, refused stale
  writes) when the engine's store keeps them, and ``kvshelf_node_info{node}``, ``kvshelf_draining``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvshelf.runtime.results import ChatResult, Residency

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
STORE_COUNTERS = {
    "round_trips": "Requests this node made to the record store",
    "failures": "Store requests that failed",
    "takeovers": "Agents this node loaded from a record another node wrote (ownership moved here)",
    "stale_reloads": "RAM copies found older than the store's record before reuse (the newer record was loaded)",
    "refused_writes": "Writes the store refused because a newer record was there (a stale writer was fenced off)",
}
_ROUTES = (
    (re.compile(r"^/v1/agents/[^/]+/(fork|append)$"), r"/v1/agents/{id}/\1"),
    (re.compile(r"^/v1/agents/[^/]+$"), "/v1/agents/{id}"),
)
_PLAIN_ROUTES = {"/v1/chat/completions", "/v1/models", "/v1/tokenize", "/v1/agents", "/health", "/metrics"}


def route_of(path: str) -> str:
    """The endpoint template a path belongs to ("other" for a path no endpoint serves)."""
    if path in _PLAIN_ROUTES:
        return path
    for pattern, template in _ROUTES:
        if pattern.match(path):
            return pattern.sub(template, path)
    return "other"


class NodeMetrics:
    """This node's counters and histograms, and the gauges read at each scrape.

    ``residency`` says where the agents are; ``store_counters`` returns the store's
    counters as a mapping of ``STORE_COUNTERS`` names to totals (or None when the
    store keeps none); ``draining`` whether the node is draining."""

    def __init__(
        self,
        node_id: str,
        residency: Callable[[], Residency],
        store_counters: Callable[[], Mapping[str, int] | None] = lambda: None,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvshelf_http_requests", "HTTP requests answered", ["method", "route", "status"], registry=r
        )
        self.errors = Counter(
            "kvshelf_http_errors", "HTTP answers with a 4xx or 5xx status", ["route", "status"], registry=r
        )
        self.ttft = Histogram(
            "kvshelf_time_to_first_token_seconds",
            "Time from a turn's start to its first token, by where the agent's cache came from",
            ["cache"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.per_token = Histogram(
            "kvshelf_time_per_output_token_seconds",
            "Decode time per generated token after the first, one observation per turn",
            buckets=PER_TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("kvshelf_prompt_tokens", "Prompt tokens of answered turns", registry=r)
        self.cached_tokens = Counter(
            "kvshelf_cached_tokens", "Prompt tokens served from an agent's cache instead of computed", registry=r
        )
        self.prompt_total = self.cached_total = 0  # for the ratio gauge (a Counter's value is not public)
        r.register(_ScrapeTime(node_id, residency, store_counters, draining, self))

    def observe_request(self, method: str, path: str, status: int) -> None:
        route = route_of(path)
        self.requests.labels(method, route, str(status)).inc()
        if status >= 400:
            self.errors.labels(route, str(status)).inc()

    def observe_turn(self, result: ChatResult) -> None:
        """One answered turn: its TTFT, its time per token and its cached share."""
        u = result.usage
        self.ttft.labels(result.cache).observe(result.ttft_s)
        if u.completion_tokens > 1:
            self.per_token.observe(max(result.total_s - result.ttft_s, 0.0) / (u.completion_tokens - 1))
        self.prompt_tokens.inc(u.prompt_tokens)
        self.cached_tokens.inc(u.cached_tokens)
        self.prompt_total += u.prompt_tokens
        self.cached_total += u.cached_tokens

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)


class _ScrapeTime(Collector):
    """The figures read when scraped rather than counted as they happen."""

    def __init__(
        self,
        node_id: str,
        residency: Callable[[], Residency],
        store_counters: Callable[[], Mapping[str, int] | None],
        draining: Callable[[], bool],
        metrics: NodeMetrics,
    ) -> None:
        self.node_id, self.residency, self.store_counters, self.draining = node_id, residency, store_counters, draining
        self.metrics = metrics

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names are only known once collected (the store's counters may be absent)

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily("kvshelf_node_info", "This node's id (the X-KVShelf-Node header)", labels=["node"])
        info.add_metric([self.node_id], 1)
        yield info
        yield GaugeMetricFamily("kvshelf_draining", "1 while the node drains (SIGTERM)", value=int(self.draining()))
        prompt, cached = self.metrics.prompt_total, self.metrics.cached_total
        yield GaugeMetricFamily(
            "kvshelf_cached_token_ratio",
            "Cached prompt tokens over prompt tokens, since the node started (0 before any turn)",
            value=cached / prompt if prompt else 0.0,
        )
        where = self.residency()
        yield GaugeMetricFamily(
            "kvshelf_agents_resident", "Agents whose cache is in this node's RAM", value=where.ram_agents
        )
        yield GaugeMetricFamily(
            "kvshelf_resident_bytes", "Bytes of the caches in this node's RAM", value=where.ram_bytes
        )
        yield GaugeMetricFamily("kvshelf_store_agents", "Agents with a record in the store", value=where.store_agents)
        yield GaugeMetricFamily("kvshelf_store_bytes", "Bytes of the records in the store", value=where.store_bytes)
        counters = self.store_counters()
        if counters is not None:
            for name, doc in STORE_COUNTERS.items():
                yield CounterMetricFamily(f"kvshelf_store_{name}", doc, value=counters.get(name, 0))
