"""Install ``tritonserver`` from the ``nvidia-pytriton`` wheel, and the environment it and its stubs run in.

The wheel ships Triton 2.51 (the NGC 24.10 binary) with the Python backend and one backend stub per
Python version. We copy the tree once into ``.cache/tritonserver``, put the stub that matches this
interpreter into ``backends/python/``, and point the stub at the same libpython as the venv (otherwise it
fails with ``undefined symbol: _PyModule_Add``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from launcher.paths import COMPILE_CACHE, REPO_ROOT, TRITON_HOME


def _wheel_tree() -> tuple[Path, Path]:
    """The wheel's ``tritonserver`` folder and its bundled shared libraries."""
    import pytriton

    site = Path(pytriton.__file__).resolve().parents[1]
    return site / "pytriton" / "tritonserver", site / "nvidia_pytriton.libs"


def install_tritonserver() -> Path:
    """Copy the wheel's server tree out once and add this Python's backend stub; idempotent."""
    stamp = TRITON_HOME / ".python-stub"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if stamp.exists() and stamp.read_text() == version:
        return TRITON_HOME
    tree, _ = _wheel_tree()
    stub = tree / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    shutil.rmtree(TRITON_HOME, ignore_errors=True)
    shutil.copytree(tree, TRITON_HOME, symlinks=True)
    shutil.copy2(stub, TRITON_HOME / "backends" / "python" / stub.name)
    stamp.write_text(version)
    return TRITON_HOME


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver and its Python stubs: same libpython, venv first, project importable."""
    _, libs = _wheel_tree()
    env = dict(os.environ)
    ld_path = [sysconfig.get_config_var("LIBDIR"), str(libs)]
    if env.get("LD_LIBRARY_PATH"):
        ld_path.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(ld_path)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(COMPILE_CACHE / "inductor"))
    env.setdefault("TRITON_CACHE_DIR", str(COMPILE_CACHE / "triton"))
    env.update(extra or {})
    env.pop("ADMIN_KEY", None)  # it reaches tritonserver as an argument; the models have no use for it
    if "MODEL_DIR" in env:  # contract/folders.py: models and tokenizers load only from inside MODEL_ROOTS
        env.setdefault("MODEL_ROOTS", str(Path(env["MODEL_DIR"]).resolve().parent))
    return env


def has_gpu() -> bool:
    """True when ``nvidia-smi`` lists at least one GPU; Triton's KIND_GPU fails to load without one."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout
