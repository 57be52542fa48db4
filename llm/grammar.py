"""Structured outputs: a grammar masks a row's logits before its sampler picks, so the reply is valid by
construction (a JSON schema, any JSON object, a regex, one of a list of choices, or a Lark grammar).

The library is llguidance (the engine behind vLLM's ``guidance`` backend and llama.cpp's): it has no
dependencies (one abi3 wheel, where xgrammar pulls OpenAI's ``triton`` compiler and a TVM runtime into a
CPU install), covers JSON Schema widely, and computes each mask lazily from a token trie (about 50 us a
token), so a new schema costs milliseconds to build instead of a precomputation that would stall a step.
It is imported only when a request asks for a grammar: a deployment that never does needs none of it,
and rows without a grammar pay nothing.

A grammar is built once per distinct request (``Grammars``, a bounded LRU of matchers, each request
getting a cheap copy) on the thread that submits it, never on the engine thread, and llguidance drops
the GIL while it builds.
"""

from __future__ import annotations

import importlib.util
import json
import threading
from collections import OrderedDict
from copy import copy
from typing import Any

import torch

from contract.errors import InvalidInput
from contract.grammar import llguidance_module

CACHED_GRAMMARS = 64


class Grammars:
    """The model's tokenizer as llguidance sees it (built on first use, about a second), and a bounded
    LRU of compiled grammars; ``matcher`` gives each request its own copy."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._llg = None
        self._unusable: str | None = None  # why the tokenizer could not be converted, if it could not
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.compiled = 0  # grammars built (cache misses), for tests and metrics

    def prepare(self) -> None:
        """Convert the tokenizer for llguidance now (about 0.3 s, at load), not under the first constrained
        request; without llguidance installed, nothing (constrained requests are refused, saying why)."""
        if importlib.util.find_spec("llguidance") is None:
            return
        with self._lock:
            if self._llg is None and self._unusable is None:
                try:
                    self._llg = llguidance_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
                except Exception as e:  # a tokenizer llguidance cannot read (not a fast one) must not fail the load
                    self._unusable = f"{type(e).__name__}: {e}"

    def matcher(self, grammar: str):
        """A fresh matcher for ``grammar``; ``InvalidInput`` if it cannot serve this tokenizer."""
        llguidance = llguidance_module()
        if self._llg is None:
            self.prepare()
        if self._llg is None:
            raise InvalidInput(f"structured_outputs cannot be served with this model's tokenizer ({self._unusable})"[:600])
        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
        if template is None:
            template = llguidance.LLMatcher(self._llg, grammar, log_level=0)  # the GIL is dropped while it builds
            if template.is_error():
                raise InvalidInput(f"structured_outputs cannot be compiled for this model: {template.get_error()}"[:600])
            template.compute_bitmask()  # a grammar no reply can follow shows only now: its matcher errs
            if template.is_error():
                raise InvalidInput(f"structured_outputs admits no reply this model's tokens can spell: "
                                   f"{template.get_error()}"[:600])
            with self._lock:
                self.compiled += 1
                self._cache[grammar] = template
                while len(self._cache) > CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
        return template.deep_copy()


def llguidance_tokenizer(tokenizer, vocab_size: int, eos_ids: list[int]):
    """The tokenizer as llguidance sees it: each token's bytes. A byte-level BPE (its pre-tokenizer is
    ``ByteLevel``) maps bytes to printable characters, and its tokens' bytes come back through a
    ``ByteLevel`` decoder; transformers may wrap that decoder in a sequence llguidance does not read
    (SmolLM2's: ByteFallback, Fuse, Replace, ByteLevel), and then it would take ``Ċ`` for a letter instead
    of a newline and let raw control characters into JSON strings. So the decoder it gets is the plain one."""
    import llguidance
    from tokenizers import decoders

    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    if "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("pre_tokenizer")):
        backend.decoder = decoders.ByteLevel()
    return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_ids[0] if eos_ids else None)


def mask(logits: torch.Tensor, matchers: list) -> None:
    """Each row's disallowed tokens set to -inf in ``logits`` (``[rows, vocabulary]``), from its matcher's
    bitmask (token t is bit t % 8 of byte t // 8); ``None`` leaves a row as it is."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return
    vocabulary = logits.shape[1]
    words = (vocabulary + 31) // 32
    bits = torch.empty((len(rows), words), dtype=torch.int32)
    for j, i in enumerate(rows):
        matchers[i].unsafe_compute_mask_ptr(bits[j].data_ptr(), words * 4)
    allowed = (bits.view(torch.uint8)[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1
    allowed = allowed.flatten(1)[:, :vocabulary].to(logits.device, torch.bool)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
