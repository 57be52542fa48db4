"""Text -> token ids, with the tokenizer's chat template by default."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from serving.errors import InvalidInput, decode_utf8
from serving.tokenizer import load_tokenizer, vocab_fingerprint


@dataclass(frozen=True)
class PreprocessConfig:
    """``preprocess`` config parameters."""

    tokenizer_dir: str
    max_input_bytes: int = 65536

    def __post_init__(self) -> None:
        if self.max_input_bytes < 1:
            raise ValueError(f"parameter 'max_input_bytes' must be >= 1, got {self.max_input_bytes}")


@dataclass(frozen=True)
class PromptRequest:
    """One client prompt as it arrives: raw bytes, checked here and nowhere else."""

    text_input: bytes
    system_prompt: bytes | None = None
    apply_chat_template: bool = True


class Preprocessor:
    def __init__(self, config: PreprocessConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or load_tokenizer(config.tokenizer_dir)
        self.fingerprint = vocab_fingerprint(self.tokenizer)

    def _text(self, field: str, raw: bytes, allow_empty: bool) -> str:
        limit = self.config.max_input_bytes
        if len(raw) > limit:
            raise InvalidInput(f"{field} is {len(raw)} bytes; the limit is {limit} bytes (max_input_bytes)")
        text = decode_utf8(field, raw)
        if not allow_empty and not text.strip():
            raise InvalidInput(f"{field} must not be empty")
        return text

    def encode(self, request: PromptRequest) -> list[int]:
        """Token ids for the model: a chat turn (user message, optional system prompt) or the raw text."""
        text = self._text("text_input", request.text_input, allow_empty=False)
        system = None
        if request.system_prompt is not None:
            system = self._text("system_prompt", request.system_prompt, allow_empty=True)
        if not request.apply_chat_template:
            if system:
                raise InvalidInput("system_prompt needs apply_chat_template=true")
            return self.tokenizer.encode(text, add_special_tokens=True)
        if not self.tokenizer.chat_template:
            raise InvalidInput("this tokenizer has no chat template; send apply_chat_template=false")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
