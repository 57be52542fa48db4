"""Model and tokenizer folders come only from the operator's ``MODEL_ROOTS``.

Requests never carry paths; folders come from config parameters, which only the (restricted) repository
API can change. ``MODEL_ROOTS`` bounds even that: a folder outside every root, symlinks resolved, fails
the load with a message that names the parameter. The launcher and the image always set it (the
launcher defaults it to the folder that holds ``MODEL_DIR``); unset, nothing is enforced.
"""

from __future__ import annotations

import os
from pathlib import Path


# What a model folder holds as weights: Hugging Face's files, or a GGUF file linked in as ``GGUF_NAME``
# (the launcher does it, launcher/model_folder.py; llm reads it, llm/gguf_weights.py).
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
GGUF_NAME = "model.gguf"


def model_roots() -> list[Path]:
    return [Path(root).resolve() for root in os.environ.get("MODEL_ROOTS", "").split(os.pathsep) if root]


def allowed_folder(parameter: str, folder: str) -> Path:
    """``folder`` resolved, when it is absolute and lies inside one of ``MODEL_ROOTS`` (a relative one would
    depend on the server's working directory)."""
    if not Path(folder).is_absolute():
        raise ValueError(f"parameter '{parameter}': {folder} is a relative path; give an absolute one")
    path, roots = Path(folder).resolve(), model_roots()
    if roots and not any(path.is_relative_to(root) for root in roots):
        raise ValueError(
            f"parameter '{parameter}': {folder} is outside MODEL_ROOTS ({os.pathsep.join(map(str, roots))})"
        )
    return path
