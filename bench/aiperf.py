"""NVIDIA's ``aiperf``, a third-party load generator, on the OpenAI endpoint: a check on our own client.

It runs from its own venv (``.cache/aiperf``: its pins are not ours) on the very prompts of our fixed
workload (a ``single_turn`` JSONL file), closed loop at the same concurrency, greedy, ``ignore_eos`` and the
same reply budget, counting tokens from the server's ``usage`` as our client does, right after our own
load generator warmed the server (aiperf's own warm-up takes entries of a sequential custom dataset and
then waits for them forever). A run that fails is reported with its log's tail, never hidden.

It needs cores to spare: its timing manager polls a core flat out for the whole run (measured with aiperf
0.13.0), and on a 2-core machine that starves llm's two OpenMP threads: one request generated 1.4 tok/s
while aiperf ran, even under ``nice -n 19``, against 35 tok/s alone. Below ``MIN_CORES`` the bench says so
instead of reporting aiperf's own CPU use as the server's speed.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.workload import Item
from launcher.frontend import OpenAIFrontend
from launcher.triton import CACHE_DIR

AIPERF = "aiperf==0.13.0"
VENV = CACHE_DIR / "aiperf"
SYSTEM = "aiperf_openai"
MIN_CORES = 4

log = logging.getLogger("bench.aiperf")


def install(out: Path) -> Path | None:
    """The ``aiperf`` command, installed once into its own venv; None (and a log) when it cannot be."""
    stamp = VENV / f".{AIPERF}"
    if stamp.exists():
        return VENV / "bin" / "aiperf"
    with open(out / "aiperf-install.log", "w") as logfile:
        for cmd in ([sys.executable, "-m", "venv", str(VENV)],
                    [str(VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", AIPERF]):
            if subprocess.run(cmd, stdout=logfile, stderr=subprocess.STDOUT).returncode:
                return None
    stamp.touch()
    return VENV / "bin" / "aiperf"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(aiperf: Path, frontend: OpenAIFrontend, items: list[Item], concurrency: int, tokenizer: Path, out: Path) -> dict:
    """One closed-loop point: aiperf's own figures, in our summary's keys."""
    folder = out / f"aiperf-c{concurrency}"
    folder.mkdir(parents=True, exist_ok=True)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"text": item.text_input}) + "\n" for item in items))
    (max_tokens,) = {item.max_tokens for item in items}  # the fixed workload: one budget
    cmd = [str(aiperf), "profile", "--model", frontend.model_name, "--url", frontend.url, "--endpoint-type", "chat",
           "--streaming", "--input-file", str(prompts), "--custom-dataset-type", "single_turn",
           "--tokenizer", str(tokenizer), "--use-server-token-count",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--extra-inputs", f"max_completion_tokens:{max_tokens}",
           "--concurrency", str(concurrency), "--request-count", str(len(items)), "--no-server-metrics",
           "--no-gpu-telemetry", "--ui", "none", "--output-artifact-dir", str(folder / "out")]
    cpu, wall = _children_cpu(), time.perf_counter()
    with open(folder / "aiperf.log", "w") as logfile:
        done = subprocess.run(cmd, stdout=logfile, stderr=subprocess.STDOUT, cwd=folder, timeout=3600)
    seconds, cpu = time.perf_counter() - wall, _children_cpu() - cpu
    if done.returncode:
        tail = (folder / "aiperf.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"aiperf exited {done.returncode}: {' | '.join(tail)}")
    data = json.loads((folder / "out" / "profile_export_aiperf.json").read_text())
    duration = data["benchmark_duration"]["avg"]
    return {
        "requests": int(data["request_count"]["avg"]),
        "seconds": duration,
        "output_tokens": int(data["total_osl"]["avg"]),
        "tokens_per_s": data["output_token_throughput"]["avg"],
        "requests_per_s": data["request_throughput"]["avg"],
        "p50_ms": data["request_latency"]["p50"], "p99_ms": data["request_latency"]["p99"],
        "ttft_p50_ms": data["time_to_first_token"]["p50"], "ttft_p99_ms": data["time_to_first_token"]["p99"],
        "client_cpu_s": cpu, "client_cpu_pct": 100 * cpu / seconds,  # aiperf's processes, start-up included
        "errors": data.get("error_summary") or [],
    }


def sweep(frontend: OpenAIFrontend, items: list[Item], concurrency: tuple[int, ...], requests: Callable[[int], int],
          dtype: str, tokenizer: Path, out: Path) -> tuple[list[dict], dict]:
    """aiperf's points (system ``aiperf_openai``) at each concurrency, and a note on how it went."""
    cores = len(os.sched_getaffinity(0))
    if cores < MIN_CORES:
        return [], {"system": SYSTEM, "status": f"not run: {cores} cores; aiperf's timing manager takes a core "
                    f"of its own and starves llm below {MIN_CORES} (bench/aiperf.py)"}
    aiperf = install(out)
    if aiperf is None:
        return [], {"system": SYSTEM, "status": f"could not be installed ({AIPERF}): see aiperf-install.log"}
    points = []
    try:
        for c in concurrency:
            measured = run(aiperf, frontend, items[c:c + requests(c)], c, tokenizer, out)
            points.append({"system": SYSTEM, "dtype": dtype, "workload": "fixed", "concurrency": c, **measured})
            log.info("%s fixed c=%d: %.1f tok/s", SYSTEM, c, measured["tokens_per_s"])
    except Exception as e:  # reported, never hidden
        return points, {"system": SYSTEM, "status": f"failed: {e}"}
    return points, {"system": SYSTEM, "status": f"ran ({AIPERF}) on the OpenAI endpoint, fixed workload"}
