"""Seeded prompt sets: a fixed-length one, a variable one, and the fixed one sampled or with a JSON schema."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

WORDS = (
    "river mountain engine garden planet music window history ocean forest language market energy "
    "bridge winter science city light memory journey animal island road story machine weather "
    "village library storm harbor desert season signal"
).split()


@dataclass(frozen=True)
class Item:
    """One request: a chat prompt and its reply budget (EOS ignored, so exactly max_tokens tokens)."""

    text_input: str
    max_tokens: int
    ignore_eos: bool = True
    temperature: float | None = None  # None: greedy (the server's default)
    top_p: float | None = None
    seed: int | None = None
    structured_outputs: dict | None = None  # a grammar every token of the reply follows


def _prompt(rng: random.Random, words: int) -> str:
    return "Write about " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


def fixed(count: int, max_tokens: int, seed: int = 0, prompt_words: int = 24) -> list[Item]:
    """Every request has the same prompt length and generates exactly ``max_tokens`` tokens."""
    rng = random.Random(seed)
    return [Item(_prompt(rng, prompt_words), max_tokens) for _ in range(count)]


def variable(count: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[Item]:
    """Prompt lengths (4 to 200 words) and reply budgets drawn uniformly from a seeded generator."""
    rng = random.Random(seed)
    return [Item(_prompt(rng, rng.randint(4, 200)), rng.randint(min_tokens, max_tokens)) for _ in range(count)]


def sampled(count: int, max_tokens: int, seed: int = 0) -> list[Item]:
    """``fixed``'s requests with temperature 0.8 and top-p 0.9, each seeded: every row goes through the
    sampler instead of the batch's one argmax."""
    return [replace(item, temperature=0.8, top_p=0.9, seed=n) for n, item in enumerate(fixed(count, max_tokens, seed))]


# A JSON object whose one string is long enough that every reply runs to max_tokens (as ignore_eos makes the
# others do), so the constrained and the free workload generate the same tokens.
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}}, "required": ["text"],
          "additionalProperties": False}


def structured(count: int, max_tokens: int, seed: int = 0) -> list[Item]:
    """``fixed``'s requests with ``SCHEMA`` on every one: every token of every row masked by its grammar."""
    return [replace(item, structured_outputs={"json": SCHEMA}) for item in fixed(count, max_tokens, seed)]
