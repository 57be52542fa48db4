"""``make gpu-check``: the GPU path end to end, on a host with an NVIDIA GPU, in under 8 minutes.

Phases, each printed with the time since the check began:

1. ``start``: tritonserver with the GPU config (``llm`` on ``KIND_GPU``); its ``llm: start-up`` lines are
   echoed while it compiles and captures; then the log must say bfloat16 and compiled, and ``llm``'s
   own counters say how many compilations and CUDA graphs the start-up made.
2. ``one request``, ``16 at once``, ``c=1``, ``c=16``, ``c=64``: streamed requests of the fixed
   workload; every one must generate exactly its tokens, and its first token must come within 10 s
   (``--first-token-limit``) of sending it: a request that waits longer fails the check, naming the phase.
3. ``no compile under traffic``: ``llm_compilations_total`` is what it was at ready.
4. ``engine <shape>``: the engine alone against Hugging Face ``generate`` on the same batch at the
   Llama-3.2-1B and Llama-3.1-8B shapes, bf16, at 1, 16 and 64 requests, against the weight-read limit
   (``bench/engine_scale.py``).

The goals of issue 20 are reported, not enforced. A phase that would start past the time budget
(``GPU_CHECK_BUDGET_S``, default 470 s) is skipped and says so. Writes ``bench_results/gpu_check.json``
after every phase. Exits 1 on a failure, 2 without a GPU. ``--rehearse`` runs the same phases on the
CPU, smaller, to check the check itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import requests
import torch
from transformers import AutoTokenizer

from bench import engine_scale, load, roofline, workload
from launcher.model_folder import prepare_default_model
from launcher.install import has_gpu
from launcher.paths import REPO_ROOT
from launcher.process import Ports
from launcher.tritonserver import TritonServer

OUT = REPO_ROOT / "bench_results" / "gpu_check.json"
GOAL_TTFT_MS = 100.0  # served, c=1, p50
GOAL_LIMIT_C1, GOAL_LIMIT_C64 = 0.70, 0.60  # engine alone at the 8B shape, of the weight-read limit


@dataclass(frozen=True)
class Plan:
    device: str
    config_name: str  # the llm config Triton loads: "" (GPU) or "cpu"
    concurrency: tuple[int, ...]
    crowd: int
    shapes: tuple[str, ...]
    engine_concurrency: tuple[int, ...]
    dtype: str


GPU = Plan("cuda", "", (1, 16, 64), 16, ("llama-3.2-1b", "llama-3.1-8b"), (1, 16, 64), "torch.bfloat16")
REHEARSAL = Plan("cpu", "cpu", (1, 4), 4, ("tiny",), (1, 4), "")


class CheckFailed(Exception):
    """A failure that ends the check; the message names the phase."""


class Clock:
    def __init__(self, budget: float) -> None:
        self.began = time.perf_counter()
        self.deadline = time.time() + budget

    def say(self, text: str) -> None:
        print(f"[{time.perf_counter() - self.began:6.1f} s] {text}", flush=True)

    def left(self) -> float:
        return self.deadline - time.time()


def llm_counter(server: TritonServer, name: str) -> float:
    text = requests.get(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def start(server: TritonServer, log_path: Path, clock: Clock, report: dict) -> None:
    """Start Triton and echo llm's start-up lines until it is ready."""
    server.start()
    echoed, began, ready = 0, time.perf_counter(), False
    while not ready:
        try:
            server.wait_ready(timeout=2)
            ready = True
        except TimeoutError:
            if clock.left() < 0:
                raise CheckFailed("phase 'start': not ready within the time budget") from None
        lines = [l for l in log_path.read_text(errors="replace").splitlines() if "llm: start-up" in l]
        for line in lines[echoed:]:
            clock.say("  " + line[line.index("llm: start-up"):].rstrip('"'))
        echoed = len(lines)
    report["startup_s"] = time.perf_counter() - began
    loaded = re.search(r"llm: .* on (\w+(?::\d+)?) as (torch\.\w+), .*?, (compiled|eager)", log_path.read_text(errors="replace"))
    report["llm"] = loaded.groups() if loaded else None
    report["compilations_at_ready"] = llm_counter(server, "llm_compilations_total")
    report["cuda_graphs"] = llm_counter(server, "llm_cuda_graphs")


async def traffic(server: TritonServer, plan: Plan, limit: float, clock: Clock, report: dict, save) -> None:
    items = workload.fixed(4 * max(plan.concurrency) + plan.crowd + 1, 64, seed=1)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        phases = [("one request", 1, items[:1]), (f"{plan.crowd} at once", plan.crowd, items[1:1 + plan.crowd])]
        phases += [(f"c={c}", c, items[1 + plan.crowd:][:4 * c]) for c in plan.concurrency]
        for phase, c, batch in phases:
            if clock.left() < 30:
                clock.say(f"phase '{phase}': skipped, out of time")
                continue
            clock.say(f"phase '{phase}': {len(batch)} streamed requests of 64 tokens, {c} at a time")
            try:
                run = await load.closed_loop(load.http_stream(session, server.url, first_token_within=limit),
                                             batch, c)
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                raise CheckFailed(f"phase '{phase}': a request's first token took more than {limit:g} s "
                                  "after ready (the server log says what llm was doing)") from None
            except RuntimeError as e:  # the server answered an error
                raise CheckFailed(f"phase '{phase}': {e}") from None
            summary = load.summary(run) | {"phase": phase, "concurrency": c,
                                           "exact_tokens": run.tokens == [64] * len(run.tokens),
                                           "ttft_max_ms": 1000 * max(run.ttfts)}
            report["points"].append(summary)
            save()
            clock.say(f"phase '{phase}': {summary['tokens_per_s']:.1f} tok/s, TTFT p50 {summary['ttft_p50_ms']:.0f} ms, "
                      f"max {summary['ttft_max_ms']:.0f} ms; every request exactly 64 tokens: {summary['exact_tokens']}")
            if not summary["exact_tokens"]:
                raise CheckFailed(f"phase '{phase}': token counts {sorted(set(run.tokens))}, not 64 each")


def goals(report: dict) -> list[str]:
    lines = []
    c1 = next((p for p in report["points"] if p["phase"] == "c=1"), None)
    if c1:
        met = c1["ttft_p50_ms"] < GOAL_TTFT_MS
        lines.append(f"served first token p50 at c=1 {c1['ttft_p50_ms']:.0f} ms (goal < {GOAL_TTFT_MS:.0f}): "
                     f"{'met' if met else 'missed'}")
    big = report["engine"].get("llama-3.1-8b", {}).get("points", [])
    for c, goal in ((1, GOAL_LIMIT_C1), (64, GOAL_LIMIT_C64)):
        point = next((p for p in big if p["concurrency"] == c), None)
        if point:
            lines.append(f"engine at the 8B shape, c={c}: {point['engine_vs_limit']:.0%} of the weight-read limit "
                         f"(goal >= {goal:.0%}): {'met' if point['engine_vs_limit'] >= goal else 'missed'}; "
                         f"{point['engine_vs_hf']:.1f}x Hugging Face generate")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--rehearse", action="store_true", help="the same phases on the CPU, smaller (no GPU needed)")
    args.add_argument("--out", type=Path, default=OUT, help="the JSON report (the server log goes beside it)")
    args.add_argument("--first-token-limit", type=float, default=10.0, metavar="S",
                      help="fail when a request's first token takes longer than this after ready")
    opts, _ = args.parse_known_args(argv)  # ../shared/gpu/triton_check.py passes its own model folder on
    plan = REHEARSAL if opts.rehearse else GPU
    if plan.device == "cuda" and not has_gpu():
        print("gpu-check: nvidia-smi finds no GPU here; run it on a GPU host (or --rehearse on the CPU)", file=sys.stderr)
        return 2
    out = opts.out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"gpu-check: stopped by SIGTERM; partial results in {out}"))
    clock = Clock(float(os.environ.get("GPU_CHECK_BUDGET_S", 470)))
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict = {"device": plan.device, "points": [], "engine": {}, "failures": []}

    def save() -> None:
        out.write_text(json.dumps(report, indent=2))

    model_dir = prepare_default_model()
    log_path = out.parent / "gpu_check_tritonserver.log"
    server = TritonServer(ports=Ports.free(), model_env={"MODEL_DIR": str(model_dir)}, log_path=log_path,
                          model_config_name=plan.config_name)
    try:
        clock.say(f"phase 'start': tritonserver, llm on {plan.device} (log: {log_path})")
        start(server, log_path, clock, report)
        save()
        clock.say(f"phase 'start': ready in {report['startup_s']:.0f} s; llm {report['llm']}; "
                  f"{report['compilations_at_ready']:.0f} compilations, {report['cuda_graphs']:.0f} CUDA graphs")
        if plan.dtype and (report["llm"] is None or report["llm"][1:] != (plan.dtype, "compiled")):
            raise CheckFailed(f"phase 'start': llm is {report['llm']}, not {plan.dtype} and compiled")
        asyncio.run(traffic(server, plan, opts.first_token_limit, clock, report, save))
        after = llm_counter(server, "llm_compilations_total")
        report["compilations_after_traffic"] = after - report["compilations_at_ready"]
        clock.say(f"phase 'no compile under traffic': {after - report['compilations_at_ready']:.0f} compilations since ready")
        if after != report["compilations_at_ready"]:
            raise CheckFailed(f"phase 'no compile under traffic': llm compiled {after - report['compilations_at_ready']:.0f} "
                              "times after ready")
    except CheckFailed as e:
        report["failures"].append(str(e))
    finally:
        server.stop()
        save()
    if not report["failures"]:
        device = torch.device(plan.device)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        bandwidth = roofline.bandwidth(device)
        report["read_bandwidth_GBps"] = bandwidth / 1e9
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        clock.say(f"engine alone: {name}, read bandwidth {bandwidth / 1e9:.0f} GB/s (measured)")
        # Each shape in bf16, then the 8B shape in fp8 on GPUs (weights: fp8, docs/configuration.md), last:
        # the first runs to drop when time is short.
        runs = [(shape, "bf16") for shape in plan.shapes]
        runs += [("llama-3.1-8b", "fp8")] if device.type == "cuda" and "llama-3.1-8b" in plan.shapes else []
        for shape, weights in runs:
            key = shape if weights == "bf16" else f"{shape} {weights}"
            if clock.left() < 60:
                clock.say(f"phase 'engine {key}': skipped, out of time")
                continue
            clock.say(f"phase 'engine {key}': {engine_scale.PROMPT}-token prompts, {engine_scale.NEW} new tokens, {weights}")
            report["engine"][key] = engine_scale.measure(shape, tokenizer, device, plan.engine_concurrency, bandwidth,
                                                         clock.deadline - 20, lambda text: clock.say("  " + text), weights)
            save()
            grew = [p["concurrency"] for p in report["engine"][key]["points"] if p["compilations_after_build"]]
            if grew:
                report["failures"].append(f"phase 'engine {key}': compiled after the engine was built (c={grew})")
    report["goals"] = goals(report)
    save()
    for line in report["goals"]:
        clock.say(f"goal: {line}")
    for line in report["failures"]:
        clock.say(f"FAIL: {line}")
    clock.say(f"gpu-check: {'FAIL' if report['failures'] else 'PASS'} (details in {out})")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
