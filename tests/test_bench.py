"""The benchmark: its arithmetic without a server, and `make bench QUICK=1` end to end (no timing checks)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from bench import report, workload
from bench.load import stats_delta
from bench.report import targets, with_ratios
from bench.roofline import Roofline
from launcher.paths import REPO_ROOT


LIMIT = Roofline("bfloat16", peak_flops=1e12, bandwidth=1e10, params=10**8, weight_bytes=2 * 10**8, kv_bytes_per_token=10**4)


def test_roofline_is_bandwidth_bound_at_batch_1_and_compute_bound_past_the_ridge():
    assert LIMIT.tokens_per_s(1, 0) == pytest.approx(1e10 / 2e8)  # weights / bandwidth
    assert LIMIT.tokens_per_s(1000, 0) == pytest.approx(1e12 / 2e8)  # 2 x params FLOPs per token
    assert LIMIT.as_dict()["ridge_batch"] == pytest.approx(100)  # where the two bounds meet


def test_roofline_counts_the_cache_each_row_reads():
    # 10 rows x 1000 positions x 10 kB = 100 MB of keys and values beside 200 MB of weights
    assert LIMIT.tokens_per_s(10, 1000) == pytest.approx(10 / (3e8 / 1e10))


def test_workloads_are_seeded_and_within_their_ranges():
    assert workload.variable(50, 8, 128, seed=3) == workload.variable(50, 8, 128, seed=3)
    assert workload.variable(50, 8, 128, seed=3) != workload.variable(50, 8, 128, seed=4)
    assert all(8 <= item.max_tokens <= 128 and item.ignore_eos for item in workload.variable(200, 8, 128))
    assert {item.max_tokens for item in workload.fixed(20, 64)} == {64}
    sampled = workload.sampled(20, 64, seed=1)
    assert [i.text_input for i in sampled] == [i.text_input for i in workload.fixed(20, 64, seed=1)]
    assert {(i.temperature, i.top_p) for i in sampled} == {(0.8, 0.9)} and len({i.seed for i in sampled}) == 20
    structured = workload.structured(20, 64, seed=1)
    assert [i.text_input for i in structured] == [i.text_input for i in sampled]
    assert all(i.structured_outputs == {"json": workload.SCHEMA} for i in structured)


def test_stats_delta_gives_per_request_means():
    def stats(count: int, executions: int, queue_ns: int) -> dict:
        zero = {"count": count, "ns": 0}
        return {"llm": {"inference_count": count, "execution_count": executions, "inference_stats": {
            "queue": {"count": count, "ns": queue_ns}, "compute_input": zero,
            "compute_infer": {"count": count, "ns": 10**9 * count}, "compute_output": zero}}}

    delta = stats_delta(stats(2, 2, 0), stats(10, 4, 8 * 10**6))
    assert delta["llm"] == {"requests": 8, "executions": 2, "queue_ms": 1.0, "compute_ms": pytest.approx(1000.0)}


def p(system: str, name: str, c: int, tokens_per_s: float, ttft: float = 100.0, dtype: str = "bfloat16") -> dict:
    return {"system": system, "dtype": dtype, "workload": name, "concurrency": c, "tokens_per_s": tokens_per_s,
            "ttft_p50_ms": ttft}


def test_ratios_compare_the_same_workload_and_concurrency_and_the_best_llama_server():
    points = [p("in_process", "fixed", 4, 100.0, 900.0), p("static", "fixed", 4, 25.0, 1000.0),
              p("ensemble_http", "fixed", 4, 90.0), p("llama_server_bf16", "fixed", 4, 60.0),
              p("llama_server_f32", "fixed", 4, 45.0, dtype="float32")]
    rooflines = {"bfloat16": LIMIT, "float32": Roofline("float32", 1e12, 1e10, 10**8, 4 * 10**8, 2 * 10**4)}
    ours, _, f32 = with_ratios(points, rooflines, {"fixed": 50.0})[2:]
    assert ours["vs_in_process"] == pytest.approx(0.9) and ours["vs_static"] == pytest.approx(3.6)
    assert ours["vs_llama_server"] == pytest.approx(1.5) and ours["ttft_vs_static"] == pytest.approx(0.1)
    assert ours["roofline_fraction"] == pytest.approx(90 / LIMIT.tokens_per_s(4, 50.0))
    assert f32["roofline_tokens_per_s"] == pytest.approx(rooflines["float32"].tokens_per_s(4, 50.0))  # its own dtype


def test_quantized_points_are_compared_with_llama_server_on_the_same_bits_and_their_own_rooflines():
    from bench.report import quantized_markdown, quantized_rows

    points = [p("ensemble_http_int4", "fixed", 1, 90.0, dtype="int4"), p("llama_server_q4_1", "fixed", 1, 100.0, dtype="Q4_1"),
              p("ensemble_http_int4", "fixed", 16, 450.0, dtype="int4"), p("llama_server_q4_1", "fixed", 16, 300.0, dtype="Q4_1"),
              p("llama_server_bf16", "fixed", 1, 50.0)]
    limits = {"bfloat16": LIMIT, "int4": replace(LIMIT, dtype="int4", weight_bytes=LIMIT.weight_bytes // 4),
              "Q4_1": replace(LIMIT, dtype="Q4_1", weight_bytes=LIMIT.weight_bytes // 3)}
    ratios = with_ratios(points, limits, {"fixed": 50.0})
    assert ratios[0]["vs_llama_server"] == pytest.approx(0.9)  # against Q4_1, not the faster-looking bf16 peer
    assert ratios[0]["roofline_tokens_per_s"] == pytest.approx(limits["int4"].tokens_per_s(1, 50.0))
    rows = quantized_rows(ratios, limits, {"fixed": 50.0})
    assert [(r["concurrency"], r["ratio"], r["goal"]) for r in rows] == [(1, pytest.approx(0.9), 1.0), (16, pytest.approx(1.5), 1.5)]
    table = quantized_markdown(rows)
    assert "| int4 | Q4_1 | 1 | 90.0 | 100.0 | 0.90x | 1.0x (**missed**) |" in table[4]
    assert "| int4 | Q4_1 | 16 | 450.0 | 300.0 | 1.50x | 1.5x (met) |" in table[5]


def test_llama_cpp_reads_a_tied_models_embeddings_as_its_output_layer():
    import gguf

    from bench.quantized import gguf_weight_bytes
    from launcher.model_folder import gguf_path

    tensors = gguf.GGUFReader(gguf_path()).tensors
    assert "output.weight" not in {t.name for t in tensors}  # SmolLM2 ties them
    assert gguf_weight_bytes(gguf_path()) == sum(int(t.n_bytes) for t in tensors)


def test_peers_carry_the_dtype_names_the_rooflines_are_keyed_by():
    from bench.peers import GGUF_DTYPES
    from llm import DTYPES

    assert set(GGUF_DTYPES.values()) <= set(DTYPES)  # a point's dtype finds its roofline (a KeyError once)


def test_goals_say_whether_each_ratio_meets_its_bound():
    points = [p("static", "variable", 16, 10), p("ensemble_http", "variable", 16, 20, ttft=600.0),
              p("llama_server_bf16", "variable", 16, 25), p("in_process", "fixed", 16, 100),
              p("llama_server_f32", "fixed", 16, 40, dtype="float32"), p("ensemble_http", "fixed", 16, 85),
              p("ensemble_http", "fixed", 32, 90), p("ensemble_http", "fixed", 64, 88)]
    met = {t["target"]: t["met"] for t in targets(with_ratios(points, {"bfloat16": LIMIT, "float32": LIMIT}, {"fixed": 1, "variable": 1}))}
    assert met == {
        "fixed c=16: throughput vs best llama-server": True,  # 85 / 40
        "fixed c=16: throughput vs in-process generate": False,  # 0.85
        "variable c=16: throughput vs static Triton": True,  # 2.0
        "variable c=16: throughput vs best llama-server": False,  # 0.8
        "fixed: throughput rises c=16 -> 32 -> 64": False,  # 85, 90, 88
        "fixed c=16: p50 time to first token vs before this engine": True,
        "variable c=16: p50 time to first token vs before this engine": False,  # 600 ms vs 597 ms
    }


def test_quick_benchmark_writes_a_well_formed_table_plots_and_json(tmp_path, model_dir):
    result = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    plan = results["plan"]
    systems = {"in_process", "static", "ensemble_http", "ensemble_grpc"}  # no peers in quick mode
    seen = {(p["system"], p["workload"], p["concurrency"]) for p in results["points"]}
    openai = {("openai_http", "fixed", c) for c in plan["openai_concurrency"]}  # guidellm runs in full mode only
    sampled = {("ensemble_http", "sampled", c) for c in plan["sampled_concurrency"]}
    structured = {("ensemble_http", "structured", c) for c in plan["structured_concurrency"]}
    served = {(s, w, c) for s in systems for w in ("fixed", "variable") for c in plan["concurrency"]}
    assert seen == served | openai | sampled | structured
    # The baselines run Hugging Face's model as loaded; the engine's points name its weights where they are
    # smaller (float32 activations over bfloat16 weights on CPUs without native bfloat16), as its roofline does.
    engine = report.engine(results)
    assert {(p["system"], p["dtype"]) for p in results["points"]} == \
        {(p["system"], results["model"]["dtype"] if p["system"] in ("in_process", "static") else engine) for p in results["points"]}
    assert results["roofline"][engine]["weight_bytes"] <= results["roofline"][results["model"]["dtype"]]["weight_bytes"]
    for p in results["points"]:
        assert p["requests"] == max(8, plan["rounds"] * p["concurrency"]) and p["tokens_per_s"] > 0
        assert p["p99_ms"] >= p["p50_ms"] >= p["ttft_p50_ms"] > 0 and 0 < p["roofline_fraction"] < 1
        if p["workload"] in ("fixed", "sampled", "structured"):  # every request generates exactly fixed_tokens
            assert p["output_tokens"] == p["requests"] * plan["fixed_tokens"]
        if p["system"] in ("ensemble_http", "openai_http"):
            assert p["server"]["llm"]["requests"] == p["requests"]
    assert results["ensemble_overhead"]["llm_p50_ms"] > 0 and results["startup_s"] > 0
    assert set(results["grammar_build_ms"]) == {"tokenizer_once", "workload_schema", "nested_schema"}
    stall = results["grammar_stall"]
    assert stall["fresh_schemas"] >= 1 and stall["cached_p99_ms"] > 0 and stall["p99_ratio"] > 0
    assert results["targets"] == [] and results["peers"] == []  # quick mode runs no peer and no c=16
    assert [r["concurrency"] for r in results["openai"]] == list(plan["openai_concurrency"])
    # The multi-turn chat workload: our endpoint with prefix caching on (off needs a second server: full mode).
    chats = results["chat"]
    assert [(r["system"], r["prefix_caching"], r["concurrency"]) for r in chats] == [
        ("openai_http", True, c) for c in plan["chat_concurrency"]]
    for r in chats:
        assert r["conversations"] == 2 * r["concurrency"] and r["turns"] == r["conversations"] * plan["chat_turns"]
        assert r["output_tokens"] == r["turns"] * plan["chat_tokens"]
        assert r["ttft_p50_first_ms"] > 0 and r["ttft_p50_later_ms"] > 0 and 0 < r["cached_share"] < 1
    assert [t["target"] for t in results["chat_targets"]] == [
        f"chat c={c}: later-turn / first-turn TTFT p50 (ours)" for c in plan["chat_concurrency"]]
    assert all(r["vs_generate_stream"] > 0 and r["guidellm_tokens_per_s"] is None for r in results["openai"])
    table = (tmp_path / "results.md").read_text()
    assert "| concurrency | generate_stream tok/s | OpenAI tok/s (ours) |" in table
    assert "| system | dtype | concurrency | tok/s |" in table and "TTFT p50 ms" in table and "**sampled** workload" in table
    assert "**chat** workload" in table and "| system | dtype | prefix cache | concurrency |" in table
    for plot in ("fixed.png", "variable.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def gpu_check(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    result = subprocess.run([sys.executable, "-m", "bench.gpu_check", "--rehearse", "--out", str(tmp_path / "check.json"),
                             *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "GPU_CHECK_BUDGET_S": "400"})
    return result, json.loads((tmp_path / "check.json").read_text())


def test_gpu_check_rehearsed_on_the_cpu_runs_every_phase_and_finds_no_compile_after_ready(tmp_path, model_dir):
    """make gpu-check's own logic, on the CPU (``--rehearse``): the start-up lines echoed, every phase
    printed with its time, llm's compilation counter read at ready and after traffic, the engine alone
    against Hugging Face generate."""
    result, report = gpu_check(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for phase in ("start", "one request", "4 at once", "c=1", "c=4", "no compile under traffic", "engine tiny"):
        assert re.search(rf"^\[ *\d+\.\d s\] phase '{phase}'", out, re.M), phase
    assert re.search(r"llm: start-up [\d.]+ s: ready: \d+ compilations", out)
    assert report["compilations_at_ready"] >= 2 and report["compilations_after_traffic"] == 0
    assert [p["phase"] for p in report["points"]] == ["one request", "4 at once", "c=1", "c=4"]
    assert all(p["exact_tokens"] for p in report["points"]) and report["failures"] == []
    engine = report["engine"]["tiny"]["points"]
    assert [p["concurrency"] for p in engine] == [1, 4]
    assert all(p["compilations_after_build"] == 0 and p["engine_tok_s"] > 0 and p["hf_generate_tok_s"] > 0 for p in engine)


def test_gpu_check_fails_naming_the_phase_when_a_first_token_is_late(tmp_path, model_dir):
    result, report = gpu_check(tmp_path, "--first-token-limit", "0.001")
    said = result.stdout[-3000:] + result.stderr[-3000:]  # what the check printed, should it fail another way
    assert result.returncode == 1, said
    assert report["failures"] == ["phase 'one request': a request's first token took more than 0.001 s after ready "
                                  "(the server log says what llm was doing)"], said
    assert "FAIL: phase 'one request'" in result.stdout and report["engine"] == {}


def test_the_step_profile_times_a_decode_step_and_names_its_kernels(model_dir):
    """docs/benchmark.md's per-operator profile of a decode step comes from this command."""
    result = subprocess.run([sys.executable, "-m", "bench.step_profile", "--rows", "2", "--columns", "16", "--profile"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^2 rows x 16 columns, torch\.\w+, weights auto \(.+\): [\d.]+ ms a step, [\d.]+ tok/s; weights read \d+ MB a step, "
                     r"bandwidth [\d.]+ GB/s: limit [\d.]+ ms \(\d+% of it\)$", result.stdout, re.M), result.stdout
    assert "Self CPU time total" in result.stdout


def test_the_linear_paths_table_has_every_level_this_cpu_runs_and_onednn(model_dir):
    """docs/benchmark.md's per-layer table (AMX against the levels below it and oneDNN) comes from this command:
    a row per weights, layer and row count, a cell per level the CPU executes, oneDNN last."""
    from llm import kernels

    result = subprocess.run([sys.executable, "-m", "bench.linear_paths", "--rows", "1", "17", "--weights", "bf16", "int4",
                             "--repeats", "1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if re.match(r"^\| (bf16|int4) \|", line)]
    assert len(rows) == 2 * 5 * 2, result.stdout  # weights x the model's five products x row counts
    header = next(line for line in result.stdout.splitlines() if line.startswith("| weights"))
    assert header.count("ours `") == len(kernels.runnable()) and header.endswith("| oneDNN (bf16) |")
    assert all(len(re.findall(r"\| [\d.]+ ", row)) == len(kernels.runnable()) + 2 for row in rows), rows  # rows, then times


def test_serving_costs_count_a_servers_cpu_seconds():
    """bench.serving's accounting: a process that spins for 0.3 s of CPU is counted as the server
    (its stubs are found and named by model by ipc/stubs.py, which test_server_faults.py uses on a real server)."""
    from bench.serving import cpu_seconds

    spin = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        deadline = time.monotonic() + 30
        while cpu_seconds(child.pid)["tritonserver"] < 0.29 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0.29 <= cpu_seconds(child.pid)["tritonserver"] < 5
    finally:
        child.kill()
        child.wait()


def test_the_quality_table_compares_each_weights_setting_with_the_first(model_dir):
    """docs/configuration.md's quality table comes from this command: bf16 against itself agrees on every
    token; each setting's row names its bytes and a finite perplexity."""
    result = subprocess.run([sys.executable, "-m", "bench.quality", "--settings", "bf16", "int8", "--tokens", "256",
                             "--max-tokens", "8"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = re.findall(r"^\| (\w+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| (\d+)% \|$", result.stdout, re.M)
    assert [r[0] for r in rows] == ["bf16", "int8"], result.stdout
    assert rows[0][3:] == ("8.0", "100") and int(rows[1][1]) < int(rows[0][1]) and 1 < float(rows[1][2]) < 100


def test_agreement_counts_tokens_before_the_first_difference():
    from bench.quality import agreement

    assert agreement([[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 9, 3]]) == (2.0, 0.5)


@pytest.mark.parametrize("setting", ["bf16", "int8", "int4"])
def test_the_memory_tables_bytes_are_what_a_loaded_model_reads(setting, model_dir):
    """bench.memory's arithmetic (docs/operations.md's table, the 8B shape included) against the bytes the
    default model reports once loaded (llm_weight_bytes)."""
    import torch

    from bench.memory import SHAPES, footprint
    from llm import LLM, LLMConfig, kernels, resolve_dtype

    if resolve_dtype("auto", torch.device("cpu")) != torch.bfloat16 or kernels.load() is not None:
        pytest.skip("the table is for CPUs that compute bfloat16 (our kernels)")
    llm = LLM(LLMConfig(str(model_dir), weights=setting, compile=False), torch.device("cpu"))
    assert llm.weight_bytes == footprint(SHAPES["SmolLM2-135M-Instruct (the default model)"], setting)["read"]


def test_the_ceiling_streams_each_protocol_through_the_stand_in_and_counts_each_hop(tmp_path, model_dir):
    """bench.serving's ceiling on a real server: the shipped pipeline around the stand-in llm (no model)
    answers every protocol with whole replies, and each hop's CPU is counted (llm's engine thread apart)."""
    from bench.serving import ceiling, ceiling_table

    points = ceiling(model_dir, (1, 4), 1.0, tmp_path)
    protocols = ("generate_stream", "grpc_stream", "openai_sse")
    assert [(p["protocol"], p["concurrency"]) for p in points] == [(name, c) for name in protocols for c in (1, 4)]
    for p in points:
        assert p["output_tokens"] == 64 * p["requests"] and p["tokens_per_chunk"] >= 1, p
        cpu = p["cpu_ms_per_token"]
        assert min(cpu["llm engine"], cpu["llm"], cpu["postprocess"], cpu["tritonserver"]) > 0, cpu
        assert cpu["openai front end"] > 0 or p["protocol"] != "openai_sse", cpu
    assert ceiling_table(points).count("\n") == 1 + len(points)
