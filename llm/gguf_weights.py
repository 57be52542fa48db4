"""A model's weights read from a GGUF file (llama.cpp's format), its 4-bit blocks kept as they are.

Why: the default model ships as a Q4_1 GGUF, and llama.cpp serves such a file at its own size. The 4-bit
types map exactly onto the ``int4`` setting's layout (``llm/quant.py``: groups of 32 input columns,
``w = (q - 8) x scale + zero``):

- Q4_0, ``w = d (q - 8)``: scale d, zero 0;
- Q4_1, ``w = d q + m``: scale d, zero m + 8 d;
- Q4_K, super-blocks of 256 in 8 groups of 32, ``w = d sc q - dmin m``: scale d sc, zero 8 d sc - dmin m.

So ``int4`` takes those blocks without a float copy of the model. Every other tensor (the embeddings and
norms, Q8_0, whose scales are per block of 32 where ``int8``'s are per row, the K types above 4 bits,
F16, BF16, F32) is de-quantized one at a time, when the decoder asks for it, and stored as the setting
says. A folder whose only weights are a GGUF serves the file's own setting under ``weights: auto``
(``own_setting``).

Names, config and tokenizer come from transformers' GGUF support (the launcher writes the folder, with
the file linked in it as ``model.gguf``); so does the permutation llama.cpp applies to the q and k rows for
its rotary layout, undone here on the blocks' rows as transformers undoes it on float weights.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

from llm import quant

Q = gguf.GGMLQuantizationType
INT4_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K)
# The decoder layers' linear weights: what the weights setting stores (the rest keeps the model's dtype).
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
GGUF_LINEAR = re.compile(r"blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight")  # the same, as GGUF names them


def linear_types(reader: gguf.GGUFReader) -> Counter:
    """How many of the file's linear weights are in each type."""
    return Counter(t.tensor_type for t in reader.tensors if GGUF_LINEAR.fullmatch(t.name))


def own_setting(path: Path | gguf.GGUFReader) -> str:
    """The setting a GGUF file's linear weights are in: int4 when most are 4-bit types, int8 when most are
    Q8_0, else auto (the model's dtype)."""
    types = linear_types(path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(path))
    common = types.most_common(1)[0][0] if types else None
    return "int4" if common in INT4_TYPES else "int8" if common == Q.Q8_0 else "auto"


def int4_blocks(data: np.ndarray, qtype: Q) -> quant.Int4:
    """A 4-bit tensor's blocks (``data``: [N, bytes a row], uint8, as ``gguf.GGUFReader`` maps them) as
    ``quant.Int4``: the same q, the float16 scales and offsets as float32."""
    rows = data.shape[0]
    nibbles = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    if qtype == Q.Q4_K:  # d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of q
        blocks = data.reshape(-1, 144)
        d, dmin = (blocks[:, i:i + 2].view(np.float16).astype(np.float32) for i in (0, 2))
        sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        scale, low = d * sc, dmin * m  # [blocks, 8]
        q = (blocks[:, 16:].reshape(-1, 4, 1, 32) >> nibbles) & 0x0F  # group 2j low nibbles, 2j + 1 high
        zero = 8 * scale - low
    else:  # Q4_0: d, 16 bytes of q; Q4_1: d, m, 16 bytes of q (weights j and j + 16 share a byte)
        start = 2 if qtype == Q.Q4_0 else 4
        blocks = data.reshape(-1, start + 16)
        scale = blocks[:, 0:2].view(np.float16).astype(np.float32)
        zero = 0 * scale if qtype == Q.Q4_0 else blocks[:, 2:4].view(np.float16).astype(np.float32) + 8 * scale
        q = (blocks[:, start:].reshape(-1, 1, 1, 16) >> nibbles) & 0x0F
    return quant.Int4(torch.from_numpy(q.reshape(rows, -1).astype(np.int32)),
                      torch.from_numpy(np.ascontiguousarray(scale.reshape(rows, -1))),
                      torch.from_numpy(np.ascontiguousarray(zero.reshape(rows, -1))))


class GGUFWeights:
    """The tensors of one GGUF file by Hugging Face parameter name, each read when asked."""

    def __init__(self, path: Path, skeleton: PreTrainedModel) -> None:
        """``skeleton``: the model built from the file's config (on the meta device), for the names."""
        self.reader = gguf.GGUFReader(path)
        names = get_gguf_hf_weights_map(skeleton)
        self.tensors = {names[t.name]: t for t in self.reader.tensors if t.name in names}
        architecture = self.reader.fields["general.architecture"].contents()
        self.processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=skeleton.config.to_dict())

    def own_setting(self) -> str:
        return own_setting(self.reader)

    def types(self) -> str:
        """The linear weights' types and counts, for the load log ("Q4_1 x 210")."""
        return ", ".join(f"{t.name} x {count}" for t, count in linear_types(self.reader).most_common())

    def get(self, name: str, setting: str, dtype: torch.dtype) -> torch.Tensor | quant.Int4:
        """Parameter ``name``: its blocks as they are where ``setting`` is int4 and they are 4-bit; else
        de-quantized to ``dtype``."""
        t = self.tensors[name]
        if setting == "int4" and t.tensor_type in INT4_TYPES and LINEAR.fullmatch(name):
            blocks = int4_blocks(t.data, t.tensor_type)
            # llama.cpp's q and k row order, undone by the same permutation transformers applies
            order = self.processor.process(np.arange(blocks.q.shape[0])[:, None], t.name).weights[:, 0]
            return quant.Int4(*(part[torch.from_numpy(np.ascontiguousarray(order))] for part in blocks))
        dense = self.processor.process(gguf.dequantize(t.data, t.tensor_type), t.name).weights
        return torch.from_numpy(np.array(dense)).to(dtype)  # a copy: the file's map is read-only


def load(folder: Path, path: Path, dtype: torch.dtype, device: torch.device) -> tuple[PreTrainedModel, GGUFWeights]:
    """The model of ``folder``'s config with every tensor but the decoder layers' linear weights read from
    the GGUF file ``path``, on ``device``; those stay ``None`` (``Decoder`` reads them from the returned
    ``GGUFWeights``, in the setting it stores them in)."""
    config = AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    weights = GGUFWeights(path, hf)
    for name, _ in list(hf.named_parameters()):
        module_name, leaf = name.rsplit(".", 1)
        module = hf.get_submodule(module_name)
        if LINEAR.fullmatch(name):
            setattr(module, leaf, None)
        elif name in weights.tensors:
            value = weights.get(name, "auto", dtype).to(device)
            setattr(module, leaf, torch.nn.Parameter(value.view(getattr(module, leaf).shape), requires_grad=False))
    hf.tie_weights()
    rotary = hf.model.rotary_emb
    hf.model.rotary_emb = type(rotary)(config=hf.config, device=device)
    missing = [name for name, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if missing:
        raise ValueError(f"parameter 'model_dir': {path} lacks {', '.join(missing[:4])}"
                         f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}")
    if (folder / "generation_config.json").is_file():
        hf.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    return hf.eval(), weights
