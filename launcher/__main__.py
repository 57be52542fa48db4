"""``python -m launcher {prepare,serve,run}``: the project's entry points (``make run`` / ``make serve``).

``MODEL_DIR`` selects the model folder (any local Hugging Face causal LM with its tokenizer) or a GGUF file
(prepared once as a folder under ``.cache/models/``, its weights read from the file); unset, the default
SmolLM2-135M-Instruct is prepared once under ``.cache/models/``. Ports come from ``HTTP_PORT``,
``GRPC_PORT``, ``METRICS_PORT`` and ``OPENAI_PORT`` (8000/8001/8002/9000). ``serve`` and ``run`` start the
OpenAI-compatible front end beside Triton unless given ``--no-openai``; Ctrl-C or SIGTERM drains both for up
to ``DRAIN_TIMEOUT`` seconds (30) before they stop. ``supervise`` is the image's main process.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from launcher.frontend import OpenAIFrontend
from launcher.model import check_model_dir, model_folder, prepare_default_model, prepare_gguf, seed_model_dir
from launcher.install import has_gpu
from launcher.paths import CACHE_DIR, MODEL_REPOSITORY
from launcher.process import Ports, drain_timeout
from launcher.triton import TritonServer
from launcher.watchdog import Watchdog, healthy, python_models
from triton_glue import drain

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
    # Ctrl-C and SIGTERM both mean "drain and leave": either raises KeyboardInterrupt, and the caller
    # then stops both servers (stop()), letting the requests running finish for up to DRAIN_TIMEOUT.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    if not os.environ.get("ADMIN_KEY"):
        log.warning("ADMIN_KEY is not set: the model repository API is locked (set it to swap tokenizers)")
    config_name = "" if gpu else "cpu"
    return TritonServer(model_env={"MODEL_DIR": str(path)}, log_path=log_path, model_config_name=config_name).start()


def start_frontend(server: TritonServer, log_path: Path | None) -> OpenAIFrontend:
    """The OpenAI API for ``server``'s model, named after its folder unless ``OPENAI_MODEL_NAME`` says."""
    name = os.environ.get("OPENAI_MODEL_NAME") or Path(server.model_env["MODEL_DIR"]).name
    return OpenAIFrontend(server, name, log_path=log_path).start()


def stop(server: TritonServer, frontend: OpenAIFrontend | None) -> None:
    """Both drain at once (DRAIN_TIMEOUT); the front end refuses with 503 until Triton has stopped, and
    exits last, once Triton's last answers have reached its clients."""
    log.info("stopping: new requests are refused; those running get up to %g s (DRAIN_TIMEOUT) to finish",
             drain_timeout())
    if frontend:
        frontend.drain()
    server.stop()
    if frontend:
        frontend.stop()


def announce(server: TritonServer, frontend: OpenAIFrontend | None) -> None:
    """The one line that says everything answers."""
    ports = server.ports
    log.info("ready: Triton http://127.0.0.1:%d (gRPC :%d, metrics :%d)%s; Ctrl-C to stop", ports.http, ports.grpc,
             ports.metrics, f", OpenAI API {frontend.url}/v1 (model {frontend.model_name!r})" if frontend else "")


def serve(args: argparse.Namespace) -> int:
    try:
        drain_timeout()  # a bad DRAIN_TIMEOUT is said now, not at the first Ctrl-C
        server = start_server(log_path=None)
        frontend = None if args.no_openai else start_frontend(server, log_path=None)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        server.wait_ready(timeout=STARTUP_TIMEOUT)
        if frontend:
            frontend.wait_ready()
        announce(server, frontend)
        return server.process.wait()
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        stop(server, frontend)


def run(args: argparse.Namespace) -> int:
    from client import ChatClient, Prompt

    log_path = CACHE_DIR / "logs" / "tritonserver.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    frontend = None
    try:
        drain_timeout()
        server = start_server(log_path)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        if not args.no_openai:
            frontend = start_frontend(server, log_path.with_name("openai.log"))
        log.info("starting tritonserver (log: %s)", log_path)
        server.wait_ready(timeout=STARTUP_TIMEOUT)
        client = ChatClient(f"127.0.0.1:{server.ports.http}")
        print(f"> {args.prompt}\n{client.generate(Prompt(args.prompt, args.max_tokens)).text_output}", flush=True)
        client.close()
        if args.once:
            return 0
        if frontend:
            frontend.wait_ready()
        announce(server, frontend)
        server.process.wait()
        return server.process.returncode
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}\n{server.log_tail()}", file=sys.stderr)
        return 1
    finally:
        stop(server, frontend)


def local_url() -> str:
    return f"http://127.0.0.1:{Ports.from_env().http}"


def supervise(command: list[str]) -> int:
    """The image's main process: ``command`` (tritonserver) as its child, the watchdog beside it, and on
    SIGTERM the drain before tritonserver gets its own (``TritonServer.stop``)."""
    ports = Ports.from_env()
    repository = Path(os.environ.get("MODEL_REPOSITORY", MODEL_REPOSITORY))
    server = TritonServer(ports=ports, model_repository=repository, admin_key=os.environ.get("ADMIN_KEY", ""))
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    env = {k: v for k, v in os.environ.items() if k != "ADMIN_KEY"}  # the models have no use for it
    server.process = subprocess.Popen(command, env=env, start_new_session=True)
    server.watchdog = Watchdog(server.url, server.grpc_url, server.admin_key, python_models(repository),
                               server.process.pid).start()
    try:
        return server.process.wait()
    except KeyboardInterrupt:
        server.stop()
        return 0


def health() -> int:
    """Exit 0 when ready, no ready Python model has lost its stub, and no drain has begun (Docker's
    HEALTHCHECK, Kubernetes' probes): Triton's own readiness says neither of the last two."""
    repository = Path(os.environ.get("MODEL_REPOSITORY", MODEL_REPOSITORY))
    return 0 if healthy(local_url(), python_models(repository)) and not drain.posted() else 1


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
