"""A ``Step`` as tensors, run through the decoder: compiled at load, and on GPUs replayed as CUDA graphs.

A 135M model's step is a few milliseconds of arithmetic, so Python and per-op dispatch would dominate it.
``torch.compile`` (inductor) fuses each layer's small ops into a few C++ or Triton kernels. Two graphs
cover every step, decode rows only and mixed (decode rows and prompt chunks); their sizes are dynamic,
so each compiles once. Compiled code is cached on disk (``TORCHINDUCTOR_CACHE_DIR`` and Triton's
``TRITON_CACHE_DIR``, under ``.cache/compile`` with the launcher), so a restart loads instead of compiling.

Nothing is compiled or recorded once the engine is built. Every step's sizes become a ``Shape``
(``llm/shapes.py``). On GPUs shapes are padded to a fixed set of buckets, all of which run at load: each
decode shape is then captured as a CUDA graph (one launch per step, as vLLM and nano-vllm capture
theirs), and each mixed shape has run once, so whatever the compiler or the GPU does on a shape's first
run (kernel specialisation, autotuning) is done before the first request.
"""

from __future__ import annotations

import locale
import types
from collections.abc import Sequence
from typing import TYPE_CHECKING, Callable

import torch

from llm import model
from llm.kv import KVManager
from llm.sampling import token_logprobs
from llm.scheduler import Step
from llm.sequence import TokenLogprobs
from llm.shapes import MIN_SIZE, Shape, Shapes

if TYPE_CHECKING:
    from torch._dynamo.types import GuardFilterEntry


def unchanged_after_load(guards: Sequence[GuardFilterEntry]) -> list[bool]:
    """Dynamo's guards worth checking each step: those on the step's inputs, global state and sizes.
    The ~2,500 on the decoder itself (its modules' types, hooks, constants, each weight's and cache's
    dtype and shape) took 0.5-1 ms of a 19 ms decode step at one row on 2 cores (bench.step_profile);
    nothing changes them once the decoder is loaded, and each decoder has graphs of its own
    (``own_code``), so a graph never meets another decoder's modules."""
    return [not g.name.startswith("self") for g in guards]


# Inductor's Python wrapper checks every tensor's size, stride and alignment as it passes: ~300 checks a
# step (0.3-0.5 ms at one row on 2 cores) of what our own operators and the decoder fix at load.
STEP_OPTIONS = {"guard_filter_fn": unchanged_after_load, "size_asserts": False, "alignment_asserts": False}


def own_code(method: Callable) -> Callable:
    """``method`` of one decoder, as a function with a code object of its own. Dynamo keeps its graphs
    per code object: without this, every decoder of a process (tests build many, in several dtypes
    and weight formats) would share ``Decoder.decode``'s graphs, chosen between by the guards on the
    decoder that ``unchanged_after_load`` leaves out."""
    function = method.__func__
    code = function.__code__.replace(co_name=f"{function.__name__}_{id(method.__self__):x}")
    own = types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
    return types.MethodType(own, method.__self__)


class ModelRunner:
    def __init__(self, decoder: model.Decoder, kv: KVManager, device: torch.device, compile: bool,
                 shapes: Shapes, progress: Callable[[str], None] = lambda text: None) -> None:
        """``shapes`` says how steps are padded (``Shapes.plan``); ``progress`` hears what the warm-up is
        doing, shape by shape (``llm.compiles.Progress.status``)."""
        self.decoder = decoder
        self.kv = kv
        self.device = device
        self.shapes = shapes
        self.warmed: frozenset[Shape] = frozenset()  # the shapes run at load
        self.last_shape: Shape | None = None  # the latest step's, for tests and logs
        self._graphs: dict[Shape, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]] = {}
        self._decode, self._mixed = decoder.decode, decoder.mixed
        if compile:
            # Inductor reads its code templates in the locale's encoding, and a Python backend stub runs in
            # the C locale (ASCII) whatever the environment says.
            if locale.getpreferredencoding(False).lower() not in ("utf-8", "utf8"):
                locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
            # Each dynamic size its own symbol: by default sizes equal when first compiled are assumed
            # equal for good (rows and columns, say).
            torch.fx.experimental._config.use_duck_shape = False
            # Inductor's Python wrapper calls the step's ~300 kernels and operators. Its C++ wrapper saved
            # 1-2.3 ms a decode step on 2 cores (bench.step_profile, 1 row), but compiling it is one more
            # monolithic g++ run per graph: a cold start of the int8 graphs on an AVX2 EPYC took over 600 s
            # with it and 330 s without (2026-12-07). GPUs replay captured CUDA graphs, with no wrapper a step.
            self._decode = torch.compile(own_code(decoder.decode), options=STEP_OPTIONS)
            self._mixed = torch.compile(own_code(decoder.mixed), options=STEP_OPTIONS)
            self.warm_up(progress)

    @property
    def cuda_graphs(self) -> int:
        return len(self._graphs)

    @torch.inference_mode()
    def warm_up(self, progress: Callable[[str], None]) -> None:
        """Run every shape of ``shapes.warm_up()`` on scratch inputs: the first of each kind compiles its
        graph (or loads it from the cache); on CUDA each decode shape is then captured as a CUDA graph."""
        plan = self.shapes.warm_up()
        capture = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if capture else None
        compiled = set()
        for i, shape in enumerate(plan, 1):
            args = self._scratch(shape)
            if shape.kind not in compiled:
                progress(f"compiling the {shape.kind} step ({shape.tokens} tokens{self._columns(shape)}; "
                         f"shape {i} of {len(plan)})")
                for tensor in args:  # the cache buffers keep their size: another kv_cache_tokens compiles anew
                    torch._dynamo.mark_dynamic(tensor, 0)
                if len(args) > 4:  # decode rows x context columns, in the graph
                    torch._dynamo.mark_dynamic(args[-2], 1)
                compiled.add(shape.kind)
            else:
                progress(f"{'capturing' if capture and shape.kind == 'decode' else 'running'} {shape.kind} shape "
                         f"{i} of {len(plan)} ({shape.tokens} tokens{self._columns(shape)})")
            self._call(shape, args)
            if capture and shape.kind == "decode":
                self._capture(shape, args, pool)
        if capture:
            torch.cuda.synchronize(self.device)
        self.warmed = frozenset(plan)

    @torch.inference_mode()
    def run(self, step: Step) -> torch.Tensor:
        """Float32 logits, one row for each of ``step.sampled``. On CUDA they may live in a CUDA graph's
        output, which the next step overwrites: use them before then."""
        shape, args, sampled = self._decode_inputs(step) if not step.prefill else self._mixed_inputs(step)
        self.last_shape = shape
        graph = self._graphs.get(shape)
        if graph is None:
            return self._call(shape, args)[:sampled]
        graph, inputs, logits = graph
        for static, value in zip(inputs, args):
            static.copy_(value)
        graph.replay()
        return logits[:sampled]

    @torch.inference_mode()
    def prompt_logprobs(self, ids: list[int], k: int) -> list[TokenLogprobs]:
        """Each prompt token after the first: its log-probability given the ones before it (the model's
        own distribution, as for generated tokens) and the ``k`` most likely tokens there, by a pass of
        the prompt's own, eager, that neither reads nor writes the cache."""
        tokens = torch.tensor(ids, device=self.device)
        return token_logprobs(self.decoder.prompt_logits(tokens)[:-1], tokens[1:], [k] * (len(ids) - 1))

    def _call(self, shape: Shape, args: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return (self._decode if shape.kind == "decode" else self._mixed)(*args)

    def _capture(self, shape: Shape, args: tuple[torch.Tensor, ...], pool) -> None:
        """A CUDA graph of the compiled decode step on inputs of its own; ``run`` copies each step's
        inputs into them and replays it. The shape has just run once outside the graph, so the compiler
        has nothing left to do for it."""
        inputs = tuple(a.clone() for a in args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = self._decode(*inputs)
        self._graphs[shape] = (graph, inputs, logits)

    def _decode_inputs(self, step: Step) -> tuple[Shape, tuple[torch.Tensor, ...], int]:
        seqs = step.decode
        shape = self.shapes.decode(len(seqs), max(s.computed_tokens for s in seqs) + 1)
        pad = [0] * (shape.tokens - len(seqs))  # padding rows: row 0, position 0, the scratch slot
        rows = torch.tensor([s.row for s in seqs] + pad, device=self.device)
        positions = torch.tensor([s.computed_tokens for s in seqs] + pad, device=self.device)
        ids = torch.tensor([s.token_at(s.computed_tokens) for s in seqs] + pad, device=self.device)
        slots = self.kv.slots
        args = (ids, positions, slots[rows, positions], slots[rows, :shape.columns], positions + 1)
        return shape, args, len(seqs)

    def _mixed_inputs(self, step: Step) -> tuple[Shape, tuple[torch.Tensor, ...], int]:
        """Decode rows first, then each prompt chunk (the decoder's ``Context.step``). Without padding (CPUs) the decode
        rows are graph inputs, at least MIN_SIZE of them; padded (GPUs), ``mixed_attention`` takes them."""
        slots, device, inline = self.kv.slots, self.device, not self.shapes.pad
        pad = [0] * (max(len(step.decode), MIN_SIZE) - len(step.decode) if inline else 0)  # row 0, position 0
        rows = [s.row for s in step.decode] + pad
        positions = [s.computed_tokens for s in step.decode] + pad
        ids = [s.token_at(s.computed_tokens) for s in step.decode] + pad
        logit_rows = list(range(len(step.decode)))
        mixed, decode = model.MixedStep(), ()
        if rows:
            rows_t = torch.tensor(rows, device=device)
            decode = (slots[rows_t, :max(max(positions) + 1, MIN_SIZE)], torch.tensor(positions, device=device) + 1)
            if not inline:
                mixed.decode_slots, mixed.decode_lengths = decode
                decode = ()
        for seq, count in step.prefill:
            mixed.chunks.append(model.PrefillChunk(len(ids), count, seq.computed_tokens, slots[seq.row, : seq.computed_tokens + count]))
            rows += [seq.row] * count
            positions += range(seq.computed_tokens, seq.computed_tokens + count)
            ids += seq.request.input_ids[seq.computed_tokens:seq.computed_tokens + count]
            if count == seq.prompt_left:
                logit_rows.append(len(ids) - 1)
        self.decoder.context.step = mixed
        sampled = len(logit_rows)
        shape = self.shapes.mixed(len(step.decode), step.tokens - len(step.decode), sampled)
        scratch = [0] * (shape.tokens - len(ids))  # row 0, position 0, slot 0; nothing reads them
        rows_t = torch.tensor(rows + scratch, device=device)
        positions_t = torch.tensor(positions + scratch, device=device)
        args = (torch.tensor(ids + scratch, device=device), positions_t, slots[rows_t, positions_t],
                torch.tensor(logit_rows + [0] * (shape.logits - sampled), device=device), *decode)
        return shape, args, sampled

    def _scratch(self, shape: Shape) -> tuple[torch.Tensor, ...]:
        """Inputs of ``shape`` that read and write only the scratch slot 0 (distinct tensors: the compiler
        would otherwise assume the inputs alias one another)."""
        def zeros(*size: int) -> torch.Tensor:
            return torch.zeros(size, dtype=torch.long, device=self.device)

        tokens = (zeros(shape.tokens), zeros(shape.tokens), zeros(shape.tokens))
        if shape.kind == "decode":
            return *tokens, zeros(shape.tokens, shape.columns), zeros(shape.tokens) + 1
        self.decoder.context.step = model.MixedStep()
        inline = () if self.shapes.pad else (zeros(MIN_SIZE, MIN_SIZE), zeros(MIN_SIZE) + 1)
        return *tokens, zeros(shape.logits), *inline

    @staticmethod
    def _columns(shape: Shape) -> str:
        return f" x {shape.columns} columns" if shape.kind == "decode" else ""
