"""``python -m bench.chaos``: kill each process of ``make serve`` in turn under steady load, and count what
its clients got.

One ``python -m launcher serve`` on free loopback ports; its capacity is measured first (closed loop,
``CAPACITY_CLIENTS`` streams for ``CAPACITY_SECONDS``), then an open-loop load at half of it runs
throughout: streamed chat on the OpenAI API and ``generate_stream`` on Triton's, alternately, each reply
``REPLY_TOKENS`` tokens. In turn: ``kill -9`` of the ``llm``, ``preprocess``, ``postprocess`` and
``ensemble_infer`` stubs, of ``tritonserver``, of the front end; a SIGSTOP of ``llm``'s stub for 20 s
then SIGCONT; and last ``kill -9`` of the launcher itself. For each, the requests sent from the kill until
the service is whole again (a probe's reply is complete, 120 s at most) plus ``SETTLE_SECONDS``: replies
complete, clear errors (status or event, and its message), and requests lost (no answer within
``CLIENT_TIMEOUT``; the goal is none); the time until replies are whole again; resident memory and open
files of every process of the server before and after. Bounded: about 12 minutes, loopback only.

Writes ``bench_results/chaos.json`` and prints the table, with the CPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import requests

from bench.stop_times import cpu_name
from launcher.model import prepare_default_model
from launcher.paths import CACHE_DIR, REPO_ROOT
from launcher.process import Ports
from triton_glue import stubs

REPLY_TOKENS = 32
CLIENT_TIMEOUT = 60.0  # a request unanswered this long is lost
PROBE_TIMEOUT = 15.0
CAPACITY_CLIENTS, CAPACITY_SECONDS = 8, 15.0
SETTLE_SECONDS = 10.0
RECOVERY_LIMIT = 120.0
PROMPT = "Tell me about the sea."


class Server:
    """``python -m launcher serve``, with a marker every process it starts inherits (to find and measure them)."""

    def __init__(self, model_dir: Path, log: Path) -> None:
        self.ports, self.model, self.log = Ports.free(), model_dir.name, log
        self.marker = f"CHAOS_MARKER={uuid.uuid4().hex}".encode()
        env = {**os.environ, "MODEL_DIR": str(model_dir), "HTTP_PORT": str(self.ports.http),
               "GRPC_PORT": str(self.ports.grpc), "METRICS_PORT": str(self.ports.metrics),
               "OPENAI_PORT": str(self.ports.openai), "RESTART_LIMIT": "20",
               self.marker.decode().split("=")[0]: self.marker.decode().split("=")[1]}
        self.launcher = subprocess.Popen([sys.executable, "-m", "launcher", "serve"], cwd=REPO_ROOT, env=env,
                                         stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        self.openai, self.triton = f"http://127.0.0.1:{self.ports.openai}", f"http://127.0.0.1:{self.ports.http}"

    def processes(self) -> list[int]:
        """Every process of this server: the launcher and whatever it started."""
        found = [self.launcher.pid] if self.launcher.poll() is None else []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and self.marker in (proc / "environ").read_bytes().split(b"\0") \
                        and int(proc.name) != self.launcher.pid and stubs.stat(int(proc.name))[0] != "Z":
                    found.append(int(proc.name))
            except (OSError, TypeError):
                continue
        return found

    def footprint(self) -> tuple[float, int]:
        """Resident MiB and open files of all its processes."""
        rss, files = 0, 0
        for pid in self.processes():
            try:
                rss += int(next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS")))
                files += len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, StopIteration):
                continue
        return rss / 1024, files

    def triton_pid(self) -> int:
        return json.loads((CACHE_DIR / "run" / f"launcher-{self.launcher.pid}.json").read_text())["triton_pid"]

    def target(self, name: str) -> int:
        """The pid of the process a scenario is named after."""
        if name == "launcher":
            return self.launcher.pid
        if name == "tritonserver":
            return self.triton_pid()
        if name == "openai_frontend":
            return next(pid for pid in self.processes() if b"openai_frontend" in Path(f"/proc/{pid}/cmdline").read_bytes())
        return min(stubs.stubs(self.triton_pid())[name.split(" stub")[0]])

    def whole(self) -> bool:
        """A probe on each API gets a complete reply."""
        return all(one_request(self, api, PROBE_TIMEOUT) == ("complete", "") for api in ("openai", "triton"))


def one_request(server: Server, api: str, timeout: float = CLIENT_TIMEOUT) -> tuple[str, str]:
    """One streamed request: ("complete", ""), ("error", what the client was told) or ("lost", "")."""
    try:
        if api == "openai":
            body = {"model": server.model, "stream": True, "max_tokens": REPLY_TOKENS, "ignore_eos": True,
                    "messages": [{"role": "user", "content": PROMPT}]}
            with requests.post(f"{server.openai}/v1/chat/completions", json=body, stream=True,
                               timeout=(5, timeout)) as reply:
                if reply.status_code != 200:
                    return "error", f"{reply.status_code} {reply.json()['error']['message'][:70]}"
                events = [line[6:] for line in reply.iter_lines() if line.startswith(b"data: ")]
            if events and events[-1] == b"[DONE]":
                last = json.loads(events[-2]) if len(events) > 1 else {}
                if "error" in last:
                    return "error", f"event: {last['error']['message'][:70]}"
                return "complete", ""
            return "error", "stream cut without [DONE]"
        body = {"text_input": PROMPT, "max_tokens": REPLY_TOKENS, "ignore_eos": True, "stream": True}
        with requests.post(f"{server.triton}/v2/models/ensemble/generate_stream", json=body, stream=True,
                           timeout=(5, timeout)) as reply:
            if reply.status_code != 200 and not reply.headers.get("content-type", "").startswith("text/event-stream"):
                return "error", f"{reply.status_code} {reply.json().get('error', '')[:70]}"
            events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith(b"data: ")]
        if events and "error" in events[-1]:
            return "error", f"{reply.status_code} {events[-1]['error'][:70]}"
        if events and events[-1].get("finish_reason"):
            return "complete", ""
        return "error", f"{reply.status_code} stream cut without finish_reason"
    except requests.Timeout:
        return "lost", ""
    except requests.ConnectionError as e:
        return "error", "connection refused" if "refused" in str(e).lower() else "connection closed"
    except (requests.exceptions.ChunkedEncodingError, ValueError):  # ValueError: a body that is not JSON
        return "error", "connection dropped mid-reply"


class Load:
    """Open-loop requests at ``rate`` per second, alternating the two APIs, each on a thread of its own;
    each is recorded when sent, and its outcome when it has one (``stop`` waits for every one)."""

    def __init__(self, server: Server, rate: float) -> None:
        self.server, self.rate = server, rate
        self.sent: list[dict] = []  # {"at", "api", "outcome"}
        self.stopped = threading.Event()
        self.threads: list[threading.Thread] = []
        self.pacer = threading.Thread(target=self._pace, daemon=True)

    def _pace(self) -> None:
        n, start = 0, time.monotonic()
        while not self.stopped.is_set():
            request = {"at": time.monotonic(), "api": ("openai", "triton")[n % 2], "outcome": None}
            self.sent.append(request)
            thread = threading.Thread(target=self._send, args=(request,), daemon=True)
            thread.start()
            self.threads.append(thread)
            n += 1
            self.stopped.wait(max(0.0, start + n / self.rate - time.monotonic()))

    def _send(self, request: dict) -> None:
        request["outcome"] = one_request(self.server, request["api"])

    def between(self, begin: float, end: float) -> list[dict]:
        return [r for r in self.sent if begin <= r["at"] < end]

    def stop(self) -> None:
        self.stopped.set()
        self.pacer.join()
        for thread in self.threads:
            thread.join(CLIENT_TIMEOUT + 10)


def capacity(server: Server) -> float:
    """Complete requests per second, closed loop, both APIs."""
    done, stop = [], time.monotonic() + CAPACITY_SECONDS

    def client(api: str) -> None:
        while time.monotonic() < stop:
            if one_request(server, api)[0] == "complete":
                done.append(1)

    threads = [threading.Thread(target=client, args=(("openai", "triton")[i % 2],)) for i in range(CAPACITY_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(done) / CAPACITY_SECONDS


def scenario(server: Server, name: str) -> dict:
    """Kill (or stop) one process; its window runs from then until the service is whole again and
    ``SETTLE_SECONDS`` more. The requests sent in it are counted once every one has an outcome (``count``)."""
    before = server.footprint()
    pid = server.target(name)
    killed = time.monotonic()
    if name == "llm stub stopped 20 s":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(20)
        os.kill(pid, signal.SIGCONT)
    else:
        os.kill(pid, signal.SIGKILL)
    recovered = None
    while time.monotonic() - killed < RECOVERY_LIMIT and name != "launcher":
        if server.whole():
            recovered = time.monotonic() - killed
            break
        time.sleep(0.5)
    time.sleep(SETTLE_SECONDS)
    after = server.footprint()
    return {"target": name, "window": [killed, time.monotonic()],
            "recovery_s": None if recovered is None else round(recovered, 1),
            "rss_mib": [round(before[0]), round(after[0])], "open_files": [before[1], after[1]]}


def count(result: dict, load: Load) -> dict:
    """The outcomes of the requests sent in the scenario's window."""
    sent = load.between(*result.pop("window"))
    counts = Counter(r["outcome"][0] if r["outcome"] else "lost" for r in sent)
    errors = Counter(r["outcome"][1] for r in sent if r["outcome"] and r["outcome"][0] == "error")
    return {**result, "requests": len(sent), "complete": counts["complete"], "error": counts["error"],
            "lost": counts["lost"], "errors": dict(errors.most_common(4))}


TARGETS = ("llm stub", "preprocess stub", "postprocess stub", "ensemble_infer stub", "tritonserver",
           "openai_frontend", "llm stub stopped 20 s", "launcher")


def main() -> int:
    model_dir = prepare_default_model()
    log = Path(tempfile.mkdtemp(prefix="chaos-")) / "serve.log"
    server = Server(model_dir, log)
    results, load = [], None
    try:
        deadline = time.monotonic() + 900
        while "ready: Triton" not in log.read_text(errors="replace"):
            if time.monotonic() > deadline or server.launcher.poll() is not None:
                raise RuntimeError(f"make serve did not start; see {log}")
            time.sleep(0.5)
        rate = capacity(server) / 2
        print(f"capacity {rate * 2:.2f} requests/s ({REPLY_TOKENS}-token streamed replies); load {rate:.2f}/s", flush=True)
        load = Load(server, rate)
        load.pacer.start()
        time.sleep(SETTLE_SECONDS)
        for name in TARGETS:
            results.append(scenario(server, name))
            print(json.dumps(results[-1]), flush=True)
    finally:
        if load:
            load.stop()  # every request has its outcome now, a lost one after CLIENT_TIMEOUT
        for pid in server.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    results = [count(r, load) for r in results]
    out = REPO_ROOT / "bench_results" / "chaos.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_name(), "load_per_s": rate, "results": results}, indent=2))
    print(f"CPU: {cpu_name()}; load {rate:.2f} requests/s, half the measured capacity (log: {log})")
    print("| killed | requests | complete | clear error (most common) | lost | whole again after | RSS MiB before/after "
          "| open files before/after |\n|---|---|---|---|---|---|---|---|")
    for r in results:
        common = "; ".join(f"{m} ({n})" for m, n in list(r["errors"].items())[:2]) or "none"
        print(f"| {r['target']} | {r['requests']} | {r['complete']} | {r['error']}: {common} | {r['lost']} | "
              f"{'never' if r['recovery_s'] is None else str(r['recovery_s']) + ' s'} | {r['rss_mib'][0]} / "
              f"{r['rss_mib'][1]} | {r['open_files'][0]} / {r['open_files'][1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
