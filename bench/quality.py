"""``python -m bench.quality``: what each ``weights`` setting changes in the default model's output.

Against bf16 (the default on CPUs with AVX512-BF16), for each setting: greedy replies to ``PROMPTS``
(chat template, 64 tokens, EOS ignored) compared token by token (how many tokens agree before the
first difference, and the share of replies identical), and perplexity over the first ``--tokens`` tokens
of a fixed text that ships with Python itself (the language reference topics of ``pydoc_data``, in
512-token windows). f32 is measured too: its distance from bf16 is the scale of bf16's own rounding.
In-process, eager (``compile=False``): the same weights and kernels the server runs, without its start-up.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from launcher.model_folder import prepare_default_model
from llm import LLM, LLMConfig
from llm.sequence import Sequence

PROMPTS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.", "Write a haiku about the sea.",
    "How do I reverse a list in Python?", "Why is the sky blue?", "Give me three tips for better sleep.",
    "What is a prime number?", "Summarize the plot of Romeo and Juliet.", "How does a bicycle stay upright?",
    "Name the planets of the solar system.", "What causes rain?", "Describe a cat to someone who has never seen one.",
    "What is the difference between weather and climate?", "Translate 'good morning' into Spanish and German.",
    "How many minutes are in a day? Show the arithmetic.", "Write a short thank-you note to a teacher.",
]
WINDOW = 512


def reference_text() -> str:
    """Python's own language reference topics, in a fixed order: English prose and code, the same for
    every install of this Python."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    engine = llm.engine()
    seqs = []
    for prompt in PROMPTS:
        ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
        seqs.append(Sequence(llm.validate(list(ids), max_tokens, ignore_eos=True)))
        engine.add(seqs[-1])
    while engine.has_work:
        engine.step()
    return [s.output_ids for s in seqs]


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int]) -> float:
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = torch.tensor(ids[start:start + WINDOW + 1])
        logits = llm.decoder.prompt_logits(window[:-1])
        total += F.cross_entropy(logits, window[1:], reduction="sum").item()
        count += len(window) - 1
    return math.exp(total / count)


def agreement(replies: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """Mean tokens before the first difference, and the share of replies identical."""
    prefixes = [next((i for i, (a, b) in enumerate(zip(r, ref)) if a != b), len(ref)) for r, ref in zip(replies, reference)]
    return sum(prefixes) / len(prefixes), sum(r == ref for r, ref in zip(replies, reference)) / len(replies)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__)
    parser.add_argument("--settings", nargs="+", default=["bf16", "f32", "int8", "int4"])
    parser.add_argument("--tokens", type=int, default=4096, help="of the reference text, for perplexity")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model_dir = str(prepare_default_model())
    results = {}
    for setting in args.settings:
        llm = LLM(LLMConfig(model_dir, weights=setting, compile=False, max_tokens_limit=512), torch.device("cpu"))
        ids = llm.tokenizer(reference_text())["input_ids"][: args.tokens + 1]
        results[setting] = greedy(llm, args.max_tokens), perplexity(llm, ids), llm.weight_bytes
        del llm
    reference = results[args.settings[0]][0]
    print(f"| weights | MiB read a step | perplexity ({args.tokens} tokens) | greedy: tokens before the first "
          f"difference (of {args.max_tokens}) | replies identical |")
    print("|---|---|---|---|---|")
    for setting, (replies, ppl, size) in results.items():
        prefix, same = agreement(replies, reference)
        print(f"| {setting} | {size / 2**20:.0f} | {ppl:.3f} | {prefix:.1f} | {same:.0%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
