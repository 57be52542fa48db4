"""``python -m bench.stop_times``: how long ``make serve`` takes to stop, and what its clients see.

Each case starts ``python -m launcher serve`` (Triton and the OpenAI API, as a user runs it), sets up its
traffic, sends SIGTERM (what Ctrl-C, ``docker stop`` and Kubernetes send) and times the exit:

- idle: nothing in flight;
- after cancellations: six ``generate_stream`` clients that went away mid-reply (Triton 2.51's ensemble
  kept each one in flight, and every later stop waited out its 30 s exit timeout);
- busy: a 512-token OpenAI stream in flight (it should finish, then the server stop);
- past the drain: a 4000-token stream (``MAX_TOKENS_LIMIT`` raised for it) with ``DRAIN_TIMEOUT=5`` (it should
  end with an error event and [DONE]).

Writes ``bench_results/stop_times.json`` and prints a table; the CPU is named with the figures.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from launcher.model_folder import prepare_default_model
from launcher.paths import REPO_ROOT
from launcher.process import Ports, wait_healthy

STORY = "Tell me a long story about a lighthouse keeper and the sea."


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    return platform.processor()


def openai_stream(url: str, model: str, max_tokens: int, events: list) -> None:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": STORY}]}
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=300) as reply:
        events += [line[6:].decode() for line in reply.iter_lines() if line.startswith(b"data: ")]


def cancelled_stream(url: str) -> None:
    with requests.post(f"{url}/v2/models/ensemble/generate_stream", stream=True, timeout=60,
                       json={"text_input": STORY, "max_tokens": 200, "ignore_eos": True, "stream": True}) as reply:
        lines = reply.iter_lines()
        for _ in range(5):
            next(line for line in lines if line)


def case(name: str, drain: float | None, model_dir: Path, log_dir: Path) -> dict:
    ports = Ports.free()
    env = {**os.environ, "MODEL_DIR": str(model_dir), "HTTP_PORT": str(ports.http), "GRPC_PORT": str(ports.grpc),
           "METRICS_PORT": str(ports.metrics), "OPENAI_PORT": str(ports.openai)}
    if drain is not None:
        env["DRAIN_TIMEOUT"] = str(drain)
    max_tokens = 4000 if name == "past the drain" else 512  # a stream that outlasts the drain on any machine
    env["MAX_TOKENS_LIMIT"] = str(max(512, max_tokens))
    log = log_dir / f"{name.replace(' ', '-')}.log"
    serve = subprocess.Popen([sys.executable, "-m", "launcher", "serve"], cwd=REPO_ROOT, env=env, stdout=log.open("wb"),
                             stderr=subprocess.STDOUT, start_new_session=True)
    openai_url, events = f"http://127.0.0.1:{ports.openai}", []
    stream = None
    try:
        wait_healthy(f"{openai_url}/health", serve, "make serve", 900)
        if name == "after cancellations":
            for _ in range(6):
                cancelled_stream(f"http://127.0.0.1:{ports.http}")
            time.sleep(1)
        if name in ("busy", "past the drain"):
            stream = threading.Thread(target=openai_stream, args=(openai_url, model_dir.name, max_tokens, events))
            stream.start()
            time.sleep(2)
        started = time.monotonic()
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(timeout=120)
        seconds = time.monotonic() - started
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
    if stream:
        stream.join(timeout=60)
    text = log.read_text(errors="replace")
    ending = "none in flight"
    if events:
        last = json.loads(events[-2]) if len(events) > 1 else {}
        ending = (f"finished ({last['choices'][0]['finish_reason']}) then [DONE]" if last.get("choices") else
                  f"error event ({last.get('error', {}).get('message', '?')[:60]}...) then [DONE]") if events[-1] == "[DONE]" \
            else "cut without [DONE]"
    return {"case": name, "drain_timeout_s": drain if drain is not None else 30, "stop_s": round(seconds, 1),
            "stream": ending, "exit_timeout_expired": "Exit timeout expired" in text,
            "non_graceful": "Non-graceful termination" in text}


def main() -> int:
    model_dir = prepare_default_model()
    log_dir = Path(tempfile.mkdtemp(prefix="stop-times-"))
    results = [case(name, drain, model_dir, log_dir) for name, drain in
               (("idle", None), ("after cancellations", None), ("busy", None), ("past the drain", 5.0))]
    out = REPO_ROOT / "bench_results" / "stop_times.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_name(), "results": results}, indent=2))
    print(f"CPU: {cpu_name()} (logs in {log_dir})")
    print("| case | DRAIN_TIMEOUT | SIGTERM to exit | the stream | Exit timeout / Non-graceful |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r['case']} | {r['drain_timeout_s']:g} s | {r['stop_s']} s | {r['stream']} | "
              f"{'yes' if r['exit_timeout_expired'] or r['non_graceful'] else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
