"""A ``Step`` as tensors, run through the decoder: compiled, and on GPUs replayed as CUDA graphs.

A 135M model's step is a few milliseconds of arithmetic, so Python and per-op dispatch would dominate it.
``torch.compile`` (inductor) fuses each layer's small ops into a few C++ or Triton kernels. Two graphs
cover every step: decode rows only, and decode rows plus prompt chunks. Their sizes are dynamic (no
recompile when the batch changes), and each is padded to at least ``MIN_SIZE`` rows and tokens, since the
compiler would otherwise specialise sizes 0 and 1 into graphs of their own. Compiled code is cached on
disk (``TORCHINDUCTOR_CACHE_DIR``, ``.cache/torchinductor`` with the launcher), so a restart reloads it.

On CUDA, decode steps are padded further, to power-of-two rows and columns, and run in
``reduce-overhead`` mode, which records a CUDA graph per shape and replays it: one launch per step.
"""

from __future__ import annotations

import locale

import torch

from llm import model
from llm.kv import BlockTable
from llm.scheduler import Step

MIN_SIZE = 2


def _bucket(n: int) -> int:
    return max(MIN_SIZE, 1 << (n - 1).bit_length())


class ModelRunner:
    def __init__(self, decoder: model.Decoder, table: BlockTable, device: torch.device, compile: bool) -> None:
        self.decoder = decoder
        self.table = table
        self.device = device
        self.cuda_graphs = compile and device.type == "cuda"
        self._decode, self._mixed = decoder.decode, decoder.mixed
        if compile:
            # Inductor reads its code templates in the locale's encoding, and a Python backend stub runs in
            # the C locale (ASCII) whatever the environment says.
            if locale.getpreferredencoding(False).lower() not in ("utf-8", "utf8"):
                locale.setlocale(locale.LC_CTYPE, "C.UTF-8")
            # Each dynamic size its own symbol: by default sizes equal when first compiled are assumed
            # equal for good, and the warm-up's 2 rows, 2 columns and 2 prompt tokens are all equal.
            torch.fx.experimental._config.use_duck_shape = False
            self._decode = torch.compile(decoder.decode, mode="reduce-overhead" if self.cuda_graphs else None)
            self._mixed = torch.compile(decoder.mixed)
            self.warm_up()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile both graphs now (or load them from the cache) rather than during a request."""
        scratch = Step()
        for prefill in (False, True):
            self._run(scratch, prefill_tokens=MIN_SIZE if prefill else 0, mark_dynamic=True)

    @torch.inference_mode()
    def run(self, step: Step) -> torch.Tensor:
        """Float32 logits, one row for each of ``step.sampled``."""
        return self._run(step)

    def _run(self, step: Step, prefill_tokens: int = 0, mark_dynamic: bool = False) -> torch.Tensor:
        rows = [s.row for s in step.decode]
        positions = [s.cached for s in step.decode]
        ids = [s.token_at(s.cached) for s in step.decode]
        padded = self._rows(len(rows), bool(step.prefill or prefill_tokens))
        pad = padded - len(rows)
        rows, positions, ids = rows + [0] * pad, positions + [0] * pad, ids + [0] * pad
        logit_rows = list(range(len(step.decode)))
        model.CHUNKS.items = []
        for seq, count in step.prefill:
            first = len(ids) - padded
            rows += [seq.row] * count
            positions += range(seq.cached, seq.cached + count)
            ids += seq.request.input_ids[seq.cached:seq.cached + count]
            model.CHUNKS.items.append(model.PrefillChunk(first, count, seq.cached,
                                                         self.table.slots[seq.row, : seq.cached + count]))
            if count == seq.prompt_left:
                logit_rows.append(len(ids) - 1)
        prefill = bool(step.prefill or prefill_tokens)
        if prefill:  # scratch tokens up to MIN_SIZE: row 0, position 0, slot 0, no chunk reads them
            scratch = max(prefill_tokens, MIN_SIZE) - (len(ids) - padded)
            rows, positions, ids = rows + [0] * scratch, positions + [0] * scratch, ids + [0] * scratch
        sampled = len(logit_rows)
        logit_rows += [0] * (MIN_SIZE - sampled)

        device = self.device
        rows_t = torch.tensor(rows, device=device)
        positions_t = torch.tensor(positions, device=device)
        decode_lengths = positions_t[:padded] + 1
        columns = max(positions[:padded]) + 1
        columns = _bucket(columns) if self.cuda_graphs and not prefill else max(columns, MIN_SIZE)
        args = (
            torch.tensor(ids, device=device), positions_t, self.table.slots[rows_t, positions_t],
            self.table.slots[rows_t[:padded], :columns], decode_lengths, torch.tensor(logit_rows, device=device),
        )
        if mark_dynamic:  # the cache buffers keep their size: another kv_cache_tokens compiles anew
            for tensor in args:
                torch._dynamo.mark_dynamic(tensor, 0)
            torch._dynamo.mark_dynamic(args[3], 1)
        logits = (self._mixed if prefill else self._decode)(*args)
        return logits[:sampled]

    def _rows(self, count: int, prefill: bool) -> int:
        """Decode rows as run: at least MIN_SIZE, and a power of two for CUDA graphs."""
        return _bucket(count) if self.cuda_graphs and not prefill else max(count, MIN_SIZE)
