"""``python -m launcher {prepare,serve,run}``: the project's entry points (``make run`` / ``make serve``).

``MODEL_DIR`` selects the model folder (any local Hugging Face causal LM with its tokenizer); unset, the
default SmolLM2-135M-Instruct is prepared once under ``.cache/models/``. Ports come from ``HTTP_PORT``,
``GRPC_PORT``, ``METRICS_PORT`` and ``OPENAI_PORT`` (8000/8001/8002/9000). ``serve`` and ``run`` start the
OpenAI-compatible front end beside Triton unless given ``--no-openai``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from launcher.frontend import OpenAIFrontend
from launcher.model import check_model_dir, prepare_default_model, seed_model_dir
from launcher.triton import CACHE_DIR, MODEL_REPOSITORY, Ports, TritonServer, has_gpu
from launcher.watchdog import Watchdog, healthy, python_models

log = logging.getLogger("launcher")


def checked(path: Path) -> Path:
    """``path``, once it is a complete model folder (raises RuntimeError naming what is missing); logs what
    it lacks that requests can do without."""
    for warning in check_model_dir(path):
        log.warning(warning)
    return path


def model_dir() -> Path:
    configured = os.environ.get("MODEL_DIR")
    return checked(Path(configured).resolve() if configured else prepare_default_model())


def start_server(log_path: Path | None) -> TritonServer:
    path, gpu = model_dir(), has_gpu()
    log.info("model %s, %s", path, "GPU instances" if gpu else "no GPU found: CPU instances (configs/cpu.pbtxt)")
    # Ctrl-C and SIGTERM both mean "drain and leave": either raises KeyboardInterrupt, the caller then
    # stops Triton, which finishes in-flight requests (up to --exit-timeout-secs) before it exits.
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


def serve(args: argparse.Namespace) -> int:
    try:
        server = start_server(log_path=None)
        frontend = None if args.no_openai else start_frontend(server, log_path=None)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        return server.process.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if frontend:
            frontend.stop()
        server.stop()


def run(args: argparse.Namespace) -> int:
    from client import ChatClient, Prompt

    log_path = CACHE_DIR / "logs" / "tritonserver.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    frontend = None
    try:
        server = start_server(log_path)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        if not args.no_openai:
            frontend = start_frontend(server, log_path.with_name("openai.log"))
        log.info("starting tritonserver (log: %s)", log_path)
        server.wait_ready()
        client = ChatClient(f"127.0.0.1:{server.ports.http}")
        print(f"> {args.prompt}\n{client.generate(Prompt(args.prompt, args.max_tokens)).text_output}", flush=True)
        client.close()
        if args.once:
            return 0
        if frontend:
            frontend.wait_ready()
        log.info("serving on http :%d, grpc :%d, metrics :%d%s; Ctrl-C to stop", server.ports.http,
                 server.ports.grpc, server.ports.metrics,
                 f", OpenAI API :{frontend.port} (model {frontend.model_name!r})" if frontend else "")
        server.process.wait()
        return server.process.returncode
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"error: {e}\n{server.log_tail()}", file=sys.stderr)
        return 1
    finally:
        if frontend:
            frontend.stop()
        server.stop()


def local_url() -> str:
    return f"http://127.0.0.1:{Ports.from_env().http}"


def watch() -> int:
    """The watchdog alone, next to a tritonserver started elsewhere (the image's entrypoint)."""
    repository = Path(os.environ.get("MODEL_REPOSITORY", MODEL_REPOSITORY))
    watchdog = Watchdog(local_url(), f"127.0.0.1:{Ports.from_env().grpc}", os.environ.get("ADMIN_KEY", ""),
                        python_models(repository))
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        watchdog.run()
    except KeyboardInterrupt:
        pass
    return 0


def health() -> int:
    """Exit 0 when ready and every ready Python model has its stub (Docker's HEALTHCHECK)."""
    repository = Path(os.environ.get("MODEL_REPOSITORY", MODEL_REPOSITORY))
    return 0 if healthy(local_url(), python_models(repository)) else 1


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
    sub.add_parser("prepare", help="prepare the default model folder (once) and print its path")
    serve_parser = sub.add_parser("serve", help="serve in the foreground until Ctrl-C")
    serve_parser.add_argument("--no-openai", action="store_true", help="Triton only, without the OpenAI API")
    sub.add_parser("watch", help="reload a model whose Python stub died (needs ADMIN_KEY), until SIGTERM")
    sub.add_parser("health", help="exit 0 when Triton is ready and no Python stub has died")
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
        print(prepare_default_model())
        return 0
    if args.command == "check-model":
        return check_model(args.seed)
    commands = {"watch": watch, "health": health}
    if args.command in commands:
        return commands[args.command]()
    return serve(args) if args.command == "serve" else run(args)


if __name__ == "__main__":
    sys.exit(main())
