"""Prometheus metrics of the HTTP server (``GET /metrics``, text format).

Counted by the front door and the engine: requests by outcome, prompt and generated tokens,
time to first token and inter-token latency (a step's k tokens arrive together: each of them
is observed at the step's gap over k). Read from the server's ``ServerStats`` at scrape time:
τ, acceptance by draft position, the draft / verify / accept / other / prefill split of the
step time, steps; and the engine's queue depth, live requests and KV cache rows.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from treespec.cli.serve.engine import Engine, EngineObserver, Job

OUTCOMES = ("stop", "length", "cancelled", "error", "rejected_queue_full", "bad_request", "draining")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                   1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics(EngineObserver):
    """One registry per app (tests run several servers in one process)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("treespec_requests", "HTTP completion requests by outcome", ["outcome"], registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("treespec_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("treespec_generation_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("treespec_time_to_first_token_seconds", "submit to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("treespec_inter_token_latency_seconds",
                             "gap between a request's steps over the tokens the later step gave",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.engine: Engine | None = None

    def attach(self, engine: Engine) -> None:
        """Read the engine's server stats and queue at scrape time."""
        self.engine = engine
        self.registry.register(_EngineCollector(engine))

    # EngineObserver (called on the loop thread)
    def on_tokens(self, job: Job, count: int, now: float) -> None:
        self.generation_tokens.inc(count)
        if job.first_token_at is None:
            self.ttft.observe(now - job.submitted)
            rest, since = count - 1, None
        else:
            rest, since = count, job.last_token_at
        if since is not None and rest > 0:
            gap = (now - since) / rest
            for _ in range(rest):
                self.itl.observe(gap)

    def on_finish(self, job: Job, outcome: str) -> None:
        self.requests.labels(outcome).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        engine = self.engine
        stats = engine.server.stats
        yield GaugeMetricFamily("treespec_queue_depth", "requests waiting to join the batch",
                                value=engine.queue_depth)
        yield GaugeMetricFamily("treespec_live_requests", "requests being decoded", value=engine.live)
        yield GaugeMetricFamily("treespec_kv_rows", "target KV cache rows held (one per live request; 0 when idle)",
                                value=engine.server.verifier.batch_size)
        yield GaugeMetricFamily("treespec_tau", "mean tokens a request emits per target forward (accepted + 1)",
                                value=stats.tau)
        steps = CounterMetricFamily("treespec_steps", "target verify forwards (one per step for the whole batch)")
        steps.add_metric([], stats.steps)
        yield steps
        phase = CounterMetricFamily("treespec_step_seconds", "time of the engine's steps by phase", labels=["phase"])
        for name, value in (("draft", stats.draft_time), ("verify", stats.verify_time),
                            ("accept", stats.accept_time), ("other", stats.other_time),
                            ("prefill", stats.prefill_time)):
            phase.add_metric([name], value)
        yield phase
        attempts = CounterMetricFamily("treespec_draft_attempts", "steps that tried a draft token at a position",
                                       labels=["position"])
        accepts = CounterMetricFamily("treespec_draft_accepts", "draft tokens accepted at a position",
                                      labels=["position"])
        rate = GaugeMetricFamily("treespec_acceptance_rate", "accepted / attempted draft tokens by position",
                                 labels=["position"])
        for d, (t, a) in enumerate(zip(stats.depth_attempts, stats.depth_accepts)):
            attempts.add_metric([str(d + 1)], t)
            accepts.add_metric([str(d + 1)], a)
            rate.add_metric([str(d + 1)], a / t if t else 0.0)
        yield attempts
        yield accepts
        yield rate
