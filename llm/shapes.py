"""The shapes the compiled forward pass runs, chosen so that every one of them is known before traffic.

A step is one of two kinds. A *decode* step carries one token for each of ``tokens`` rows, each
attending over ``columns`` cache positions; a *mixed* step carries ``tokens`` flat tokens (decode rows,
then prompt chunks) whose attention happens outside the compiled graph, so only ``tokens`` shapes it.

Padded (the rule on GPUs): rows, columns and tokens are rounded up to a small fixed set of buckets
(powers of two, capped at the engine's limits), so the engine can compile and capture every shape at
load and no request mix can bring a new one. Six row buckets times eight column buckets is 48 decode
shapes for the defaults (64 rows, 8192 positions); five token buckets make the mixed shapes.

Exact (the rule on CPUs): sizes are kept, only raised to ``MIN_SIZE``: the compiled C++ kernels take
sizes as arguments, so one compile serves them all, and padding would only add arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MIN_SIZE = 2  # the compiler specialises sizes 0 and 1 into graphs of their own
MIN_COLUMNS = 64  # the smallest padded context: a GPU attends over 64 positions as fast as over 2
MIN_TOKENS = 16  # the smallest padded mixed step


@dataclass(frozen=True)
class Shape:
    """A step as the compiled graph sees it; ``logits`` rows of logits are computed."""

    kind: Literal["decode", "mixed"]
    tokens: int
    columns: int  # decode: context columns of each row; mixed: 0 (attention is outside the graph)
    logits: int


def doublings(low: int, high: int) -> tuple[int, ...]:
    """``low, 2 low, 4 low, ...`` below ``high``, then ``high``."""
    sizes, n = [], low
    while n < high:
        sizes.append(n)
        n *= 2
    return (*sizes, high)


def _up(n: int, buckets: tuple[int, ...]) -> int:
    for bucket in buckets:
        if n <= bucket:
            return bucket
    raise ValueError(f"{n} is past the largest bucket {buckets[-1]}: the scheduler broke a limit")


@dataclass(frozen=True)
class Shapes:
    """How a step's sizes become a ``Shape``, and the shapes to run at load."""

    pad: bool
    rows: tuple[int, ...]  # decode rows
    columns: tuple[int, ...]  # context columns of a decode step
    tokens: tuple[int, ...]  # tokens of a mixed step

    @classmethod
    def plan(cls, pad: bool, max_rows: int, max_columns: int, max_tokens: int) -> Shapes:
        """Buckets up to the engine's limits: ``max_running_requests``, the width of the block table (the
        longest context a request may reach) and ``max_batched_tokens``."""
        max_rows, max_columns, max_tokens = (max(n, MIN_SIZE) for n in (max_rows, max_columns, max_tokens))
        return cls(pad, doublings(MIN_SIZE, max_rows), doublings(min(MIN_COLUMNS, max_columns), max_columns),
                   doublings(min(MIN_TOKENS, max_tokens), max_tokens))

    def decode(self, rows: int, columns: int) -> Shape:
        if self.pad:
            rows, columns = _up(rows, self.rows), _up(columns, self.columns)
        else:
            rows, columns = max(rows, MIN_SIZE), max(columns, MIN_SIZE)
        return Shape("decode", rows, columns, rows)

    def mixed(self, decode: int, prompt: int, sampled: int) -> Shape:
        """``decode`` rows and ``prompt`` tokens of prompt chunks, of which ``sampled`` get logits (the
        decode rows and the prompts that this step completes). Padded, every row the engine may hold (or
        every token, if fewer) gets logits. Exact, the decode rows and the prompt part are each at least
        MIN_SIZE: both are sizes in the CPU's graph."""
        if self.pad:
            tokens = _up(decode + prompt, self.tokens)
            return Shape("mixed", tokens, 0, min(tokens, self.rows[-1]))
        return Shape("mixed", max(decode, MIN_SIZE) + max(prompt, MIN_SIZE), 0, max(sampled, MIN_SIZE))

    def warm_up(self) -> list[Shape]:
        """Padded: every shape, the largest first (CUDA graphs captured in that order share memory best).
        Exact: one shape of each kind, which compiles the graph that serves every size."""
        if not self.pad:
            return [self.decode(MIN_SIZE, MIN_SIZE), self.mixed(MIN_SIZE, MIN_SIZE, MIN_SIZE)]
        decode = [self.decode(r, c) for r in reversed(self.rows) for c in reversed(self.columns)]
        return decode + [self.mixed(0, t, t) for t in reversed(self.tokens)]
