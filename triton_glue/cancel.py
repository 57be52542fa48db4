"""Client cancellation carried across the ensemble, from the step that sees it to llm, which must act.

Triton 2.51's ensemble marks only the steps it schedules after a client cancels, never the llm request
already running, so llm's ``is_cancelled()`` stays false while it generates for nobody. The next
postprocess request of that stream does arrive marked (postprocess runs without a dynamic batcher, which
would drop it unseen), so postprocess leaves a mark named by the ``generation_id`` llm attached to every
response, and each llm instance looks for its running requests' marks before every step. A directory is
the one place every instance of both models shares without Triton in between.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

BOARD = Path(os.environ.get("CANCEL_DIR") or Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()) / "triton-chat-cancel")
GENERATION_ID = re.compile(r"^[0-9]{1,10}-[0-9]{1,20}$")  # "<llm stub pid>-<counter>": unique on the host


def mark(generation_id: str) -> None:
    """Ask llm to stop ``generation_id``; ignores ids llm could not have made (no path ever escapes)."""
    if GENERATION_ID.match(generation_id):
        BOARD.mkdir(parents=True, exist_ok=True)
        (BOARD / generation_id).touch()


def take(generation_id: str) -> bool:
    """True once if ``generation_id`` was marked; the mark is consumed."""
    try:
        os.unlink(BOARD / generation_id)
        return True
    except FileNotFoundError:
        return False
