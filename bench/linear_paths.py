"""``python -m bench.linear_paths``: each linear layer of the default model on every kernel level this CPU
runs, in bf16, int8 and int4 weights (``--weights``), against oneDNN's own GEMM on the same bfloat16 weights
(on an AMX CPU, oneDNN's AMX path), at a decode step's rows and a batch's.

Why: the choice of a level (``llm/kernels.py``) and, on AMX, of tiles for every row count is made from
these figures (docs/benchmark.md, "AMX"); a row is microseconds a call, best of three runs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from bench.__main__ import machine
from launcher.model_folder import prepare_default_model
from llm import kernels, quant


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    """The model's linear layers as the engine fuses them: name -> (out features, in features)."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config.get("head_dim", hidden // config["num_attention_heads"])
    return {"qkv": (hidden + 2 * kv, hidden), "o": (hidden, hidden), "gate_up": (2 * inner, hidden),
            "down": (hidden, inner), "head": (config["vocab_size"], hidden)}


def microseconds(call: Callable[[], object], repeats: int) -> float:
    """Best of three runs of ``repeats`` calls, after a warm-up."""
    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(3):
        began = time.perf_counter()
        for _ in range(repeats):
            call()
        best = min(best, (time.perf_counter() - began) / repeats)
    return best * 1e6


def product(weights: str, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> x @ w.T`` on the loaded level's kernel for ``weights``, packed as ``llm`` packs them."""
    n = w.shape[0]
    if weights == "bf16":
        packed = kernels.ops.bf16_pack(w)
        return lambda x: kernels.ops.bf16_linear(x, packed, n, None)
    if weights == "int8":
        q, scale = quant.int8_weights(w)
        packed = kernels.ops.int8_pack(q)
        return lambda x: kernels.ops.int8_linear(x, packed, scale, n, None)
    q, scale, zero = quant.int4_weights(w)
    nibbles, scales = kernels.ops.int4_pack(q, scale, zero - 8 * scale)
    return lambda x: kernels.ops.int4_linear(x, nibbles, scales, n, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.linear_paths", description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--weights", nargs="+", default=["bf16", "int8", "int4"], choices=["bf16", "int8", "int4"])
    parser.add_argument("--repeats", type=int, default=100)
    args = parser.parse_args(argv)
    config = json.loads((prepare_default_model() / "config.json").read_text())
    levels, cpu = kernels.runnable(), machine()
    print(f"{cpu['cpu']} ({', '.join(cpu['cpu_features'])}), {torch.get_num_threads()} threads; "
          "microseconds a call, bfloat16 x")
    print("| weights | layer (out x in) | rows | " + " | ".join(f"ours `{name}`" for name in levels) + " | oneDNN (bf16) |")
    print("|---|---|---|" + "---|" * (len(levels) + 1))
    torch.manual_seed(0)
    for weights in args.weights:
        for name, (n, k) in shapes(config).items():
            w = torch.randn(n, k).bfloat16() * 0.05
            reordered = torch.ops.mkldnn._reorder_linear_weight(w, 16)
            repeats = max(3, args.repeats * 1000 // n)  # the output layer is 50x the others
            products = {}
            for level in levels:
                with kernels.using(level):
                    products[level] = product(weights, w)
            for rows in args.rows:
                x = torch.randn(rows, k).bfloat16()
                cells = []
                for level in levels:
                    with kernels.using(level):
                        cells.append(microseconds(lambda: products[level](x), repeats))
                onednn = microseconds(lambda: torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], ""), repeats)
                print(f"| {weights} | {name} ({n} x {k}) | {rows} | " + " | ".join(f"{c:.1f}" for c in cells)
                      + f" | {onednn:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
