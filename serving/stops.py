"""Stop strings matched on text, shared by ``llm`` (to stop generating) and ``postprocess`` (to cut text).

Both sides decode the same ids with the same vocabulary and call these functions, so the place where
``llm`` stops and the place where ``postprocess`` cuts are the same character.
"""

from __future__ import annotations

from typing import Sequence


def find_stop(text: str, stop: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    starts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return min(starts, default=None)


def partial_stop_length(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is the start of some stop string.

    A stream holds that tail back: the next token may complete the stop string, and then none of it may
    have been sent.
    """
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


def visible_text(text: str, stop: Sequence[str], final: bool) -> str:
    """The part of a reply's decoded text that a client may see now.

    Cut at a stop string. Before the end, also hold back an incomplete multi-byte character (byte-level
    BPE decodes it to U+FFFD until its last byte arrives) and any tail that may grow into a stop string.
    At the end a U+FFFD tail is a character ``max_tokens`` cut in half, and is dropped.
    """
    cut = find_stop(text, stop)
    if cut is not None:
        return text[:cut]
    text = text.rstrip("\ufffd")
    return text if final else text[: len(text) - partial_stop_length(text, stop)]
