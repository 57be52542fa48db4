"""``python -m bench.chaos``: kill each process of ``make serve`` in turn under steady load, and count what
its clients got.

One ``python -m launcher serve`` on free loopback ports; its capacity is measured first (closed loop,
``CAPACITY_CLIENTS`` streams for ``CAPACITY_SECONDS``), then an open-loop load at half of it runs
throughout: streamed chat on the OpenAI API and ``generate_stream`` on Triton's, alternately, each reply
``REPLY_TOKENS`` tokens. In turn: ``kill -9`` of the ``llm``, ``preprocess``, ``postprocess`` and
``ensemble_infer`` stubs, of ``tritonserver``, of the front end; a SIGSTOP of ``llm``'s stub for 20 s
then SIGCONT; ``SLOW_CLIENTS`` streamed chats whose clients stop reading after the first bytes and as
many requests whose bodies come a byte a second (the load's latency beside them against before, each
part's peak memory, what the slow clients got); and last ``kill -9`` of the launcher itself. For each, the requests sent from the kill until
the service is whole again (a probe's reply is complete, 120 s at most) plus ``SETTLE_SECONDS``: replies
complete, clear errors (status or event, and its message), and requests lost (no answer within
``CLIENT_TIMEOUT``; the goal is none); the time until replies are whole again; resident memory and open
files of every process of the server before and after. Bounded: about 15 minutes, loopback only.

Writes ``bench_results/chaos.json`` and prints the table, with the CPU.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Callable

import requests

from bench.stop_times import cpu_name
from launcher.model_folder import prepare_default_model
from launcher.paths import CACHE_DIR, REPO_ROOT
from launcher.process import Ports
from ipc import stubs

REPLY_TOKENS = 32
CLIENT_TIMEOUT = 60.0  # a request unanswered this long is lost
PROBE_TIMEOUT = 15.0
CAPACITY_CLIENTS, CAPACITY_SECONDS = 8, 15.0
SETTLE_SECONDS = 10.0
SLOW_CLIENTS, SLOW_SECONDS = 200, 40.0  # the baseline's window, and the slow clients'
RECOVERY_LIMIT = 120.0
PROMPT = "Tell me about the sea."


class Serving:
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

    def footprint(self, only: str = "") -> tuple[float, int]:
        """Resident MiB and open files of all its processes (those whose command line has ``only``)."""
        rss, files = 0, 0
        for pid in self.processes():
            if only and only.encode() not in _cmdline(pid):
                continue
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
            return next(pid for pid in self.processes() if b"openai_frontend" in _cmdline(pid))
        return min(stubs.stubs(self.triton_pid())[name.split(" stub")[0]])

    def whole(self) -> bool:
        """A probe on each API gets a complete reply."""
        return all(one_request(self, api, PROBE_TIMEOUT) == ("complete", "") for api in ("openai", "triton"))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def one_request(server: Serving, api: str, timeout: float = CLIENT_TIMEOUT) -> tuple[str, str]:
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

    def __init__(self, server: Serving, rate: float) -> None:
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
        request["seconds"] = time.monotonic() - request["at"]

    def between(self, begin: float, end: float) -> list[dict]:
        return [r for r in self.sent if begin <= r["at"] < end]

    def stop(self) -> None:
        self.stopped.set()
        self.pacer.join()
        for thread in self.threads:
            thread.join(CLIENT_TIMEOUT + 10)


def capacity(server: Serving) -> float:
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


def scenario(server: Serving, name: str) -> dict:
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


def stuck_reader(server: Serving, readers: list) -> None:
    """A streamed chat request whose client reads the response's first bytes and then nothing more, with a
    4 KiB receive buffer: what the server wrote for it waits in buffers until it is reset or goes. Its
    socket, and what it read, join ``readers``."""
    body = json.dumps({"model": server.model, "stream": True, "max_tokens": REPLY_TOKENS, "ignore_eos": True,
                       "messages": [{"role": "user", "content": PROMPT}]}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(CLIENT_TIMEOUT)
    try:
        sock.connect(("127.0.0.1", server.ports.openai))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        readers.append((sock, sock.recv(1024)))  # the status line, maybe the first event; then it stops reading
    except OSError:
        readers.append((sock, b""))


def slow_body(server: Serving, stop: threading.Event, answers: list) -> None:
    """A request whose body comes a byte a second (its Content-Length says 100): what the server answers,
    and when, or "sent whole" if it read all 100 bytes without cutting the client off."""
    sock, started = socket.create_connection(("127.0.0.1", server.ports.openai), timeout=5), time.monotonic()
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: chaos\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n")
        sock.settimeout(1.0)
        for _ in range(100):
            try:
                reply = sock.recv(4096)
                answers.append((reply.split(b"\r\n")[0].decode(errors="replace") or "closed", time.monotonic() - started))
                return
            except TimeoutError:
                pass
            if stop.is_set():
                break
            sock.sendall(b" ")
        answers.append(("sent whole" if not stop.is_set() else "still sending", time.monotonic() - started))
    except OSError as e:
        answers.append((f"cut: {e.__class__.__name__}", time.monotonic() - started))
    finally:
        sock.close()


def metric(server: Serving, name: str, url: str = "") -> float:
    """The sum of a metric's samples on the front end's ``/metrics`` (or ``url``'s)."""
    text = requests.get(url or f"{server.openai}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def engine_busy(server: Serving) -> float:
    """Requests llm runs or queues, from Triton's metrics: both APIs' load, and any backlog."""
    url = f"http://127.0.0.1:{server.ports.metrics}/metrics"
    return metric(server, "llm_requests_running", url) + metric(server, "llm_requests_waiting", url)


def burst(targets: list[Callable[[], None]]) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    return threads


def slow_clients(server: Serving, load: Load) -> dict:
    """Beside the steady load: ``SLOW_SECONDS`` of nothing more (the baseline); then ``SLOW_CLIENTS``
    streamed chats at once whose clients stop reading after the first bytes (their generations are load
    like any other: the window waits until llm runs and queues no more than the load alone did, and so
    has no backlog left, at most twice ``CLIENT_TIMEOUT``); then, those connections still held, as many
    bodies sent a byte a second, for
    ``SLOW_SECONDS`` (the load's latency against the baseline's). Each part's peak memory while they are
    there, what the slow clients got; then they go, and what they held must be freed."""
    parts = {"front end": "openai_frontend", "Triton": "triton"}  # tritonserver and its stubs
    baseline = time.monotonic()
    time.sleep(SLOW_SECONDS)
    before = {name: server.footprint(only) for name, only in parts.items()}
    stalled_before, opened = metric(server, "openai_stalled_connections_total"), time.monotonic()
    stop, answers, readers, peak = threading.Event(), [], [], dict(before)

    def sample_peak() -> None:
        for name, only in parts.items():
            peak[name] = max(peak[name], server.footprint(only))

    burst([lambda: stuck_reader(server, readers)] * SLOW_CLIENTS)
    quiet = engine_busy(server) + 2  # what the load alone keeps running
    while time.monotonic() - opened < 2 * CLIENT_TIMEOUT and (len(readers) < SLOW_CLIENTS or engine_busy(server) > quiet):
        sample_peak()
        time.sleep(1)
    generated = time.monotonic()
    bodies = burst([lambda: slow_body(server, stop, answers)] * SLOW_CLIENTS)
    while time.monotonic() - generated < SLOW_SECONDS:
        sample_peak()
        time.sleep(1)
    stalled = metric(server, "openai_stalled_connections_total") - stalled_before
    stop.set()
    for sock, _ in readers:
        sock.close()
    for thread in bodies:
        thread.join(10)
    ended = time.monotonic()
    time.sleep(SETTLE_SECONDS)
    after = {name: server.footprint(only) for name, only in parts.items()}

    def latency(begin: float, end: float) -> list[float | None]:
        done = sorted(r["seconds"] for r in load.between(begin, end) if r["outcome"] and r["outcome"][0] == "complete")
        return [round(done[min(len(done) - 1, int(q * len(done)))], 2) if done else None for q in (0.5, 0.95)]

    return {"target": f"{SLOW_CLIENTS} stuck readers + {SLOW_CLIENTS} byte-a-second bodies", "window": [opened, ended],
            "recovery_s": None,
            "latency_s": {"baseline": latency(baseline, opened), "while the stuck readers generate": latency(opened, generated),
                          "stuck readers held, bodies trickling": latency(generated, ended)},
            "generation_s": round(generated - opened, 1),
            "stuck_readers": {"opened": len(readers), "reset for reading nothing": int(stalled)},
            "slow_bodies": dict(Counter(f"{status} after ~{round(seconds)} s" for status, seconds in answers)),
            "rss_mib": {name: [round(before[name][0]), round(peak[name][0]), round(after[name][0])] for name in parts},
            "open_files": {name: [before[name][1], peak[name][1], after[name][1]] for name in parts}}


TARGETS = ("llm stub", "preprocess stub", "postprocess stub", "ensemble_infer stub", "tritonserver",
           "openai_frontend", "llm stub stopped 20 s", "launcher")


def main() -> int:
    model_dir = prepare_default_model()
    log = Path(tempfile.mkdtemp(prefix="chaos-")) / "serve.log"
    server = Serving(model_dir, log)
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
            if name == "launcher":  # the last: nothing is served after it
                results.append(slow_clients(server, load))
                print(json.dumps(results[-1]), flush=True)
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
        if "latency_s" in r:
            continue
        common = "; ".join(f"{m} ({n})" for m, n in list(r["errors"].items())[:2]) or "none"
        print(f"| {r['target']} | {r['requests']} | {r['complete']} | {r['error']}: {common} | {r['lost']} | "
              f"{'never' if r['recovery_s'] is None else str(r['recovery_s']) + ' s'} | {r['rss_mib'][0]} / "
              f"{r['rss_mib'][1]} | {r['open_files'][0]} / {r['open_files'][1]} |")
    for r in (r for r in results if "latency_s" in r):
        print(f"\n{r['target']}, beside the load: {r['requests']} requests, {r['complete']} complete, {r['error']} "
              f"errors, {r['lost']} lost; stuck readers {r['stuck_readers']}; slow bodies {r['slow_bodies']}")
        print(f"the stuck readers' generations took {r['generation_s']} s")
        print("| the load's latency (p50 / p95 s) | " + " | ".join(r["latency_s"]) + " |\n|---|---|---|---|")
        print("| | " + " | ".join(f"{p50} / {p95}" for p50, p95 in r["latency_s"].values()) + " |")
        print("| part | RSS MiB before / peak / after | open files before / peak / after |\n|---|---|---|")
        for part, rss in r["rss_mib"].items():
            files = r["open_files"][part]
            print(f"| {part} | {' / '.join(map(str, rss))} | {' / '.join(map(str, files))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
