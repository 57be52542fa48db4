"""Cross-check one point with Triton's own ``perf_analyzer`` (a load generator nobody here wrote).

The ``tritonclient==2.51.0`` wheel in the venv ships ``bin/perf_analyzer``; it needs ``libb64.so.0d``
(Debian's ``libb64-0d``) and ``libcudart.so.12`` (the ``nvidia-cuda-runtime-cu12`` wheel, kept apart in
``.cache/perf_analyzer`` so it never touches the venv).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from bench.workload import Item
from launcher.paths import CACHE_DIR

CUDART = "nvidia-cuda-runtime-cu12==12.6.77"
LIBS = CACHE_DIR / "perf_analyzer"


def ensure_installed() -> dict[str, str]:
    """Install the two libraries once; returns the environment to run perf_analyzer with."""
    if not Path("/usr/lib/x86_64-linux-gnu/libb64.so.0d").exists() and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "libb64-0d"], check=True, capture_output=True)
    cudart = LIBS / "nvidia" / "cuda_runtime" / "lib"
    if not cudart.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(LIBS), CUDART],
                       check=True, capture_output=True)
    return {**os.environ, "LD_LIBRARY_PATH": f"{cudart}{os.pathsep}{os.environ.get('LD_LIBRARY_PATH', '')}"}


def measure(http_port: int, items: list[Item], concurrency: int, workdir: Path) -> dict:
    """perf_analyzer's requests/s and latency at ``concurrency`` over HTTP infer on the same prompts."""
    env = ensure_installed()
    data = workdir / "perf_analyzer_input.json"
    data.write_text(json.dumps({"data": [
        {"text_input": [item.text_input], "max_tokens": [item.max_tokens], "ignore_eos": [item.ignore_eos]}
        for item in items
    ]}))
    cmd = [
        str(Path(sys.executable).parent / "perf_analyzer"), "-m", "ensemble_infer", "-u", f"127.0.0.1:{http_port}",
        "-i", "http", "--input-data", str(data), "--concurrency-range", str(concurrency),
        "--measurement-mode", "count_windows", "--measurement-request-count", str(len(items)),
        "--stability-percentage", "50", "--max-trials", "3",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return {"error": (out.stdout + out.stderr)[-2000:], "command": " ".join(cmd)}
    throughput = re.search(r"Throughput: ([\d.]+) infer/sec", out.stdout)
    p50 = re.search(r"p50 latency: (\d+) usec", out.stdout)
    p99 = re.search(r"p99 latency: (\d+) usec", out.stdout)
    return {
        "requests_per_s": float(throughput.group(1)),
        "p50_ms": int(p50.group(1)) / 1000 if p50 else None,
        "p99_ms": int(p99.group(1)) / 1000 if p99 else None,
        "command": " ".join(cmd),
    }
