"""The multi-turn chat workload: what a chat client sends, and where prefix caching pays.

Seeded conversations over one long system prompt (an application's instructions, the same for all its
users): each turn re-sends the whole history, the system prompt, every earlier question and the server's
own replies, then a new question. ``concurrency`` users run at once in a closed loop: each sends its next
turn as soon as its last reply has ended, and starts the next conversation when its own is over.
Streamed over OpenAI's ``/v1/chat/completions``, the one API every system here serves; greedy, each reply
exactly ``max_tokens`` tokens (``ignore_eos``), so every system generates the same number of tokens.
The time to first token of first turns and of later turns, apart, says whether a conversation's turns get
slower as it grows.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from bench.load import chat_events
from bench.workload import WORDS

TOPICS = ("the river", "the old library", "the harbor", "the mountain road", "the village market", "the storm")


def system_prompt(seed: int = 0, sentences: int = 19) -> str:
    """About 400 tokens of instructions, as an assistant deployed for one purpose has."""
    rng = random.Random(seed)
    rules = [f"Rule {n}: when asked about {rng.choice(WORDS)}, mention the {rng.choice(WORDS)} and the "
             f"{rng.choice(WORDS)}, never the {rng.choice(WORDS)}." for n in range(1, sentences + 1)]
    return "You are the guide of a travel library. Answer briefly and follow these rules. " + " ".join(rules)


@dataclass(frozen=True)
class Conversation:
    questions: tuple[str, ...]  # one per turn


def conversations(count: int, turns: int, seed: int) -> list[Conversation]:
    rng = random.Random(seed)

    def question() -> str:
        return (f"Tell me about {rng.choice(TOPICS)} and its {rng.choice(WORDS)}, "
                f"then about the {rng.choice(WORDS)} near the {rng.choice(WORDS)}.")

    return [Conversation(tuple(question() for _ in range(turns))) for _ in range(count)]


@dataclass
class Turn:
    ttft: float
    tokens: int
    prompt_tokens: int
    cached_tokens: int | None  # as the server reports it, when it does


@dataclass
class ChatRun:
    first: list[Turn] = field(default_factory=list)  # each conversation's first turn
    later: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    client_cpu_s: float = 0.0


async def _turn(session: aiohttp.ClientSession, url: str, model: str, messages: list[dict], max_tokens: int
                ) -> tuple[str, Turn]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    begin, first, text, usage, cache_n = time.perf_counter(), None, [], None, None
    async for data in chat_events(session, url, body):
        delta = data["choices"][0]["delta"].get("content") if data.get("choices") else None
        if delta:
            first = first or time.perf_counter() - begin
            text.append(delta)
        usage = data.get("usage") or usage
        cache_n = (data.get("timings") or {}).get("cache_n", cache_n)  # llama-server's count of reused tokens
    if usage is None:
        raise RuntimeError("chat completion stream ended without usage")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cache_n)
    return "".join(text), Turn(first, usage["completion_tokens"], usage["prompt_tokens"], cached)


async def run(url: str, model: str, system: str, items: list[Conversation], concurrency: int, max_tokens: int,
              fresh_connections: bool = False) -> ChatRun:
    """``items`` in a closed loop of ``concurrency`` users. ``fresh_connections`` for servers that close
    streamed connections (llama-server)."""
    queue = list(reversed(items))
    result = ChatRun()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=aiohttp.TCPConnector(limit=0, force_close=fresh_connections)) as session:

        async def user() -> None:
            while queue:
                conversation = queue.pop()
                messages = [{"role": "system", "content": system}]
                for n, question in enumerate(conversation.questions):
                    messages.append({"role": "user", "content": question})
                    reply, turn = await _turn(session, url, model, messages, max_tokens)
                    messages.append({"role": "assistant", "content": reply})
                    (result.later if n else result.first).append(turn)

        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        result.seconds, result.client_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    return result


def summary(result: ChatRun) -> dict:
    turns = result.first + result.later
    tokens = sum(t.tokens for t in turns)
    p50 = lambda group: float(np.percentile([t.ttft for t in group], 50) * 1000)  # noqa: E731
    reported = [t for t in turns if t.cached_tokens is not None]
    first, later = p50(result.first), p50(result.later)
    return {
        "conversations": len(result.first),
        "turns": len(turns),
        "seconds": result.seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / result.seconds,
        "ttft_p50_first_ms": first,
        "ttft_p50_later_ms": later,
        "later_over_first": later / first,
        "ttft_p99_ms": float(np.percentile([t.ttft for t in turns], 99) * 1000),
        "prompt_tokens_mean": float(np.mean([t.prompt_tokens for t in turns])),
        "cached_share": (sum(t.cached_tokens for t in reported) / sum(t.prompt_tokens for t in reported)
                         if reported else None),
        "client_cpu_pct": 100 * result.client_cpu_s / result.seconds,
    }


async def measure(url: str, model: str, concurrency: int, turns: int, max_tokens: int,
                  fresh_connections: bool = False) -> dict:
    """One point: a warm-up of ``concurrency`` one-turn conversations (not measured; it leaves the system
    prompt wherever a server keeps prompts, as any running server has it), then ``2 x concurrency``
    conversations of ``turns`` turns."""
    system = system_prompt()
    await run(url, model, system, conversations(concurrency, 1, seed=100 + concurrency), concurrency, max_tokens,
              fresh_connections)
    measured = await run(url, model, system, conversations(2 * concurrency, turns, seed=concurrency), concurrency,
                         max_tokens, fresh_connections)
    return {"workload": "chat", "concurrency": concurrency, "turns": turns, "max_tokens": max_tokens, **summary(measured)}
