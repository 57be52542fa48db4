"""``python -m bench.serving``: what serving costs the engine, hop by hop.

The fixed workload of ``make bench`` (24-word prompts, exactly 64 tokens a reply, streamed), closed loop
at each ``--concurrency``, through two paths on the same machine:

- **the engine alone**: ``llm``'s own port (``EngineLoop``, its engine and responder threads, built as the
  Triton glue builds it) in this process, fed the token ids ``preprocess`` makes of the same prompts; no
  Triton, no text;
- **served**: Triton's ``generate_stream`` on the shipped repository (a server per ``--stream-interval``),
  with the CPU seconds each process spent per generated token: the ``llm`` stub (the engine and its
  responder), ``postprocess``, ``preprocess``, ``tritonserver`` itself (HTTP, the ensemble's routing) and
  this client.

On a CPU every hop after the engine (a response, an ensemble step, a ``postprocess`` call, an event to
the client) takes its time from the engine's two OpenMP threads, and each time one of them is preempted
the other waits for it at the end of the operator; so the engine's own CPU per token is reported too, and
grows when serving runs beside it. docs/benchmark.md shows this command's output.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.__main__ import FULL, machine, start, sweep_triton, workloads
from launcher.install import has_gpu
from launcher.model_folder import prepare_default_model
from launcher.paths import MODEL_REPOSITORY
from llm import LLM, LLMConfig, configure_threads
from llm.service import EngineLoop
from preprocess import PreprocessConfig, Preprocessor, PromptRequest
from ipc.stubs import stat, stubs

log = logging.getLogger("bench.serving")
TICKS = os.sysconf("SC_CLK_TCK")


def engine_alone(model_dir: Path, prompts: list[list[int]], max_tokens: int, concurrency: tuple[int, ...]) -> dict[int, dict]:
    """Tokens a second through ``llm``'s port alone at each concurrency, every token streamed to a caller
    that only counts them: a warm-up round, then ``FULL.requests(c)`` requests, as the served points."""
    built: list[LLM] = []

    device = torch.device("cuda:0" if has_gpu() else "cpu")  # where the server puts llm

    def build():
        configure_threads(1, device)
        built.append(LLM(LLMConfig(str(model_dir), max_tokens_limit=512), device))
        return built[0].engine()

    ended: queue.Queue = queue.Queue()
    loop = EngineLoop(build, lambda update: update.finish_reason and ended.put(update.completion_tokens))

    def submit(ids: list[int]) -> None:
        loop.submit(built[0].validate(ids, max_tokens, ignore_eos=True), object(), every_token=True)

    def run(batch: list[list[int]], c: int) -> tuple[int, float]:
        waiting, tokens, began = list(batch), 0, time.perf_counter()
        for _ in range(min(c, len(waiting))):
            submit(waiting.pop(0))
        for _ in batch:
            tokens += ended.get(timeout=600)
            if waiting:
                submit(waiting.pop(0))
        return tokens, time.perf_counter() - began

    points = {}
    try:
        for c in concurrency:
            run(prompts[:c], c)
            tokens, seconds = run(prompts[c:c + FULL.requests(c)], c)
            points[c] = {"tokens_per_s": tokens / seconds, "output_tokens": tokens}
            log.info("engine alone, c=%d: %.1f tok/s", c, points[c]["tokens_per_s"])
    finally:
        loop.stop()
    return points


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a tritonserver and of each model's Python stubs, by model
    (``ipc/stubs.py`` finds them)."""
    processes = {"tritonserver": {server_pid}} | stubs(server_pid)
    return {name: sum(int(f[11]) + int(f[12]) for pid in pids if (f := stat(pid))) / TICKS
            for name, pids in processes.items()}


def served(model_dir: Path, sets: dict, concurrency: tuple[int, ...], stream_interval: int, out: Path) -> list[dict]:
    """``generate_stream`` points at each concurrency, with every process's CPU seconds per token."""
    server, _ = start(MODEL_REPOSITORY, model_dir, out, f"serving-interval-{stream_interval}", "" if has_gpu() else "cpu",
                      STREAM_INTERVAL=str(stream_interval))
    points = []
    try:
        for c in concurrency:
            plan = replace(FULL, concurrency=(c,))
            before, client = cpu_seconds(server.process.pid), time.process_time()
            [point] = asyncio.run(sweep_triton("ensemble_http", "", server, sets, plan, (c,)))
            after, client = cpu_seconds(server.process.pid), time.process_time() - client
            # The warm-up round ran inside the window too: count its tokens (c replies) with the measured ones.
            tokens = point["output_tokens"] + c * sets["fixed"][0].max_tokens
            per_token = {name: 1e3 * (after[name] - before.get(name, 0.0)) / tokens for name in after}
            per_token["client"] = 1e3 * client / tokens
            points.append({"concurrency": c, "stream_interval": stream_interval, "tokens_per_s": point["tokens_per_s"],
                           "ttft_p50_ms": point["ttft_p50_ms"], "cpu_ms_per_token": per_token})
            log.info("served, interval %d, c=%d: %.1f tok/s", stream_interval, c, point["tokens_per_s"])
    finally:
        server.stop()
    return points


def table(alone: dict[int, dict], points: list[dict]) -> str:
    hops = ("llm", "postprocess", "preprocess", "tritonserver", "client")
    lines = ["| concurrency | stream_interval | served tok/s | engine alone tok/s | served / alone | "
             + " | ".join(f"{h} CPU ms/token" for h in hops) + " |", "|---" * (5 + len(hops)) + "|"]
    for p in points:
        base = alone[p["concurrency"]]["tokens_per_s"]
        cpu = " | ".join(f"{p['cpu_ms_per_token'].get(h, 0.0):.2f}" for h in hops)
        lines.append(f"| {p['concurrency']} | {p['stream_interval']} | {p['tokens_per_s']:.1f} | {base:.1f} | "
                     f"{p['tokens_per_s'] / base:.0%} | {cpu} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--stream-interval", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", type=Path, default=Path("bench_results/serving"))
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_default_model()
    sets = {"fixed": workloads(FULL)["fixed"]}
    preprocessor = Preprocessor(PreprocessConfig(str(model_dir)))
    prompts = [preprocessor.encode(PromptRequest(i.text_input.encode())).input_ids for i in sets["fixed"]]
    alone = engine_alone(model_dir, prompts, sets["fixed"][0].max_tokens, tuple(args.concurrency))
    points = [p for interval in args.stream_interval for p in served(model_dir, sets, tuple(args.concurrency), interval, out)]
    results = {"machine": machine(), "engine_alone": alone, "served": points}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"{results['machine']['cpu']}, {results['machine']['cores']} cores\n{table(alone, points)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
