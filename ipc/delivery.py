"""How far postprocess has taken each stream: what lets llm coalesce tokens without adding latency.

Every response of a stream costs each hop after the engine the same whatever it carries (llm's send,
the ensemble's routing, a postprocess call, Triton's front end, the client). So llm sends a stream's new
tokens at once only when its previous response has been through postprocess; while that one is still on
its way, they wait and join the next (``llm/service.py``). At low load nothing is ever on its way when
the next token comes, so nothing waits; under load a response carries every token made meanwhile.

Triton gives llm no sign of where a response is, so postprocess says it here: each llm stub owns a board,
a file in /dev/shm of ``SLOTS`` 8-byte words that both map; postprocess writes, for generation
``<pid>-<n>`` (``generation_id``), into slot ``n % SLOTS`` the word ``(n mod 2**32) << 32 | tokens``: the
``completion_tokens`` of that generation's latest response it finished. An aligned 8-byte store is one
instruction on x86-64 and Arm64, so llm never reads half a word; the tag in the high half tells a slot's
old generation from its new one. Word 0 counts the marks, so llm looks at its held streams only when it
changed. Only requests that ask (``coalesce``, which preprocess sets in the ensemble) are ever held: a
caller of llm alone, whose responses no postprocess marks, gets every token as it comes.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

from ipc.cancel import GENERATION_ID

BOARDS = Path(os.environ.get("DELIVERY_DIR") or Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
              / "triton-chat-delivery")
SLOTS = 1 << 16  # generations a board tells apart at once: far more than llm holds (running and queued)
WORD = 8


def _tag(n: int) -> int:
    return n & 0xFFFFFFFF


def _slot(n: int) -> int:
    return 1 + n % (SLOTS - 1)  # word 0 is the count of marks


class Board:
    """llm's side: its own board, made empty at start and removed at the end (``llm.service.Deliveries``)."""

    def __init__(self) -> None:
        self.path = BOARDS / str(os.getpid())
        BOARDS.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w+b") as f:
            f.truncate(SLOTS * WORD)
            self._map = mmap.mmap(f.fileno(), SLOTS * WORD)
        self._words = memoryview(self._map).cast("Q")
        self._seen = 0

    def changed(self) -> bool:
        """Whether postprocess marked anything since the last call."""
        count = self._words[0]
        changed, self._seen = count != self._seen, count
        return changed

    def delivered(self, generation_id: str) -> int | None:
        """The ``completion_tokens`` of ``generation_id``'s (one of this llm's) latest response postprocess
        finished; None while it has finished none."""
        n = int(generation_id.rpartition("-")[2])
        word = self._words[_slot(n)]
        return word & 0xFFFFFFFF if word >> 32 == _tag(n) else None

    def close(self) -> None:
        self._words.release()
        self._map.close()
        self.path.unlink(missing_ok=True)


def sweep() -> None:
    """Remove the boards of llm stubs that no longer run (llm calls this when it starts)."""
    for path in BOARDS.glob("*"):
        if path.name.isdigit() and not Path(f"/proc/{path.name}").exists():
            path.unlink(missing_ok=True)


class Marker:
    """postprocess's side: marks on whichever llm's board a generation id names."""

    def __init__(self) -> None:
        self._boards: dict[str, memoryview] = {}

    def mark(self, generation_id: str, tokens: int) -> None:
        """Postprocess finished the response of ``generation_id`` that carried ``tokens`` completion tokens.
        Ids llm could not have made, and boards that are gone, are ignored: a mark is only ever a hint."""
        if not GENERATION_ID.match(generation_id) or not 0 <= tokens <= 0xFFFFFFFF:
            return
        pid, _, counter = generation_id.partition("-")
        n = int(counter)
        words = self._boards.get(pid) or self._open(pid)
        if words is not None:
            words[_slot(n)] = _tag(n) << 32 | tokens
            words[0] = (words[0] + 1) & 0xFFFFFFFFFFFFFFFF

    def _open(self, pid: str) -> memoryview | None:
        for old in [p for p in self._boards if not Path(f"/proc/{p}").exists()]:  # an llm stub that ended
            self._boards.pop(old).release()
        try:
            with open(BOARDS / pid, "r+b") as f:
                words = memoryview(mmap.mmap(f.fileno(), SLOTS * WORD)).cast("Q")
        except (OSError, ValueError):  # no such board (yet, or any more), or not whole
            return None
        self._boards[pid] = words
        return words
