"""The KV manager: the KV budget in blocks, every admitted request's cache slots in one table, and the
prefix cache.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


@dataclass
class _Row:
    """What the manager holds for one admitted request: its blocks, its full blocks' hashes so far, how
    many of them are registered, and the salt its chain starts from."""

    blocks: list[int]
    hashes: list[bytes]
    registered: int
    salt: str | None


class KVManager:
    """The one owner of the cache's blocks: ref counts, the hash chain, lookup, registration as blocks
    fill, the LRU of freed registered blocks, and forgetting them. ``hasher`` None turns prefix caching
    off: nothing is hashed, looked up or registered."""

    def __init__(self, kv_cache_tokens: int, max_rows: int, max_tokens_per_row: int, device: torch.device,
                 hasher: BlockHasher | None = None) -> None:
        self.hasher = hasher
        self.blocks = kv_cache_tokens // BLOCK_SIZE
        self._free_blocks = list(range(self.blocks, 0, -1))  # holding nothing worth keeping; pop() gives the lowest
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free but registered, least recently freed first
        self._block_of: dict[bytes, int] = {}  # registered blocks by hash, in use or evictable
        self._hash_of: dict[int, bytes] = {}
        self._refs = [0] * (self.blocks + 1)  # rows holding each block
        self._free_rows = list(range(max_rows, 0, -1))
        self._rows: dict[int, _Row] = {}
        width = blocks_for(max_tokens_per_row) * BLOCK_SIZE
        self.slots = torch.zeros((max_rows + 1, width), dtype=torch.long, device=device)
        self._offsets = torch.arange(BLOCK_SIZE, device=device)

    @property
    def caching(self) -> bool:
        return self.hasher is not None

    @property
    def used_tokens(self) -> int:
        """Slots held by admitted requests (whole blocks; a block rows share counts once)."""
        return (self.blocks - len(self._free_blocks) - len(self._evictable)) * BLOCK_SIZE

    @property
    def cached_blocks(self) -> int:
        """Registered blocks, in use or evictable."""
        return len(self._hash_of)

    def prompt_hashes(self, input_ids: Sequence[int], salt: str | None) -> list[bytes]:
        """The hashes of a prompt's full blocks (none while caching is off). Called on the submitting
        thread, so a long prompt's hashing never holds up a step."""
        return self.hasher.chain(self.hasher.root(salt), input_ids) if self.hasher is not None else []

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The registered blocks of the longest prefix of ``hashes``."""
        found = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def computed_blocks(self, hashes: Sequence[bytes], prompt_tokens: int) -> list[int]:
        """The blocks of a prompt's prefix already in the cache, never the one holding its last token:
        that token's logits are needed, so it is always computed (and a shared block never written)."""
        return self.lookup(hashes[:(prompt_tokens - 1) // BLOCK_SIZE])

    def can_allocate(self, tokens: int, computed: Sequence[int] = ()) -> bool:
        """Whether a row and the blocks for ``tokens`` are free, the ``computed`` blocks reused."""
        taken = sum(1 for block in computed if self._refs[block])  # in use: they cost nothing more
        return bool(self._free_rows) and blocks_for(tokens) - taken <= len(self._free_blocks) + len(self._evictable)

    def allocate(self, tokens: int, computed: Sequence[int] = (), hashes: Sequence[bytes] = (),
                 salt: str | None = None) -> int:
        """A row whose first ``tokens`` positions have slots, the first ones in the ``computed`` blocks and
        the rest its own; ``can_allocate`` must be true. ``hashes`` (the prompt's) and ``salt`` continue
        its chain as its reply fills blocks."""
        for block in computed:
            self._evictable.pop(block, None)
            self._refs[block] += 1
        blocks = list(computed) + [self._take() for _ in range(blocks_for(tokens) - len(computed))]
        row = self._free_rows.pop()
        self._rows[row] = _Row(blocks, list(hashes), len(computed), salt)
        first = torch.tensor(blocks, device=self.slots.device)[:, None] * BLOCK_SIZE
        self.slots[row, : len(blocks) * BLOCK_SIZE] = (first + self._offsets).flatten()
        return row

    def cache_full_blocks(self, row: int, computed_tokens: int, token_at: Callable[[int], int]) -> None:
        """Register the blocks of ``row`` its first ``computed_tokens`` positions filled: those of its
        prompt were hashed when it came, those of its reply are hashed here as they fill (a
        conversation's next turn re-sends the reply). When another block already holds the same keys
        (two rows prefilled the same prefix at once), this one stays unregistered and is plainly freed."""
        if self.hasher is None:
            return
        held = self._rows[row]
        while held.registered < computed_tokens // BLOCK_SIZE:
            i = held.registered
            if i == len(held.hashes):
                parent = held.hashes[-1] if i else self.hasher.root(held.salt)
                held.hashes += self.hasher.chain(parent, [token_at(p) for p in range(i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE)])
            block, block_hash = held.blocks[i], held.hashes[i]
            if block_hash not in self._block_of and block not in self._hash_of:
                self._block_of[block_hash] = block
                self._hash_of[block] = block_hash
            held.registered += 1

    def free(self, row: int) -> None:
        """Free ``row``; its blocks no other row holds become free, the registered ones evictable, the
        tail first (as vLLM: a prefix's later blocks are the less likely to be asked for again)."""
        for block in reversed(self._rows.pop(row).blocks):
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
