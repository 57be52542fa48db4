"""Variants of the model repository that benchmarks and tests serve: ``ensemble_repo`` with llm changed."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from launcher.paths import MODEL_REPOSITORY


def repository_variant(target: Path, edit_llm_config: Callable[[str], str], llm_model: Path | None = None) -> Path:
    """``ensemble_repo`` at ``target`` with llm's configs (GPU and CPU) edited and, if given, its ``model.py``
    replaced; every other model is a symlink to the original (benchmarks and tests run such variants)."""
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for model in MODEL_REPOSITORY.iterdir():
        if model.is_dir() and model.name != "llm":
            (target / model.name).symlink_to(model)
    llm = target / "llm"
    (llm / "configs").mkdir(parents=True)
    for config in ("config.pbtxt", "configs/cpu.pbtxt"):
        (llm / config).write_text(edit_llm_config((MODEL_REPOSITORY / "llm" / config).read_text()))
    if llm_model is None:
        (llm / "1").symlink_to(MODEL_REPOSITORY / "llm" / "1")
    else:
        (llm / "1").mkdir()
        shutil.copy2(llm_model, llm / "1" / "model.py")
    return target
