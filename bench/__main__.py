"""``python -m bench [--quick]``: every system, every workload and concurrency, in one run.

Systems: ``in_process`` (Hugging Face ``generate`` on batches of size = concurrency, no server: the
practical limit of static batching), ``roofline`` (this machine's measured physical limit), ``static``
(Triton with the static dynamic-batching ``llm`` that the in-flight engine replaced, streaming nothing),
and the shipped pipeline: ``ensemble_http`` (``generate_stream``, streamed) and ``ensemble_grpc``
(KServe infer on ``ensemble_infer``). Writes ``results.json``, ``results.md`` and PNG plots to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import re
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import torch
import tritonclient.grpc.aio as grpcaio

from bench import load, perf_analyzer, report, roofline, workload
from launcher.model import prepare_default_model
from launcher.triton import CACHE_DIR, MODEL_REPOSITORY, Ports, TritonServer, has_gpu
from bench.static_llm import StaticGenerator
from llm import LLM, LLMConfig, load_model
from preprocess import PreprocessConfig, Preprocessor, PromptRequest

log = logging.getLogger("bench")


@dataclass(frozen=True)
class Plan:
    concurrency: tuple[int, ...]
    fixed_tokens: int
    variable_tokens: tuple[int, int]
    perf_analyzer: bool
    rounds: int  # measured requests per point = max(8, rounds x concurrency), after one warm-up round

    def requests(self, concurrency: int) -> int:
        return max(8, self.rounds * concurrency)


QUICK = Plan((1, 4), 16, (4, 32), False, 1)
FULL = Plan((1, 4, 16), 64, (8, 128), True, 2)


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.+)", cpuinfo)
    return {
        "cpu": model.group(1) if model else platform.processor(),
        "cores": len(os.sched_getaffinity(0)),
        "gpu": has_gpu(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }


def workloads(plan: Plan) -> dict[str, list[workload.Item]]:
    """Enough seeded items for the largest point plus its warm-up; each point takes a prefix."""
    count = 2 * plan.requests(max(plan.concurrency)) + max(plan.concurrency)
    return {
        "fixed": workload.fixed(count, plan.fixed_tokens, seed=1),
        "variable": workload.variable(count, *plan.variable_tokens, seed=2),
    }


def point(system: str, name: str, concurrency: int, measured: dict, **extra) -> dict:
    return {"system": system, "workload": name, "concurrency": concurrency, **measured, **extra}


def in_process(generator: StaticGenerator, ids: dict[str, list[int]], sets: dict, plan: Plan) -> list[dict]:
    """The practical limit: the same engine and prompts, batches of ``concurrency``, no server."""
    points = []
    for name, items in sets.items():
        for c in plan.concurrency:
            chosen = items[c:c + plan.requests(c)]
            validate = generator.llm.validate
            generator.generate([validate(ids[i.text_input], i.max_tokens, ignore_eos=True) for i in items[:c]])
            run = load.Run()
            cpu, wall = time.process_time(), time.perf_counter()
            for start in range(0, len(chosen), c):
                batch = [validate(ids[i.text_input], i.max_tokens, ignore_eos=True) for i in chosen[start:start + c]]
                begin = time.perf_counter()
                replies = generator.generate(batch)
                seconds = time.perf_counter() - begin  # no streaming: the first token comes with the last
                run.latencies += [seconds] * len(batch)
                run.ttfts += [seconds] * len(batch)
                run.tokens += [len(r) for r in replies]
            run.seconds, run.client_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
            points.append(point("in_process", name, c, load.summary(run)))
            log.info("in_process %s c=%d: %.1f tok/s", name, c, points[-1]["tokens_per_s"])
    return points


async def sweep_server(system: str, url: str, grpc_port: int | None, sets: dict, plan: Plan) -> list[dict]:
    points = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        protocols = {"http": load.http_stream(session, url)}
        grpc = grpcaio.InferenceServerClient(f"127.0.0.1:{grpc_port}") if grpc_port else None
        if grpc:
            protocols["grpc"] = load.grpc_infer(grpc)
        for protocol, send in protocols.items():
            for name, items in sets.items():
                for c in plan.concurrency:
                    await load.warm_up(send, items[:c])
                    await asyncio.sleep(0.2)
                    before = load.server_stats(url)
                    run = await load.closed_loop(send, items[c:c + plan.requests(c)], c)
                    await asyncio.sleep(0.2)  # the ensemble's statistics land just after its reply
                    server = load.stats_delta(before, load.server_stats(url))
                    label = f"{system}_{protocol}" if grpc else system
                    points.append(point(label, name, c, load.summary(run), server=server))
                    log.info("%s %s c=%d: %.1f tok/s", label, name, c, points[-1]["tokens_per_s"])
        if grpc:
            await grpc.close()
    return points


async def ensemble_overhead(url: str, ids: dict, items: list[workload.Item], count: int) -> dict:
    """Same token-level work at concurrency 1: token ids straight to llm vs text through the ensemble."""
    async with aiohttp.ClientSession() as session:
        out = {}
        for model in ("llm", "ensemble"):
            send = load.http_generate_ids(session, url, model, ids)
            await load.warm_up(send, items[:1])
            run = await load.closed_loop(send, items[1:count + 1], 1)
            out[model] = load.summary(run)["p50_ms"]
    overhead = out["ensemble"] - out["llm"]
    return {"llm_p50_ms": out["llm"], "ensemble_p50_ms": out["ensemble"], "overhead_ms": overhead,
            "overhead_pct": 100 * overhead / out["llm"]}


def static_repository(target: Path, gpu: bool) -> Path:
    """ensemble_repo with llm swapped for the static baseline (bench/static_model.py), batched by Triton's
    dynamic batcher with the 5 ms queue delay the shipped config used before the engine."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in ("ensemble", "ensemble_infer", "preprocess", "postprocess"):
        (target / name).symlink_to(MODEL_REPOSITORY / name)
    (target / "llm" / "1").mkdir(parents=True)
    shutil.copy2(Path(__file__).parent / "static_model.py", target / "llm" / "1" / "model.py")
    source = MODEL_REPOSITORY / "llm" / ("config.pbtxt" if gpu else "configs/cpu.pbtxt")
    text = source.read_text().replace("dynamic_batching { }", "dynamic_batching { max_queue_delay_microseconds: 5000 }")
    (target / "llm" / "config.pbtxt").write_text("# Benchmark baseline: static batches (bench/static_model.py).\n" + text)
    return target


def start(repository: Path, model_dir: Path, out: Path, name: str, config_name: str) -> TritonServer:
    server = TritonServer(ports=Ports.free(), model_repository=repository, model_env={"MODEL_DIR": str(model_dir)},
                          log_path=out / f"{name}.log", model_config_name=config_name)
    server.start().wait_ready(600)
    return server


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few points, under 5 minutes on 2 cores")
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    model_dir = Path(os.environ.get("MODEL_DIR") or prepare_default_model())
    gpu = has_gpu()
    device = torch.device("cuda:0" if gpu else "cpu")
    sets = workloads(plan)
    preprocessor = Preprocessor(PreprocessConfig(str(model_dir)))
    ids = {i.text_input: preprocessor.encode(PromptRequest(i.text_input.encode()))
           for items in sets.values() for i in items}

    config = LLMConfig(str(model_dir), max_tokens_limit=512, compile=False)
    hf = load_model(config, device)
    generator = StaticGenerator(hf, LLM(config, device, hf))
    limit = roofline.measure(hf, device, args.quick)
    log.info("roofline: %.1f GFLOP/s, %.1f GB/s", limit.peak_flops / 1e9, limit.bandwidth / 1e9)
    points = in_process(generator, ids, sets, plan)
    del generator, hf

    config_name = "" if gpu else "cpu"
    server = start(MODEL_REPOSITORY, model_dir, out, "ensemble", config_name)
    try:
        points += asyncio.run(sweep_server("ensemble", server.url, server.ports.grpc, sets, plan))
        overhead = asyncio.run(ensemble_overhead(server.url, ids, sets["fixed"], 8 if args.quick else 24))
        cross_check = None
        if plan.perf_analyzer:
            c = 4  # every plan has it
            ours = next(p for p in points if p["system"] == "ensemble_http" and p["workload"] == "fixed" and p["concurrency"] == c)
            cross_check = {"concurrency": c, "workload": "fixed", "ours_requests_per_s": ours["requests_per_s"],
                           "ours_p50_ms": ours["p50_ms"],
                           "perf_analyzer": perf_analyzer.measure(server.ports.http, sets["fixed"][: plan.requests(c)], c, out)}
    finally:
        server.stop()

    static = start(static_repository(CACHE_DIR / "bench" / "static_repo", gpu), model_dir, out, "static", "")
    try:
        points += asyncio.run(sweep_server("static", static.url, None, sets, plan))
    finally:
        static.stop()

    results = {
        "mode": "quick" if args.quick else "full",
        "plan": asdict(plan),
        "machine": machine(),
        "model": {"dir": str(model_dir), "params": limit.params, "weight_bytes": limit.weight_bytes},
        "roofline": limit.as_dict(),
        "points": report.with_ratios(points, limit),
        "targets": report.targets(points),
        "ensemble_overhead": overhead,
        "perf_analyzer_cross_check": cross_check,
        "wall_s": time.perf_counter() - started,
    }
    report.write(results, out)
    log.info("wrote %s (%.0f s)", out, results["wall_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
