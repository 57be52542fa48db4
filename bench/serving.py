"""``python -m bench.serving``: what serving costs the engine, hop by hop, and the pipeline's own ceiling.

The fixed workload of ``make bench`` (24-word prompts, exactly 64 tokens a reply, streamed), closed loop
at each concurrency, through three paths on the same machine:

- **the ceiling**: the shipped pipeline with ``llm``'s model taken out (``bench/standin_model.py``: every
  token ready at once), so what sets the pace is everything after the engine; per protocol
  (``generate_stream``, the gRPC stream, the OpenAI front end's SSE) at each ``--ceiling-concurrency``,
  with the tokens a chunk carries, the time between chunks and each process's CPU per token (``llm``'s
  engine thread apart from the rest of its process, which is its responder and Triton's stub);

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

import aiohttp
import tritonclient.grpc.aio as grpcaio

from bench import load, workload
from bench.__main__ import FULL, machine, start, sweep_triton, workloads
from launcher.frontend import OpenAIFrontend
from launcher.install import has_gpu
from launcher.model_folder import prepare_default_model
from launcher.paths import MODEL_REPOSITORY
from launcher.process import free_port
from launcher.repository import repository_variant
from llm import LLM, LLMConfig, configure_threads
from llm.service import ENGINE_THREAD, EngineLoop
from preprocess import PreprocessConfig, Preprocessor, PromptRequest
from ipc.stubs import stat, stubs

log = logging.getLogger("bench.serving")
TICKS = os.sysconf("SC_CLK_TCK")
STANDIN_MODEL = Path(__file__).with_name("standin_model.py")
# What runs after the engine, whose CPU per streamed token the ceiling sums (issue 45's 0.25 ms goal).
AFTER_ENGINE = ("llm", "tritonserver", "postprocess", "openai front end")


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


def _cpu(fields: list[str] | None) -> float:
    """CPU seconds (user + system) in /proc's stat fields after "(comm)"."""
    return (int(fields[11]) + int(fields[12])) / TICKS if fields else 0.0


def _thread_cpu(pid: int, name: str) -> float:
    """CPU seconds of process ``pid``'s threads named ``name``."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            comm = (task / "comm").read_text().strip()
            if comm == name:
                total += _cpu((task / "stat").read_text().rsplit(")", 1)[1].split())
        except OSError:
            continue
    return total


def cpu_seconds(server_pid: int, frontend_pid: int | None = None) -> dict[str, float]:
    """CPU seconds of a tritonserver, of each model's Python stubs by model (``ipc/stubs.py`` finds them),
    of llm's engine thread apart from the rest of its stub, and of the OpenAI front end when given."""
    processes = {"tritonserver": {server_pid}} | stubs(server_pid)
    out = {name: sum(_cpu(stat(pid)) for pid in pids) for name, pids in processes.items()}
    engine = sum(_thread_cpu(pid, ENGINE_THREAD) for pid in processes.get("llm", ()))
    out["llm"] = out.get("llm", 0.0) - engine
    out["llm engine"] = engine
    if frontend_pid is not None:
        out["openai front end"] = _cpu(stat(frontend_pid))
    return out


def cpu_ms_per_token(before: dict[str, float], after: dict[str, float], client: float, tokens: int) -> dict[str, float]:
    """Each process's CPU milliseconds per streamed token between two ``cpu_seconds`` readings, and the
    client's (``client`` CPU seconds)."""
    return {**{name: 1e3 * (after[name] - before.get(name, 0.0)) / tokens for name in after}, "client": 1e3 * client / tokens}


def standin_repository(target: Path, running: int) -> Path:
    """ensemble_repo with llm's model taken out (bench/standin_model.py), uncompiled (nothing to compile),
    with room for ``running`` streams at once and their prompts beside them in a step."""
    def edit(config: str) -> str:
        for key, value in (("compile", "false"), ("max_batched_tokens", str(max(256, 4 * running)))):
            line = f'parameters {{ key: "{key}" value: {{ string_value: "'
            assert line in config, f"llm's config no longer has its {key} parameter"
            start = config.index(line) + len(line)
            config = config[:start] + value + config[config.index('"', start):]
        return "# Benchmark stand-in: every token ready at once (bench/standin_model.py).\n" + config

    return repository_variant(target, edit, STANDIN_MODEL)


def ceiling(model_dir: Path, concurrency: tuple[int, ...], step_ms: float, out: Path) -> list[dict]:
    """The pipeline's own capacity per protocol and concurrency (the stand-in ``llm``), each point with
    its chunking and every process's CPU milliseconds per streamed token."""
    requests = lambda c: max(32, 4 * c)  # noqa: E731
    items = workload.fixed(max(concurrency) + requests(max(concurrency)), FULL.fixed_tokens)
    server, _ = start(standin_repository(out / "standin_repository", max(concurrency)), model_dir, out, "standin",
                      "" if has_gpu() else "cpu", MAX_RUNNING_REQUESTS=str(max(concurrency)),
                      KV_CACHE_TOKENS=str(max(16384, 256 * max(concurrency))), STANDIN_STEP_MS=f"{step_ms:g}")
    frontend = OpenAIFrontend(server, model_dir.name, log_path=out / "standin-openai.log", port=free_port()).start()
    points: list[dict] = []

    async def sweep() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            grpc = grpcaio.InferenceServerClient(server.grpc_url)
            senders = {"generate_stream": load.http_stream(session, server.url), "grpc_stream": load.grpc_stream(grpc),
                       "openai_sse": load.openai_stream(session, frontend.url, frontend.model_name)}
            for protocol, send in senders.items():
                for c in concurrency:
                    await load.warm_up(send, items[:c])
                    before, client = cpu_seconds(server.process.pid, frontend.process.pid), time.process_time()
                    run = await load.closed_loop(send, items[c:c + requests(c)], c)
                    after, client = cpu_seconds(server.process.pid, frontend.process.pid), time.process_time() - client
                    tokens = sum(run.tokens)
                    per_token = cpu_ms_per_token(before, after, client, tokens)
                    per_token["after the engine"] = sum(per_token.get(name, 0.0) for name in AFTER_ENGINE)
                    points.append({"protocol": protocol, "concurrency": c, "step_ms": step_ms, **load.summary(run),
                                   "cpu_ms_per_token": per_token})
                    log.info("ceiling, %s, c=%d: %.0f tok/s, %.1f tokens a chunk", protocol, c,
                             points[-1]["tokens_per_s"], points[-1].get("tokens_per_chunk", 0))
            await grpc.close()

    try:
        frontend.wait_ready()
        asyncio.run(sweep())
    finally:
        frontend.stop()
        server.stop()
    return points


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
            per_token = cpu_ms_per_token(before, after, client, tokens)
            points.append({"concurrency": c, "stream_interval": stream_interval, "cpu_ms_per_token": per_token,
                           **{k: point[k] for k in ("tokens_per_s", "ttft_p50_ms", "tokens_per_chunk", "chunk_gap_p50_ms",
                                                    "chunk_gap_p99_ms")}})
            log.info("served, interval %d, c=%d: %.1f tok/s", stream_interval, c, point["tokens_per_s"])
    finally:
        server.stop()
    return points


def table(alone: dict[int, dict], points: list[dict]) -> str:
    """The real engine served against itself alone, with the chunking and each process's CPU per token."""
    hops = ("llm engine", "llm", "postprocess", "preprocess", "tritonserver", "client")
    lines = ["| concurrency | stream_interval | served tok/s | engine alone tok/s | served / alone | tokens a chunk | "
             "chunk gap p50 / p99 ms | TTFT p50 ms | " + " | ".join(f"{h} CPU ms/token" for h in hops) + " |",
             "|---" * (8 + len(hops)) + "|"]
    for p in points:
        base = alone[p["concurrency"]]["tokens_per_s"]
        cpu = " | ".join(f"{p['cpu_ms_per_token'].get(h, 0.0):.2f}" for h in hops)
        lines.append(f"| {p['concurrency']} | {p['stream_interval']} | {p['tokens_per_s']:.1f} | {base:.1f} | "
                     f"{p['tokens_per_s'] / base:.0%} | {p.get('tokens_per_chunk', 0):.1f} | "
                     f"{p.get('chunk_gap_p50_ms', 0):.1f} / {p.get('chunk_gap_p99_ms', 0):.1f} | {p['ttft_p50_ms']:.0f} | {cpu} |")
    return "\n".join(lines)


def ceiling_table(points: list[dict]) -> str:
    """The stand-in's points: the pipeline's capacity per protocol, its chunking, and CPU per token."""
    hops = ("llm engine", *AFTER_ENGINE, "after the engine", "preprocess", "client")
    lines = ["| protocol | concurrency | tok/s | tokens a chunk | chunk gap p50 / p99 ms | TTFT p50 ms | "
             + " | ".join(f"{h} CPU ms/token" for h in hops) + " |", "|---" * (6 + len(hops)) + "|"]
    for p in points:
        cpu = " | ".join(f"{p['cpu_ms_per_token'].get(h, 0.0):.3f}" for h in hops)
        lines.append(f"| {p['protocol']} | {p['concurrency']} | {p['tokens_per_s']:.0f} | {p.get('tokens_per_chunk', 0):.1f} | "
                     f"{p.get('chunk_gap_p50_ms', 0):.2f} / {p.get('chunk_gap_p99_ms', 0):.2f} | {p['ttft_p50_ms']:.1f} | {cpu} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--stream-interval", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ceiling-concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--step-ms", type=float, default=1.0,
                        help="the stand-in's step, a token for every stream (sleeping, as a GPU's step leaves the CPU "
                             "free): 1 ms offers 1,000 tokens a second a stream, more than any engine here; 0: every "
                             "token of a reply at once")
    parser.add_argument("--parts", nargs="+", choices=["ceiling", "served"], default=["ceiling", "served"],
                        help="the stand-in's ceiling (no model runs), the model served against the engine alone, or both")
    parser.add_argument("--out", type=Path, default=Path("bench_results/serving"))
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_default_model()
    results: dict = {"machine": machine()}
    print(f"{results['machine']['cpu']}, {results['machine']['cores']} cores")
    if "ceiling" in args.parts:
        results["ceiling"] = ceiling(model_dir, tuple(args.ceiling_concurrency), args.step_ms, out)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        print(f"\nThe ceiling (no model, a {args.step_ms:g} ms step):\n{ceiling_table(results['ceiling'])}")
    if "served" not in args.parts:
        return 0
    sets = {"fixed": workloads(FULL)["fixed"]}
    preprocessor = Preprocessor(PreprocessConfig(str(model_dir)))
    prompts = [preprocessor.encode(PromptRequest(i.text_input.encode())).input_ids for i in sets["fixed"]]
    alone = engine_alone(model_dir, prompts, sets["fixed"][0].max_tokens, tuple(args.concurrency))
    points = [p for interval in args.stream_interval for p in served(model_dir, sets, tuple(args.concurrency), interval, out)]
    results |= {"engine_alone": alone, "served": points}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\nThe model served against the engine alone:\n{table(alone, points)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
