"""The benchmark: its arithmetic without a server, and `make bench QUICK=1` end to end (no timing checks)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import workload
from bench.load import stats_delta
from bench.report import targets, with_ratios
from bench.roofline import Roofline
from launcher.triton import REPO_ROOT


def test_roofline_is_bandwidth_bound_at_batch_1_and_compute_bound_past_the_ridge():
    limit = Roofline(peak_flops=1e12, bandwidth=1e10, params=10**8, weight_bytes=4 * 10**8)
    assert limit.tokens_per_s(1) == pytest.approx(1e10 / 4e8)  # weights / bandwidth
    assert limit.tokens_per_s(1000) == pytest.approx(1e12 / 2e8)  # 2 x params FLOPs per token
    assert limit.as_dict()["ridge_batch"] == pytest.approx(200)  # where the two bounds meet


def test_workloads_are_seeded_and_within_their_ranges():
    assert workload.variable(50, 8, 128, seed=3) == workload.variable(50, 8, 128, seed=3)
    assert workload.variable(50, 8, 128, seed=3) != workload.variable(50, 8, 128, seed=4)
    assert all(8 <= item.max_tokens <= 128 and item.ignore_eos for item in workload.variable(200, 8, 128))
    assert {item.max_tokens for item in workload.fixed(20, 64)} == {64}


def test_stats_delta_gives_per_request_means():
    def stats(count: int, executions: int, queue_ns: int) -> dict:
        zero = {"count": count, "ns": 0}
        return {"llm": {"inference_count": count, "execution_count": executions, "inference_stats": {
            "queue": {"count": count, "ns": queue_ns}, "compute_input": zero,
            "compute_infer": {"count": count, "ns": 10**9 * count}, "compute_output": zero}}}

    delta = stats_delta(stats(2, 2, 0), stats(10, 4, 8 * 10**6))
    assert delta["llm"] == {"requests": 8, "executions": 2, "queue_ms": 1.0, "compute_ms": pytest.approx(1000.0)}


def test_ratios_compare_the_same_workload_and_concurrency():
    points = [{"system": s, "workload": "fixed", "concurrency": 4, "tokens_per_s": v, "ttft_p50_ms": t}
              for s, v, t in (("in_process", 100.0, 900.0), ("static", 25.0, 1000.0), ("ensemble_http", 90.0, 100.0))]
    limit = Roofline(1e12, 1e10, 10**8, 4 * 10**8)
    ours = with_ratios(points, limit)[2]
    assert ours["vs_in_process"] == pytest.approx(0.9) and ours["vs_static"] == pytest.approx(3.6)
    assert ours["ttft_vs_static"] == pytest.approx(0.1)
    assert ours["roofline_fraction"] == pytest.approx(90 / limit.tokens_per_s(4))


def test_targets_say_whether_each_ratio_meets_its_goal():
    def p(system: str, name: str, tokens_per_s: float, ttft: float) -> dict:
        return {"system": system, "workload": name, "concurrency": 16, "tokens_per_s": tokens_per_s, "ttft_p50_ms": ttft}

    points = [p("static", "variable", 10, 1000), p("ensemble_http", "variable", 20, 600),
              p("in_process", "fixed", 100, 1), p("static", "fixed", 90, 1), p("ensemble_http", "fixed", 85, 1)]
    met = {t["target"]: t["met"] for t in targets(with_ratios(points, Roofline(1e12, 1e10, 10**8, 4 * 10**8)))}
    assert list(met.values()) == [True, False, True]


def test_quick_benchmark_writes_a_well_formed_table_plots_and_json(tmp_path, model_dir):
    result = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    plan = results["plan"]
    systems = {"in_process", "static", "ensemble_http", "ensemble_grpc"}
    seen = {(p["system"], p["workload"], p["concurrency"]) for p in results["points"]}
    assert seen == {(s, w, c) for s in systems for w in ("fixed", "variable") for c in plan["concurrency"]}
    for p in results["points"]:
        assert p["requests"] == max(8, plan["rounds"] * p["concurrency"]) and p["tokens_per_s"] > 0
        assert p["p99_ms"] >= p["p50_ms"] >= p["ttft_p50_ms"] > 0 and 0 < p["roofline_fraction"] < 1
        if p["workload"] == "fixed":  # ignore_eos: every request generates exactly fixed_tokens
            assert p["output_tokens"] == p["requests"] * plan["fixed_tokens"]
        if p["system"] == "ensemble_http":
            assert p["server"]["llm"]["requests"] == p["requests"]
    assert results["ensemble_overhead"]["llm_p50_ms"] > 0
    table = (tmp_path / "results.md").read_text()
    assert "| system | concurrency | tok/s |" in table and "TTFT p50 ms" in table
    for plot in ("fixed.png", "variable.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
