"""A local Hugging Face chat model behind one validation point and an in-flight batching engine."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from contract.folders import GGUF_NAME, HF_WEIGHTS, allowed_folder
from contract.schema import DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT
from contract.tokenizer import decode_text, load_tokenizer, vocab_fingerprint
from llm import gguf_weights, kernels, quant
from llm.engine import Engine
from llm.grammar import Grammars
from llm.kv import BLOCK_SIZE, BlockHasher, KVManager, cache_slots
from llm.model import Decoder
from llm.compiles import Progress
from llm.runner import ModelRunner
from llm.request import GenerationRequest, Limits, SamplingParams, validate
from llm.scheduler import Scheduler
from llm.metrics import EngineMetrics
from llm.sampling import BatchSampler
from llm.shapes import Shapes

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
WEIGHT_DTYPES = {"bf16": "bfloat16", "f32": "float32"}  # weights settings that choose the dtype too


@dataclass(frozen=True)
class LLMConfig:
    """``llm`` config parameters."""

    model_dir: str
    dtype: str = "auto"  # auto: bfloat16 where the hardware computes it natively, see resolve_dtype
    weights: str = "auto"  # the linear layers' storage: auto (the dtype), bf16, f32, int8, int4 or fp8 (llm/quant.py)
    compile: bool = True  # torch.compile the forward pass (CUDA graphs on GPUs); false runs it eagerly
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    max_context_tokens: int = 0  # prompt + reply; 0 means the model's max_position_embeddings
    kv_cache_tokens: int = 16384  # KV budget in cache slots, a multiple of 16; see docs/configuration.md for bytes
    max_running_requests: int = 64  # rows decoded together at most
    prefix_caching: bool = True  # reuse the KV blocks of a prompt's prefix an earlier request filled
    max_batched_tokens: int = 256  # tokens in one forward pass: the decode rows, then prompt chunks
    max_queued_requests: int = 256  # waiting for the KV budget; more are refused at once (overloaded)
    max_queue_seconds: float = 60.0  # a request that waited this long for room is refused (overloaded)
    max_stop_count: int = 8
    max_stop_bytes: int = 128  # each stop string, UTF-8
    stream_interval: int = 1  # a streamed reply's tokens go out this many at a time (its first and last at once)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"parameter 'dtype' must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.weights not in quant.SETTINGS:
            raise ValueError(f"parameter 'weights' must be one of {', '.join(quant.SETTINGS)}, got {self.weights!r}")
        wanted = WEIGHT_DTYPES.get(self.weights)
        if wanted and self.dtype not in ("auto", wanted):
            raise ValueError(f"parameter 'weights' is {self.weights}, which runs the model in {wanted}, but parameter "
                             f"'dtype' is {self.dtype}: set dtype to auto or {wanted}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_limit:
            raise ValueError(
                f"parameter 'default_max_tokens' must be in [1, max_tokens_limit={self.max_tokens_limit}], "
                f"got {self.default_max_tokens}"
            )
        for name in ("kv_cache_tokens", "max_running_requests", "max_queued_requests", "max_stop_count",
                     "max_stop_bytes", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter '{name}' must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_tokens % BLOCK_SIZE:
            raise ValueError(f"parameter 'kv_cache_tokens' must be a multiple of {BLOCK_SIZE} (the KV block size), "
                             f"got {self.kv_cache_tokens}")
        if self.max_batched_tokens <= self.max_running_requests:
            raise ValueError(
                f"parameter 'max_batched_tokens' must exceed max_running_requests={self.max_running_requests} "
                f"(room for prompt chunks beside every decoding row), got {self.max_batched_tokens}"
            )
        if not self.max_queue_seconds > 0:
            raise ValueError(f"parameter 'max_queue_seconds' must be > 0, got {self.max_queue_seconds}")
        if self.max_context_tokens < 0:
            raise ValueError(f"parameter 'max_context_tokens' must be >= 0, got {self.max_context_tokens}")


def resolve_dtype(name: str, device: torch.device, weights: str = "auto") -> torch.dtype:
    """``weights`` bf16 or f32 name the dtype. Else ``auto``: bfloat16 on GPUs that support it (float16 on
    older ones), and on CPUs with native bfloat16 arithmetic (AVX512-BF16 or AMX), which halves the bytes
    every decode step reads; float32 on other CPUs. There our AVX2 and AVX-512 kernels run bfloat16 too
    (``dtype: bfloat16`` or ``weights: bf16``) and faster, but the compiled bfloat16 step on an AVX2 EPYC
    turned the default model's greedy answer to the README's prompt into a repeating French phrase (the
    eager step and float32 answer it), so ``auto`` keeps float32 there until that is understood."""
    if weights in WEIGHT_DTYPES:
        return DTYPES[WEIGHT_DTYPES[weights]]
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return torch.bfloat16 if native else torch.float32


def bf16_storage(config: LLMConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``weights: auto`` keeps the linear layers in bfloat16 under float32 activations: on a CPU
    where ``dtype: auto`` is float32 (no native bfloat16 arithmetic: AVX2, AVX-512 without BF16) and our
    kernels run. They multiply float32 activations by the bfloat16 weights, widened exactly in registers,
    with float32 sums: float32's arithmetic over bf16-rounded weights, half float32's bytes a step, and the
    output layer's greedy pick still exactly float32's (``Head``). The norms, attention and the KV cache stay
    float32. (A bfloat16 model, ``dtype: bfloat16``, rounds the activations too; on an AVX2 EPYC its compiled
    step answered the README's prompt with a repeating French phrase: see docs/configuration.md.)"""
    return config.dtype == "auto" and device.type == "cpu" and dtype == torch.float32 and kernels.load() is None


def load_model(config: LLMConfig, device: torch.device) -> PreTrainedModel:
    """The Hugging Face model of ``config.model_dir`` in the resolved dtype, on ``device``."""
    return AutoModelForCausalLM.from_pretrained(
        allowed_folder("model_dir", config.model_dir), dtype=resolve_dtype(config.dtype, device, config.weights),
        local_files_only=True, trust_remote_code=False,
    ).to(device).eval()


def load_weights(config: LLMConfig, device: torch.device) -> tuple[PreTrainedModel, gguf_weights.GGUFWeights | None]:
    """``load_model``, or where the folder's ``model.gguf`` is to be read, the model without its linear
    weights and the file they are still to be read from (``llm/gguf_weights.py``). The file is read where
    its weights are 4-bit and the setting is int4 (the blocks as they are), or where the folder has no
    Hugging Face weights."""
    folder = allowed_folder("model_dir", config.model_dir)
    file = folder / GGUF_NAME
    # A link the launcher wrote, read as the folder's other files are (symlinks, as in Hugging Face's cache).
    if file.exists() and (gguf_weights.own_setting(file) == "int4" == config.weights
                          or not any((folder / name).is_file() for name in HF_WEIGHTS)):
        return gguf_weights.load(folder, file, resolve_dtype(config.dtype, device, config.weights), device)
    return load_model(config, device), None


def configure_threads(instance_count: int, device: torch.device) -> int:
    """Split the cores between CPU instances (each is its own stub process); GPU instances need few."""
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // max(1, instance_count)) if device.type == "cpu" else min(2, cores)
    torch.set_num_threads(threads)
    return threads


class LLM:
    """The weights, what a request may ask of them, and the engine that runs them."""

    def __init__(
        self, config: LLMConfig, device: torch.device,
        model: PreTrainedModel | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        """``model`` (an already loaded Hugging Face model) is for tests; the server loads ``model_dir``.
        The engine keeps only its own copy of the weights (``Decoder``), not the Hugging Face modules."""
        self.config = config
        self.device = device
        hf, stored = (model.to(device).eval(), None) if model is not None else load_weights(config, device)
        # The setting served: ``auto`` on a GGUF file is the file's own where its kernels run (CPUs).
        own = stored.own_setting() if stored is not None and config.weights == "auto" and device.type == "cpu" else "auto"
        self.weights = own if config.weights == "auto" else config.weights
        self.source = f"{GGUF_NAME} ({stored.types()})" if stored is not None else "Hugging Face weights"
        # The model's own vocabulary turns ids into text for stop strings (postprocess checks that its
        # tokenizer shares it).
        self.tokenizer = tokenizer or load_tokenizer(config.model_dir, "model_dir")
        self.fingerprint = vocab_fingerprint(self.tokenizer)
        self.dtype = hf.dtype
        if self.weights == "auto" and bf16_storage(config, device, self.dtype):
            self.weights = "bf16"
        self.vocab_size = hf.get_input_embeddings().num_embeddings
        positions = getattr(hf.config, "max_position_embeddings", None) or 2**31
        self.context_tokens = min(config.max_context_tokens or positions, positions)
        self.room = min(self.context_tokens, config.kv_cache_tokens)  # tokens one request may hold
        eos = hf.generation_config.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        pad = hf.generation_config.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)
        quant.check(self.weights, device)
        self.decoder = Decoder(hf, cache_slots(config.kv_cache_tokens), self.context_tokens, self.weights,
                               stored and (lambda name: stored.get(name, self.weights, self.dtype)))
        self.weight_bytes = self.decoder.weight_bytes()
        self.kv_bytes_per_token = self.decoder.kv_bytes_per_token
        # What runs the linear layers and attention, for the load log (llm/kernels.py and gpu_attention.py say why).
        gpu = self.decoder.gpu_attention
        self.kernels = (f"torch, attention {'in place (llm/gpu_attention.py)' if gpu is None else f'gathered: {gpu}'}"
                        if device.type != "cpu" else kernels.describe() if self.decoder.lm_head.fast else
                        f"oneDNN and torch ({kernels.load() or 'our kernels take bfloat16, int8 and int4 weights'})")
        if self.weights in quant.QUANTIZED:
            self.kernels = (f"{self.weights} linear layers on {self.decoder.layers[0].down.kernel()}, "
                            f"the rest on {self.kernels}")
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        self.limits = Limits(self.vocab_size, self.room, config.default_max_tokens, config.max_tokens_limit,
                             config.max_stop_count, config.max_stop_bytes, self.fingerprint)

    def engine(self, metrics: EngineMetrics | None = None, progress: Progress | None = None,
               pad: bool | None = None) -> Engine:
        """A fresh engine (empty cache table) on this model's weights and cache; one runs at a time.
        Compiled, it is ready when this returns: every shape it will run has run (``llm/runner.py``).
        ``pad`` forces the GPU's padding rules on or off (``llm/shapes.py``); by default they follow the
        device. ``progress`` logs the start-up as it goes."""
        c, metrics = self.config, metrics or EngineMetrics()
        # The model's folder, dtype and vocabulary lead every block's hash chain: one engine serves one
        # model, and a key written for another is never taken for its own.
        hasher = BlockHasher(f"{c.model_dir}\0{self.dtype}\0{self.weights}\0{self.fingerprint}") if c.prefix_caching else None
        kv = KVManager(c.kv_cache_tokens, c.max_running_requests, self.room, self.device, hasher)
        scheduler = Scheduler(
            kv, max_running=c.max_running_requests, max_batched_tokens=c.max_batched_tokens,
            max_queued_requests=c.max_queued_requests, max_queue_seconds=c.max_queue_seconds, metrics=metrics,
        )
        pad = self.device.type == "cuda" if pad is None else pad
        shapes = Shapes.plan(pad, c.max_running_requests, kv.slots.shape[1], c.max_batched_tokens)
        if progress is not None and c.compile:
            progress.phase(f"compiling and running {len(shapes.warm_up())} step shapes"
                           f"{', capturing the decode shapes as CUDA graphs' if self.device.type == 'cuda' else ''}")
        runner = ModelRunner(self.decoder, kv, self.device, c.compile, shapes,
                             progress.status if progress is not None else lambda text: None)
        self.grammars.prepare()
        sampler = BatchSampler(c.max_running_requests, self.device, self.eos_ids)
        return Engine(runner, scheduler, sampler, self.decode, metrics, self.grammars)

    def decode(self, ids: list[int]) -> str:
        return decode_text(self.tokenizer, ids)

    def validate(self, input_ids: list[int], max_tokens: int | None = None, **fields) -> GenerationRequest:
        """``llm.request.validate`` with this model's limits."""
        return validate(self.limits, input_ids, max_tokens, **fields)


__all__ = ["LLM", "LLMConfig", "GenerationRequest", "SamplingParams", "configure_threads", "load_model", "resolve_dtype"]
