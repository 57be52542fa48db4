"""Our own CPU kernels (``llm/kernels.cpp``), compiled for the CPU at hand the first time a model loads.

Why: a decode step is bound by reading the weights once, and on 2 cores oneDNN's GEMM reads bfloat16
weights at a row or a few at about half the rate a plain sum of the same bytes does (docs/benchmark.md
has the measurements). The kernel reads them at the sum's rate and is as fast as oneDNN up to
prompt-sized steps.

Where: CPUs with AVX512-BF16 (the ones ``dtype: auto`` runs in bfloat16), when a C++ compiler is there
(the image and these machines have g++). It is built with ``-march=native`` against the installed torch
into the compile cache (inductor's ``TORCHINDUCTOR_CACHE_DIR``), under a name that covers the source, the
torch version and the CPU's flags, so a restart loads it in milliseconds and another CPU builds its own.
Anywhere else, or if the build fails, ``load`` says why and the model runs on oneDNN as before.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.cpp")
_lock = threading.Lock()
loaded = False  # whether torch.ops.triton_chat_cpu is there: what traced code reads (it cannot call ``load``)


def _cpu_flags() -> str:
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


def _command(source: Path, target: Path) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib = cpp_extension.library_paths()[0]
    return ["g++", "-O3", "-march=native", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *includes, str(source),
            "-o", str(target), f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def _cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "triton_chat_kernels"


@lru_cache(maxsize=1)
def load() -> str | None:
    """Build (once per CPU, source and torch) and load the kernels: None when ``torch.ops.triton_chat_cpu``
    is ready, its shapes known to the compiler; else why not."""
    if not torch.cpu._is_avx512_bf16_supported():
        return "this CPU lacks AVX512-BF16"
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, torch.__version__.encode(), _cpu_flags().encode()])).hexdigest()[:16]
    folder = _cache_dir()
    target = folder / f"kernels-{key}.so"
    with _lock:
        if not target.exists():
            partial = None
            try:
                folder.mkdir(parents=True, exist_ok=True)
                # Built beside, then renamed: another process loading the same file never sees half of it.
                fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
                os.close(fd)
                subprocess.run(_command(SOURCE, Path(partial)), check=True, capture_output=True, text=True, timeout=600)
                os.replace(partial, target)
            except (OSError, subprocess.SubprocessError) as e:
                if partial is not None:
                    Path(partial).unlink(missing_ok=True)
                detail = getattr(e, "stderr", None) or str(e)
                return f"building {SOURCE.name} failed: {detail.strip()[-400:]}"
        torch.ops.load_library(str(target))
        torch.library.register_fake("triton_chat_cpu::paged_attention",
                                    lambda q, k_cache, v_cache, slots, lengths, scale: torch.empty_like(q))
        torch.library.register_fake("triton_chat_cpu::bf16_linear",
                                    lambda x, packed, n, bias, float32=False: x.new_empty(
                                        x.shape[0], n, dtype=torch.float32 if float32 else x.dtype))
        torch.library.register_fake("triton_chat_cpu::int8_linear",
                                    lambda x, packed, scale, n, bias: x.new_empty(x.shape[0], n))
        torch.library.register_fake("triton_chat_cpu::int4_linear",
                                    lambda x, nibbles, scales, n, bias: x.new_empty(x.shape[0], n))
    global loaded
    loaded = True
    return None
