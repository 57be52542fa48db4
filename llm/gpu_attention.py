"""Attention over the paged cache on CUDA, read in place: a Triton-language kernel (Triton the GPU
compiler, not the server), the counterpart of ``llm/kernels.cpp``'s ``paged_attention`` on the CPU.

The same contract: one query token per row, attending to the first ``lengths[r]`` of its ``slots[r]``
(cache slots, position by position), the cache ``[kv_heads, slots, dim]`` read where it lies; a prompt
chunk's tokens are rows that share its slot table (a row stride of 0), each up to its own position.
One program per row and KV head: its query heads (padded to 16, the smallest ``tl.dot``) against blocks
of 64 positions, an online softmax in float32 (flash attention's), so a row of any length needs no
scratch and the step stays one graph. Registered through ``torch.library.triton_op``, so inductor
traces it into the compiled decode step, and it runs inside the CUDA graphs captured at load.

Where: CUDA devices where ``triton`` imports (the CUDA builds of torch ship it). ``load`` compiles it and
checks it once against the gathered attention on the device before the engine uses it, and says why
not otherwise; the step then gathers as before. Its arithmetic is tested on the CPU in Triton's
interpreter (``TRITON_INTERPRET=1``, tests/test_unit_gpu_attention.py); on a GPU the engine tests run it.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

BLOCK = 64  # positions a program takes at a time
ready = False  # ``load`` found the kernel right on this process's device: the traced step reads it here


@functools.cache
def op() -> Callable[..., torch.Tensor]:
    """``paged_attention(q, k_cache, v_cache, slots, lengths, scale)``; raises ImportError without triton."""
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def kernel(q, k_cache, v_cache, slots, lengths, out, scale, slot_stride, cache_slots,
               HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
               BLOCK_N: tl.constexpr):
        row, kv_head = tl.program_id(0), tl.program_id(1)
        g, d = tl.arange(0, GROUP_PAD), tl.arange(0, DIM)
        heads = kv_head * GROUP + g
        valid_head = g < GROUP
        at = (row * HEADS + heads)[:, None] * DIM + d[None, :]
        query = tl.load(q + at, mask=valid_head[:, None], other=0.0)
        length = tl.load(lengths + row)
        top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM], tl.float32)
        cache = kv_head * cache_slots * DIM
        for start in range(0, length, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            valid = n < length
            slot = tl.load(slots + row * slot_stride + n, mask=valid, other=0)
            where = cache + slot[:, None] * DIM + d[None, :]
            keys = tl.load(k_cache + where, mask=valid[:, None], other=0.0)
            scores = tl.dot(query, tl.trans(keys)) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            weights = tl.exp(scores - new_top[:, None])
            shrink = tl.exp(top - new_top)
            total = total * shrink + tl.sum(weights, 1)
            values = tl.load(v_cache + where, mask=valid[:, None], other=0.0)
            acc = acc * shrink[:, None] + tl.dot(weights.to(values.dtype), values)
            top = new_top
        result = tl.where(total[:, None] > 0, acc / tl.maximum(total, 1e-30)[:, None], 0.0)
        tl.store(out + at, result.to(out.dtype.element_ty), mask=valid_head[:, None])

    @triton_op("triton_chat_gpu::paged_attention", mutates_args=())
    def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                        lengths: torch.Tensor, scale: float) -> torch.Tensor:
        q = q.contiguous()
        slots = slots if slots.stride(1) == 1 else slots.contiguous()
        out = torch.empty_like(q)
        rows, heads, dim = q.shape
        kv_heads, cache_slots = k_cache.shape[0], k_cache.shape[1]
        group = heads // kv_heads
        wrap_triton(kernel)[(rows, kv_heads)](
            q, k_cache, v_cache, slots, lengths, out, scale, slots.stride(0), cache_slots,
            HEADS=heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), DIM=dim, BLOCK_N=BLOCK)
        return out

    return paged_attention


def load(device: torch.device, heads: int, kv_heads: int, dim: int, dtype: torch.dtype,
         reference: Callable[..., torch.Tensor]) -> str | None:
    """None when the kernel runs on ``device`` for this model's heads and gives ``reference``'s result on
    a small case (scattered slots, ragged lengths, a row of length 0); else why not. Sets ``ready``."""
    global ready
    ready = False
    if device.type != "cuda":
        return "not a CUDA device"
    if dim not in (64, 128, 256) or heads % kv_heads:
        return f"head_dim {dim} (64, 128 or 256) or {heads} heads over {kv_heads}"
    try:
        attention = op()
        generator = torch.Generator(device).manual_seed(0)
        k_cache, v_cache = (torch.randn(kv_heads, 512, dim, generator=generator, device=device).to(dtype) for _ in "kv")
        q = torch.randn(4, heads, dim, generator=generator, device=device).to(dtype)
        slots = torch.randint(0, 512, (4, 200), generator=generator, device=device)
        lengths = torch.tensor([200, 65, 1, 0], device=device)
        got = attention(q, k_cache, v_cache, slots, lengths, dim**-0.5)
        expected = reference(q.float(), k_cache.float(), v_cache.float(), slots, lengths, dim**-0.5)
        expected[lengths == 0] = 0
        torch.testing.assert_close(got.float(), expected, rtol=2**-6, atol=2e-2)
    except Exception as e:  # no triton, a compile failure, or a wrong result: gather as before, saying why
        return f"{type(e).__name__}: {str(e).strip()[:300]}"
    ready = True
    return None
