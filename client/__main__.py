"""``python -m client "prompt"``: send one prompt and print the reply as it is generated."""

from __future__ import annotations

import argparse
import json
import sys

from tritonclient.utils import InferenceServerException

from client import PROMPT_FIELDS, ChatClient, Prompt
from contract.schema import PYTHON_TYPES


def _add_fields(parser: argparse.ArgumentParser) -> None:
    """A flag per request field of contract/schema.py (``--max-tokens``, ``--top-p``, ...), with its help."""
    for f in PROMPT_FIELDS[1:]:  # text_input is the positional argument
        flag, default = "--" + f.name.replace("_", "-"), f" (server default {f.default})" if f.default is not None else ""
        kwargs: dict = {"dest": f.name, "help": f.help + default}
        if f.json is not None:
            kwargs.update(type=json.loads, metavar="JSON")
        elif f.dims == (-1,):
            kwargs.update(action="append", type=PYTHON_TYPES[f.data_type], help=f.help + " (repeatable)")
        elif f.data_type == "TYPE_BOOL":
            kwargs.update(action=argparse.BooleanOptionalAction)
        else:
            kwargs.update(type=PYTHON_TYPES[f.data_type])
        parser.add_argument(flag, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__)
    parser.add_argument("text_input", help="the user message (or raw text with --raw)")
    parser.add_argument("--url", default="localhost:8000", help="host:port (8000 for http, 8001 for grpc)")
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http")
    parser.add_argument("--no-stream", action="store_true", help="wait for the whole reply (KServe infer)")
    parser.add_argument("--raw", action="store_true", help="send the text as is, without the chat template "
                        "(--no-apply-chat-template)")
    _add_fields(parser)
    args = parser.parse_args(argv)
    if args.raw:
        args.apply_chat_template = False
    prompt = Prompt(**{f.name: getattr(args, f.name) for f in PROMPT_FIELDS if getattr(args, f.name) is not None})
    client = ChatClient(args.url, args.protocol)
    try:
        if args.no_stream:
            reply = client.generate(prompt)
            if reply.reasoning_output:
                print(reply.reasoning_output, file=sys.stderr)
            print(reply.text_output)
        else:
            for chunk in client.stream(prompt):  # a thinking model's thinking to stderr, its answer to stdout
                print(chunk.reasoning_output, end="", flush=True, file=sys.stderr)
                print(chunk.text_output, end="", flush=True)
            print()
    except InferenceServerException as e:
        print(f"error: {e.message()}", file=sys.stderr)
        return 1
    except OSError as e:  # nothing listens there (requests' errors are OSErrors too): one line, no traceback
        print(f"error: cannot reach a server at {args.url} over {args.protocol}: {type(e).__name__}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
