"""vLLM's ``guidellm``, a third-party load generator, on the OpenAI endpoint: a check on our own client.

It runs from its own venv (``.cache/guidellm``: its pins are not ours) on the very prompts of our fixed
workload (a JSON-lines file), closed loop at the same concurrency (its ``concurrent`` profile), greedy,
``ignore_eos`` and the same reply budget, right after our own load generator warmed the server. A run that
fails is reported with its log's tail, never hidden.

Why not NVIDIA's aiperf (0.13.0, tried first): its timing manager polls a core flat out for the whole run,
and on a 2-core machine that starves llm's two OpenMP threads (one request generated 1.4 tok/s while aiperf
ran, even under ``nice -n 19``, against 35 tok/s alone), so it measured its own CPU use, not the server;
and its warm-up took entries of a sequential custom dataset and then waited for them forever.
"""

from __future__ import annotations

import json
import logging
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.workload import Item
from launcher.frontend import OpenAIFrontend
from launcher.paths import CACHE_DIR

GUIDELLM = "guidellm==0.8.1"
VENV = CACHE_DIR / "guidellm"
SYSTEM = "guidellm_openai"

log = logging.getLogger("bench.guidellm")


def install(out: Path) -> Path | None:
    """The ``guidellm`` command, installed once into its own venv; None (and a log) when it cannot be."""
    stamp = VENV / f".{GUIDELLM}"
    if stamp.exists():
        return VENV / "bin" / "guidellm"
    with open(out / "guidellm-install.log", "w") as logfile:
        for cmd in ([sys.executable, "-m", "venv", str(VENV)],
                    [str(VENV / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", GUIDELLM]):
            if subprocess.run(cmd, stdout=logfile, stderr=subprocess.STDOUT).returncode:
                return None
    stamp.touch()
    return VENV / "bin" / "guidellm"


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(guidellm: Path, frontend: OpenAIFrontend, items: list[Item], concurrency: int, tokenizer: Path, out: Path) -> dict:
    """One closed-loop point: guidellm's own figures, in our summary's keys."""
    folder = out / f"guidellm-c{concurrency}"
    folder.mkdir(parents=True, exist_ok=True)
    prompts, report = folder / "prompts.jsonl", folder / "report.json"
    prompts.write_text("".join(json.dumps({"prompt": item.text_input}) + "\n" for item in items))
    (max_tokens,) = {item.max_tokens for item in items}  # the fixed workload: one budget
    cmd = [str(guidellm), "run",
           "--backend", f"kind=openai_http,target={frontend.url},model={frontend.model_name},max_tokens={max_tokens},"
                        "extras.body.temperature=0,extras.body.ignore_eos=true",
           "--profile", f"kind=concurrent,streams={concurrency}",
           "--constraint", f"kind=max_requests,count={len(items)}",
           "--data", f"kind=json_file,path={prompts}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    cpu, wall = _children_cpu(), time.perf_counter()
    with open(folder / "guidellm.log", "w") as logfile:
        done = subprocess.run(cmd, stdout=logfile, stderr=subprocess.STDOUT, cwd=folder, timeout=3600)
    seconds, cpu = time.perf_counter() - wall, _children_cpu() - cpu
    if done.returncode:
        tail = (folder / "guidellm.log").read_text(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"guidellm exited {done.returncode}: {' | '.join(tail)}")
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    metrics, duration = benchmark["metrics"], benchmark["duration"]
    totals = metrics["request_totals"]
    if totals["errored"] or totals["incomplete"]:
        raise RuntimeError(f"guidellm: {totals['errored']} requests errored, {totals['incomplete']} incomplete")
    latency, ttft = metrics["request_latency"]["successful"], metrics["time_to_first_token_ms"]["successful"]
    tokens = int(metrics["output_token_count"]["successful"]["total_sum"])
    return {
        "requests": totals["successful"], "seconds": duration, "output_tokens": tokens,
        "tokens_per_s": tokens / duration, "requests_per_s": totals["successful"] / duration,
        "p50_ms": 1000 * latency["percentiles"]["p50"], "p99_ms": 1000 * latency["percentiles"]["p99"],
        "ttft_p50_ms": ttft["percentiles"]["p50"], "ttft_p99_ms": ttft["percentiles"]["p99"],
        "client_cpu_s": cpu, "client_cpu_pct": 100 * cpu / seconds,  # guidellm's processes, start-up included
    }


def sweep(frontend: OpenAIFrontend, items: list[Item], concurrency: tuple[int, ...], requests: Callable[[int], int],
          dtype: str, tokenizer: Path, out: Path) -> tuple[list[dict], dict]:
    """guidellm's points (system ``guidellm_openai``) at each concurrency, and a note on how it went."""
    guidellm = install(out)
    if guidellm is None:
        return [], {"system": SYSTEM, "status": f"could not be installed ({GUIDELLM}): see guidellm-install.log"}
    points = []
    try:
        for c in concurrency:
            measured = run(guidellm, frontend, items[c:c + requests(c)], c, tokenizer, out)
            points.append({"system": SYSTEM, "dtype": dtype, "workload": "fixed", "concurrency": c, **measured})
            log.info("%s fixed c=%d: %.1f tok/s", SYSTEM, c, measured["tokens_per_s"])
    except Exception as e:  # reported, never hidden
        return points, {"system": SYSTEM, "status": f"failed: {e}"}
    return points, {"system": SYSTEM, "status": f"ran ({GUIDELLM}) on the OpenAI endpoint, fixed workload"}
