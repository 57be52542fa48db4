"""Generated token ids -> text, paired with the tokenizer that encoded the prompt, streamed or whole."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from serving.errors import InvalidInput
from serving.stops import visible_text
from serving.tokenizer import decode_text, load_tokenizer, vocab_fingerprint


@dataclass(frozen=True)
class PostprocessConfig:
    """``postprocess`` config parameters."""

    tokenizer_dir: str


@dataclass(frozen=True)
class Chunk:
    """One llm response: every id so far, how many an earlier response already covered, and whether
    this is the last one."""

    output_ids: list[int]
    sent_tokens: int
    finished: bool
    stop: tuple[str, ...] = ()


class Detokenizer:
    def __init__(self, config: PostprocessConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer_dir)
        self.fingerprint = vocab_fingerprint(self.tokenizer)
        self.vocab_size = len(self.tokenizer)

    def check(self, tokenizer_fingerprint: str) -> None:
        if tokenizer_fingerprint != self.fingerprint:
            raise InvalidInput(
                f"tokenizer_fingerprint {tokenizer_fingerprint!r} does not match postprocess's tokenizer "
                f"({self.fingerprint!r}): load preprocess and postprocess with the same tokenizer vocabulary"
            )

    def text(self, chunk: Chunk) -> str:
        """The text this response adds to the reply (the whole reply when nothing was sent before).

        Stateless incremental detokenization: the text visible after all ids minus the text that was
        visible after the ids already sent. Visible text never ends inside a UTF-8 character or in a
        tail that could still become a stop string, so chunks are always valid UTF-8, never leak a stop
        string, and add up to exactly the text of a non-streamed reply.
        """
        ids = chunk.output_ids
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidInput(f"output_ids holds id {bad[0]}, outside the tokenizer vocabulary of {self.vocab_size}")
        if not 0 <= chunk.sent_tokens <= len(ids):
            raise InvalidInput(f"sent_tokens must be in [0, {len(ids)}], got {chunk.sent_tokens}")
        now = visible_text(decode_text(self.tokenizer, ids), chunk.stop, chunk.finished)
        if chunk.sent_tokens == 0:
            return now
        before = visible_text(decode_text(self.tokenizer, ids[: chunk.sent_tokens]), chunk.stop, final=False)
        return now[len(before):]
