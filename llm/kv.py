"""The KV budget in blocks, and every admitted request's cache slots in one table.

As in vLLM's paged attention and nano-vllm's block manager: the cache holds ``kv_cache_tokens`` slots per
layer, allocated once and cut into blocks of ``BLOCK_SIZE`` slots. A request reserves, when admitted, the
blocks its prompt plus ``max_tokens`` can fill, so it never runs out of room mid-reply; rows of different
lengths waste at most the tail of their last block, and nothing is ever copied to make room.

Row ``r`` of ``slots`` maps the positions of the request holding row ``r`` to its cache slots, so the
forward pass finds a token's slot with one gather. Row 0 and block 0 are scratch: padding tokens write
there and padding rows read there, never a request's keys.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 16


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def cache_slots(kv_cache_tokens: int) -> int:
    """Slots the cache allocates per layer: the budget (a multiple of BLOCK_SIZE) and the scratch block."""
    return kv_cache_tokens + BLOCK_SIZE


class BlockTable:
    def __init__(self, kv_cache_tokens: int, max_rows: int, max_tokens_per_row: int, device: torch.device) -> None:
        self.blocks = kv_cache_tokens // BLOCK_SIZE
        self._free_blocks = list(range(self.blocks, 0, -1))  # pop() hands out the lowest first
        self._free_rows = list(range(max_rows, 0, -1))
        self._held: dict[int, list[int]] = {}
        width = blocks_for(max_tokens_per_row) * BLOCK_SIZE
        self.slots = torch.zeros((max_rows + 1, width), dtype=torch.long, device=device)
        self._offsets = torch.arange(BLOCK_SIZE, device=device)

    @property
    def used_tokens(self) -> int:
        """Slots reserved by admitted requests (whole blocks)."""
        return (self.blocks - len(self._free_blocks)) * BLOCK_SIZE

    def fits(self, tokens: int) -> bool:
        return bool(self._free_rows) and blocks_for(tokens) <= len(self._free_blocks)

    def reserve(self, tokens: int) -> int:
        """A row whose first ``tokens`` positions have slots of their own; ``fits`` must be true."""
        blocks = [self._free_blocks.pop() for _ in range(blocks_for(tokens))]
        row = self._free_rows.pop()
        self._held[row] = blocks
        first = torch.tensor(blocks, device=self.slots.device)[:, None] * BLOCK_SIZE
        self.slots[row, : len(blocks) * BLOCK_SIZE] = (first + self._offsets).flatten()
        return row

    def release(self, row: int) -> None:
        self._free_blocks += reversed(self._held.pop(row))
        self._free_rows.append(row)
        self.slots[row].zero_()
