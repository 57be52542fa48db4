"""Generated token ids -> text, paired with the tokenizer that encoded the prompt."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from serving.errors import InvalidInput
from serving.tokenizer import load_tokenizer, vocab_fingerprint


@dataclass(frozen=True)
class PostprocessConfig:
    """``postprocess`` config parameters."""

    tokenizer_dir: str


class Detokenizer:
    def __init__(self, config: PostprocessConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer_dir)
        self.fingerprint = vocab_fingerprint(self.tokenizer)
        self.vocab_size = len(self.tokenizer)

    def decode(self, output_ids: list[int], tokenizer_fingerprint: str) -> str:
        """Text of the generated ids alone (``llm`` returns no prompt ids), without special tokens.

        A reply cut by ``max_tokens`` can end inside a multi-byte character, which byte-level BPE decodes
        to U+FFFD; that partial tail is dropped so the text is always complete UTF-8 (a U+FFFD the model
        really generated at the very end goes with it, which no reader will miss).
        """
        if tokenizer_fingerprint != self.fingerprint:
            raise InvalidInput(
                f"tokenizer_fingerprint {tokenizer_fingerprint!r} does not match postprocess's tokenizer "
                f"({self.fingerprint!r}): load preprocess and postprocess with the same tokenizer vocabulary"
            )
        bad = [i for i in output_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise InvalidInput(f"output_ids holds id {bad[0]}, outside the tokenizer vocabulary of {self.vocab_size}")
        return self.tokenizer.decode(output_ids, skip_special_tokens=True).rstrip("\ufffd")
