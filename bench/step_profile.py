"""``python -m bench.step_profile``: one decode step of the engine alone, timed and taken apart by operator.

The default model, compiled as the server runs it, ``--rows`` rows decoding at ``--columns`` positions of
context. Prints the step's time, the bytes it reads of the weights (``Decoder.weight_bytes``) against
this machine's read bandwidth (``bench.roofline.bandwidth``), and with ``--profile`` torch's per-operator
table of a few steps. docs/benchmark.md shows its output before and
after the CPU kernels (``llm/kernels.py``).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.roofline import bandwidth
from launcher.model_folder import prepare_default_model
from llm import LLM, LLMConfig
from llm.sequence import Sequence


def step_seconds(llm: LLM, engine, rows: int, columns: int, steps: int) -> float:
    """Seconds per decode step for ``rows`` rows past ``columns`` positions (prompts prefilled first)."""
    seqs = [Sequence(llm.validate(list(range(10, 10 + columns)), steps, ignore_eos=True)) for _ in range(rows)]
    for seq in seqs:
        engine.add(seq)
    while any(s.computed_tokens < columns for s in seqs):
        engine.step()
    began, count = time.perf_counter(), 0
    while engine.has_work:
        engine.step()
        count += 1
    return (time.perf_counter() - began) / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--columns", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weights", default="auto", help="the weights setting (docs/configuration.md#weights)")
    parser.add_argument("--profile", action="store_true", help="also torch's per-operator table")
    args = parser.parse_args(argv)
    llm = LLM(LLMConfig(str(prepare_default_model()), dtype=args.dtype, weights=args.weights, compile=True, max_tokens_limit=512,
                        kv_cache_tokens=max(16384, args.rows * (args.columns + 160)), max_running_requests=64),
              torch.device("cpu"))
    engine = llm.engine()
    step_seconds(llm, engine, args.rows, args.columns, 8)  # a first pass through every path
    seconds = min(step_seconds(llm, engine, args.rows, args.columns, 64) for _ in range(3))
    read, weights = bandwidth(torch.device("cpu"), gib=1.0, repeats=5), llm.decoder.weight_bytes()
    print(f"{args.rows} rows x {args.columns} columns, {llm.dtype}, weights {args.weights} ({llm.kernels}): {seconds * 1e3:.2f} ms a step, "
          f"{args.rows / seconds:.1f} tok/s; weights read {weights / 1e6:.0f} MB a step, bandwidth {read / 1e9:.1f} GB/s: "
          f"limit {weights / read * 1e3:.2f} ms ({weights / read / seconds:.0%} of it)")
    if args.profile:
        with torch.profiler.profile() as trace:
            step_seconds(llm, engine, args.rows, args.columns, 32)
        print(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=16))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
