"""Benchmark stand-in ``llm``: the shipped glue, port and engine with the model's forward pass taken out.

Everything of ``llm`` but the model runs as shipped: validation, the scheduler and its paged-cache
bookkeeping, stop tracking, the engine and responder threads, the responses. Each step gives every
scheduled row its next token, the next of a fixed English text (so ``postprocess`` decodes real words),
a step every ``STANDIN_STEP_MS`` milliseconds, sleeping between (as a GPU's step leaves the CPU to the
rest; unset or 0: steps back to back, every token of a reply at once). So what sets the pace is everything after the engine: llm's responses, the
ensemble, ``postprocess``, Triton's front ends and the client, and ``python -m bench.serving`` measures
that ceiling (issue 45). Requests that ask for logprobs get none. The benchmark copies this file into its
own model repository as ``llm/1/model.py``; the weights still load (uncompiled), as validation needs the
model's limits.
"""

import os
import time

import triton_python_backend_utils as pb_utils

from llm.compiles import Progress
from llm.engine import Engine
from llm.sampling import Sampled
from llm.sequence import Sequence
from triton_glue import llm_model
from triton_glue.metrics import TritonMetrics

TEXT = ("The river runs past the old mill, where the miller's children count the boats that go down to the sea "
        "each morning; by noon the market is full of voices, bread and fish, and the bells ring twice. ")


class StandInEngine(Engine):
    """``engine`` (the model's, for its scheduler, cache and sampler state) with every step's tokens ready."""

    def __init__(self, engine: Engine, text: list[int], step_s: float) -> None:
        super().__init__(engine.runner, engine.scheduler, engine.sampler, engine.decode, engine.metrics, engine.grammars)
        self.text = text
        self.step_s = step_s

    def step(self) -> list[Sequence]:
        began = time.perf_counter()
        step = self.scheduler.schedule()
        rows = step.sampled
        for seq in rows:
            self.sampler._row(seq)  # the row's sampling state (its end tokens), as a real sample makes it
        sampled = Sampled([self.text[len(seq.output_ids) % len(self.text)] for seq in rows], [None] * len(rows))
        changed = self.update(step, sampled if rows else None)
        if (wait := self.step_s - (time.perf_counter() - began)) > 0:
            time.sleep(wait)
        return changed


class TritonPythonModel(llm_model.TritonPythonModel):
    def engine(self, metrics: TritonMetrics, progress: Progress) -> Engine:
        step_ms = float(os.environ.get("STANDIN_STEP_MS") or 0)
        pb_utils.Logger.log_info(f"llm: the benchmark's stand-in: no model, every token ready "
                                 f"{f'after a {step_ms:g} ms step' if step_ms else 'at once'}")
        text = self.llm.tokenizer.encode(TEXT, add_special_tokens=False)
        return StandInEngine(self.llm.engine(metrics, progress), text, step_ms / 1000)
