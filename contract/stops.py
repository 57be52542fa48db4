"""Stop strings matched on text, shared by ``llm`` (to stop generating) and ``postprocess`` (to cut text).

Both sides decode the same ids with the same vocabulary and call these functions, so the place where
``llm`` stops and the place where ``postprocess`` cuts are the same character.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from typing import Callable, Sequence


def find_stop(text: str, stop: Sequence[str], after: int = 0) -> int | None:
    """Index where the earliest stop string that ends after character ``after`` starts in ``text``, or
    None. ``after`` is where min_tokens lets stop strings count from (as vLLM: one ending earlier does not)."""
    starts = [i for i in (text.find(s, max(0, after - len(s) + 1)) for s in stop) if i >= 0]
    return min(starts, default=None)


def matched_stop(text: str, stop: Sequence[str], after: int = 0) -> str | None:
    """The stop string ``find_stop`` cuts ``text`` at (the shortest there: the one completed first), or None."""
    cut = find_stop(text, stop, after)
    return None if cut is None else min((s for s in stop if text.startswith(s, cut) and cut + len(s) > after), key=len)


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


def visible_text(text: str, stop: Sequence[str], final: bool, after: int = 0) -> str:
    """The part of a reply's decoded text that a client may see now.

    Cut at a stop string. Before the end, also hold back an incomplete multi-byte character (byte-level
    BPE decodes it to U+FFFD until its last byte arrives) and any tail that may grow into a stop string.
    At the end a U+FFFD tail is a character ``max_tokens`` cut in half, and is dropped. Stop strings count
    from ``after`` (``find_stop``).
    """
    cut = find_stop(text, stop, after)
    if cut is not None:
        return text[:cut]
    text = text.rstrip("\ufffd")
    return text if final else text[: len(text) - partial_stop_length(text, stop)]


class TextTracker:
    """A reply's text, decoded a few ids at a time, as TGI's ``decode_token`` does.

    Each new id costs two decodes of a handful of ids, never a decode of the whole reply, so stop
    matching stays linear in the reply's length. It records checkpoints, (ids, characters) where the
    decoded text was whole, so a response can carry only the tail of the ids that postprocess needs
    (``window``) and postprocess's work per response is bounded too.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.longest = max((len(s) for s in stop), default=0)
        self.tail = ""  # the last characters a stop string could start in
        self._prefix = self._read = 0
        self.ids: list[int] = [0]  # checkpoints: ids decoded ...
        self.chars: list[int] = [0]  # ... and the characters they make

    def add(self, ids: list[int]) -> bool:
        """Take the reply so far (one id longer than last time); True when a stop string has appeared."""
        before = self.decode(ids[self._prefix:self._read])
        after = self.decode(ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):  # nothing new, or a character half made
            return False
        new = after[len(before):]
        self._prefix, self._read = self._read, len(ids)
        self.ids.append(len(ids))
        self.chars.append(self.chars[-1] + len(new))
        if not self.stop:
            return False
        text = self.tail + new
        self.tail = text[len(text) - self.longest + 1:] if self.longest > 1 else ""
        if len(ids) <= self.min_tokens:
            return False
        return find_stop(text, self.stop, max(0, self.stops_from() - (self.chars[-1] - len(text)))) is not None

    def stops_from(self) -> int:
        """The character after which stop strings count: the text of the first ``min_tokens`` ids (at its
        last whole checkpoint); 0 without min_tokens."""
        return self.chars[bisect_right(self.ids, self.min_tokens) - 1] if self.min_tokens else 0

    def stop_after(self, first: int) -> int:
        """``stops_from`` in the text decoded from id ``first`` (a checkpoint ``window`` gave), for postprocess."""
        return max(0, self.stops_from() - self.chars[bisect_left(self.ids, first)])

    def window(self, sent: int) -> int:
        """The first id a response must carry when ``sent`` ids went out before.

        Postprocess decodes only ids from here on and subtracts what was visible at ``sent``. That is exact
        when decoding starts where the text was whole and covers every character still held back: an
        incomplete character or the start of a stop string, which lie after the last checkpoint before
        ``sent`` or within ``longest`` characters of it (one more, for a tokenizer that drops a leading
        space at the start of a decode).
        """
        last = bisect_right(self.ids, sent) - 1
        first, margin = last, self.longest + 1 if self.longest else 0
        while first > 0 and self.chars[last] - self.chars[first] < margin:
            first -= 1
        return self.ids[first]
