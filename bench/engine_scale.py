"""The engine alone (no Triton) against Hugging Face ``generate`` on the same batch, at public model shapes.

Weights are seeded random (no hub here); the vocabulary is the served model's tokenizer's. Every request
has a 128-token prompt and generates exactly 128 tokens. The weight-read limit is what a decode step can
reach if reading the weights once per step were all it did: ``rows x read bandwidth / bytes read``, with
the bandwidth measured on this device by ``bench.roofline.bandwidth`` (a full read of 2 GiB).
``make gpu-check`` runs it at the Llama-3.2-1B and Llama-3.1-8B shapes in bf16, and the 8B shape in fp8.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from llm import LLM, LLMConfig
from llm.compiles import COMPILATIONS
from llm.sequence import Sequence
from llm.reference import StaticGenerator

SHAPES = {  # layers, heads and widths of public models
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, rope_theta=500000.0),
}
PROMPT, NEW = 128, 128


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_model(shape: str, vocab: int, device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, max_position_embeddings=PROMPT + NEW, eos_token_id=2, pad_token_id=2,
                         bos_token_id=1, **SHAPES[shape])
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        try:
            return LlamaForCausalLM(config).eval()
        finally:
            torch.set_default_dtype(torch.float32)


def _engine_run(llm: LLM, engine, batch) -> float:
    seqs = [Sequence(r) for r in batch]
    for seq in seqs:
        engine.add(seq)
    synchronize(llm.device)
    began = time.perf_counter()
    while engine.has_work:
        engine.step()
    synchronize(llm.device)
    took = time.perf_counter() - began
    assert all(len(s.output_ids) == NEW for s in seqs), [len(s.output_ids) for s in seqs]
    return took


def _static_run(generator: StaticGenerator, batch) -> float:
    synchronize(generator.llm.device)
    began = time.perf_counter()
    out = generator.generate(batch)
    synchronize(generator.llm.device)
    assert all(len(o) == NEW for o in out)
    return time.perf_counter() - began


def measure(shape: str, tokenizer: PreTrainedTokenizerBase, device: torch.device, concurrency: tuple[int, ...],
            bandwidth: float, deadline: float, say: Callable[[str], None], weights: str = "bf16") -> dict:
    """One shape at each concurrency: our engine's tok/s (after a first, timed run that must not be
    slower for compiling: the engine compiles and captures at load), Hugging Face ``generate``'s on the
    same batch (bf16, whatever ``weights`` our engine stores), and both against the weight-read limit of
    the bytes our engine reads. Stops early, saying so, at ``deadline``."""
    began = time.perf_counter()
    vocab = len(tokenizer)
    hf = random_model(shape, vocab, device)
    llm = LLM(LLMConfig("unused", dtype="bfloat16", weights=weights, compile=True, kv_cache_tokens=max(concurrency) * (PROMPT + NEW),
                        max_tokens_limit=NEW, max_running_requests=max(concurrency)), device, hf, tokenizer)
    engine = llm.engine()
    built = COMPILATIONS.count
    weight_bytes = llm.decoder.weight_bytes()
    report = {"weights": llm.weights, "parameters_M": sum(p.numel() for p in hf.parameters()) / 1e6,
              "weights_read_GB": weight_bytes / 1e9,
              "load_and_compile_s": time.perf_counter() - began, "cuda_graphs": engine.runner.cuda_graphs, "points": []}
    say(f"{shape}: {report['parameters_M']:.0f}M parameters, engine built (compiled, {engine.runner.cuda_graphs} "
        f"CUDA graphs) in {report['load_and_compile_s']:.0f} s")
    generator = StaticGenerator(hf, llm)
    rng = torch.Generator().manual_seed(1)
    for c in concurrency:
        if time.time() > deadline:
            say(f"{shape} c={c}: skipped, out of time")
            report["skipped"] = True
            break
        batch = [llm.validate(torch.randint(10, vocab, (PROMPT,), generator=rng).tolist(), NEW, ignore_eos=True)
                 for _ in range(c)]
        first = _engine_run(llm, engine, batch)
        ours = _engine_run(llm, engine, batch)
        _static_run(generator, batch[:1])  # Hugging Face's first call pays its own set-up
        theirs = _static_run(generator, batch)
        limit = c * bandwidth / weight_bytes
        point = {"concurrency": c, "first_run_s": first, "engine_tok_s": c * NEW / ours,
                 "hf_generate_tok_s": c * NEW / theirs, "weight_read_limit_tok_s": limit,
                 "compilations_after_build": COMPILATIONS.count - built}
        point["engine_vs_hf"] = point["engine_tok_s"] / point["hf_generate_tok_s"]
        point["engine_vs_limit"] = point["engine_tok_s"] / limit
        report["points"].append(point)
        say(f"{shape} c={c}: engine {point['engine_tok_s']:.0f} tok/s (first run {first:.1f} s), Hugging Face "
            f"generate {point['hf_generate_tok_s']:.0f} tok/s ({point['engine_vs_hf']:.2f}x), weight-read limit "
            f"{limit:.0f} tok/s ({point['engine_vs_limit']:.0%}); compilations since load "
            f"{point['compilations_after_build']}")
    del engine, generator, llm, hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return report
