"""Quantized linear layers: the ``weights`` setting's ``int8`` and ``int4`` (CPUs), and ``fp8`` (CUDA).

Why: a decode step reads every weight once, so at a row or a few its time is the weights' bytes over the
machine's read bandwidth. int8 takes half of bfloat16's bytes, int4 with its group scales about 0.3 of
them. Only the weights are quantized; activations, sums and the KV cache stay in the model's dtype, and
the embeddings and output layer keep it too (``model.Head`` picks float32's greedy token from them).

- ``int8``: symmetric, one scale per output row: ``w ~ q x scale``, q in [-127, 127].
- ``int4``: one scale and offset per ``GROUP`` input columns of each output row, ``w ~ (q - 8) x scale +
  zero`` with q in [0, 15]: GGUF's Q4_1 layout (``w = d q + m``, so ``scale = d``, ``zero = m + 8 d``),
  which is also what torch's int4 kernels take.
- ``fp8``: float8 e4m3 weights with one float32 scale per output row, each row's largest magnitude at
  448 (e4m3's largest). On GPUs of compute capability 8.9 and up (Ada, H100, H200) the activations are
  quantized the same way per row at each step and ``torch._scaled_mm`` multiplies in fp8 with float32
  sums (vLLM's and TensorRT-LLM's per-token, per-channel fp8); elsewhere the weights are de-quantized to
  the model's dtype in the step (weight-only: the bytes read are fp8's, the arithmetic 16-bit).

The matmuls, on any CPU with AVX2 (``llm/kernels.py``'s levels; x in bfloat16, or float32 where ``dtype: auto``
keeps float32 activations), run our kernels (``llm/kernels.cpp``): ``int8_linear`` (the bf16 kernel's packed
order; on AVX512-BF16 the int8 weights widened exactly to bfloat16, in registers for a few rows, into L1 once
for more; on AVX-512 and AVX2 multiplied in integers against x quantized per 32 columns to int8, as llama.cpp's
Q8_0 x Q8_0 dot product) and ``int4_linear`` (Q4_1's own arithmetic, ``d q + m`` with d and m in float16 as a
GGUF holds them: on AVX512-BF16 the nibbles widened to bfloat16 through a table in registers; on AVX-512 and
AVX2 multiplied in integers against x quantized the same way, as llama.cpp's Q4_1 x Q8_1 dot product).
Elsewhere (``CPU_KERNELS=none``, CPUs without AVX2) torch's ``aten._weight_int8pack_mm`` and
``aten._weight_int4pack_mm_for_cpu``, whose int4 scales are in the model's dtype. docs/configuration.md has the kernels' measurements.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from llm import kernels

SETTINGS = ("auto", "bf16", "f32", "int8", "int4", "fp8")
QUANTIZED = ("int8", "int4", "fp8")
GROUP = 32  # int4's input columns per scale: Q4_0 and Q4_1's block
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_ALIGN = 16  # torch._scaled_mm's K and N must be multiples of 16


def check(setting: str, device: torch.device) -> None:
    """A setting this device runs, or a ValueError naming what would work (``LLMConfig`` checks the name).
    int8 and int4 run on CPUs: on GPUs their kernels have not run here yet, and nothing is served in a
    precision that has not been checked. fp8 runs on CUDA GPUs."""
    if setting in ("int8", "int4") and device.type != "cpu":
        raise ValueError(f"parameter 'weights': {setting} runs on CPUs only so far; on {device.type} use fp8, bf16 or auto")
    if setting == "fp8" and device.type != "cuda":
        raise ValueError(f"parameter 'weights': fp8 runs on CUDA GPUs; on {device.type} use int8, int4, bf16 or auto")


def fp8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] (or activations [M, K]) as float8 e4m3 and float32 scales [N], each row's largest
    magnitude at e4m3's largest."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_scaled(device: torch.device) -> bool:
    """Whether ``device`` multiplies in fp8 (``torch._scaled_mm``): CUDA compute capability 8.9 and up."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def int8_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [N, K] as int8 [N, K] and float32 scales [N], each row's largest magnitude at 127."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int4(NamedTuple):
    """Group-wise 4-bit weights [N, K]: q (int32 in [0, 15]) [N, K], scale and zero [N, K / group] (float32),
    ``w = (q - 8) x scale + zero``. Made by ``int4_weights``, or read as they are from a GGUF file's 4-bit
    blocks (``llm/gguf_weights.py``)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weights these stand for."""
        n, k = self.q.shape
        groups = self.scale.shape[1]
        return ((self.q.view(n, groups, k // groups).float() - 8) * self.scale[..., None]
                + self.zero[..., None]).view(n, k)

    @staticmethod
    def cat(parts: "list[Int4]") -> "Int4":
        """Stacked by output rows, as ``torch.cat`` stacks weights (the q, k and v projections as one)."""
        return Int4(*(torch.cat(column) for column in zip(*parts)))


def int4_weights(w: torch.Tensor, group: int = GROUP) -> Int4:
    """``w`` [N, K] in groups of ``group`` input columns: each group's minimum and maximum map to q = 0 and
    15, as llama.cpp's Q4_1 quantizer does."""
    n, k = w.shape
    g = w.detach().float().view(n, k // group, group)
    low, high = g.amin(-1), g.amax(-1)
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((g - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    return Int4(q, scale, low + 8 * scale)


def check_shape(setting: str, name: str, w: torch.Tensor) -> None:
    """A layer ``setting`` can quantize, or a ValueError naming it, its width and what would work."""
    if setting == "int4" and w.shape[1] % GROUP:
        raise ValueError(f"parameter 'weights': int4 takes groups of {GROUP} input columns, and {name} has "
                         f"{w.shape[1]}; use int8, bf16 or auto for this model")
    if setting == "fp8" and (w.shape[0] % FP8_ALIGN or w.shape[1] % FP8_ALIGN) and fp8_scaled(w.device):
        raise ValueError(f"parameter 'weights': fp8 multiplies matrices whose sides are multiples of {FP8_ALIGN}, "
                         f"and {name} is {w.shape[0]} x {w.shape[1]}; use bf16 or auto for this model")


class QuantizedLinear(torch.nn.Module):
    """``x @ w.T (+ bias)`` from quantized weights, ``x`` in the model's dtype."""

    def __init__(self, setting: str, weight: torch.Tensor | Int4, bias: torch.Tensor | None, dtype: torch.dtype,
                 scaled: bool | None = None) -> None:
        """``weight``: the layer's weights in ``dtype``, quantized here, or int4 ones already (a GGUF's).
        ``scaled``: fp8 through ``torch._scaled_mm`` (default: where the device has it; tests set it)."""
        super().__init__()
        if isinstance(weight, Int4):
            assert setting == "int4", setting
            ready, weight = weight, weight.q
        else:
            ready = None
        self.setting, self.out_features = setting, weight.shape[0]
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        # Our int8 and int4 kernels where the bf16 one runs (llm/model.py's ``_ours``): AVX2 or better, x in
        # bfloat16 or float32 (rounded to bfloat16 on the AVX512-BF16 level, which multiplies that).
        self.ours = (setting in ("int8", "int4") and weight.device.type == "cpu"
                     and dtype in (torch.bfloat16, torch.float32) and kernels.load() is None)
        self.op = (kernels.ops.int8_linear if setting == "int8" else kernels.ops.int4_linear) if self.ours else None
        if self.ours and setting == "int8":
            q, scale = int8_weights(weight)
            self.q = torch.nn.Parameter(kernels.ops.int8_pack(q), requires_grad=False)
            self.scales = torch.nn.Parameter(scale, requires_grad=False)
            if bias is not None:
                self.bias = torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        elif setting == "int8":
            q, scale = int8_weights(weight)
            self.q = torch.nn.Parameter(q, requires_grad=False)
            self.scales = torch.nn.Parameter(scale.to(dtype), requires_grad=False)
        elif setting == "fp8":
            self.scaled = fp8_scaled(weight.device) if scaled is None else scaled
            q, scale = fp8_weights(weight)
            self.q = torch.nn.Parameter(q, requires_grad=False)
            self.scales = torch.nn.Parameter(scale if self.scaled else scale.to(dtype), requires_grad=False)
        elif self.ours:  # Q4_1's own arithmetic, w = d q + m, d and m in float16 as a GGUF holds them
            q, scale, zero = ready or int4_weights(weight)
            packed = kernels.ops.int4_pack(q, scale, zero - 8 * scale)
            self.q, self.scales = (torch.nn.Parameter(t, requires_grad=False) for t in packed)
            if bias is not None:
                self.bias = torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        else:
            q, scale, zero = ready or int4_weights(weight)
            self.group = GROUP
            self.q = torch.nn.Parameter(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), requires_grad=False)
            # [K / group, N, 2]: each group's scale and zero, as the kernel reads them: in ``dtype``, which
            # is all it takes (a GGUF's float16 scales lose 3 bits of their 11 in bfloat16).
            self.scales = torch.nn.Parameter(torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(dtype),
                                             requires_grad=False)

    def kernel(self) -> str:
        """What multiplies, for the load log."""
        if self.ours:
            return kernels.describe()
        if self.setting == "fp8":
            return "torch._scaled_mm (fp8 activations too)" if self.scaled else "fp8 weights widened in the step"
        return "torch weight-only kernels"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours:  # int8's scales are per row, int4's its packed d and m
            return self.op(x, self.q, self.scales, self.out_features, self.bias)
        if self.setting == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.scales)
        elif self.setting == "fp8" and self.scaled:  # both in fp8, float32 sums, each side's row scales after
            xq, xs = fp8_weights(x)
            return torch._scaled_mm(xq, self.q.t(), scale_a=xs[:, None], scale_b=self.scales[None, :],
                                    bias=self.bias, out_dtype=x.dtype)
        elif self.setting == "fp8":
            y = F.linear(x, self.q.to(x.dtype) * self.scales[:, None])
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.q, self.group, self.scales)
        return y if self.bias is None else y + self.bias
