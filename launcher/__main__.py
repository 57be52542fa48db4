"""``python -m launcher {prepare,serve,run}``: the project's entry points (``make run`` / ``make serve``).

``MODEL_DIR`` selects the model folder (any local Hugging Face causal LM with its tokenizer) or a GGUF file
(prepared once as a folder under ``.cache/models/``, its weights read from the file); unset, the default
SmolLM2-135M-Instruct is prepared once under ``.cache/models/``. Ports come from ``HTTP_PORT``,
``GRPC_PORT``, ``METRICS_PORT`` and ``OPENAI_PORT`` (8000/8001/8002/9000). ``serve`` and ``run`` start the
OpenAI-compatible front end beside Triton unless given ``--no-openai``, and start either again when it dies
(launcher/supervisor.py); Ctrl-C or SIGTERM drains both for up to ``DRAIN_TIMEOUT`` seconds (30) before they
stop (a third cuts the drain short), and neither outlives the launcher (launcher/child.py). ``supervise``
is the image's main process.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

from launcher.frontend import OpenAIFrontend
from launcher.model_folder import check_model_dir, model_folder, prepare_default_model, prepare_gguf, seed_model_dir
from launcher.install import has_gpu
from launcher.paths import CACHE_DIR, MODEL_REPOSITORY
from launcher.process import Ports, StopSignals, drain_timeout
from launcher.supervisor import State, keep_serving, limits
from launcher.tritonserver import TritonServer
from launcher.watchdog import Watchdog, healthy, python_models
from ipc import drain_notice

log = logging.getLogger("launcher")
STARTUP_TIMEOUT = 1800.0  # seconds for Triton to be ready: a cold start on a GPU compiles for minutes


def checked(path: Path) -> Path:
    """``path``, once it is a complete model folder (raises RuntimeError naming what is missing); logs what
    it lacks that requests can do without."""
    for warning in check_model_dir(path):
        log.warning(warning)
    return path


def model_dir() -> Path:
    configured = os.environ.get("MODEL_DIR")
    return checked(model_folder(Path(configured).resolve()) if configured else prepare_default_model())


def start_server(log_path: Path | None) -> TritonServer:
    path, gpu = model_dir(), has_gpu()
    log.info("model %s, %s", path, "GPU instances" if gpu else "no GPU found: CPU instances (configs/cpu.pbtxt)")
    if not os.environ.get("ADMIN_KEY"):
        log.warning("ADMIN_KEY is not set: the model repository API is locked (set it to swap tokenizers)")
    config_name = "" if gpu else "cpu"
    return TritonServer(model_env={"MODEL_DIR": str(path)}, log_path=log_path, model_config_name=config_name).start()


def start_frontend(server: TritonServer, log_path: Path | None, state: Path) -> OpenAIFrontend:
    """The OpenAI API for ``server``'s model, named after its folder unless ``OPENAI_MODEL_NAME`` says;
    ``state``: the launcher's state file (launcher/supervisor.py)."""
    name = os.environ.get("OPENAI_MODEL_NAME") or Path(server.model_env["MODEL_DIR"]).name
    return OpenAIFrontend(server, name, env={"LAUNCHER_STATE": str(state)}, log_path=log_path).start()


def stop(server: TritonServer | None, frontend: OpenAIFrontend | None, signals: StopSignals) -> None:
    """Both drain at once (DRAIN_TIMEOUT, or until a third signal); the front end refuses with 503 until
    Triton has stopped, and exits last, once Triton's last answers have reached its clients."""
    log.info("stopping: new requests are refused; those running get up to %g s (DRAIN_TIMEOUT) to finish",
             drain_timeout())
    if frontend:
        frontend.drain()
    if server:
        server.stop(hurry=signals.hurry)
    if frontend:
        frontend.stop()


def announce(server: TritonServer, frontend: OpenAIFrontend | None) -> None:
    """The one line that says everything answers."""
    ports = server.ports
    log.info("ready: Triton http://127.0.0.1:%d (gRPC :%d, metrics :%d)%s; Ctrl-C to stop", ports.http, ports.grpc,
             ports.metrics, f", OpenAI API {frontend.url}/v1 (model {frontend.model_name!r})" if frontend else "")


class Service:
    """What ``serve`` and ``run`` start: tritonserver, the front end beside it (unless ``--no-openai``) and
    the state file the front end reads (launcher/supervisor.py). Everything it started is stopped by
    ``stop``, whatever was interrupted; what was not reached never started."""

    def __init__(self, no_openai: bool, log_path: Path | None) -> None:
        self.no_openai, self.log_path = no_openai, log_path
        self.server: TritonServer | None = None
        self.frontend: OpenAIFrontend | None = None
        self.state = State(CACHE_DIR / "run" / f"launcher-{os.getpid()}.json")

    def start(self) -> None:
        drain_timeout()  # bad settings are said now, not at the first Ctrl-C or failure
        limits()
        self.server = start_server(self.log_path)
        self.state.triton_pid = self.server.process.pid
        self.state.write()
        if not self.no_openai:
            log_path = self.log_path.with_name("openai.log") if self.log_path else None
            self.frontend = start_frontend(self.server, log_path, self.state.path)
        if self.log_path:
            log.info("starting tritonserver (log: %s)", self.log_path)

    def wait_ready(self) -> None:
        self.server.wait_ready(timeout=STARTUP_TIMEOUT)
        if self.frontend:
            self.frontend.wait_ready()

    def keep_serving(self) -> NoReturn:
        """Announce, then restart what dies until interrupted (KeyboardInterrupt) or past the restart limit."""
        announce(self.server, self.frontend)
        children = {"tritonserver": self.server} | ({"openai_frontend": self.frontend} if self.frontend else {})
        keep_serving(children, self.state, self._triton_ended, STARTUP_TIMEOUT)

    def _triton_ended(self) -> None:
        """Why it ended, as far as its log says (``serve`` shows its output above), and its stubs ended."""
        if self.log_path:
            log.error("the last lines of %s:\n%s", self.log_path, self.server.log_tail(20))
        self.server.end_orphaned_stubs()

    def stop(self, signals: StopSignals) -> None:
        try:
            stop(self.server, self.frontend, signals)
        finally:
            self.state.remove()


def serve(args: argparse.Namespace) -> int:
    signals = StopSignals().install()  # Ctrl-C and SIGTERM: drain and leave (launcher/process.py)
    service = Service(args.no_openai, log_path=None)
    try:
        service.start()
        service.wait_ready()
        service.keep_serving()
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        service.stop(signals)


def run(args: argparse.Namespace) -> int:
    from client import ChatClient, Prompt

    signals = StopSignals().install()
    log_path = CACHE_DIR / "logs" / "tritonserver.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    service = Service(args.no_openai, log_path)
    try:
        service.start()
        service.server.wait_ready(timeout=STARTUP_TIMEOUT)
        client = ChatClient(f"127.0.0.1:{service.server.ports.http}")
        print(f"> {args.prompt}\n{client.generate(Prompt(args.prompt, args.max_tokens)).text_output}", flush=True)
        client.close()
        if args.once:
            return 0
        service.wait_ready()
        service.keep_serving()
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}\n{service.server.log_tail() if service.server else ''}", file=sys.stderr)
        return 1
    finally:
        service.stop(signals)


def local_url() -> str:
    return f"http://127.0.0.1:{Ports.from_env().http}"


def supervise(command: list[str]) -> int:
    """The image's main process: ``command`` (tritonserver) as its child, the watchdog beside it, and on
    SIGTERM the drain before tritonserver gets its own (``TritonServer.stop``)."""
    ports = Ports.from_env()
    repository = Path(os.environ.get("MODEL_REPOSITORY", MODEL_REPOSITORY))
    server = TritonServer(ports=ports, model_repository=repository, admin_key=os.environ.get("ADMIN_KEY", ""))
    signals = StopSignals().install()
    env = {k: v for k, v in os.environ.items() if k != "ADMIN_KEY"}  # the models have no use for it
    server.process = subprocess.Popen(command, env=env, start_new_session=True)
    server.watchdog = Watchdog(server.url, server.grpc_url, server.admin_key, python_models(repository),
                               server.process.pid).start()
    try:
        return server.process.wait()
    except KeyboardInterrupt:
        server.stop(hurry=signals.hurry)
        return 0


def health() -> int:
    """Exit 0 when ready, no ready Python model has lost its stub, and no drain has begun (Docker's
    HEALTHCHECK, Kubernetes' probes): Triton's own readiness says neither of the last two."""
    repository = Path(os.environ.get("MODEL_REPOSITORY", MODEL_REPOSITORY))
    return 0 if healthy(local_url(), python_models(repository)) and not drain_notice.posted() else 1


def check_model(seed: bool) -> int:
    """Exit 1, naming what is missing, unless MODEL_DIR is a complete model folder (Kubernetes' init
    container); ``seed`` first copies the default model there when MODEL_DIR names it and it is absent."""
    path = Path(os.environ.get("MODEL_DIR", "")).resolve()
    if seed and seed_model_dir(path):
        log.info("copied the default model into %s", path)
    try:
        checked(path)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    log.info("MODEL_DIR %s is complete", path)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m launcher", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prepare_parser = sub.add_parser("prepare", help="prepare the default model's folder, or a GGUF file's, (once) and print its path")
    prepare_parser.add_argument("gguf", nargs="?", type=Path, help="a GGUF file (default: the default model)")
    serve_parser = sub.add_parser("serve", help="serve in the foreground until Ctrl-C")
    serve_parser.add_argument("--no-openai", action="store_true", help="Triton only, without the OpenAI API")
    supervise_parser = sub.add_parser(
        "supervise", help="run COMMAND (tritonserver) with the watchdog beside it (needs ADMIN_KEY); SIGTERM drains first")
    supervise_parser.add_argument("server_command", nargs=argparse.REMAINDER, metavar="COMMAND")
    sub.add_parser("health", help="exit 0 when Triton is ready, no Python stub has died and no drain has begun")
    check_parser = sub.add_parser("check-model", help="exit 1, naming what is missing, unless MODEL_DIR is a complete model folder")
    check_parser.add_argument("--seed", action="store_true", help="first copy the default model to MODEL_DIR when it names it and is absent")
    run_parser = sub.add_parser("run", help="serve, answer one prompt over HTTP, keep serving")
    run_parser.add_argument("--prompt", default="What is the capital of France?", help="the user message to answer")
    run_parser.add_argument("--max-tokens", type=int, dest="max_tokens", default=None,
                            help="reply budget in tokens (default: llm's default_max_tokens, 64)")
    run_parser.add_argument("--once", action="store_true", help="exit after the reply")
    run_parser.add_argument("--no-openai", action="store_true", help="Triton only, without the OpenAI API")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        print(prepare_gguf(args.gguf) if args.gguf else prepare_default_model())
        return 0
    if args.command == "check-model":
        return check_model(args.seed)
    if args.command == "supervise":
        return supervise(args.server_command)
    if args.command == "health":
        return health()
    return serve(args) if args.command == "serve" else run(args)


if __name__ == "__main__":
    sys.exit(main())
