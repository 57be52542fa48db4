"""Our own CPU kernels (``llm/kernels.cpp``), built for an instruction-set level the CPU has, the first
time a model loads.

Why: a decode step is bound by reading the weights once, and on 2 cores oneDNN's GEMM reads bfloat16
weights at a row or a few at about half the rate a plain sum of the same bytes does (docs/benchmark.md
has the measurements); on a CPU without AVX512-BF16 it cannot take bfloat16 weights at all, and the model
ran in float32, twice the bytes. The kernels read bfloat16, int8 or int4 weights at the sum's rate with
float32 sums on any x86-64 CPU with AVX2, and are as fast as oneDNN up to prompt-sized steps.

Levels, as llama.cpp builds its CPU variants (``LEVELS``, best first): ``amx`` (AMX tiles for every row count, on
AVX512-BF16's other loops), ``avx512bf16`` (vdpbf16ps), ``avx512`` (F, BW, DQ, VL) and ``avx2``
(with FMA and F16C), the last two one source that widens the weights to float32 in registers. ``load`` takes the best the CPU has, or the one the ``CPU_KERNELS``
environment variable names (``auto``, the default; a level: a lower one than the CPU's best forces that
path, as the tests do for every level the machine runs; or ``none``: oneDNN and torch only). Each level
is built with its own ``-m`` flags against the installed torch into the compile cache (inductor's
``TORCHINDUCTOR_CACHE_DIR``), under
a name that covers the sources, the level, the torch version and the CPU's flags, so a restart loads it
in milliseconds; its ops live under a namespace of its own (``torch.ops.triton_chat_avx2``, ...), so one
process can hold several. Under ``auto`` a level that fails to build gives way to the next one down (the
load log says why); where none runs (a CPU without AVX2, an Arm one, no level that builds), ``load`` says
why and the model runs on oneDNN and torch as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(name) for name in ("kernels.cpp", "kernels_amx.h", "kernels_bf16.h", "kernels_vec.h")]
SETTING = "CPU_KERNELS"
# Each level: the /proc/cpuinfo flags it needs, the compiler's flags for them, and what the load log calls it.
_AVX512 = ("avx512f", "avx512bw", "avx512dq", "avx512vl")
_BF16 = (("avx2", "fma", "f16c", *_AVX512, "avx512_bf16"), ("-mavx2", "-mfma", "-mf16c", *(f"-m{f}" for f in _AVX512), "-mavx512bf16"))
LEVELS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "amx": ((*_BF16[0], "amx_tile", "amx_bf16"), (*_BF16[1], "-mamx-tile", "-mamx-bf16"), "AMX"),
    "avx512bf16": (*_BF16, "AVX512-BF16"),
    "avx512": (("avx2", "fma", "f16c", *_AVX512), ("-mavx2", "-mfma", "-mf16c", *(f"-m{f}" for f in _AVX512)),
               "AVX-512"),
    "avx2": (("avx2", "fma", "f16c"), ("-mavx2", "-mfma", "-mf16c"), "AVX2"),
}
_lock = threading.Lock()
_loaded: set[str] = set()  # the levels whose ops this process holds
ops = None  # the chosen level's ``torch.ops`` namespace, once ``load`` found one; what traced code reads
level: str | None = None  # its name
passed_over: str | None = None  # why ``auto`` took a lower level than the CPU's best (its build failed)


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    try:
        line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def runnable() -> list[str]:
    """The levels this CPU executes, best first (none on a CPU that is not x86-64 with AVX2)."""
    flags = cpu_flags()
    return [name for name, (needs, _, _) in LEVELS.items() if flags.issuperset(needs)]


def _lacking(name: str) -> str:
    """The flags level ``name`` needs that this CPU lacks, comma-separated ("" when it has them all)."""
    return ", ".join(sorted(set(LEVELS[name][0]) - cpu_flags()))


def setting() -> str:
    """``CPU_KERNELS``: ``auto``, a level or ``none``; anything else is refused naming the variable and its values."""
    value = os.environ.get(SETTING, "auto").strip() or "auto"
    if value not in ("auto", *LEVELS, "none"):
        raise ValueError(f"{SETTING} must be auto, {', '.join(LEVELS)} or none, got {value!r}")
    return value


def describe() -> str:
    """The chosen level for the load log: ``our AVX2 kernels``."""
    if level == "amx" and not ops.tiles():
        return "our AVX512-BF16 kernels (the AMX level: Linux lent this process no AMX tiles)"
    if not level:
        return "no kernels of ours"
    return f"our {LEVELS[level][2]} kernels" + (f" ({passed_over})" if passed_over else "")


def _command(source: Path, target: Path, name: str) -> list[str]:
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    lib = cpp_extension.library_paths()[0]
    return ["g++", "-O3", *LEVELS[name][1], "-mtune=native", "-ffp-contract=fast", "-std=c++20", "-shared", "-fPIC",
            "-fopenmp", "-w", f"-DKERNELS_NAMESPACE=triton_chat_{name}",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *includes, str(source),
            "-o", str(target), f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"]


def _cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "triton_chat_kernels"


@lru_cache(maxsize=None)
def build(name: str) -> str | None:
    """Build (once per CPU, sources, level and torch) and load level ``name``: None when
    ``torch.ops.triton_chat_<name>`` is ready, its shapes known to the compiler; else why not."""
    if missing := _lacking(name):
        return f"this CPU lacks {missing}, which {LEVELS[name][2]} needs"
    if name in _loaded:  # registered once per process, whatever asks again
        return None
    parts = [path.read_bytes() for path in SOURCES] + [name.encode(), torch.__version__.encode(),
                                                       " ".join(sorted(cpu_flags())).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    folder = _cache_dir()
    target = folder / f"kernels-{name}-{key}.so"
    with _lock:
        if not target.exists():
            partial = None
            try:
                folder.mkdir(parents=True, exist_ok=True)
                # Built beside, then renamed: another process loading the same file never sees half of it.
                fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
                os.close(fd)
                subprocess.run(_command(SOURCES[0], Path(partial), name), check=True, capture_output=True, text=True,
                               encoding="utf-8", errors="replace",  # g++ quotes in UTF-8; a stub's locale may be ASCII
                               timeout=600)
                os.replace(partial, target)
            except (OSError, subprocess.SubprocessError) as e:
                if partial is not None:
                    Path(partial).unlink(missing_ok=True)
                detail = getattr(e, "stderr", None) or str(e)
                return f"building {SOURCES[0].name} for {LEVELS[name][2]} failed: {detail.strip()[-400:]}"
        torch.ops.load_library(str(target))
        _loaded.add(name)
        namespace = f"triton_chat_{name}"
        torch.library.register_fake(f"{namespace}::paged_attention",
                                    lambda q, k_cache, v_cache, slots, lengths, scale: torch.empty_like(q))
        torch.library.register_fake(f"{namespace}::bf16_linear",
                                    lambda x, packed, n, bias, float32=False: x.new_empty(
                                        x.shape[0], n, dtype=torch.float32 if float32 else x.dtype))
        torch.library.register_fake(f"{namespace}::int8_linear",
                                    lambda x, packed, scale, n, bias: x.new_empty(x.shape[0], n))
        torch.library.register_fake(f"{namespace}::int4_linear",
                                    lambda x, nibbles, scales, n, bias: x.new_empty(x.shape[0], n))
    return None


def load() -> str | None:
    """Choose the level (``CPU_KERNELS``, else the best this CPU runs) and build it: None when ``ops`` is
    ready, else why not (the model then runs on oneDNN and torch). A level forced past what the CPU runs is
    a ValueError naming the setting, the missing flags and what would work: never executed."""
    global ops, level, passed_over
    wanted, found = setting(), runnable()
    if wanted not in ("auto", "none", *found):
        raise ValueError(f"{SETTING}={wanted}: this CPU lacks {_lacking(wanted)}, "
                         f"which {LEVELS[wanted][2]} needs; set {SETTING} to auto, {' or '.join([*found, 'none'])}")
    ops, level, passed_over = None, None, None
    if wanted == "none":
        return f"{SETTING}=none"
    if not found:
        return "this CPU has no AVX2 with FMA and F16C (our kernels' lowest level)"
    failures = []  # auto goes down the levels past one that fails to build (a compiler without -mamx-tile)
    for chosen in found if wanted == "auto" else [wanted]:
        if (why := build(chosen)) is None:
            ops, level, passed_over = getattr(torch.ops, f"triton_chat_{chosen}"), chosen, "; ".join(failures) or None
            return None
        failures.append(why)
    return "; ".join(failures)


@contextlib.contextmanager
def using(name: str | None) -> Iterator[None]:
    """Level ``name`` (None: no kernels) for what is built inside, as ``CPU_KERNELS`` would choose it: for tests
    that run every level the CPU executes in one process."""
    global ops, level, passed_over
    before, saved = (ops, level, passed_over), os.environ.get(SETTING)
    try:
        os.environ[SETTING] = name or "none"
        if (why := load()) is not None and name is not None:
            raise RuntimeError(why)
        yield
    finally:
        ops, level, passed_over = before
        if saved is None:
            os.environ.pop(SETTING, None)
        else:
            os.environ[SETTING] = saved
