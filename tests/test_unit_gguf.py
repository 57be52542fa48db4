"""GGUF files (``llm/gguf_weights.py``, ``launcher/model_folder.py``), in-process: 4-bit blocks become ``int4``'s
layout with their values unchanged, the shipped Q4_1 file loads as its own int4 weights equal to what
transformers de-quantizes from it, and the folder the launcher writes for a file holds the file's own
special tokens."""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from launcher.model_folder import check_model_dir, gguf_path, model_folder, prepare_gguf
from llm import LLM, LLMConfig, gguf_weights, quant

Q = gguf.GGMLQuantizationType


def random_blocks(qtype: Q, rows: int = 8, k: int = 256) -> np.ndarray:
    """``rows`` rows of ``k`` weights in ``qtype``: gguf's own quantizer where it has one, else (Q4_K)
    random bytes with finite float16 scales, every bit pattern of the 6-bit scales and the nibbles."""
    rng = np.random.default_rng(0)
    if qtype != Q.Q4_K:
        return gguf.quantize(rng.normal(size=(rows, k)).astype(np.float32), qtype)
    blocks = rng.integers(0, 256, size=(rows * k // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = rng.uniform(0.001, 0.1, size=(len(blocks), 2)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", gguf_weights.INT4_TYPES, ids=lambda t: t.name)
def test_4_bit_blocks_stand_for_the_weights_gguf_de_quantizes(qtype):
    data = random_blocks(qtype)
    blocks = gguf_weights.int4_blocks(data, qtype)
    assert blocks.q.shape == (8, 256) and blocks.scale.shape == (8, 256 // quant.GROUP)
    assert blocks.q.min() >= 0 and blocks.q.max() <= 15
    expected = torch.from_numpy(gguf.dequantize(data, qtype))
    torch.testing.assert_close(blocks.dequantize(), expected, atol=1e-6 * expected.abs().max().item(), rtol=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return prepare_gguf(gguf_path(), tmp_path_factory.mktemp("gguf") / "SmolLM2-135M-Instruct.Q4_1")


def test_the_folder_holds_the_files_special_tokens_and_a_link_to_it(folder):
    assert check_model_dir(folder) == [] and (folder / "model.gguf").resolve() == gguf_path().resolve()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    fields = gguf.GGUFReader(gguf_path()).fields
    eos = fields["tokenizer.ggml.eos_token_id"].contents()
    assert tokenizer.eos_token_id == eos and tokenizer.pad_token_id == fields["tokenizer.ggml.padding_token_id"].contents()
    assert tokenizer("Hello").input_ids[0] != tokenizer.bos_token_id  # the file says no bos on raw text
    assert tokenizer.chat_template


def test_a_folder_is_prepared_once_per_version_of_its_file(tmp_path):
    file = tmp_path / "model.Q4_1.gguf"
    file.symlink_to(gguf_path())
    first = prepare_gguf(file, tmp_path / "model")
    written = (first / ".prepared").stat().st_mtime_ns
    assert prepare_gguf(file, tmp_path / "model") == first and (first / ".prepared").stat().st_mtime_ns == written
    file.unlink()
    shutil.copyfile(gguf_path(), file)  # another file at that name
    again = prepare_gguf(file, tmp_path / "model")
    assert (again / "model.gguf").resolve() == file and (again / ".prepared").stat().st_mtime_ns != written
    assert model_folder(tmp_path) == tmp_path  # a folder is taken as it is


def test_the_shipped_file_loads_as_its_own_int4_blocks(folder):
    """``weights: auto`` on a folder whose only weights are the Q4_1 file serves int4, and every linear
    layer holds exactly the values transformers de-quantizes from the file (its q and k rows in
    transformers' order: the permutation is undone on the blocks as on the floats)."""
    llm = LLM(LLMConfig(str(folder), dtype="float32", compile=False), torch.device("cpu"))
    assert llm.weights == "int4" and llm.source == "model.gguf (Q4_1 x 210)"
    stored = gguf_weights.load(folder, folder / "model.gguf", torch.float32, torch.device("cpu"))[1]
    reference = AutoModelForCausalLM.from_pretrained(gguf_path().parent, gguf_file=gguf_path().name).state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.mlp.down_proj.weight"):
        blocks = stored.get(name, "int4", torch.float32)
        assert isinstance(blocks, quant.Int4)
        torch.testing.assert_close(blocks.dequantize(), reference[name], atol=1e-6, rtol=0)
    dense = stored.get("model.layers.0.self_attn.k_proj.weight", "bf16", torch.float32)
    torch.testing.assert_close(dense, reference["model.layers.0.self_attn.k_proj.weight"], atol=0, rtol=0)


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_other_settings_de_quantize_the_file_a_tensor_at_a_time(folder, weights):
    llm = LLM(LLMConfig(str(folder), weights=weights, compile=False), torch.device("cpu"))
    assert llm.weights == weights and llm.source == "model.gguf (Q4_1 x 210)"
    assert llm.weight_bytes / 2**20 > (240 if weights == "bf16" else 140)


def test_the_launcher_serves_a_model_dir_naming_a_gguf_file_from_its_folder(monkeypatch):
    """``MODEL_DIR=file.gguf make run``: the launcher hands Triton the file's prepared folder, the one
    ``python -m launcher prepare file.gguf`` prints."""
    import subprocess
    import sys

    from launcher.__main__ import model_dir
    from launcher.paths import REPO_ROOT

    monkeypatch.setenv("MODEL_DIR", str(gguf_path()))
    folder = model_dir()
    assert folder.name == gguf_path().stem and (folder / "model.gguf").resolve() == gguf_path().resolve()
    printed = subprocess.run([sys.executable, "-m", "launcher", "prepare", str(gguf_path())], cwd=REPO_ROOT,
                             capture_output=True, text=True, check=True, timeout=300).stdout.strip().splitlines()[-1]
    assert printed == str(folder)
