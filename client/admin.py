"""``python -m client.admin swap-tokenizer DIR``: swap the tokenizer live, without touching ``llm``.

Triton runs in explicit model-control mode, so one model can be reloaded through the repository API
(a load with a config override). Triton loads the new ``preprocess`` while the old one keeps serving,
switches over, reloads the ``ensemble`` that depends on it, and leaves ``llm`` alone. ``DIR`` is a path
as the *server* sees it, inside one of its ``MODEL_ROOTS``.

Loads go over gRPC: while Triton 2.51's HTTP front end answers a load, its other connections wait
(measured: 7 of 8 waited all of a 13 s swap over HTTP; over gRPC, none waited over 50 ms). The repository
API is restricted: requests carry the server's ``ADMIN_KEY`` (``--admin-key``, or the same environment
variable here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Callable

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

ADMIN_HEADER = "admin-key"
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"  # Triton prefixes gRPC restriction headers
RESTRICTED = "This protocol is restricted"  # Triton's refusal, whether the key is missing or wrong


def reload_with_config(grpc_url: str, model: str, edit: Callable[[dict], None], change: str,
                       admin_key: str | None = None, timeout: float = 600, unload_first: bool = False) -> None:
    """Load ``model`` again, over gRPC, with its served config changed by ``edit`` (``change`` says how,
    for errors); ``unload_first`` for a model whose stub died, which a plain load leaves as it is.

    Raises with Triton's message when the load fails (a wrong ``admin_key`` included); Triton then keeps
    serving the old model.
    """
    key = admin_key if admin_key is not None else os.environ.get("ADMIN_KEY", "")
    headers = {GRPC_ADMIN_HEADER: key}
    client = grpcclient.InferenceServerClient(grpc_url)
    try:
        config = client.get_model_config(model, as_json=True, client_timeout=30)["config"]
        edit(config)
        if unload_first:
            client.unload_model(model, headers=headers, client_timeout=timeout)
        client.load_model(model, headers=headers, config=json.dumps(config), client_timeout=timeout)
    except InferenceServerException as e:
        if RESTRICTED in (e.message() or ""):
            raise RuntimeError(f"loading {model} with {change} failed: {key_problem(key)}") from None
        raise RuntimeError(f"loading {model} with {change} failed: {reason(e.message())}") from None
    finally:
        client.close()


def key_problem(key: str) -> str:
    """What to do when Triton refused the repository API for want of the right admin key."""
    if not key:
        return ("the server's model repository API needs its admin key and none was given: set ADMIN_KEY (or pass "
                "--admin-key) to the ADMIN_KEY the server was started with (a server started without one has a "
                "random key: restart it with ADMIN_KEY set)")
    return ("the admin key given (ADMIN_KEY or --admin-key) is not the server's: use the ADMIN_KEY the server was "
            "started with")


def reason(message: str) -> str:
    """Triton's message without the Python stack (``At:`` lines) its Python backend appends to a failed load."""
    return re.split(r"\n\s*At:\n", message, maxsplit=1)[0].strip()


def swap_tokenizer(grpc_url: str, tokenizer_dir: str, models: tuple[str, ...] = ("preprocess",), admin_key: str | None = None,
                   timeout: float = 300) -> None:
    """Reload each model in ``models`` with ``tokenizer_dir``; raises with Triton's message on failure.

    A new chat template or a re-packaged tokenizer keeps the vocabulary, so ``preprocess`` alone is
    enough (``postprocess`` too when its decoding should change). A tokenizer with another vocabulary
    does not fit the llm model: llm refuses its ids with a clear fingerprint error.
    """
    if not os.path.isabs(tokenizer_dir):
        raise RuntimeError(f"tokenizer_dir must be an absolute path as the server sees it, got {tokenizer_dir!r}")

    def use_tokenizer(config: dict) -> None:
        config["parameters"]["tokenizer_dir"] = {"string_value": tokenizer_dir}

    for name in models:
        reload_with_config(grpc_url, name, use_tokenizer, f"tokenizer_dir={tokenizer_dir}", admin_key, timeout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.admin", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    swap = sub.add_parser("swap-tokenizer", help="load preprocess (and optionally postprocess) with a new tokenizer")
    swap.add_argument("tokenizer_dir", help="tokenizer folder, as a path on the server")
    swap.add_argument("--url", default="localhost:8001", help="Triton gRPC host:port")
    swap.add_argument("--admin-key", default=None, help="the server's ADMIN_KEY (default: $ADMIN_KEY)")
    swap.add_argument("--with-postprocess", action="store_true",
                      help="also reload postprocess (the tokenizer that decodes replies)")
    args = parser.parse_args(argv)
    models = ("preprocess", "postprocess") if args.with_postprocess else ("preprocess",)
    try:
        swap_tokenizer(args.url, args.tokenizer_dir, models, args.admin_key)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{' and '.join(models)} now {'use' if len(models) > 1 else 'uses'} the tokenizer in {args.tokenizer_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
