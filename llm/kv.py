"""The KV budget in blocks, every admitted request's cache slots in one table, and the prefix cache.

As in vLLM's paged attention and nano-vllm's block manager: the cache holds ``kv_cache_tokens`` slots per
layer, allocated once and cut into blocks of ``BLOCK_SIZE`` slots. A request reserves, when admitted, the
blocks its prompt plus ``max_tokens`` can fill, so it never runs out of room mid-reply; rows of different
lengths waste at most the tail of their last block, and nothing is ever copied to make room.

Row ``r`` of ``slots`` maps the positions of the request holding row ``r`` to its cache slots, so the
forward pass finds a token's slot with one gather. Row 0 and block 0 are scratch: padding tokens write
there and padding rows read there, never a request's keys.

Prefix caching, as vLLM's (``docs/design/prefix_caching.md``): a block whose every slot holds keys and
values is registered under the hash of its tokens chained to its parent block's hash (``BlockHasher``:
the first block's hash also covers the model and the request's ``cache_salt``). A request whose prompt
starts with registered blocks maps them into its own row and skips their prefill. Blocks are
ref-counted while rows use them; a freed registered block keeps its keys in an LRU, handed out for new
keys only when no plain free block is left. Only full blocks are shared, and a request never takes its
last prompt token from the cache (its logits are needed), so a shared block is never written again.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

BLOCK_SIZE = 16


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def cache_slots(kv_cache_tokens: int) -> int:
    """Slots the cache allocates per layer: the budget (a multiple of BLOCK_SIZE) and the scratch block."""
    return kv_cache_tokens + BLOCK_SIZE


class BlockHasher:
    """Hashes of full blocks of tokens, each chained to the one before. SHA-256, as vLLM's default since
    its hash could be made to collide across tenants: a collision would hand one request another's keys."""

    def __init__(self, model: str) -> None:
        self.model = model.encode()

    def root(self, salt: str | None) -> bytes:
        """The parent of a request's first block: the model, and its salt when it gives one (tenants with
        different salts never share a block)."""
        return hashlib.sha256(self.model + b"\0" + (salt or "").encode()).digest()

    @staticmethod
    def chain(parent: bytes, tokens: Sequence[int]) -> list[bytes]:
        """The hashes of ``tokens``' full blocks, the first chained to ``parent``."""
        hashes = []
        for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
            parent = hashlib.sha256(parent + array("q", tokens[start:start + BLOCK_SIZE]).tobytes()).digest()
            hashes.append(parent)
        return hashes


class BlockTable:
    def __init__(self, kv_cache_tokens: int, max_rows: int, max_tokens_per_row: int, device: torch.device) -> None:
        self.blocks = kv_cache_tokens // BLOCK_SIZE
        self._free_blocks = list(range(self.blocks, 0, -1))  # holding nothing worth keeping; pop() gives the lowest
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free but registered, least recently freed first
        self._block_of: dict[bytes, int] = {}  # registered blocks by hash, in use or evictable
        self._hash_of: dict[int, bytes] = {}
        self._refs = [0] * (self.blocks + 1)  # rows holding each block
        self._free_rows = list(range(max_rows, 0, -1))
        self._held: dict[int, list[int]] = {}
        width = blocks_for(max_tokens_per_row) * BLOCK_SIZE
        self.slots = torch.zeros((max_rows + 1, width), dtype=torch.long, device=device)
        self._offsets = torch.arange(BLOCK_SIZE, device=device)

    @property
    def used_tokens(self) -> int:
        """Slots held by admitted requests (whole blocks; a block rows share counts once)."""
        return (self.blocks - len(self._free_blocks) - len(self._evictable)) * BLOCK_SIZE

    @property
    def cached_blocks(self) -> int:
        """Registered blocks, in use or evictable."""
        return len(self._hash_of)

    def cached(self, hashes: Sequence[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of ``hashes``."""
        found = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def fits(self, tokens: int, prefix: Sequence[int] = ()) -> bool:
        """Whether a row and the blocks for ``tokens`` are free, the cached ``prefix`` blocks reused."""
        taken = sum(1 for block in prefix if self._refs[block])  # in use: they cost nothing more
        return bool(self._free_rows) and blocks_for(tokens) - taken <= len(self._free_blocks) + len(self._evictable)

    def reserve(self, tokens: int, prefix: Sequence[int] = ()) -> int:
        """A row whose first ``tokens`` positions have slots, the first ones in the cached ``prefix``
        blocks and the rest its own; ``fits`` must be true."""
        for block in prefix:
            self._evictable.pop(block, None)
            self._refs[block] += 1
        blocks = list(prefix) + [self._take() for _ in range(blocks_for(tokens) - len(prefix))]
        row = self._free_rows.pop()
        self._held[row] = blocks
        first = torch.tensor(blocks, device=self.slots.device)[:, None] * BLOCK_SIZE
        self.slots[row, : len(blocks) * BLOCK_SIZE] = (first + self._offsets).flatten()
        return row

    def register(self, row: int, index: int, block_hash: bytes) -> None:
        """The ``index``-th block of ``row`` is full, its tokens hashing to ``block_hash``. When another
        block already holds those keys (two rows prefilled the same prefix at once), this one stays
        unregistered and is plainly freed with its row."""
        block = self._held[row][index]
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def release(self, row: int) -> None:
        """Free ``row``; its blocks no other row holds become free, the registered ones evictable, the
        tail first (as vLLM: a prefix's later blocks are the less likely to be asked for again)."""
        for block in reversed(self._held.pop(row)):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free_blocks.append(block)
        self._free_rows.append(row)
        self.slots[row].zero_()

    def forget(self) -> None:
        """Drop every registered block's keys (after a failed step nothing in the cache is trusted)."""
        self._free_blocks += reversed(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()

    def _take(self) -> int:
        """A block for new keys: a plain free one, else the least recently freed registered one."""
        if self._free_blocks:
            block = self._free_blocks.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block
