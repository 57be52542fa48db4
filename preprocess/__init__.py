"""Text -> token ids, with the tokenizer's chat template by default."""

from __future__ import annotations

import json
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from contract.errors import InvalidInput, decode_utf8
from contract.tokenizer import load_tokenizer, vocab_fingerprint


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

    text_input: bytes | None = None
    system_prompt: bytes | None = None
    apply_chat_template: bool = True
    messages: bytes | None = None  # a whole conversation, JSON: [{"role": ..., "content": ...}, ...]


ROLES = ("system", "user", "assistant")


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
        """Token ids for the model: a conversation (``messages``), a chat turn (user message, optional
        system prompt) or the raw text."""
        if request.messages is not None:
            if request.text_input is not None or request.system_prompt is not None:
                raise InvalidInput("send either messages or text_input (with system_prompt), not both")
            if not request.apply_chat_template:
                raise InvalidInput("messages needs apply_chat_template=true")
            return self._chat(self._messages(request.messages))
        if request.text_input is None:
            raise InvalidInput("text_input is required (or messages, a whole conversation)")
        text = self._text("text_input", request.text_input, allow_empty=False)
        system = None
        if request.system_prompt is not None:
            system = self._text("system_prompt", request.system_prompt, allow_empty=True)
        if not request.apply_chat_template:
            if system:
                raise InvalidInput("system_prompt needs apply_chat_template=true")
            return self.tokenizer.encode(text, add_special_tokens=True)
        return self._chat(([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}])

    def _chat(self, messages: list[dict]) -> list[int]:
        if not self.tokenizer.chat_template:
            raise InvalidInput("this tokenizer has no chat template; send apply_chat_template=false")
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

    def _messages(self, raw: bytes) -> list[dict]:
        """The conversation, checked: a JSON list of {"role", "content"} with known roles and text content."""
        try:
            messages = json.loads(self._text("messages", raw, allow_empty=False))
        except json.JSONDecodeError as e:
            raise InvalidInput(f"messages is not valid JSON: {e}") from None
        if not isinstance(messages, list) or not messages:
            raise InvalidInput("messages must be a non-empty JSON list of {\"role\", \"content\"} objects")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or set(message) != {"role", "content"}:
                raise InvalidInput(f"messages[{i}] must be an object with exactly the keys role and content")
            if message["role"] not in ROLES:
                raise InvalidInput(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {message['role']!r}")
            if not isinstance(message["content"], str):
                raise InvalidInput(f"messages[{i}].content must be a string")
        return messages  # a system message alone is a conversation too (OpenAI answers it)
