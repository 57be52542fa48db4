"""``python -m client "prompt"``: send one prompt and print the reply as it is generated."""

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
    parser.add_argument("--no-stream", action="store_true", help="wait for the whole reply (KServe infer)")
    parser.add_argument("--max-tokens", type=int, dest="max_tokens", help="reply budget (server default 64)")
    parser.add_argument("--system-prompt", dest="system_prompt", help="system message for the chat template")
    parser.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
    parser.add_argument("--temperature", type=float, help="0 (the default) is greedy")
    parser.add_argument("--top-p", type=float, dest="top_p")
    parser.add_argument("--top-k", type=int, dest="top_k")
    parser.add_argument("--repetition-penalty", type=float, dest="repetition_penalty")
    parser.add_argument("--seed", type=int, help="repeatable sampling")
    parser.add_argument("--stop", action="append", default=[], help="a string that ends the reply (repeatable)")
    args = parser.parse_args(argv)
    prompt = Prompt(
        args.text_input, args.max_tokens, args.system_prompt, False if args.raw else None, args.temperature,
        args.top_p, args.top_k, args.repetition_penalty, args.seed, args.stop,
    )
    client = ChatClient(args.url, args.protocol)
    try:
        if args.no_stream:
            print(client.generate(prompt).text_output)
        else:
            for chunk in client.stream(prompt):
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
