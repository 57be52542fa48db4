"""Load a Hugging Face tokenizer from a local folder, and fingerprint its vocabulary.

``preprocess`` and ``postprocess`` load their tokenizers independently (so either can be swapped). The
fingerprint travels with every request from one to the other, so a pair that would decode ids with a
different vocabulary than it encoded them fails loudly instead of returning garbage. A new chat template
or system prompt keeps the vocabulary, and so the fingerprint.
"""

from __future__ import annotations

import hashlib
import json

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from contract.folders import allowed_folder


def load_tokenizer(folder: str, parameter: str = "tokenizer_dir") -> PreTrainedTokenizerBase:
    """The tokenizer in ``folder`` (the config ``parameter`` that named it, for errors)."""
    path = allowed_folder(parameter, folder)
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        raise ValueError(f"parameter '{parameter}': {folder} holds no Hugging Face tokenizer")
    # Local folders only, and no code from the folder is ever executed.
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


def vocab_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Short hash of the id -> token mapping (added tokens included), independent of templates."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def decode_text(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Text of generated ids, decoded the same way wherever it is needed (llm's stop strings, postprocess).

    Special tokens are dropped. Spaces stay as generated: cleaning them up (" ," -> ",") would rewrite
    earlier text when a later token arrives, so streamed chunks would no longer add up to the reply.
    """
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
