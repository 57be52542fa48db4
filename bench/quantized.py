"""``python -m bench.quantized``: quantized weights side by side, ours against llama.cpp's on the same bits.

Our ``WEIGHTS=int8`` and ``WEIGHTS=int4`` pipelines (``generate_stream``) against ``llama-server`` on
``Q8_0`` and on ``Q4_1``, the fixed workload of ``make bench`` at each concurrency of ``--concurrency``.
``Q4_1`` is the shipped file itself; ours ``int4`` serves its very blocks (``llm/gguf_weights.py``).
``Q8_0`` is made from it by ``llama-quantize``; ours ``int8`` quantizes the same de-quantized weights by
row. Each system has its own roofline for the bytes it reads a decode step (ours from ``llm_weight_bytes``,
llama.cpp's from the file: every tensor but the embeddings, plus the output matrix, which a tied model
reads from the embeddings), at the bandwidth and bfloat16 GEMM peak this machine measures now.

``--weights bf16`` adds our bfloat16 weights against llama-server on ``BF16`` (made by ``llama-quantize``
from the shipped file): with ``--weights bf16 int4``, the table by CPU kind of docs/benchmark.md (the file
as it ships, and bfloat16, each against llama.cpp on the same bits).

``make bench`` runs this (int8 and int4) as a part of its full mode, whose main sweep holds our automatic
dtype against llama-server BF16; alone it takes about 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path

import gguf
import requests
import torch

from bench import peers, report, roofline
from bench.__main__ import FULL, machine, start, sweep_peer, sweep_triton, workloads
from bench.roofline import Roofline
from launcher.install import has_gpu
from launcher.model_folder import gguf_path, prepare_default_model
from launcher.paths import MODEL_REPOSITORY
from llm import LLMConfig, load_model
from preprocess import PreprocessConfig, Preprocessor, PromptRequest

log = logging.getLogger("bench.quantized")


def gguf_weight_bytes(path: Path) -> int:
    """What llama.cpp reads of a GGUF's weights a decode step: every tensor but the token embeddings (read
    by row), plus the output matrix, the token embeddings themselves where the model ties them."""
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    return sum(sizes.values()) - sizes["token_embd.weight"] + (0 if "output.weight" in sizes else sizes["token_embd.weight"])


def weight_bytes(port: int, timeout: float = 60.0) -> int:
    """``llm_weight_bytes`` from a server's metrics port, which Triton opens just after it says ready."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            return int(float(next(line.split()[-1] for line in text.splitlines() if line.startswith("llm_weight_bytes"))))
        except (requests.ConnectionError, StopIteration):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def llama_file(bin_dir: Path, kind: str, out: Path) -> Path:
    """The shipped Q4_1 file as it is, or ``llama-quantize``'s ``kind`` of it."""
    return gguf_path() if kind == "Q4_1" else peers.llama_gguf(bin_dir, kind, out)


def run(sets: dict, ids: dict, model_dir: Path, concurrency: tuple[int, ...], bf16: Roofline, out: Path,
        config_name: str, settings: tuple[str, ...] = ("int8", "int4")) -> tuple[list[dict], dict[str, Roofline], list[dict]]:
    """Points, rooflines (by the points' ``dtype``: the setting or llama.cpp's type) and notes, for our
    ``settings`` and their pairs (``report.QUANTIZED_PAIRS``)."""
    pairs = [(setting, kind) for setting, kind in report.QUANTIZED_PAIRS if setting in settings]
    fixed = {"fixed": sets["fixed"]}
    context = max(len(ids[i.text_input]) + i.max_tokens for i in sets["fixed"]) + 16
    points, limits, notes = [], {}, []

    def limit(name: str, weight_bytes: int) -> Roofline:
        return Roofline(name, bf16.peak_flops, bf16.bandwidth, bf16.params, weight_bytes, bf16.kv_bytes_per_token)

    for setting, _ in pairs:
        server, _ = start(MODEL_REPOSITORY, model_dir, out, f"ensemble-{setting}", config_name, WEIGHTS=setting)
        try:
            limits[setting] = limit(setting, weight_bytes(server.ports.metrics))
            points += asyncio.run(sweep_triton(f"ensemble_http_{setting}", setting, server, fixed, FULL, concurrency))
        finally:
            server.stop()
    bin_dir = peers.build_llama_cpp(out)

    def sweep_llama(file: Path, kind: str, slots: int, repack: bool) -> bool:
        """llama-server's points on ``file`` with ``slots``, and a note either way; False when it died by a signal."""
        server = peers.llama_server(bin_dir, file, kind, slots, context, out, repack)
        said = f"{slots} slots{'' if repack else ', --no-repack'}"
        try:
            server.wait_ready(300)
            found, check = asyncio.run(sweep_peer(server, fixed, FULL, ids, (slots,)))
            points.extend(found)
            notes.append({"system": server.name, "status": f"ran with {said}; prompt tokens agree: {check['agree']}"})
        except Exception as e:  # a peer that fails is reported, never hidden
            notes.append({"system": server.name, "status": f"failed with {said}: {e}"})
            return (server.process.poll() or 0) >= 0
        finally:
            server.stop()
        return True

    for _, kind in pairs:
        file = llama_file(bin_dir, kind, out)
        limits[kind] = limit(kind, gguf_weight_bytes(file))
        repack = True
        for slots in concurrency:  # one server per concurrency, a slot per client (as make bench runs it)
            if not sweep_llama(file, kind, slots, repack) and repack:
                # killed by a signal in its repacked (AMX, AVX-512) path: again without it, said in the notes
                repack = False
                sweep_llama(file, kind, slots, repack)
    return points, limits, notes


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m bench.quantized", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--weights", nargs="+", default=["int8", "int4"], choices=[s for s, _ in report.QUANTIZED_PAIRS],
                        help="our settings, each against llama-server on the same bits (bf16: against BF16)")
    parser.add_argument("--out", type=Path, default=Path("bench_results/quantized"))
    args = parser.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_default_model()
    sets = {"fixed": workloads(FULL)["fixed"]}
    preprocessor = Preprocessor(PreprocessConfig(str(model_dir)))
    ids = {i.text_input: preprocessor.encode(PromptRequest(i.text_input.encode())).input_ids for i in sets["fixed"]}
    contexts = {"fixed": sum(len(ids[i.text_input]) + i.max_tokens / 2 for i in sets["fixed"]) / len(sets["fixed"])}
    config = json.loads((model_dir / "config.json").read_text())
    params = sum(p.numel() for p in load_model(LLMConfig(str(model_dir), compile=False), torch.device("cpu")).parameters())
    kv_values = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
    bf16 = roofline.measure(params, kv_values, [torch.bfloat16], torch.device("cpu"), quick=False)["bfloat16"]
    points, limits, notes = run(sets, ids, model_dir, tuple(args.concurrency), bf16, out, "" if has_gpu() else "cpu",
                                tuple(args.weights))
    table = report.quantized_rows(points, limits, contexts)
    results = {"machine": machine(), "contexts": contexts, "roofline_bfloat16": bf16.as_dict(),
               "rooflines": {k: v.as_dict() for k, v in limits.items()}, "points": points, "quantized": table,
               "peers": notes}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    text = "\n".join(report.quantized_markdown(table))
    (out / "results.md").write_text(text)
    m = results["machine"]
    print(f"{m['cpu']} ({', '.join(m['cpu_features'])}; {m['kernels']}), {m['cores']} cores, {bf16.bandwidth / 1e9:.1f} GB/s read\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
