"""Client cancellation carried across the ensemble, from the step that sees it to llm, which must act.

Triton 2.51's ensemble marks only the steps it schedules after a client cancels, never the llm request
already running, so llm's ``is_cancelled()`` stays false while it generates for nobody. The next
postprocess request of that stream does arrive marked (postprocess runs without a dynamic batcher, which
would drop it unseen), so postprocess leaves a mark named by the ``generation_id`` llm attached to every
response, and each llm instance looks for its running requests' marks before every step. A directory is
the one place every instance of both models shares without Triton in between.

A mark may carry an error: postprocess cannot fail a chunk while llm still streams (``docs/operations.md``
says why: Triton 2.51's ensemble would never finish the request), so it hands the failure to llm, which
ends the generation with it.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

BOARD = Path(os.environ.get("CANCEL_DIR") or Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()) / "triton-chat-cancel")
GENERATION_ID = re.compile(r"^[0-9]{1,10}-[0-9]{1,20}$")  # "<llm stub pid>-<counter>": unique on the host


def mark(generation_id: str, error: str = "") -> None:
    """Ask llm to stop ``generation_id`` (with ``error``, to fail it); ignores ids llm could not have made
    (no path ever escapes)."""
    if GENERATION_ID.match(generation_id):
        BOARD.mkdir(parents=True, exist_ok=True)
        draft = BOARD / f".{generation_id}.{os.getpid()}"  # whole or absent: llm never reads half an error
        draft.write_text(error)
        os.replace(draft, BOARD / generation_id)


def sweep() -> None:
    """Remove the marks of llm stubs that no longer run: a mark that came after its generation ended is
    never taken (llm calls this when it starts)."""
    for path in BOARD.glob("*-*"):
        pid = path.name.split("-")[0]
        if GENERATION_ID.match(path.name) and not Path(f"/proc/{pid}").exists():
            path.unlink(missing_ok=True)


def take(generation_id: str) -> str | None:
    """Once, if ``generation_id`` was marked: its error ("" for a plain cancellation); the mark is consumed."""
    path = BOARD / generation_id
    try:
        error = path.read_text(errors="replace")
        os.unlink(path)
        return error
    except FileNotFoundError:
        return None
