"""``python -m bench [--quick]``: every system, every workload and concurrency, in one run.

Systems, all on the same weights and the same seeded prompts:

- ``in_process``: Hugging Face ``generate`` on batches of size = concurrency, no server (static batching
  at its best);
- ``static``: Triton with the static dynamic-batching ``llm`` the in-flight engine replaced;
- ``ensemble_http`` (``generate_stream``, streamed) and ``ensemble_grpc`` (KServe infer on
  ``ensemble_infer``): the shipped pipeline;
- ``openai_http``: the same pipeline through the OpenAI front end (streamed ``/v1/chat/completions``), and
  in full mode vLLM's ``guidellm`` driving that endpoint too (``bench/guidellm.py``);
- ``llama_server_bf16`` and ``llama_server_f32``: llama.cpp's server (full mode), and ``vllm``, vLLM's CPU
  build, where it runs here (``bench/peers.py``);
- quantized weights (full mode, ``bench/quantized.py``): ``ensemble_http_int8`` and ``ensemble_http_int4``
  against ``llama_server_q8_0`` and ``llama_server_q4_1``, each with the roofline of the bytes it reads;
- the roofline: this machine's measured limit in each system's dtype;
- the multi-turn ``chat`` workload (``bench/chat.py``): our OpenAI endpoint with prefix caching on and off,
  and in full mode llama-server (ours's dtype) and vLLM, each with its prompt or prefix cache on.

Writes ``results.json``, ``results.md`` and PNG plots to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import re
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import torch
import tritonclient.grpc.aio as grpcaio

from bench import chat, guidellm, load, peers, perf_analyzer, report, roofline, stall, workload
from launcher.frontend import OpenAIFrontend
from launcher.model_folder import prepare_default_model
from launcher.install import has_gpu
from launcher.paths import CACHE_DIR, COMPILE_CACHE, MODEL_REPOSITORY
from launcher.process import Ports, free_port
from launcher.repository import repository_variant
from launcher.tritonserver import TritonServer
from llm import LLM, LLMConfig, kernels, load_model
from llm.reference import StaticGenerator
from contract.grammar import llguidance_grammar
from preprocess import PreprocessConfig, Preprocessor, PromptRequest

log = logging.getLogger("bench")


@dataclass(frozen=True)
class Plan:
    concurrency: tuple[int, ...]  # the shipped pipeline and its peers
    baseline_concurrency: tuple[int, ...]  # in_process, static and ensemble_grpc
    openai_concurrency: tuple[int, ...]  # openai_http (fixed workload), and guidellm in full mode
    sampled_concurrency: tuple[int, ...]  # ensemble_http on the sampled workload (every row through the sampler)
    structured_concurrency: tuple[int, ...]  # ensemble_http on the structured workload (a JSON schema on every row)
    chat_concurrency: tuple[int, ...]  # the multi-turn chat workload, on every system that runs it
    chat_turns: int
    chat_tokens: int  # each reply
    chat_cache_off: bool  # also our endpoint with prefix caching off (a second server start)
    fixed_tokens: int
    variable_tokens: tuple[int, int]
    perf_analyzer: bool
    peers: bool  # llama-server and vLLM
    third_party: bool  # guidellm on the OpenAI endpoint
    rounds: int  # measured requests per point = max(8, rounds x concurrency), after one warm-up round

    def requests(self, concurrency: int) -> int:
        return max(8, self.rounds * concurrency)


QUANTIZED_CONCURRENCY = (1, 16, 64)  # bench/quantized.py's points in full mode: int8 and int4 against llama.cpp's

QUICK = Plan((1, 4), (1, 4), (1, 4), (4,), (4,), (4,), 3, 16, False, 16, (4, 32), perf_analyzer=False, peers=False,
             third_party=False, rounds=1)
FULL = Plan((1, 4, 16, 32, 64), (1, 4, 16), (1, 16), (16, 64), (1, 16), (4, 16), 6, 48, True, 64, (8, 128),
            perf_analyzer=True, peers=True, third_party=True, rounds=2)


def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"model name\s*:\s*(.+)", cpuinfo)
    why_not = kernels.load()
    return {
        "cpu": model.group(1) if model else platform.processor(),
        "cpu_features": sorted(kernels.cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "kernels": kernels.describe() if why_not is None else f"oneDNN and torch ({why_not})",
        "cores": len(os.sched_getaffinity(0)),
        "gpu": has_gpu(),
        "torch": torch.__version__,
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
    }


def grammar_build_ms(llm: LLM) -> dict[str, float]:
    """Milliseconds to build a grammar no request asked for before (what a new schema costs, on the
    submitting thread): the structured workload's schema and a nested one; first the tokenizer's one-time
    conversion for llguidance."""
    def timed(spec: dict) -> float:
        begin = time.perf_counter()
        llm.grammars.matcher(llguidance_grammar(spec))
        return 1000 * (time.perf_counter() - begin)

    nested = {"type": "object", "additionalProperties": False, "required": ["customer", "items", "colour"], "properties": {
        "customer": {"type": "string", "maxLength": 16}, "colour": {"enum": ["red", "green", "blue"]},
        "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "additionalProperties": False,
                  "required": ["name", "quantity"], "properties": {"name": {"type": "string", "maxLength": 12},
                                                                   "quantity": {"type": "integer", "minimum": 1}}}}}}
    return {"tokenizer_once": timed({"regex": "a"}), "workload_schema": timed({"json": workload.SCHEMA}),
            "nested_schema": timed({"json": nested})}


def workloads(plan: Plan) -> dict[str, list[workload.Item]]:
    """Enough seeded items for the largest point plus its warm-up; each point takes a prefix."""
    count = 2 * plan.requests(max(plan.concurrency)) + max(plan.concurrency)
    return {
        "fixed": workload.fixed(count, plan.fixed_tokens, seed=1),
        "variable": workload.variable(count, *plan.variable_tokens, seed=2),
    }


def point(system: str, dtype: str, name: str, concurrency: int, measured: dict, **extra) -> dict:
    return {"system": system, "dtype": dtype, "workload": name, "concurrency": concurrency, **measured, **extra}


def in_process(generator: StaticGenerator, ids: dict[str, list[int]], sets: dict, plan: Plan, dtype: str) -> list[dict]:
    """Static batching at its best: the same model and prompts, batches of ``concurrency``, no server."""
    points = []
    validate = generator.llm.validate
    for name, items in sets.items():
        for c in plan.baseline_concurrency:
            chosen = items[c:c + plan.requests(c)]
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
            points.append(point("in_process", dtype, name, c, load.summary(run)))
            log.info("in_process %s c=%d: %.1f tok/s", name, c, points[-1]["tokens_per_s"])
    return points


async def sweep(system: str, dtype: str, send: load.Send, sets: dict, plan: Plan, concurrency: tuple[int, ...],
                stats_url: str | None = None) -> list[dict]:
    """Closed-loop points for one system; with ``stats_url``, Triton's per-model statistics too."""
    points = []
    for name, items in sets.items():
        for c in concurrency:
            await load.warm_up(send, items[:c])
            await asyncio.sleep(0.2)
            before = load.server_stats(stats_url) if stats_url else {}
            run = await load.closed_loop(send, items[c:c + plan.requests(c)], c)
            extra = {}
            if stats_url:
                await asyncio.sleep(0.2)  # the ensemble's statistics land just after its reply
                extra["server"] = load.stats_delta(before, load.server_stats(stats_url))
            points.append(point(system, dtype, name, c, load.summary(run), **extra))
            log.info("%s %s c=%d: %.1f tok/s", system, name, c, points[-1]["tokens_per_s"])
    return points


async def sweep_triton(system: str, dtype: str, server: TritonServer, sets: dict, plan: Plan,
                       concurrency: tuple[int, ...], grpc_concurrency: tuple[int, ...] = ()) -> list[dict]:
    """``generate_stream`` points as ``system``, and KServe gRPC infer points as ``<system>_grpc`` when asked."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        points = await sweep(system, dtype, load.http_stream(session, server.url), sets, plan, concurrency, server.url)
    if grpc_concurrency:
        client = grpcaio.InferenceServerClient(server.grpc_url)
        points += await sweep(f"{system.removesuffix('_http')}_grpc", dtype, load.grpc_infer(client), sets, plan,
                              grpc_concurrency, server.url)
        await client.close()
    return points


async def sweep_openai(frontend: OpenAIFrontend, dtype: str, sets: dict, plan: Plan) -> list[dict]:
    """The pipeline through the OpenAI front end, on the fixed workload, by the client the peers get."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        send = load.openai_stream(session, frontend.url, frontend.model_name)
        return await sweep("openai_http", dtype, send, {"fixed": sets["fixed"]}, plan, plan.openai_concurrency,
                           frontend.triton.url)


async def sweep_peer(server: peers.OpenAIServer, sets: dict, plan: Plan, ids: dict[str, list[int]],
                     concurrency: tuple[int, ...]) -> tuple[list[dict], dict]:
    """A peer's points at ``concurrency``, after checking on a few prompts that it makes as many prompt tokens of them as we do
    (same chat template and tokenizer, so the same work)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        sample = [item.text_input for items in sets.values() for item in items[:4]]
        theirs = [await load.openai_prompt_tokens(session, server.url, server.model, text) for text in sample]
        ours = [len(ids[text]) for text in sample]
        check = {"prompts": len(sample), "agree": theirs == ours, "ours": ours, "theirs": theirs}
        send = load.openai_stream(session, server.url, server.model)
        return await sweep(server.name, server.dtype, send, sets, plan, concurrency), check


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


def static_repository(target: Path) -> Path:
    """ensemble_repo with llm swapped for the static baseline (bench/static_model.py), batched by Triton's
    dynamic batcher with the 5 ms queue delay the shipped config used before the engine."""
    def delay(config: str) -> str:
        return ("# Benchmark baseline: static batches (bench/static_model.py).\n" + config.replace(
            "dynamic_batching { default_queue_policy", "dynamic_batching { max_queue_delay_microseconds: 5000 default_queue_policy"))

    return repository_variant(target, delay, Path(__file__).parent / "static_model.py")


def start(repository: Path, model_dir: Path, out: Path, name: str, config_name: str,
          **env: str) -> tuple[TritonServer, float]:
    server = TritonServer(ports=Ports.free(), model_repository=repository, model_env={"MODEL_DIR": str(model_dir), **env},
                          log_path=out / f"{name}.log", model_config_name=config_name)
    began = time.perf_counter()
    server.start().wait_ready(900)
    return server, time.perf_counter() - began


def chat_points(system: str, dtype: str, url: str, model: str, plan: Plan, prefix_caching: bool,
                fresh_connections: bool = False, concurrency: tuple[int, ...] | None = None) -> list[dict]:
    """The multi-turn chat workload on one system, at ``concurrency`` (by default each of the plan's)."""
    rows = []
    for c in plan.chat_concurrency if concurrency is None else concurrency:
        measured = asyncio.run(chat.measure(url, model, c, plan.chat_turns, plan.chat_tokens, fresh_connections))
        rows.append({"system": system, "dtype": dtype, "prefix_caching": prefix_caching, **measured})
        log.info("%s chat c=%d (prefix caching %s): %.1f tok/s, TTFT p50 first %.0f ms, later %.0f ms", system, c,
                 "on" if prefix_caching else "off", measured["tokens_per_s"], measured["ttft_p50_first_ms"],
                 measured["ttft_p50_later_ms"])
    return rows


def run_peers(plan: Plan, sets: dict, ids: dict, model_dir: Path, dtype: str, out: Path,
              chat_context: int) -> tuple[list[dict], list[dict], list[dict]]:
    """llama-server (F32 and BF16) and vLLM, one at a time; a peer that cannot run says why. The chat
    workload runs on vLLM and on the llama-server of our dtype.

    llama-server runs each concurrency on a server of its own with one slot per client, its best
    configuration there: its slots split the context and decode as one batch, so spare slots cost it
    (379.6 against 330.4 tok/s at c=16 with 16 slots against 64, AMD EPYC 2 cores). vLLM's
    ``max_num_seqs`` only caps its batch, so one server serves every point."""
    context = max(chat_context, max(len(ids[i.text_input]) + i.max_tokens for items in sets.values() for i in items) + 16)
    points, notes, chats = [], [], []
    bin_dir = peers.build_llama_cpp(out)
    for gguf_dtype in ("BF16", "F32"):
        gguf = peers.llama_gguf(bin_dir, gguf_dtype, out)
        chat = gguf_dtype.lower() == {"bfloat16": "bf16"}.get(dtype, "f32")
        for slots in sorted(set(plan.concurrency) | set(plan.chat_concurrency if chat else ())):
            server = peers.llama_server(bin_dir, gguf, gguf_dtype, slots, context, out)
            try:
                server.wait_ready(300)
                if slots in plan.concurrency:
                    found, check = asyncio.run(sweep_peer(server, sets, plan, ids, (slots,)))
                    points += found
                    notes.append({"system": server.name, "status": f"ran with {slots} slots; prompt tokens agree with "
                                  f"ours on {check['prompts']} prompts: {'yes' if check['agree'] else 'no'}",
                                  "prompt_check": check})
                if slots in plan.chat_concurrency and chat:
                    chats += chat_points(server.name, server.dtype, server.url, server.model, plan, True,
                                         fresh_connections=True, concurrency=(slots,))
            except Exception as e:  # a peer that fails is reported, never hidden
                notes.append({"system": server.name, "status": f"failed with {slots} slots: {e}; see {server.name}.log"})
            finally:
                server.stop()
    python = peers.install_vllm(out)
    if python is None:
        notes.append({"system": "vllm", "status": f"could not be installed: see vllm-install.log ({peers.VLLM})"})
        return points, notes, chats
    server = peers.vllm_server(python, model_dir, dtype, max(plan.concurrency), context, out)
    try:
        server.wait_ready(900)
        found, check = asyncio.run(sweep_peer(server, sets, plan, ids, plan.concurrency))
        points += found
        chats += chat_points(server.name, server.dtype, server.url, server.model, plan, True)
        notes.append({"system": "vllm", "status": f"ran ({peers.VLLM}); prompt tokens agree: {check['agree']}",
                      "prompt_check": check})
    except Exception as e:
        tail = (out / "vllm.log").read_text(errors="replace").strip().splitlines()[-3:]
        notes.append({"system": "vllm", "status": f"failed: {e}; last lines of vllm.log: {' | '.join(tail)}"})
    finally:
        server.stop()
    return points, notes, chats


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a few points, no peers, under 5 minutes on 2 cores")
    parser.add_argument("--no-peers", action="store_true",
                        help="full mode without llama-server and vLLM (they take most of its time)")
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else replace(FULL, peers=False) if args.no_peers else FULL
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    model_dir = Path(os.environ.get("MODEL_DIR") or prepare_default_model())
    gpu = has_gpu()
    device = torch.device("cuda:0" if gpu else "cpu")
    sets = workloads(plan)
    sampled = {"sampled": workload.sampled(len(sets["fixed"]), plan.fixed_tokens, seed=1)}  # our pipeline only
    structured = {"structured": workload.structured(len(sets["fixed"]), plan.fixed_tokens, seed=1)}
    preprocessor = Preprocessor(PreprocessConfig(str(model_dir)))
    ids = {i.text_input: preprocessor.encode(PromptRequest(i.text_input.encode())).input_ids
           for items in sets.values() for i in items}
    contexts = {name: sum(len(ids[i.text_input]) + i.max_tokens / 2 for i in items) / len(items)
                for name, items in (sets | sampled | structured).items()}
    # A conversation's last turn: the system prompt, then each turn's question (under 64 tokens with the
    # template's markers) and reply.
    chat_context = len(preprocessor.encode(PromptRequest(chat.system_prompt().encode())).input_ids) \
        + plan.chat_turns * (64 + plan.chat_tokens)

    config = LLMConfig(str(model_dir), max_tokens_limit=512, compile=False)
    hf = load_model(config, device)
    llm = LLM(config, device, hf)
    dtype = str(llm.dtype).removeprefix("torch.")  # the baselines' (Hugging Face's model as loaded) and the peers'
    weights = llm.weights
    served = roofline.engine_dtype(dtype, weights)  # the engine's points': its activations and, where smaller, its weights
    params = sum(p.numel() for p in hf.parameters())
    limits = roofline.measure(params, llm.kv_bytes_per_token // llm.dtype.itemsize,
                              list(dict.fromkeys([llm.dtype, torch.float32])), device, args.quick)
    limits[served] = replace(limits[dtype], dtype=served, weight_bytes=llm.weight_bytes) if served != dtype else limits[dtype]
    points = in_process(StaticGenerator(hf, llm), ids, sets, plan, dtype)
    grammar_build = grammar_build_ms(llm)
    del hf, llm

    config_name = "" if gpu else "cpu"
    tool_notes: list[dict] = []
    cache = COMPILE_CACHE / "inductor"
    cache_warm = cache.exists() and any(cache.iterdir())
    server, startup = start(MODEL_REPOSITORY, model_dir, out, "ensemble", config_name)
    try:
        points += asyncio.run(sweep_triton("ensemble_http", served, server, sets, plan, plan.concurrency,
                                           plan.baseline_concurrency))
        points += asyncio.run(sweep_triton("ensemble_http", served, server, sampled, plan, plan.sampled_concurrency))
        points += asyncio.run(sweep_triton("ensemble_http", served, server, structured, plan, plan.structured_concurrency))
        streams = max(plan.structured_concurrency)
        grammar_stall = stall.measure(server.url, workload.fixed(streams, 4 * plan.fixed_tokens, seed=3))
        overhead = asyncio.run(ensemble_overhead(server.url, ids, sets["fixed"], 8 if args.quick else 24))
        frontend = OpenAIFrontend(server, model_dir.name, log_path=out / "openai.log", port=free_port()).start()
        try:
            frontend.wait_ready()
            points += asyncio.run(sweep_openai(frontend, served, sets, plan))
            chats = chat_points("openai_http", served, frontend.url, frontend.model_name, plan, True)
            if plan.third_party:  # full mode: a third-party tool on the same endpoint and workload
                found, note = guidellm.sweep(frontend, sets["fixed"], plan.openai_concurrency, plan.requests, served,
                                           model_dir, out)
                points += found
                tool_notes.append(note)
        finally:
            frontend.stop()
        cross_check = None
        if plan.perf_analyzer:
            c = 4  # every plan has it
            ours = next(p for p in points if p["system"] == "ensemble_http" and p["workload"] == "fixed" and p["concurrency"] == c)
            cross_check = {"concurrency": c, "workload": "fixed", "ours_requests_per_s": ours["requests_per_s"],
                           "ours_p50_ms": ours["p50_ms"],
                           "perf_analyzer": perf_analyzer.measure(server.ports.http, sets["fixed"][: plan.requests(c)], c, out)}
    finally:
        server.stop()

    if plan.chat_cache_off:
        uncached, _ = start(MODEL_REPOSITORY, model_dir, out, "ensemble-no-prefix-caching", config_name, PREFIX_CACHING="false")
        try:
            frontend = OpenAIFrontend(uncached, model_dir.name, log_path=out / "openai-no-prefix-caching.log",
                                      port=free_port()).start()
            try:
                frontend.wait_ready()
                chats += chat_points("openai_http", served, frontend.url, frontend.model_name, plan, False)
            finally:
                frontend.stop()
        finally:
            uncached.stop()

    static, _ = start(static_repository(CACHE_DIR / "bench" / "static_repo"), model_dir, out, "static", config_name)
    try:
        points += asyncio.run(sweep_triton("static", dtype, static, sets, plan, plan.baseline_concurrency))
    finally:
        static.stop(drain_seconds=0)  # nothing in flight, and the baseline's llm leaves no drain note to wait for

    peer_notes: list[dict] = tool_notes
    if plan.peers:
        found, notes, peer_chats = run_peers(plan, sets, ids, model_dir, dtype, out, chat_context)
        points += found
        peer_notes += notes
        chats += peer_chats
        from bench import quantized  # it builds on this module's sweeps

        found, quantized_limits, notes = quantized.run(sets, ids, model_dir, QUANTIZED_CONCURRENCY, limits[dtype], out,
                                                       config_name)
        points += found
        peer_notes += notes
        limits |= quantized_limits

    points = report.with_ratios(points, limits, contexts)
    results = {
        "mode": "quick" if args.quick else "full, no peers" if args.no_peers else "full",
        "plan": asdict(plan),
        "machine": machine(),
        "model": {"dir": str(model_dir), "params": params, "dtype": dtype, "weights": weights},
        "roofline": {name: limit.as_dict() for name, limit in limits.items()},
        "contexts": contexts,
        "points": points,
        "targets": report.targets(points),
        "openai": report.openai_rows(points),
        "chat": chats,
        "chat_targets": report.chat_targets(chats),
        "quantized": report.quantized_rows(points, limits, contexts),
        "peers": peer_notes,
        "ensemble_overhead": overhead,
        "grammar_build_ms": grammar_build,
        "grammar_stall": grammar_stall,
        "startup_s": startup,
        "compile_cache_warm": cache_warm,
        "perf_analyzer_cross_check": cross_check,
        "wall_s": time.perf_counter() - started,
    }
    report.write(results, out)
    log.info("wrote %s (%.0f s)", out, results["wall_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
