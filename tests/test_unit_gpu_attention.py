"""``llm/gpu_attention.py``'s Triton-language kernel, run on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is imported, so in a process of its own) against the gathered
attention of ``llm/model.py``: decode rows and a prompt chunk's rows, grouped heads, ragged lengths.

The interpreter computes in numpy, which has no bfloat16: the kernel's arithmetic is checked in float32
and float16 here; on a GPU, ``gpu_attention.load`` checks it in the model's dtype before the engine uses
it, and the engine's tests run it there."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from launcher.paths import REPO_ROOT
from llm import gpu_attention

CHECK = r"""
import torch
from llm import gpu_attention, kernels, model as M
kernels.ops = None  # the reference: the gathered attention
torch.manual_seed(0)
attention = gpu_attention.op()
for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
    for heads, kv_heads, dim in ((9, 3, 64), (8, 8, 128), (32, 8, 64)):
        k, v = (torch.randn(kv_heads, 600, dim).to(dtype) for _ in "kv")
        q = torch.randn(5, heads, dim).to(dtype)
        slots, lengths = torch.randint(0, 600, (5, 150)), torch.tensor([150, 64, 65, 1, 0])
        got = attention(q, k, v, slots, lengths, dim**-0.5)
        expected = M.decode_attention(q.float(), k.float(), v.float(), slots, lengths, dim**-0.5)
        expected[lengths == 0] = 0
        torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
        # A prompt chunk: 30 tokens at positions 70.. of one sequence, rows sharing its slot table.
        table, positions = torch.randperm(600)[:100], 70 + torch.arange(30)
        q = torch.randn(30, heads, dim).to(dtype)
        got = attention(q, k, v, table.expand(30, -1), positions + 1, dim**-0.5)
        expected = M.decode_attention(q.float(), k.float(), v.float(), table.expand(30, -1).contiguous(), positions + 1, dim**-0.5)
        torch.testing.assert_close(got.float(), expected, rtol=tolerance, atol=tolerance)
print("ok")
"""


def test_the_kernel_gives_the_gathered_attention_in_the_interpreter():
    pytest.importorskip("triton")  # requirements-test.txt installs it; a CPU torch does not bring it
    result = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def test_off_cuda_the_engine_gathers_and_says_why():
    reason = gpu_attention.load(torch.device("cpu"), 9, 3, 64, torch.bfloat16, lambda *_: None)
    assert reason == "not a CUDA device" and not gpu_attention.ready
