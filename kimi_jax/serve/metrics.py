"""Prometheus metrics for /metrics, with vLLM's names where one exists.

From the engine at scrape time (``EngineCollector``):
  vllm:num_requests_running, vllm:num_requests_waiting (gauges), vllm:kv_cache_usage_perc (gauge: pages held by
  sequences / pages), vllm:prompt_tokens_total, vllm:generation_tokens_total, vllm:prefix_cache_queries_total,
  vllm:prefix_cache_hits_total (counters, in tokens: their ratio is the hit rate), kimi_jax:free_slots,
  kimi_jax:max_num_seqs, kimi_jax:engine_alive (gauges), kimi_jax:xla_compilations_total, kimi_jax:engine_steps_total
  (counters); with speculative decoding vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
  vllm:spec_decode_num_accepted_tokens_total (counters).
Per finished request (observed on the engine thread, ``on_request_done``):
  vllm:time_to_first_token_seconds, vllm:time_per_output_token_seconds (the request's mean inter-token time),
  vllm:e2e_request_latency_seconds, vllm:request_prompt_tokens, vllm:request_generation_tokens (histograms),
  vllm:request_success_total{finished_reason} (counter).
Every series carries ``model_name``.  Each server has its own registry (several servers can share a process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000,
                  500000, 1000000)


class EngineCollector:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        s = self.engine.stats()
        name = [self.model_name]

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, float(value))
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, float(value))
            return c

        busy = s["max_num_seqs"] - s["free_slots"]
        yield gauge("vllm:num_requests_running", "Requests with sequences in decode slots.", s["num_requests_running"])
        yield gauge("vllm:num_requests_waiting", "Requests queued or being prefilled.", s["num_requests_waiting"])
        total = s.get("total_blocks", 0)
        usage = s["used_blocks"] - s.get("prefix_cache_blocks", 0) if "used_blocks" in s else busy
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of the paged KV cache held by sequences (1 = full; pages "
                    "only the prefix cache holds count as free, as they are evicted on demand).",
                    usage / total if total > 0 else busy / s["max_num_seqs"])
        yield counter("vllm:prompt_tokens", "Prefilled prompt tokens.", s["prompt_tokens_total"])
        yield counter("vllm:generation_tokens", "Generated tokens.", s["generation_tokens_total"])
        if "prefix_cache_query_tokens" in s:  # hit rate = hits / queries
            yield counter("vllm:prefix_cache_queries", "Prompt tokens of new requests looked up in the prefix cache.",
                          s["prefix_cache_query_tokens"])
            yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                          s["prefix_cache_hit_tokens"])
        yield gauge("kimi_jax:free_slots", "Free cache slots.", s["free_slots"])
        if "free_blocks" in s:
            yield gauge("kimi_jax:free_blocks", "Free pages of the paged MLA cache.", s["free_blocks"])
            yield gauge("kimi_jax:total_blocks", "Pages of the paged MLA cache (the null page excluded).",
                        s["total_blocks"])
        yield gauge("kimi_jax:max_num_seqs", "Cache slots (max concurrent sequences).", s["max_num_seqs"])
        yield gauge("kimi_jax:engine_alive", "1 while the engine loop runs.", 1.0 if s["alive"] else 0.0)
        yield counter("kimi_jax:xla_compilations", "XLA backend compilations in this process.", s["compilations"])
        yield counter("kimi_jax:engine_steps", "Batched decode steps run.", s["num_steps"])
        if s.get("speculative_tokens"):
            yield counter("vllm:spec_decode_num_drafts", "Speculative verify steps run.", s["spec_verify_steps"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", s["spec_draft_tokens"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", s["spec_accepted_tokens"])


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        reg, lab = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token of a request.",
                              lab, buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", lab,
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", lab,
                                       buckets=_TOKEN_BUCKETS, registry=reg)
        self.gen_tokens = Histogram("vllm:request_generation_tokens", "Generated tokens per request.", lab,
                                    buckets=_TOKEN_BUCKETS, registry=reg)
        self.success = Counter("vllm:request_success", "Finished requests by reason.", lab + ["finished_reason"],
                               registry=reg)
        for h in (self.ttft, self.tpot, self.e2e, self.prompt_tokens, self.gen_tokens):
            h.labels(model_name)  # export empty series from the start, as vLLM does
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)
        reg.register(EngineCollector(engine, model_name))
        engine.listeners.append(self)

    def on_request_done(self, done) -> None:
        m = self.model_name
        if done.first_token_time is not None:
            self.ttft.labels(m).observe(done.first_token_time - done.arrival_time)
            most = max(done.num_generated or [0])
            if most > 1:
                self.tpot.labels(m).observe((done.finish_time - done.first_token_time) / (most - 1))
        self.e2e.labels(m).observe(done.finish_time - done.arrival_time)
        self.prompt_tokens.labels(m).observe(done.num_prompt_tokens)
        self.gen_tokens.labels(m).observe(done.num_generated_total)
        for r in done.finish_reasons:
            self.success.labels(m, r).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
