"""``python -m bench [--quick]``: every system, every workload and concurrency, in one run.

Systems: ``in_process`` (the llm package's batched ``generate`` at batch = concurrency, no server),
``roofline`` (this machine's measured physical limit), ``naive`` (Triton, the same ``llm`` with dynamic
batching off: one request at a time), and ``ensemble_http`` / ``ensemble_grpc`` (the shipped pipeline).
Writes ``results.json``, ``results.md`` and PNG plots to ``--out``.
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
import requests
import torch
import tritonclient.grpc.aio as grpcaio

from bench import load, perf_analyzer, report, roofline, workload
from client.admin import reload_with_config
from launcher.model import prepare_default_model
from launcher.triton import CACHE_DIR, MODEL_REPOSITORY, Ports, TritonServer, has_gpu
from llm import Generator, LLMConfig
from preprocess import PreprocessConfig, Preprocessor, PromptRequest

log = logging.getLogger("bench")


@dataclass(frozen=True)
class Plan:
    concurrency: tuple[int, ...]
    fixed_tokens: int
    variable_tokens: tuple[int, int]
    delays_us: tuple[int, ...]
    sweep_concurrency: int
    perf_analyzer: bool
    rounds: int  # measured requests per point = max(8, rounds x concurrency), after one warm-up round

    def requests(self, concurrency: int) -> int:
        return max(8, self.rounds * concurrency)


QUICK = Plan((1, 8), 16, (4, 32), (0, 5000), 8, False, 1)
FULL = Plan((1, 2, 4, 8, 16, 32), 64, (8, 128), (0, 1000, 5000, 20000), 16, True, 2)


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


def in_process(generator: Generator, ids: dict[str, list[int]], sets: dict, plan: Plan) -> list[dict]:
    """The practical limit: the same engine and prompts, batches of ``concurrency``, no server."""
    points = []
    for name, items in sets.items():
        for c in plan.concurrency:
            chosen = items[c:c + plan.requests(c)]
            generator.generate([generator.validate(ids[i.text_input], i.max_tokens, True) for i in items[:c]])
            run = load.Run()
            cpu, wall = time.process_time(), time.perf_counter()
            for start in range(0, len(chosen), c):
                batch = [generator.validate(ids[i.text_input], i.max_tokens, True) for i in chosen[start:start + c]]
                begin = time.perf_counter()
                replies = generator.generate(batch)
                run.latencies += [time.perf_counter() - begin] * len(batch)
                run.tokens += [len(r) for r in replies]
            run.seconds, run.client_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
            points.append(point("in_process", name, c, load.summary(run)))
            log.info("in_process %s c=%d: %.1f tok/s", name, c, points[-1]["tokens_per_s"])
    return points


async def sweep_server(system: str, url: str, grpc_port: int | None, sets: dict, plan: Plan) -> list[dict]:
    points = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        protocols = {"http": load.http_generate(session, url)}
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
            send = load.http_infer_ids(session, url, model, ids)
            await load.warm_up(send, items[:1])
            run = await load.closed_loop(send, items[1:count + 1], 1)
            out[model] = load.summary(run)["p50_ms"]
    overhead = out["ensemble"] - out["llm"]
    return {"llm_p50_ms": out["llm"], "ensemble_p50_ms": out["ensemble"], "overhead_ms": overhead,
            "overhead_pct": 100 * overhead / out["llm"]}


def reload_llm_with_delay(url: str, delay_us: int) -> None:
    def set_delay(config: dict) -> None:
        config["dynamic_batching"]["max_queue_delay_microseconds"] = delay_us

    reload_with_config(url, "llm", set_delay, f"max_queue_delay_microseconds={delay_us}")


async def delay_sweep(url: str, items: list[workload.Item], plan: Plan) -> list[dict]:
    """Throughput and latency of the variable workload for each max_queue_delay_microseconds."""
    c, points = plan.sweep_concurrency, []
    original = requests.get(f"{url}/v2/models/llm/config", timeout=30).json()["dynamic_batching"]["max_queue_delay_microseconds"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        for delay in plan.delays_us:
            reload_llm_with_delay(url, delay)
            send = load.http_generate(session, url)
            await load.warm_up(send, items[:c])
            run = await load.closed_loop(send, items[c:c + plan.requests(c)], c)
            points.append({"max_queue_delay_us": delay, "concurrency": c, **load.summary(run)})
            log.info("delay %d us: %.1f tok/s, p50 %.0f ms", delay, points[-1]["tokens_per_s"], points[-1]["p50_ms"])
    reload_llm_with_delay(url, int(original))
    return points


def naive_repository(target: Path, gpu: bool) -> Path:
    """ensemble_repo with llm's dynamic batcher removed: Triton then runs one request per execution."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for name in ("ensemble", "preprocess", "postprocess"):
        (target / name).symlink_to(MODEL_REPOSITORY / name)
    llm = target / "llm"
    llm.mkdir()
    (llm / "1").symlink_to(MODEL_REPOSITORY / "llm" / "1")
    source = MODEL_REPOSITORY / "llm" / ("config.pbtxt" if gpu else "configs/cpu.pbtxt")
    text = re.sub(r"^dynamic_batching .*\n", "", source.read_text(), flags=re.M)
    (llm / "config.pbtxt").write_text("# Benchmark baseline: no dynamic batching.\n" + text)
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

    generator = Generator(LLMConfig(str(model_dir), max_tokens_limit=512), device)
    limit = roofline.measure(generator.model, device, args.quick)
    log.info("roofline: %.1f GFLOP/s, %.1f GB/s", limit.peak_flops / 1e9, limit.bandwidth / 1e9)
    points = in_process(generator, ids, sets, plan)
    del generator

    config_name = "" if gpu else "cpu"
    server = start(MODEL_REPOSITORY, model_dir, out, "ensemble", config_name)
    try:
        points += asyncio.run(sweep_server("ensemble", server.url, server.ports.grpc, sets, plan))
        overhead = asyncio.run(ensemble_overhead(server.url, ids, sets["fixed"], 8 if args.quick else 24))
        delays = asyncio.run(delay_sweep(server.url, sets["variable"], plan))
        cross_check = None
        if plan.perf_analyzer:
            c = 8
            ours = next(p for p in points if p["system"] == "ensemble_http" and p["workload"] == "fixed" and p["concurrency"] == c)
            cross_check = {"concurrency": c, "workload": "fixed", "ours_requests_per_s": ours["requests_per_s"],
                           "ours_p50_ms": ours["p50_ms"],
                           "perf_analyzer": perf_analyzer.measure(server.ports.http, sets["fixed"][: plan.requests(c)], c, out)}
    finally:
        server.stop()

    naive = start(naive_repository(CACHE_DIR / "bench" / "naive_repo", gpu), model_dir, out, "naive", "")
    try:
        points += asyncio.run(sweep_server("naive", naive.url, None, sets, plan))
    finally:
        naive.stop()

    results = {
        "mode": "quick" if args.quick else "full",
        "plan": asdict(plan),
        "machine": machine(),
        "model": {"dir": str(model_dir), "params": limit.params, "weight_bytes": limit.weight_bytes},
        "roofline": limit.as_dict(),
        "points": report.with_ratios(points, limit),
        "ensemble_overhead": overhead,
        "max_queue_delay_sweep": delays,
        "perf_analyzer_cross_check": cross_check,
        "wall_s": time.perf_counter() - started,
    }
    report.write(results, out)
    log.info("wrote %s (%.0f s)", out, results["wall_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
