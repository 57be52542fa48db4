"""The engine's events as Triton custom metrics, served on Triton's metrics port next to its own.

Prometheus names with units. Importable only inside a Python stub.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from llm.sequence import Metrics

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]


class TritonMetrics(Metrics):
    def __init__(self, model: str, version: str, kv_cache_tokens: int) -> None:
        labels = {"model": model, "version": version}
        families = []  # a family must outlive its metrics, so it lives as long as this object

        def _metric(name: str, description: str, kind, labels: dict, **kwargs):
            families.append(pb_utils.MetricFamily(name=name, description=description, kind=kind))
            return families[-1].Metric(labels=labels, **kwargs)

        self._families = families
        counter, gauge, histogram = (
            pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.HISTOGRAM
        )
        self.prompt_tokens = _metric("llm_prompt_tokens_total", "Prompt tokens prefilled", counter, labels)
        self.generation_tokens = _metric("llm_generation_tokens_total", "Tokens generated", counter, labels)
        self.forwards = _metric(
            "llm_forward_passes_total", "Forward passes (decode rows and prompt chunks together); tokens / passes = batch", counter, labels
        )
        self.running = _metric("llm_requests_running", "Requests in the running batch", gauge, labels)
        self.waiting = _metric("llm_requests_waiting", "Requests queued for the KV budget", gauge, labels)
        self.kv_tokens = _metric("llm_kv_cache_tokens", "KV cache slots reserved by admitted requests (whole blocks)", gauge, labels)
        self.kv_budget = _metric("llm_kv_cache_budget_tokens", "KV cache slots allowed (kv_cache_tokens)", gauge, labels)
        self.kv_budget.set(kv_cache_tokens)
        self.rejections = _metric(
            "llm_requests_rejected_total", "Requests refused for overload (queue full or waited too long)", counter, labels
        )
        self.ttft = _metric(
            "llm_time_to_first_token_seconds", "From arrival at llm to the first token", histogram, labels,
            buckets=TTFT_BUCKETS,
        )
        self.tpot = _metric(
            "llm_time_per_output_token_seconds", "Between two tokens of one request", histogram, labels,
            buckets=TPOT_BUCKETS,
        )

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens.increment(prompt_tokens)

    def tokens(self, first: list[float], later: list[float]) -> None:
        self.generation_tokens.increment(len(first) + len(later))
        for seconds in first:
            self.ttft.observe(seconds)
        for seconds in later:
            self.tpot.observe(seconds)

    def forward(self, rows: int) -> None:
        self.forwards.increment(1)

    def rejected(self) -> None:
        self.rejections.increment(1)

    def step(self, running: int, waiting: int, kv_tokens: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_tokens.set(kv_tokens)
