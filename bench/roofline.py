"""This machine's measured peak, per dtype: GEMM FLOP/s and memory bandwidth.

A decode step at batch b reads every weight once plus each row's keys and values, and does 2 x params
FLOPs per row, so its time is at least max((weight_bytes + b x context x kv_bytes) / bandwidth,
2 x params x b / peak_flops), and tokens/s is at most b / that. Weights and cache are counted in the dtype
the system actually runs.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from llm import kernels


@dataclass(frozen=True)
class Roofline:
    dtype: str
    peak_flops: float  # FLOP/s, best of square GEMMs in this dtype
    bandwidth: float  # bytes/s, best multi-GiB read
    params: int
    weight_bytes: int  # params in this dtype
    kv_bytes_per_token: int  # keys and values of one position, every layer, in this dtype

    def tokens_per_s(self, batch: int, context: float) -> float:
        """The bound at ``batch`` rows attending to ``context`` positions each on average."""
        bytes_per_step = self.weight_bytes + batch * context * self.kv_bytes_per_token
        step = max(bytes_per_step / self.bandwidth, 2 * self.params * batch / self.peak_flops)
        return batch / step

    def as_dict(self) -> dict:
        return asdict(self) | {"ridge_batch": self.peak_flops * self.weight_bytes / (2 * self.params * self.bandwidth)}


def engine_dtype(dtype: str, weights: str) -> str:
    """The engine's points' dtype (and roofline's name): ``dtype`` alone where the weights are stored in it
    (``weights: auto``), else both, so the roofline counts the bytes a step really reads (``LLM.weight_bytes``:
    on CPUs without native bfloat16, float32 activations over bfloat16 weights read half float32's)."""
    return dtype if weights == "auto" else f"{dtype}, {weights} weights"


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peak_flops(dtype: torch.dtype, device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n product in ``dtype`` as the engine computes it: bfloat16 on a CPU through our
    kernel where it runs (torch's own bfloat16 GEMM is emulated on CPUs without AVX512-BF16, hundreds of
    times slower than what the engine runs), else torch's ``@``."""
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cpu" and dtype == torch.bfloat16 and kernels.load() is None:
        packed = kernels.ops.bf16_pack(b)
        return 2 * n**3 / _best(lambda: kernels.ops.bf16_linear(a, packed, n, None, False), repeats)
    return 2 * n**3 / _best(lambda: (a @ b, sync()), repeats)


def bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 5) -> float:
    """Bytes/s of a full read of a ``gib`` GiB buffer (a sum: one read, almost no writes)."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return gib * 2**30 / _best(lambda: (x.sum(), sync()), repeats)


def measure(params: int, kv_values_per_token: int, dtypes: list[torch.dtype], device: torch.device,
            quick: bool) -> dict[str, Roofline]:
    """One roofline per dtype for a model of ``params`` parameters whose cache holds
    ``kv_values_per_token`` values per position."""
    read = bandwidth(device, gib=1.0 if quick else 2.0, repeats=3 if quick else 8)
    return {
        str(dtype).removeprefix("torch."): Roofline(
            str(dtype).removeprefix("torch."), peak_flops(dtype, device, repeats=3 if quick else 8), read, params,
            params * dtype.itemsize, kv_values_per_token * dtype.itemsize,
        )
        for dtype in dtypes
    }
