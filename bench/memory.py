"""``python -m bench.memory``: the memory each ``weights`` setting takes, and what a budget leaves the KV cache.

For a model shape, by the storage ``llm`` gives each tensor (``llm/model.py`` and ``llm/quant.py``), on
a CPU with bfloat16 (our kernels) and on a GPU:

- **read a step**: the bytes a decode step reads of the weights (``llm_weight_bytes``): every linear layer
  as its setting stores it (int8 and fp8: a byte a weight and a float32 scale a row; int4: half a byte a weight
  and a 16-bit scale and offset per 32), the output layer in bfloat16 on CPUs (``Head``: float32 on GPUs),
  the norms; the input embeddings are read by row, so not counted;
- **resident**: what the weights occupy: that, the input embeddings, and on CPUs the output layer's
  float32 copy that ``Head`` re-scores its candidates from (a few rows a step);
- **KV tokens**: the cache slots ``--budget-gib`` leaves after the resident weights, at bfloat16's 2 bytes
  a value (``kv_cache_tokens`` is set in tokens; this says how many a memory size holds).

``tests/test_bench.py`` checks the arithmetic against the bytes a loaded default model reports.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GROUP = 32  # llm/quant.py's int4 group


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool  # the output layer shares the input embeddings' weights (it is still stored apart: Head)

    def linears(self) -> list[tuple[int, int]]:
        """[N, K] of every linear layer, as the decoder groups them (q, k and v as one; gate and up as one)."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        per_layer = [(qkv, self.hidden), (self.hidden, self.heads * self.head_dim),
                     (2 * self.intermediate, self.hidden), (self.hidden, self.intermediate)]
        return per_layer * self.layers

    def kv_bytes_per_token(self, value_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * value_bytes


SHAPES = {
    "SmolLM2-135M-Instruct (the default model)": ModelShape(30, 576, 9, 3, 64, 1536, 49152, True),
    "Llama-3.1-8B": ModelShape(32, 4096, 32, 8, 128, 14336, 128256, False),
}


def linear_bytes(n: int, k: int, setting: str, value_bytes: int) -> int:
    """One [N, K] linear layer as ``setting`` stores it (``value_bytes``: the model dtype's)."""
    if setting in ("int8", "fp8"):
        return n * k + 4 * n
    if setting == "int4":
        return n * k // 2 + n * (k // GROUP) * 2 * value_bytes
    return n * k * value_bytes


def footprint(shape: ModelShape, setting: str, device: str = "cpu") -> dict[str, int]:
    """Bytes read a decode step and resident, for ``setting`` (``bf16``, ``f32``, ``int8``, ``int4``, ``fp8``)."""
    value_bytes = 4 if setting == "f32" else 2
    linear = sum(linear_bytes(n, k, setting, value_bytes) for n, k in shape.linears())
    norms = (2 * shape.layers + 1) * shape.hidden * value_bytes
    table = shape.vocab * shape.hidden
    # The output layer: read in the model dtype where our CPU kernel runs it (bfloat16), float32 elsewhere;
    # on CPUs in bfloat16 a float32 copy stays resident for Head's exact re-scoring.
    head_read = table * (value_bytes if device == "cpu" and value_bytes == 2 else 4)
    head_copy = table * 4 if device == "cpu" and value_bytes == 2 else 0
    read = linear + norms + head_read
    return {"read": read, "resident": read + table * value_bytes + head_copy}


def table(budget_gib: dict[str, float]) -> str:
    lines = ["| model shape | device | weights | MiB read a step | resident MiB | KV bytes a token | KV tokens in "
             "the budget |", "|---|---|---|---|---|---|---|"]
    for name, shape in SHAPES.items():
        budget = budget_gib[name] * 2**30
        for device, settings in (("cpu", ("bf16", "f32", "int8", "int4")), ("cuda", ("bf16", "fp8"))):
            for setting in settings:
                f = footprint(shape, setting, device)
                kv = shape.kv_bytes_per_token(4 if setting == "f32" else 2)
                left = max(0, int((budget - f["resident"]) // kv))
                lines.append(f"| {name} | {device} | {setting} | {f['read'] / 2**20:,.0f} | {f['resident'] / 2**20:,.0f} | "
                             f"{kv:,} | {left:,} ({budget_gib[name]:g} GiB) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-gib", type=float, nargs=2, default=[2.0, 24.0], metavar=("DEFAULT", "LLAMA_8B"),
                        help="memory for weights and KV cache, per shape (default: 2 and 24 GiB)")
    args = parser.parse_args(argv)
    print(table(dict(zip(SHAPES, args.budget_gib))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
