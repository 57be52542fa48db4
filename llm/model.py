"""The forward pass the engine runs: a Llama-family decoder over one flat batch of tokens.

Why not the Hugging Face module: its forward pads every row to the batch's longest, grows a
``DynamicCache`` with ``torch.cat`` every step and dispatches hundreds of small ops per step from Python,
which on a 135M model costs more than the arithmetic. Here, as in vLLM and nano-vllm:

- a step is one flat batch of tokens: each running row's next token and chunks of prompts, side by side,
  so the weight GEMMs see every token of the step at once and nothing is padded;
- keys and values go straight into a paged cache allocated once (``slots`` per layer, see ``llm/kv.py``),
  written in place at each token's slot;
- a decode step (one token per row) is one compiled graph, attention included, so on GPUs it replays as
  one CUDA graph; in a mixed step (decode rows and prompt chunks) the chunks attend in
  ``mixed_attention``, an opaque op, since their shapes vary too much to compile well; on GPUs the decode
  rows too, so that only the step's token count shapes the compiled graph (``llm/shapes.py``).

transformers still loads the weights and config, and computes the rotary tables for every RoPE variant.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from llm import gpu_attention, kernels, quant

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")  # Llama-shaped decoders: RMSNorm, RoPE, GQA, SwiGLU


@dataclass
class PrefillChunk:
    """Prompt tokens ``[first, first + count)`` of a mixed step, at positions ``[start, start + count)`` of
    one sequence whose cache slots (from position 0) are ``slots``."""

    first: int
    count: int
    start: int
    slots: torch.Tensor


@dataclass
class MixedStep:
    """What ``mixed_attention`` reads (kept out of the compiled graph's inputs, whose shapes it would
    multiply): the prompt chunks, and, when the graph leaves them to it, the decode rows (the first
    ``len(decode_slots)`` tokens) over ``decode_slots`` up to ``decode_lengths``."""

    decode_slots: torch.Tensor | None = None
    decode_lengths: torch.Tensor | None = None
    chunks: list[PrefillChunk] = field(default_factory=list)


class Context:
    """What one ``Decoder``'s own operators read outside its compiled graph: its oneDNN-packed weights,
    and the layout of the mixed step about to run, which the runner sets before each one (nano-vllm's
    ``Context``, owned by its decoder instead of a module global). An operator takes no Python object, so
    the graph names a context by a small integer, ``key``; the table that finds it holds it weakly, and
    the context and its weights go with their decoder."""

    _by_key: "weakref.WeakValueDictionary[int, Context]" = weakref.WeakValueDictionary()

    def __init__(self) -> None:
        self.key = next(k for k in itertools.count() if k not in Context._by_key)
        Context._by_key[self.key] = self
        self.packed: list[torch.Tensor] = []  # named by index in the compiled graph
        self.head: torch.Tensor | None = None  # the output layer's float32 weight, where ``Head`` re-scores
        self.step = MixedStep()

    @staticmethod
    def of(key: int) -> "Context":
        return Context._by_key[key]

    def pack(self, weight: torch.Tensor) -> int:
        """``weight`` packed by oneDNN for this CPU; its index."""
        self.packed.append(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16))
        return len(self.packed) - 1


# The two steps the compiled graph calls out to, as operators of our own. Registered with torch.library's
# plain API: a call costs ~10 us of dispatch against ~25 us for torch.library.custom_op, and a step makes
# four per layer.
_LIBRARY = torch.library.Library("triton_chat", "DEF")
_LIBRARY.define("mixed_attention(Tensor q, Tensor k_cache, Tensor v_cache, int context) -> Tensor")
_LIBRARY.define("packed_linear(Tensor x, int context, int index, int out_features, Tensor? bias) -> Tensor")
_LIBRARY.define("settled_logits(Tensor logits, Tensor h, Tensor unsure, int context) -> Tensor")


def mixed_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context: int) -> torch.Tensor:
    """Attention of a mixed step as its decoder's ``Context.step`` describes it: the decode rows over
    their contexts, then each prompt chunk, causally, over its sequence's cached keys and values.

    ``q`` is ``[tokens, heads, head_dim]``; keys and values are already in the cache. In place
    (``_in_place``) every token is a row of ``paged_attention``, which reads the cache where it lies: a
    chunk's tokens share its slot table, each up to its own position (1.0 to 3.8x faster than the
    gathered attention below, measured on 2 cores; docs/benchmark.md). Elsewhere a chunk's keys and values
    are gathered, and the query heads that share a KV head are laid out as extra query rows
    (``[kv_heads, count x group, head_dim]``), which PyTorch's CPU kernels run 4-5x faster than ``enable_gqa``.
    """
    out = torch.zeros_like(q)  # padding tokens get zeros: finite, whatever they feed
    heads, kv_heads, dim = q.shape[1], k_cache.shape[0], q.shape[2]
    group = heads // kv_heads
    step = Context.of(context).step
    if step.decode_slots is not None:
        rows = step.decode_slots.shape[0]
        out[:rows] = decode_attention(q[:rows], k_cache, v_cache, step.decode_slots, step.decode_lengths, dim**-0.5)
    for c in step.chunks:
        rows = slice(c.first, c.first + c.count)
        if _in_place(q):  # each token of the chunk a row over its sequence's slots, up to itself
            lengths = c.start + 1 + torch.arange(c.count, device=q.device)
            out[rows] = paged_attention(q[rows], k_cache, v_cache, c.slots.expand(c.count, -1), lengths, dim**-0.5)
            continue
        keys = k_cache.index_select(1, c.slots).unsqueeze(0)  # [1, kv_heads, context, dim]
        values = v_cache.index_select(1, c.slots).unsqueeze(0)
        query = q[rows].view(c.count, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, c.count * group, dim)
        position = c.start + torch.arange(c.count, device=q.device).repeat_interleave(group)
        mask = torch.arange(keys.shape[2], device=q.device)[None, :] <= position[:, None]
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
        out[rows] = o.view(kv_heads, c.count, group, dim).permute(1, 0, 2, 3).reshape(c.count, heads, dim)
    return out


def packed_linear(x: torch.Tensor, context: int, index: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with a weight oneDNN packed once for this CPU (1.2-2x faster than
    ``F.linear`` in bf16 on 2 cores). An opaque op, so the packed weight never enters the compiled
    graph, which stays cacheable (inductor's own ``freezing`` packs too, but then nothing is cached)."""
    return torch.ops.mkldnn._linear_pointwise(x, Context.of(context).packed[index], bias, "none", [], "")


def settled_logits(logits: torch.Tensor, h: torch.Tensor, unsure: torch.Tensor, context: int) -> torch.Tensor:
    """``logits`` with the rows ``unsure`` marks computed whole in float32 (``Head`` says when): rare, so
    out of the compiled graph. A copy, as an operator's output must be."""
    logits = logits.clone()
    if unsure.any():
        rows = unsure.nonzero().squeeze(1)
        logits[rows] = F.linear(h[rows], Context.of(context).head)
    return logits


_LIBRARY.impl("mixed_attention", mixed_attention, "CompositeExplicitAutograd")
_LIBRARY.impl("settled_logits", settled_logits, "CPU")
_LIBRARY.impl("packed_linear", packed_linear, "CPU")
torch.library.register_fake("triton_chat::mixed_attention", lambda q, k_cache, v_cache, context: torch.empty_like(q),
                            lib=_LIBRARY)
torch.library.register_fake("triton_chat::settled_logits", lambda logits, h, unsure, context: torch.empty_like(logits),
                            lib=_LIBRARY)
torch.library.register_fake("triton_chat::packed_linear",
                            lambda x, context, index, out_features, bias: x.new_empty(x.shape[0], out_features), lib=_LIBRARY)


def _ours(weight: torch.Tensor) -> bool:
    """Whether ``weight`` runs on our CPU kernel (``llm/kernels.py``: bfloat16, on a CPU with AVX2 or better)."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and kernels.load() is None


def _onednn_packs(weight: torch.Tensor) -> bool:
    """Whether oneDNN packs ``weight`` on this CPU: float32 always, bfloat16 and float16 only where it computes
    them (AVX-512 BW/DQ/VL, AVX512-FP16 or AVX-NE-CONVERT; elsewhere its reorder fails with a raw error)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if weight.dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


class Linear(torch.nn.Module):
    """A weight used as ``F.linear``. On CPUs, bfloat16 weights go to our kernel (``llm/kernels.py``: it
    reads them at the machine's speed), packed in its order; other weights, or without the kernel, are
    packed by oneDNN where it takes their dtype (``_onednn_packs``), else used as they are. Plain on GPUs."""

    def __init__(self, weight: torch.Tensor, context: Context, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.context, self.index = context.key, None
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self.weight = self.packed = self.op = None
        if _ours(weight):
            self.packed = torch.nn.Parameter(kernels.ops.bf16_pack(weight.detach()), requires_grad=False)
            self.op = kernels.ops.bf16_linear
            if bias is not None:
                self.bias = torch.nn.Parameter(bias.detach().float(), requires_grad=False)
        elif _onednn_packs(weight):
            self.index = context.pack(weight)
        else:
            self.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self.op(x, self.packed, self.out_features, self.bias)
        if self.index is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.triton_chat.packed_linear(x, self.context, self.index, self.out_features, self.bias)


class Head(torch.nn.Module):
    """The output layer: float32 logits, so that greedy picks float32's token (bfloat16 logits are
    rounded to 1/8 near the top, enough to flip near ties: "The" 25.33 vs "L" 25.24 for SmolLM2's answer
    to the README's prompt). Float32 weights are a third of what a 135M model's decode step reads.

    So where our CPU kernel runs (``Linear``), the logits come from the bfloat16 weights and hidden state,
    summed in float32: each is within ``error[t] x |h|`` of float32's (both roundings, ``2^-8`` relative
    at most, and float32's own sums, bounded through Cauchy-Schwarz by token t's weight norm). The
    ``CANDIDATES`` tokens with the highest upper bound are re-scored exactly from the float32 weights; every
    other token's upper bound lies below the best lower bound, so none of them can be float32's best. Where
    that fails (more than ``CANDIDATES`` tokens near the top), the row is computed whole in float32. The
    top of every row is exact; the rest, which only sampling's tail and log-probabilities' sums see, are
    within the bound (measured under 0.15 for SmolLM2). Elsewhere (float32 models, GPUs) float32 weights."""

    CANDIDATES = 16

    def __init__(self, weight: torch.Tensor, context: Context, bf16: bool = False) -> None:
        """``bf16``: the approximate logits from ``weight`` rounded to bfloat16 (float32 models whose linear
        layers are stored smaller: bf16, int8 or int4)."""
        super().__init__()
        self.context = context
        stored = weight.to(torch.bfloat16) if bf16 else weight
        self.fast = _ours(stored)
        self.linear = Linear(stored if self.fast else weight.float(), context)
        if self.fast:  # the model's own weights, exactly
            context.head = weight.detach().float()
            bound = 2**-8 * 1.01 + 2 * weight.shape[1] * 2**-23
            self.register_buffer("error", bound * context.head.norm(dim=1), persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the float32 hidden states ``h`` (``[rows, hidden]``)."""
        if not self.fast:
            return self.linear(h)
        approx = self.linear.op(h, self.linear.packed, self.linear.out_features, None, True)
        bound = self.error * torch.linalg.vector_norm(h, dim=-1, keepdim=True)
        top = (approx + bound).topk(self.CANDIDATES + 1, dim=-1)
        ids = top.indices[:, : self.CANDIDATES]
        exact = torch.bmm(self.context.head[ids], h.unsqueeze(-1)).squeeze(-1)
        unsure = top.values[:, self.CANDIDATES] >= (approx - bound).amax(-1)
        return torch.ops.triton_chat.settled_logits(approx.scatter(1, ids, exact), h, unsure, self.context.key)


def _in_place(q: torch.Tensor) -> bool:
    """Whether attention reads the paged cache where it lies: our CPU kernel (``llm/kernels.cpp``: bfloat16
    on a CPU with AVX2 or better, head_dim 64 or 128), or on CUDA ``llm/gpu_attention.py``'s once its
    ``load`` found it right on this device."""
    if q.device.type == "cpu":
        return kernels.ops is not None and q.dtype == torch.bfloat16 and q.shape[-1] in (64, 128)
    return gpu_attention.ready


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """The in-place kernel of ``q``'s device (``_in_place``): a row per query token over its slots."""
    on = kernels.ops if q.device.type == "cpu" else torch.ops.triton_chat_gpu
    return on.paged_attention(q, k_cache, v_cache, slots, lengths, scale)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per row over that row's ``lengths`` cached slots (``slots`` is ``[rows, columns]``).

    Plain ops, so the compiler fuses the gather, the masking and the softmax around two batched matmuls.
    The cache is head-major (``[kv_heads, slots, dim]``) so the gathered keys are already laid out as the
    matmul's batch of ``kv_heads x rows`` matrices.
    """
    if _in_place(q):
        return paged_attention(q, k_cache, v_cache, slots, lengths, scale)
    rows, columns = slots.shape
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[0]
    keys, values = k_cache[:, slots], v_cache[:, slots]  # [kv_heads, rows, columns, dim]
    query = q.view(rows, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [kv_heads, rows, group, dim]
    scores = torch.matmul(query, keys.transpose(2, 3)).float() * scale  # [kv_heads, rows, group, columns]
    valid = torch.arange(columns, device=q.device)[None, :] < lengths[:, None]
    scores = scores.masked_fill(~valid[None, :, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1).to(q.dtype), values)  # [kv_heads, rows, group, dim]
    return out.transpose(0, 1).reshape(rows, heads, dim)


class Decoder(torch.nn.Module):
    """The weights of a loaded Hugging Face model, regrouped for one GEMM per projection group, plus the
    KV cache: ``slots`` token slots per layer, allocated once."""

    def __init__(self, hf: PreTrainedModel, slots: int, positions: int, weights: str = "auto",
                 stored: Callable[[str], torch.Tensor | quant.Int4] | None = None) -> None:
        """``weights``: the linear layers' storage (``llm/quant.py`` for ``int8`` and ``int4``; any other
        setting keeps the model's dtype). ``stored`` gives, by parameter name, the linear weights ``hf``
        holds as ``None`` (a GGUF file's, ``llm/gguf_weights.py``: int4 blocks as they are)."""
        super().__init__()
        c = hf.config
        if c.model_type not in SUPPORTED or getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True):
            raise ValueError(
                f"parameter 'model_dir': the engine runs Llama-shaped decoders ({', '.join(SUPPORTED)}, no sliding "
                f"window); this model is {c.model_type!r} ({', '.join(c.architectures or [])})"
            )
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        dtype, device = hf.dtype, hf.device
        body = hf.model
        self.context = Context()
        self.embed = body.embed_tokens.weight
        self.layers = torch.nn.ModuleList(_Layer(layer, self.kv_heads, self.head_dim, self.context, weights, i, dtype, stored)
                                          for i, layer in enumerate(body.layers))
        self.norm = body.norm.weight
        # In bfloat16 where the linear layers are stored smaller than float32 (bf16, int8, int4; on our CPU kernels).
        self.lm_head = Head(hf.lm_head.weight, self.context, weights in ("bf16", "int8", "int4"))
        cos, sin = body.rotary_emb(torch.zeros(1, dtype=dtype, device=device), torch.arange(positions, device=device)[None])
        self.register_buffer("cos", cos[0], persistent=False)
        self.register_buffer("sin", sin[0], persistent=False)
        shape = (self.kv_heads, slots, self.head_dim)
        for i in range(len(self.layers)):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.kv_bytes_per_token = 2 * len(self.layers) * self.kv_heads * self.head_dim * dtype.itemsize
        # On CUDA, attention in place once the kernel proves right here (llm/gpu_attention.py); else gathered.
        self.gpu_attention = None if device.type != "cuda" else gpu_attention.load(
            device, self.heads, self.kv_heads, self.head_dim, dtype, decode_attention)

    def weight_bytes(self) -> int:
        """What a decode step reads of the weights, as this decoder keeps them: every matrix once (packed
        where it is), the input embedding only by row (so not at all, to first order), and of the output
        layer's float32 copy only the re-scored rows (``Head``; not at all, to first order)."""
        tensors = [*self.parameters(), *self.context.packed]
        return sum(t.numel() * t.element_size() for t in tensors) - self.embed.numel() * self.embed.element_size()

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               decode_slots: torch.Tensor, decode_lengths: torch.Tensor) -> torch.Tensor:
        """A step of decode rows only, one token each: float32 logits for every row. Every row attends
        over ``decode_lengths`` of its ``decode_slots`` (``[rows, columns]``) inside the graph."""
        scale = self.head_dim**-0.5

        def attention(q, k_cache, v_cache):
            return decode_attention(q, k_cache, v_cache, decode_slots, decode_lengths, scale)

        return self._forward(input_ids, positions, slots, None, attention)

    def mixed(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, logit_rows: torch.Tensor,
              decode_slots: torch.Tensor | None = None, decode_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """A step of decode rows, then prompt chunks: float32 logits for the tokens ``logit_rows``. The chunks
        attend in ``mixed_attention`` (``Context.step``), and so do the decode rows unless ``decode_slots`` is
        given: then they attend inside the graph, as in ``decode``. CPUs take that (their compiled decode
        attention runs 2x faster than eager at 300 columns); GPUs leave rows and columns out of the graph's
        shape, so that only the token count shapes it."""
        scale = self.head_dim**-0.5

        def attention(q, k_cache, v_cache):
            out = torch.ops.triton_chat.mixed_attention(q, k_cache, v_cache, self.context.key)
            if decode_slots is None:
                return out
            rows = decode_slots.shape[0]
            return torch.cat([decode_attention(q[:rows], k_cache, v_cache, decode_slots, decode_lengths, scale), out[rows:]])

        return self._forward(input_ids, positions, slots, logit_rows, attention)

    def prompt_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """float32 logits at every position of one prompt, by a causal pass of its own that neither reads
        nor writes the cache: eager and off the step, so only the requests that ask for their prompt's
        log-probabilities pay for it."""
        h = self.embed[input_ids]
        positions = torch.arange(len(input_ids), device=input_ids.device)
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        for layer in self.layers:
            q, k, v = (t.transpose(0, 1) for t in layer.qkv(F.rms_norm(h, h.shape[-1:], layer.input_norm, self.eps), cos, sin))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = h + layer.o_proj(out.transpose(0, 1).flatten(1))
            h = h + layer.mlp(F.rms_norm(h, h.shape[-1:], layer.post_norm, self.eps))
        return self.lm_head(F.rms_norm(h.float(), h.shape[-1:], self.norm.float(), self.eps))

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 logit_rows: torch.Tensor | None, attention) -> torch.Tensor:
        """Every token's key and value are written at its slot in ``slots`` before ``attention`` reads the
        cache."""
        h = self.embed[input_ids]
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
            q, k, v = layer.qkv(F.rms_norm(h, h.shape[-1:], layer.input_norm, self.eps), cos, sin)
            k_cache.index_copy_(1, slots, k.transpose(0, 1))
            v_cache.index_copy_(1, slots, v.transpose(0, 1))
            h = h + layer.o_proj(attention(q, k_cache, v_cache).flatten(1))
            h = h + layer.mlp(F.rms_norm(h, h.shape[-1:], layer.post_norm, self.eps))
        if logit_rows is not None:
            h = h[logit_rows]
        h = F.rms_norm(h.float(), h.shape[-1:], self.norm.float(), self.eps)
        return self.lm_head(h)


class _Layer(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module, kv_heads: int, head_dim: int, context: Context, weights: str,
                 index: int, dtype: torch.dtype, stored: Callable[[str], torch.Tensor | quant.Int4] | None) -> None:
        super().__init__()
        a, mlp = layer.self_attn, layer.mlp

        def weight(name: str) -> torch.Tensor | quant.Int4:
            held = layer.get_submodule(name).weight
            return held if held is not None else stored(f"model.layers.{index}.{name}.weight")

        def linear(name: str, parts: list[str], bias: torch.Tensor | None = None) -> torch.nn.Module:
            """One layer for the weights ``parts`` stacked by output rows."""
            found = [weight(part) for part in parts]
            if weights == "int4" and all(isinstance(w, quant.Int4) for w in found):
                return quant.QuantizedLinear(weights, quant.Int4.cat(found), bias, dtype)
            w = torch.cat([w.dequantize().to(dtype) if isinstance(w, quant.Int4) else w for w in found])
            if weights not in quant.QUANTIZED:  # bf16: stored so under float32 activations too (bf16_storage)
                return Linear(w.to(torch.bfloat16) if weights == "bf16" else w, context, bias)
            quant.check_shape(weights, f"layers.{index}.{name}", w)
            return quant.QuantizedLinear(weights, w, bias, dtype)

        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.input_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        bias = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
        self.qkv_proj = linear("self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                               torch.cat(bias) if bias[0] is not None else None)
        self.q_norm = a.q_norm.weight if hasattr(a, "q_norm") else None  # qwen3
        self.k_norm = a.k_norm.weight if hasattr(a, "k_norm") else None
        self.eps = getattr(a.q_norm, "variance_epsilon", 1e-6) if self.q_norm is not None else 0.0
        self.o_proj = linear("self_attn.o_proj", ["self_attn.o_proj"])
        self.gate_up = linear("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"])
        self.down = linear("mlp.down_proj", ["mlp.down_proj"])

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        tokens, kv = x.shape[0], self.kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.qkv_proj.out_features - 2 * kv, kv, kv], -1)
        q, k = q.view(tokens, -1, self.head_dim), k.view(tokens, -1, self.head_dim)
        if self.q_norm is not None:
            q = F.rms_norm(q, q.shape[-1:], self.q_norm, self.eps)
            k = F.rms_norm(k, k.shape[-1:], self.k_norm, self.eps)
        return _rope(q, cos, sin), _rope(k, cos, sin), v.view(tokens, -1, self.head_dim)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)
        return self.down(F.silu(gate) * up)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin
