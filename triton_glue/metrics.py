"""The engine's events as Triton custom metrics, served on Triton's metrics port next to its own.

Prometheus names with units. Importable only inside a Python stub. Every update of a Triton metric is a
round trip to the server process, so the engine's calls only record (it makes them in its decode loop),
and ``flush`` hands the records over from the responder thread: every 0.1 s, and before a request's first
and final answers (``llm/service.py``), gauges only when they moved.
"""

from __future__ import annotations

import threading

import triton_python_backend_utils as pb_utils

from llm.compiles import COMPILATIONS
from llm.metrics import EngineMetrics

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]


class TritonMetrics(EngineMetrics):
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
        self.prompt_tokens = _metric("llm_prompt_tokens_total", "Prompt tokens of admitted requests (cached ones "
                                     "included)", counter, labels)
        self.prefix_queries = _metric("llm_prefix_cache_queries_tokens_total", "Prompt tokens looked up in the prefix "
                                      "cache (every admitted prompt's, while prefix_caching is on)", counter, labels)
        self.prefix_hits = _metric("llm_prefix_cache_hits_tokens_total", "Prompt tokens found in the prefix cache: "
                                   "their prefill was skipped; hits / queries = hit rate", counter, labels)
        self.prefix_blocks = _metric("llm_prefix_cache_blocks", "KV blocks (16 slots) holding registered prefixes, in "
                                     "use or evictable", gauge, labels)
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
        self.compilations = _metric(
            "llm_compilations_total",
            "Compilations of the forward pass (traced, compiled or loaded from the cache); all happen at load, "
            "so growth after ready means a request waited on the compiler", counter, labels,
        )
        self.cuda_graphs = _metric("llm_cuda_graphs", "Step shapes captured as CUDA graphs at load", gauge, labels)
        self.weight_bytes = _metric("llm_weight_bytes", "Bytes of weights a decode step reads, as the weights setting "
                                    "keeps them (the input embedding, read a row at a time, left out)", gauge, labels)
        self.ttft = _metric(
            "llm_time_to_first_token_seconds", "From arrival at llm to the first token", histogram, labels,
            buckets=TTFT_BUCKETS,
        )
        self.tpot = _metric(
            "llm_time_per_output_token_seconds", "Between two tokens of one request", histogram, labels,
            buckets=TPOT_BUCKETS,
        )

        self._lock = threading.Lock()  # the engine thread records, the responder flushes, execute rejects
        self._counts = {"prompt": 0, "generation": 0, "forwards": 0, "rejections": 0, "queries": 0, "hits": 0}
        self._first: list[float] = []
        self._later: list[float] = []
        self._gauges: tuple[int, int, int, int] | None = None
        self._published: tuple[int, int, int, int] | None = None  # the gauges as last set
        self._compiled = 0  # COMPILATIONS.count as last published

    def loaded(self, cuda_graphs: int, weight_bytes: int) -> None:
        """The engine is built: what it compiled and captured at load, and the weights it reads a step."""
        self.cuda_graphs.set(cuda_graphs)
        self.weight_bytes.set(weight_bytes)
        self._publish_compilations()

    def _publish_compilations(self) -> None:
        count = COMPILATIONS.count
        if count > self._compiled:
            if self._compiled:
                pb_utils.Logger.log_warn(f"llm: {count - self._compiled} compilations after ready: a request waited "
                                         "on the compiler (a step shape the start-up did not run)")
            self.compilations.increment(count - self._compiled)
            self._compiled = count

    def admitted(self, prompt_tokens: int, queried_tokens: int, cached_tokens: int) -> None:
        with self._lock:
            self._counts["prompt"] += prompt_tokens
            self._counts["queries"] += queried_tokens
            self._counts["hits"] += cached_tokens

    def tokens(self, first: list[float], later: list[float]) -> None:
        with self._lock:
            self._counts["generation"] += len(first) + len(later)
            self._first += first
            self._later += later

    def forward(self, rows: int) -> None:
        with self._lock:
            self._counts["forwards"] += 1

    def overloaded(self) -> None:
        with self._lock:
            self._counts["rejections"] += 1

    def step(self, running: int, waiting: int, kv_tokens: int, cached_blocks: int) -> None:
        self._gauges = (running, waiting, kv_tokens, cached_blocks)

    def flush(self) -> None:
        with self._lock:
            counts, first, later, gauges = self._counts, self._first, self._later, self._gauges
            self._counts, self._first, self._later, self._gauges = dict.fromkeys(counts, 0), [], [], None
        for counter, name in ((self.prompt_tokens, "prompt"), (self.generation_tokens, "generation"),
                              (self.forwards, "forwards"), (self.rejections, "rejections"),
                              (self.prefix_queries, "queries"), (self.prefix_hits, "hits")):
            if counts[name]:
                counter.increment(counts[name])
        for histogram, values in ((self.ttft, first), (self.tpot, later)):
            for seconds in values:
                histogram.observe(seconds)
        if gauges is not None:  # only the values that moved: each set is a round trip too
            for gauge, value, old in zip((self.running, self.waiting, self.kv_tokens, self.prefix_blocks), gauges,
                                         self._published or (None,) * 4):
                if value != old:
                    gauge.set(value)
            self._published = gauges
        self._publish_compilations()
