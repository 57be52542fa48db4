"""What the engine tells operators, as calls on an ``EngineMetrics``: Triton's glue records them
(``triton_glue/metrics.py``); this default records nothing, so the engine needs no server."""

from __future__ import annotations


class EngineMetrics:
    """Engine events for operators. This default records nothing."""

    def admitted(self, prompt_tokens: int, queried_tokens: int, cached_tokens: int) -> None:
        """A request took a row: its prompt, of which ``queried_tokens`` were looked up in the prefix cache
        (all, or none while it is off) and ``cached_tokens`` found there."""

    def tokens(self, first: list[float], later: list[float]) -> None:
        """One step's new tokens: seconds from arrival to a request's first token, and between later ones."""

    def forward(self, rows: int) -> None:
        """One forward pass over ``rows`` requests."""

    def step(self, running: int, waiting: int, kv_tokens: int, cached_blocks: int) -> None:
        """After every step, forward pass or not."""

    def overloaded(self) -> None:
        """A request refused for overload (queue full, or waited too long)."""

    def flush(self) -> None:
        """Hand what was recorded to wherever it goes (called off the decode loop)."""
