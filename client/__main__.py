"""``python -m client "prompt"``: send one prompt to the ensemble and print the reply."""

from __future__ import annotations

import argparse
import sys

from tritonclient.utils import InferenceServerException

from client import ChatClient, Prompt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client", description=__doc__)
    parser.add_argument("text_input", help="the user message (or raw text with --raw)")
    parser.add_argument("--url", default="localhost:8000", help="host:port (8000 for http, 8001 for grpc)")
    parser.add_argument("--protocol", choices=["http", "grpc"], default="http")
    parser.add_argument("--max-tokens", type=int, dest="max_tokens", help="reply budget (server default 64)")
    parser.add_argument("--system-prompt", dest="system_prompt", help="system message for the chat template")
    parser.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
    args = parser.parse_args(argv)
    client = ChatClient(args.url, args.protocol)
    prompt = Prompt(args.text_input, args.max_tokens, args.system_prompt, False if args.raw else None)
    try:
        print(client.generate(prompt))
    except InferenceServerException as e:
        print(f"error: {e.message()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
