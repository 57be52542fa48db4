"""``python -m openai_frontend``: the OpenAI-compatible API beside a running tritonserver.

Every option has an environment variable, so the launcher, the image and compose configure it the same
way: ``TRITON_GRPC_URL``, ``OPENAI_PORT`` (9000, as Triton's own OpenAI frontend), ``OPENAI_MODEL_NAME``
(default: the name of ``MODEL_DIR``'s folder), ``OPENAI_REQUEST_TIMEOUT`` (seconds), ``API_KEYS``
(comma-separated) or ``API_KEYS_FILE`` (one key a line), ``DRAIN_TIMEOUT`` (seconds a stop lets requests
finish, 30), ``TRITON_PID`` (or ``LAUNCHER_STATE``, the file ``make serve``'s launcher keeps: the
tritonserver running now) and ``MAX_MODEL_LEN`` (the model's context that ``/tokenize`` reports; default:
``MODEL_DIR``'s ``config.json``), ``OPENAI_MAX_BODY_BYTES`` (a larger request body is refused unread, 1 MiB),
``OPENAI_BODY_TIMEOUT`` (seconds for a body to arrive whole, 30), ``OPENAI_SEND_BUFFER_BYTES`` (each
connection's send buffer, 64 KiB) and ``OPENAI_STALL_TIMEOUT`` (seconds a client may read nothing while that
buffer is full before its connection is reset, 30; openai_frontend/connections.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import uvicorn

from openai_frontend.app import Settings, create_app
from openai_frontend.connections import protocol
from openai_frontend.shutdown import Server
from openai_frontend.tokens import model_context


def default_model_name() -> str:
    model_dir = os.environ.get("MODEL_DIR")
    return Path(model_dir).resolve().name if model_dir else "ensemble"


def api_keys(inline: str, key_file: str) -> frozenset[str]:
    keys = {k.strip() for k in inline.split(",") if k.strip()}
    if key_file:
        keys |= {line.strip() for line in Path(key_file).read_text().splitlines() if line.strip() and not line.startswith("#")}
    return frozenset(keys)


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    parser = argparse.ArgumentParser(prog="python -m openai_frontend", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton-url", default=env("TRITON_GRPC_URL", f"127.0.0.1:{env('GRPC_PORT', '8001')}"),
                        help="Triton's gRPC host:port")
    parser.add_argument("--host", default=env("OPENAI_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(env("OPENAI_PORT", "9000")))
    parser.add_argument("--model-name", default=env("OPENAI_MODEL_NAME") or default_model_name(),
                        help="the model id clients send and /v1/models lists")
    parser.add_argument("--request-timeout", type=float, default=float(env("OPENAI_REQUEST_TIMEOUT", "600")),
                        help="server-side deadline in seconds (a client's X-Request-Timeout header may shorten it)")
    parser.add_argument("--api-keys", default=env("API_KEYS", ""), help="comma-separated; unset: no keys needed")
    parser.add_argument("--api-keys-file", default=env("API_KEYS_FILE", ""), help="one key a line")
    parser.add_argument("--drain-timeout", type=float, default=float(env("DRAIN_TIMEOUT", "30")),
                        help="seconds a stop (SIGTERM) lets requests in flight finish before ending them")
    parser.add_argument("--triton-pid", type=int, default=int(env("TRITON_PID", "0")) or None,
                        help="the tritonserver whose Python stubs to watch (default: any on this host)")
    parser.add_argument("--launcher-state", default=env("LAUNCHER_STATE") or None,
                        help="the launcher's state file: the tritonserver running now, and restarts (a metric)")
    parser.add_argument("--max-model-len", type=int, default=int(env("MAX_MODEL_LEN", "0")) or model_context(env("MODEL_DIR")),
                        help="the model's context in tokens, which /tokenize reports (default: MODEL_DIR's config.json)")
    parser.add_argument("--responses-store-size", type=int, default=int(env("RESPONSES_STORE_SIZE", "1000")),
                        help="stored responses (/v1/responses with store) kept at most; 0 keeps none")
    parser.add_argument("--max-body-bytes", type=int, default=int(env("OPENAI_MAX_BODY_BYTES", str(1 << 20))),
                        help="a request body past this many bytes is refused (413) before it is read")
    parser.add_argument("--body-timeout", type=float, default=float(env("OPENAI_BODY_TIMEOUT", "30")),
                        help="seconds for a request body to arrive whole; past it, 408")
    parser.add_argument("--send-buffer-bytes", type=int, default=int(env("OPENAI_SEND_BUFFER_BYTES", str(1 << 16))),
                        help="each connection's send buffer: what a client that stops reading can hold here")
    parser.add_argument("--stall-timeout", type=float, default=float(env("OPENAI_STALL_TIMEOUT", "30")),
                        help="seconds a client may read nothing with its send buffer full before its connection is reset")
    parser.add_argument("--responses-store-seconds", type=float, default=float(env("RESPONSES_STORE_SECONDS", "3600")),
                        help="how long a stored response is kept")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not args.request_timeout > 0:
        parser.error("--request-timeout must be > 0")
    if args.responses_store_size < 0 or not args.responses_store_seconds > 0:
        parser.error("--responses-store-size (RESPONSES_STORE_SIZE) must be >= 0 and --responses-store-seconds > 0")
    if args.max_body_bytes < 1:
        parser.error("--max-body-bytes (OPENAI_MAX_BODY_BYTES) must be >= 1")
    if not (0 < args.body_timeout < float("inf") and 0 < args.stall_timeout < float("inf")):
        parser.error("--body-timeout (OPENAI_BODY_TIMEOUT) and --stall-timeout (OPENAI_STALL_TIMEOUT) must be seconds > 0")
    if args.send_buffer_bytes < 4096:
        parser.error("--send-buffer-bytes (OPENAI_SEND_BUFFER_BYTES) must be >= 4096")
    if not 0 <= args.drain_timeout < float("inf"):
        parser.error("--drain-timeout (DRAIN_TIMEOUT) must be a number of seconds >= 0")
    settings = Settings(args.triton_url, args.model_name, args.request_timeout,
                        api_keys(args.api_keys, args.api_keys_file), args.triton_pid, args.launcher_state,
                        args.drain_timeout, args.max_model_len, args.responses_store_size, args.responses_store_seconds,
                        args.max_body_bytes, args.body_timeout)
    log = logging.getLogger("openai_frontend")
    log.info("OpenAI API for %r: waiting for Triton (gRPC %s) to be ready before answering on :%d",
             settings.model_name, settings.triton_url, args.port)

    def ready() -> None:
        log.info("OpenAI API ready: http://%s:%d/v1, model %r, deadline %g s, %s", args.host, args.port,
                 settings.model_name, settings.request_timeout,
                 f"{len(settings.api_keys)} API keys" if settings.api_keys else "no API keys (open)")

    app = create_app(settings, on_ready=ready)
    http = protocol(args.send_buffer_bytes, args.stall_timeout, app.state.metrics.stalled)
    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", http=http), app.state.drain)
    signal.signal(signal.SIGUSR1, server.drain_only)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
