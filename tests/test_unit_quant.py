"""Weight-only quantized linear layers (``weights: int8`` and ``int4``, ``llm/quant.py``), in-process.

Each quantizer is checked against its own definition, each quantized layer against ``F.linear`` over the
weights it stands for, and a whole engine against Hugging Face ``generate`` on a model whose linear
layers hold those same de-quantized weights: equal greedy tokens, so the kernels, the packing and the
scales are all what they claim.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from llm.reference import StaticGenerator
from conftest import Letters, head_dim_64_model
from llm import LLM, LLMConfig, kernels, quant, resolve_dtype
from llm.model import Context, Linear
from llm.sequence import Sequence
from test_unit_engine import run

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20]]


def weights(n: int = 96, k: int = 128) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(n, k) * torch.linspace(0.01, 1.0, n)[:, None]  # rows of very different scales


def test_int8_rows_round_to_the_nearest_step_of_their_own_scale():
    w = weights()
    q, scale = quant.int8_weights(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale.shape == (96,)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-6).all()


def test_int4_groups_map_their_minimum_and_maximum_to_0_and_15():
    w = weights()
    q, scale, zero = quant.int4_weights(w)
    assert q.min() == 0 and q.max() == 15 and scale.shape == zero.shape == (96, 128 // quant.GROUP)
    groups = q.view(96, -1, quant.GROUP)
    assert (groups.amin(-1) == 0).all() and (groups.amax(-1) == 15).all()
    assert ((quant.Int4(q, scale, zero).dequantize() - w).abs().view(96, -1, quant.GROUP) <= scale[..., None] / 2 + 1e-6).all()


@pytest.mark.parametrize("setting", quant.QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 5, 64])
def test_a_quantized_layer_is_f_linear_over_the_weights_it_stands_for(cpu_kernels, setting, dtype, rows):
    w, bias = weights().to(dtype), torch.randn(96).to(dtype)
    layer = quant.QuantizedLinear(setting, w, bias, dtype)
    # int8 and int4 run our kernels at every level (CPU_KERNELS=none: torch's), x in bfloat16 or float32: on
    # AVX512-BF16 int8's in-register path (up to 4 rows) and its widened-slice path (more).
    assert layer.ours == (setting in ("int8", "int4") and cpu_kernels != "none")
    if setting == "int8":
        q, scale = quant.int8_weights(w)
        reference = q.float() * scale.to(dtype).float()[:, None]
    elif setting == "fp8":  # weight-only, as on GPUs without fp8 arithmetic (fp8 is refused on CPUs at load)
        assert not layer.scaled and layer.kernel() == "fp8 weights widened in the step"
        q, scale = quant.fp8_weights(w)
        reference = q.float() * scale.to(dtype).float()[:, None]
    elif layer.ours:  # Q4_1's own arithmetic: w = d q + m, d and m (= zero - 8 d) in float16
        q, scale, zero = quant.int4_weights(w)
        d, m = scale.half().float(), (zero - 8 * scale).half().float()
        reference = (q.view(96, -1, quant.GROUP).float() * d[..., None] + m[..., None]).view(96, 128)
    else:  # torch's kernel: scale and zero in the model's dtype
        q, scale, zero = quant.int4_weights(w)
        reference = quant.Int4(q, scale.to(dtype).float(), zero.to(dtype).float()).dequantize()
    x = torch.randn(rows, 128).to(dtype)
    expected = F.linear(x.float(), reference, bias.float())
    # float32 x: exact but for the sums' order where the level widens it (AVX-512 and AVX2 quantize it per block
    # to int8 for int8 and int4, as llama.cpp's Q8 activations; AVX512-BF16 rounds it to bfloat16, which it
    # multiplies).
    exact = dtype == torch.float32 and not layer.ours
    tolerance = 1e-4 if exact else 0.05
    out = layer(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tolerance * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("k", [75, 130])
def test_int8_on_our_kernels_takes_an_odd_k_and_a_short_last_block_of_x(level, k):
    """AVX-512 and AVX2 quantize x per 32 columns: a last block of 11 or 2 columns gets its own scale, and
    the column past an odd K is zero, as the packed weights' is."""
    w = weights(n=70, k=k)
    layer = quant.QuantizedLinear("int8", w, None, torch.float32)
    q, scale = quant.int8_weights(w)
    x = torch.randn(5, k)
    expected = F.linear(x, q.float() * scale[:, None])
    torch.testing.assert_close(layer(x), expected, atol=0.02 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("setting", ["bf16", "int8", "int4"])
def test_a_rows_result_on_our_kernels_does_not_depend_on_the_rows_beside_it(level, setting):
    """A request's tokens are the same alone or in any batch: each row of x takes the same operations in
    the same order, in-register (up to 2 or 4 rows) or not, on every output row (64 of a group, and the rest)."""
    w = weights(n=200, k=192).to(torch.bfloat16)
    layer = Linear(w, Context()) if setting == "bf16" else quant.QuantizedLinear(setting, w, None, torch.bfloat16)
    x = torch.randn(37, 192).to(torch.bfloat16)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(37)])
    for rows in (2, 3, 4, 5, 16, 37):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


def test_fp8_rows_keep_their_largest_magnitude_and_e4m3s_relative_step():
    w = weights()
    q, scale = quant.fp8_weights(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (96,)
    assert (q.float().abs().amax(dim=1) == quant.FP8_MAX).all()
    # e4m3 keeps 3 mantissa bits: every weight within 2^-4 of itself (relative), or of the smallest normal
    error = (q.float() * scale[:, None] - w).abs()
    assert (error <= w.abs() * 2**-4 + scale[:, None] * 2**-6).all()


@pytest.mark.parametrize("rows", [1, 16])
def test_fp8_with_fp8_activations_is_scaled_mm_over_both_sides_row_scales(rows):
    """The path GPUs of compute capability 8.9 and up take (``torch._scaled_mm``), run on the CPU: each
    activation row quantized like a weight row, then exactly the product of the two de-quantized sides."""
    w, bias = weights().to(torch.bfloat16), torch.randn(96).to(torch.bfloat16)
    layer = quant.QuantizedLinear("fp8", w, bias, torch.bfloat16, scaled=True)
    assert layer.kernel() == "torch._scaled_mm (fp8 activations too)"
    x = torch.randn(rows, 128).to(torch.bfloat16)
    q, scale = quant.fp8_weights(w)
    xq, xs = quant.fp8_weights(x)
    expected = F.linear(xq.float() * xs[:, None], q.float() * scale[:, None], bias.float())
    torch.testing.assert_close(layer(x).float(), expected, atol=0.01 * expected.abs().max().item(), rtol=0)
    assert layer(x).dtype == torch.bfloat16


def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model


def dequantized(model: LlamaForCausalLM, setting: str) -> LlamaForCausalLM:
    """``model`` with every linear layer of its decoder layers replaced by the weights ``setting`` keeps."""
    model = copy.deepcopy(model)
    for layer in model.model.layers:
        for linear in [*(getattr(layer.self_attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
                       *(getattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))]:
            w = linear.weight.data
            if setting == "int8":
                q, scale = quant.int8_weights(w)
                linear.weight.data = q.float() * scale[:, None]
            else:
                linear.weight.data = quant.int4_weights(w).dequantize()
    return model


@pytest.mark.parametrize("setting", ["int8", "int4"])  # the CPU's (fp8: the layer tests above)
def test_an_engine_on_quantized_weights_decodes_what_hugging_face_does_on_the_weights_they_stand_for(setting):
    """q, k and v are quantized together (one packed matrix): int8's row scales and int4's groups are per
    output row, so that equals quantizing each apart, which is what the reference does."""
    model = tiny_model()
    llm = LLM(LLMConfig("unused", weights=setting, compile=False, kv_cache_tokens=208, default_max_tokens=4,
                        max_tokens_limit=16), torch.device("cpu"), model, Letters())
    requests = [llm.validate(ids, 12) for ids in PROMPTS]
    seqs = run(llm.engine(), [Sequence(r) for r in requests])
    reference = StaticGenerator(dequantized(model, setting), llm)
    assert [s.output_ids for s in seqs] == [reference.generate([r])[0] for r in requests]
    plain = LLM(LLMConfig("unused", compile=False, kv_cache_tokens=208), torch.device("cpu"), model, Letters())
    assert llm.weight_bytes < plain.weight_bytes


def test_weights_settings_that_cannot_run_name_the_setting_and_what_would():
    with pytest.raises(ValueError, match=r"parameter 'weights' must be one of auto, bf16, f32, int8, int4, fp8, got 'int3'"):
        LLMConfig("unused", weights="int3")
    with pytest.raises(ValueError, match=r"parameter 'weights' is bf16, which runs the model in bfloat16, but parameter "
                                         r"'dtype' is float32: set dtype to auto or bfloat16"):
        LLMConfig("unused", weights="bf16", dtype="float32")
    for setting in ("int8", "int4"):
        with pytest.raises(ValueError, match=rf"parameter 'weights': {setting} runs on CPUs only so far; on cuda use fp8, bf16 or auto"):
            quant.check(setting, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"parameter 'weights': fp8 runs on CUDA GPUs; on cpu use int8, int4, bf16 or auto"):
        LLM(LLMConfig("unused", weights="fp8", compile=False, kv_cache_tokens=64), torch.device("cpu"), tiny_model(), Letters())
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"int4 takes groups of 32 input columns, and layers\.0\.self_attn\.qkv_proj has 48; "
                                         r"use int8, bf16 or auto for this model"):
        LLM(LLMConfig("unused", weights="int4", compile=False, kv_cache_tokens=64), torch.device("cpu"), model, Letters())


DTYPES_FOR = {"auto": ("auto", "float32", "float16", "bfloat16"), "bf16": ("auto", "bfloat16"), "f32": ("auto", "float32"),
              "int8": ("auto", "float32", "float16", "bfloat16"), "int4": ("auto", "float32", "float16", "bfloat16")}


@pytest.mark.parametrize("weights, dtype", [(w, d) for w, dtypes in DTYPES_FOR.items() for d in dtypes])
def test_every_cpu_setting_loads_and_decodes_at_every_kernel_level(cpu_kernels, weights, dtype):
    """Every ``weights`` and ``dtype`` a CPU takes, on each kernel level this CPU runs and with none (oneDNN
    where it takes the dtype, torch elsewhere: on a CPU without AVX-512 BW/DQ/VL oneDNN refuses bfloat16 and
    float16 weights with a raw error, which the load must never reach): the model loads, the load log names
    what runs it, and a batch decodes whole. ``auto`` is bfloat16 where the CPU computes it natively."""
    hf = head_dim_64_model().to(torch.bfloat16 if weights == "bf16" else torch.float32)
    config = LLMConfig("unused", weights=weights, dtype=dtype, compile=False, kv_cache_tokens=208, default_max_tokens=4,
                       max_tokens_limit=16)
    llm = LLM(config, torch.device("cpu"), hf.to(resolve_dtype(dtype, torch.device("cpu"), weights)), Letters())
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if dtype == "auto" and weights in ("auto", "int8", "int4"):
        assert (llm.dtype == torch.bfloat16) == native
    if dtype == weights == "auto":  # float32 activations over bfloat16 weights where our kernels run, not native
        assert llm.weights == ("bf16" if not native and cpu_kernels != "none" else "auto")
    quantized_ours = weights in ("int8", "int4") and llm.dtype in (torch.bfloat16, torch.float32)
    # The output layer too: in bfloat16 wherever the linear layers are stored smaller than float32.
    ours = cpu_kernels != "none" and (llm.dtype == torch.bfloat16 or llm.weights in ("bf16", "int8", "int4"))
    assert (kernels.describe() in llm.kernels) == ours, llm.kernels
    if weights in ("int8", "int4"):
        assert (llm.decoder.layers[0].down.kernel() == kernels.describe()) == (ours and quantized_ours)
    seqs = run(llm.engine(), [Sequence(llm.validate(ids, 6, ignore_eos=True)) for ids in PROMPTS])
    assert all(len(s.output_ids) == 6 and all(0 <= t < 256 for t in s.output_ids) for s in seqs)


def test_a_kernel_setting_that_cannot_run_names_itself_and_what_would(monkeypatch):
    """``CPU_KERNELS``: a value that is no level, and a level this CPU lacks, fail the load naming the
    setting, the missing flags and the levels that run here; never oneDNN's raw error or an illegal
    instruction."""
    monkeypatch.setenv("CPU_KERNELS", "avx3")
    with pytest.raises(ValueError, match=r"CPU_KERNELS must be auto, amx, avx512bf16, avx512, avx2 or none, got 'avx3'"):
        LLM(LLMConfig("unused", compile=False, kv_cache_tokens=64), torch.device("cpu"), head_dim_64_model(), Letters())
    lacking = [name for name in kernels.LEVELS if name not in kernels.runnable()]
    if not lacking:
        pytest.skip("this CPU runs every level")
    monkeypatch.setenv("CPU_KERNELS", lacking[0])
    with pytest.raises(ValueError, match=rf"CPU_KERNELS={lacking[0]}: this CPU lacks (avx|amx)[a-z0-9_, ]*, which .* needs; "
                                         rf"set CPU_KERNELS to auto, {' or '.join([*kernels.runnable(), 'none'])}"):
        LLM(LLMConfig("unused", compile=False, kv_cache_tokens=64), torch.device("cpu"), head_dim_64_model(), Letters())


def test_auto_takes_the_next_level_when_the_best_fails_to_build_and_says_why(monkeypatch, tmp_path):
    """A compiler that cannot build the CPU's best level (an old g++ without -mamx-tile on an AMX Xeon): ``auto``
    loads the next level down, and the load log names both."""
    found = kernels.runnable()
    if len(found) < 2:
        pytest.skip("this CPU runs one level or none")
    real = kernels._command
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CPU_KERNELS", "auto")
    monkeypatch.setattr(kernels, "_command", lambda source, target, name: (
        ["g++", "--no-such-flag", str(source)] if name == found[0] else real(source, target, name)))
    # as in a process that has not loaded the best level (a level's ops register once a process: the next one
    # down, if loaded already, is taken as it is)
    monkeypatch.setattr(kernels, "_loaded", kernels._loaded - {found[0]})
    kernels.build.cache_clear()
    try:
        llm = LLM(LLMConfig("unused", compile=False, kv_cache_tokens=208), torch.device("cpu"), head_dim_64_model(), Letters())
        assert llm.kernels.startswith(f"our {kernels.LEVELS[found[1]][2]} kernels (building kernels.cpp for "
                                      f"{kernels.LEVELS[found[0]][2]} failed: "), llm.kernels
        assert "no-such-flag" in llm.kernels and kernels.level == found[1]
    finally:
        kernels.build.cache_clear()  # the next build finds the real one in its own cache


def test_a_failed_build_or_a_cpu_without_avx2_falls_back_to_onednn_saying_why(monkeypatch, tmp_path):
    """No level to run (an Arm CPU, or x86 without AVX2), or a compiler that fails: the model loads on
    oneDNN and torch in float32 under ``dtype: auto``, the load log says why, and it decodes."""
    monkeypatch.setenv("CPU_KERNELS", "auto")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"fpu", "sse2"}))
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    llm = LLM(LLMConfig("unused", compile=False, kv_cache_tokens=208), torch.device("cpu"), head_dim_64_model(), Letters())
    assert "oneDNN and torch (this CPU has no AVX2 with FMA and F16C (our kernels' lowest level))" in llm.kernels
    monkeypatch.undo()
    lowest = kernels.runnable()[-1:] or pytest.skip("this CPU runs no level to fail a build of")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CPU_KERNELS", lowest[0])
    monkeypatch.setattr(kernels, "_command", lambda source, target, name: ["g++", "--no-such-flag", str(source)])
    monkeypatch.setattr(kernels, "_loaded", set())  # as in a process that has loaded none
    kernels.build.cache_clear()
    try:
        llm = LLM(LLMConfig("unused", compile=False, kv_cache_tokens=208), torch.device("cpu"), head_dim_64_model(), Letters())
        assert f"oneDNN and torch (building kernels.cpp for {kernels.LEVELS[lowest[0]][2]} failed: " in llm.kernels
        assert "no-such-flag" in llm.kernels and not list(tmp_path.rglob("*.so"))
        seqs = run(llm.engine(), [Sequence(llm.validate(ids, 4, ignore_eos=True)) for ids in PROMPTS])
        assert all(len(s.output_ids) == 4 for s in seqs)
    finally:
        kernels.build.cache_clear()  # the next build finds the real one in its own cache
