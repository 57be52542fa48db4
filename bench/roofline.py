"""This machine's measured peak: GEMM FLOP/s in the model's dtype and memory bandwidth.

Decode step at batch b reads every weight once and does 2 x params FLOPs per row, so its time is at
least max(weight_bytes / bandwidth, 2 x params x b / peak_flops); tokens/s <= b / that.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Roofline:
    peak_flops: float  # FLOP/s, best of square GEMMs
    bandwidth: float  # bytes/s, best multi-GiB read
    params: int
    weight_bytes: int

    def tokens_per_s(self, batch: int) -> float:
        step = max(self.weight_bytes / self.bandwidth, 2 * self.params * batch / self.peak_flops)
        return batch / step

    def as_dict(self) -> dict:
        return asdict(self) | {"ridge_batch": self.peak_flops * self.weight_bytes / (2 * self.params * self.bandwidth)}


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def peak_flops(dtype: torch.dtype, device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return 2 * n**3 / _best(lambda: (a @ b, sync()), repeats)


def bandwidth(device: torch.device, gib: float = 2.0, repeats: int = 5) -> float:
    """Bytes/s of a full read of a ``gib`` GiB buffer (a sum: one read, almost no writes)."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    return gib * 2**30 / _best(lambda: (x.sum(), sync()), repeats)


def measure(model: torch.nn.Module, device: torch.device, quick: bool) -> Roofline:
    dtype = next(model.parameters()).dtype
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return Roofline(
        peak_flops(dtype, device, repeats=3 if quick else 8),
        bandwidth(device, gib=1.0 if quick else 2.0, repeats=3 if quick else 8),
        params, weight_bytes,
    )
