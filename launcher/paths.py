"""Where the project's files live: the repository, the model repository Triton loads, and the cache
(``CHAT_CACHE_DIR``, default ``.cache/``) that holds the Triton install, the models and the compile cache."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODEL_REPOSITORY = REPO_ROOT / "ensemble_repo"
CACHE_DIR = Path(os.environ.get("CHAT_CACHE_DIR", REPO_ROOT / ".cache"))
TRITON_HOME = CACHE_DIR / "tritonserver"
# llm's compiled forward pass: inductor's code and Triton's GPU kernels, compiled by the first start and
# loaded by every later one. The image keeps the same folder (/opt/chat/cache/compile) in a volume.
COMPILE_CACHE = CACHE_DIR / "compile"
