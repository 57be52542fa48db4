"""Reasoning kept apart from the answer: models whose chat templates think in ``<think>...</think>``
(Qwen3, SmolLM3, DeepSeek-R1 distills) write their thinking first, and a client wants it beside the
answer, never inside it (vLLM's and SGLang's ``reasoning_content``).

Where a reply begins depends on the prompt, so preprocess, which renders it, decides (``state_of``) and
the decision comes back with every response (``reasoning_state``): ``inside`` when the prompt ends inside
an open ``<think>`` (DeepSeek-R1's template, Qwen3's with thinking on), ``outside`` when the template
thinks but the prompt closed the block (Qwen3's ``enable_thinking: false``) or never opened one (the reply
may open its own), and ``""`` for a template that never thinks or a raw prompt: that reply is not split.

The pipeline's ``text_output`` stays what the model wrote. Whoever reads a whole reply splits it
(``split``); whoever reads a stream keeps a ``Splitter`` per reply, as vLLM's reasoning parsers run in
its API server: splitting needs the whole reply so far (was ``</think>`` written, where did the reply
start), which the response that carries a piece of it does not have.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
INSIDE, OUTSIDE, NONE = "inside", "outside", ""
STATES = (INSIDE, OUTSIDE, NONE)


def thinks(chat_template: object) -> bool:
    """Whether a chat template is a thinking model's: it writes or strips ``</think>`` blocks."""
    return CLOSE in str(chat_template or "")


def state_of(prompt: str, template_thinks: bool) -> str:
    """Where a reply to the rendered ``prompt`` begins: inside thinking (the prompt's last ``<think>`` is
    still open), outside it, or not split at all (a template that never thinks)."""
    if not template_thinks:
        return NONE
    return INSIDE if prompt.rfind(OPEN) > prompt.rfind(CLOSE) else OUTSIDE


@dataclass(frozen=True)
class Split:
    """A reply's text so far as its reasoning and its answer."""

    reasoning: str
    content: str


def split(text: str, state: str, finished: bool) -> Split:
    """``text`` (the reply so far, ``finished`` or not) as its reasoning and its answer. The markers and
    the whitespace around them belong to neither; a reply that ends while thinking (``max_tokens``) is all
    reasoning, as vLLM returns it. While a reply runs, a tail that may be the start of a marker (or
    whitespace that may precede ``</think>``) is held back, so what was shown is never taken back."""
    if state == NONE:
        return Split("", text)
    start = 0
    if state == OUTSIDE:
        body = text.lstrip()
        if body.startswith(OPEN):
            start = len(text) - len(body) + len(OPEN)
        elif not finished and OPEN.startswith(body):
            return Split("", "")  # nothing yet, or the start of <think>
        else:
            return Split("", text)
    end = text.find(CLOSE, start)
    if end >= 0:
        return Split(text[start:end].strip(), text[end + len(CLOSE):].lstrip())
    if finished:
        return Split(text[start:].strip(), "")
    return Split(text[start:len(text) - _marker_start(text, CLOSE)].strip(), "")


class Splitter:
    """One streamed reply's pieces as the reasoning and the answer each adds: the split of the reply so
    far minus what earlier pieces showed, so the pieces add up to the whole reply's split."""

    def __init__(self) -> None:
        self.text = ""
        self.shown = Split("", "")

    def feed(self, text: str, state: str, finished: bool) -> tuple[str, str]:
        """The reasoning and the answer that ``text``, the reply's next piece, adds."""
        if state == NONE:  # nothing to split, nothing to keep
            return "", text
        self.text += text
        now = split(self.text, state, finished)
        added = now.reasoning[len(self.shown.reasoning):], now.content[len(self.shown.content):]
        self.shown = now
        return added


def _marker_start(text: str, marker: str) -> int:
    """The length of the longest tail of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
