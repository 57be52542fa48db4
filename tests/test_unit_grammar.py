"""Structured outputs in the engine: a random model's replies follow the grammar by construction."""

from __future__ import annotations

import json
from enum import Enum
from typing import Optional

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from contract.errors import InvalidInput
from contract.schema import FinishReason
from llm import LLM, LLMConfig
from contract import tools
from contract.grammar import closed, llguidance_grammar
from contract.tools import check_tools
from llm.sequence import Sequence

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["colour", "count", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    """A random two-layer Llama with the real tokenizer's vocabulary: whatever it prefers, the mask decides."""
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return LLM(LLMConfig("unused", compile=False, max_tokens_limit=128, kv_cache_tokens=2048), torch.device("cpu"),
               model, tokenizer)


def run(llm: LLM, requests) -> list[Sequence]:
    engine = llm.engine()
    seqs = [Sequence(r) for r in requests]
    for seq in seqs:
        engine.add(seq)
    while engine.has_work:
        engine.step()
    return seqs


def test_replies_follow_a_json_schema_greedy_and_sampled_beside_free_rows(llm):
    structured = {"json": SCHEMA}
    requests = [llm.validate([1, 2, 3], 100, structured_outputs=structured)]
    requests += [llm.validate([4, 5], 100, structured_outputs=structured, temperature=1.0, seed=s) for s in range(6)]
    requests += [llm.validate([6, 7], 20)]  # a free row in the same batch
    seqs = run(llm, requests)
    for seq in seqs[:-1]:
        assert seq.finish_reason is FinishReason.STOP, seq.finish_reason
        jsonschema.validate(json.loads(llm.decode(seq.output_ids)), SCHEMA)
    assert len({llm.decode(s.output_ids) for s in seqs[1:-1]}) > 1  # sampled rows still sample
    free = seqs[-1]
    assert free.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) and free.output_ids


def test_regex_choice_and_any_json_object(llm):
    regex, choice, anything = run(llm, [llm.validate([1], 40, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2}"}),
                                        llm.validate([2], 40, structured_outputs={"choice": ["yes", "no", "maybe"]}),
                                        llm.validate([3], 120, structured_outputs={"json_object": True})])
    assert regex.finish_reason is FinishReason.STOP and len(llm.decode(regex.output_ids)) == 6
    assert llm.decode(choice.output_ids) in ("yes", "no", "maybe")
    if anything.finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(llm.decode(anything.output_ids)), dict)


def test_a_grammar_is_built_once_per_distinct_request(llm):
    before = llm.grammars.compiled
    run(llm, [llm.validate([1], 10, structured_outputs={"regex": "[ab]{4}"}) for _ in range(3)])
    assert llm.grammars.compiled == before + 1


@pytest.mark.parametrize("spec, message", [
    ({}, "must set exactly one of"),
    ({"json": SCHEMA, "regex": "a"}, "must set exactly one of"),
    ({"jsn": {}}, "unknown keys"),
    ({"regex": "("}, "structured_outputs.regex cannot be compiled"),
    ({"json": {"type": "string", "pattern": "(?=a)"}}, "structured_outputs.json cannot be compiled"),
    ({"choice": []}, "non-empty list"),
    ({"json_object": "yes"}, "json_object must be true"),
])
def test_bad_specs_name_the_field(spec, message):
    with pytest.raises(InvalidInput, match=message):
        llguidance_grammar(spec)


def test_llguidance_reads_the_tokenizers_bytes(model_dir):
    """Each token's bytes as the model's tokenizer decodes them: a newline token is a newline, not the
    letter byte-level BPE prints for it, so no raw control character gets into a JSON string."""
    import numpy as np

    from llm.grammar import Grammars, llguidance_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = 'line one\n\ttab "quoted" 中文 🙂'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert llguidance_tokenizer(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).decode_bytes(ids) == text.encode()
    matcher = Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id}).matcher(llguidance_grammar(
        {"json": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}))
    for token in tokenizer.encode('{"a":"', add_special_tokens=False):
        assert matcher.consume_token(token)
    allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")[:len(tokenizer)]
    controls = [i for i in np.nonzero(allowed)[0] if any(ord(c) < 32 for c in tokenizer.decode([int(i)]))]
    assert allowed.sum() > 1000 and controls == []


def test_a_grammar_no_reply_can_follow_is_refused(llm):
    with pytest.raises(InvalidInput, match="admits no reply"):
        llm.grammars.matcher(llguidance_grammar({"regex": "[^\\s\\S]"}))


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                         "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = check_tools([{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
                     {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}])


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.mark.parametrize("syntax", ["generic", "hermes"])
@pytest.mark.parametrize("choice, parallel, response", [("required", True, None), ("required", False, None),
                                                        ("weather", True, None), ("auto", True, None), ("auto", True, ANSWER)])
def test_tool_call_grammars_hold_random_replies_to_the_tools(llm, syntax, choice, parallel, response):
    """Whatever a random model prefers, a reply held by a tool grammar parses into calls of defined tools
    whose arguments follow their parameters (a named choice: that tool, once; without parallel: once),
    or, under auto, an answer (following ``response`` when given)."""
    spec = tools.grammar(list(TOOLS), choice, parallel, syntax, response)
    if spec is None:  # hermes auto is free, as vLLM's hermes parser leaves it
        assert (syntax, choice) == ("hermes", "auto")
        return
    seqs = run(llm, [llm.validate([1, 2], 128, structured_outputs=spec, temperature=1.0, seed=s) for s in range(6)])
    finished = [s for s in seqs if s.finish_reason is FinishReason.STOP]
    assert finished  # a random model may run out of tokens inside a string; most finish
    for seq in finished:
        parsed = tools.parse(llm.decode(seq.output_ids), final=True)
        if not parsed.calls:  # only auto may answer instead
            assert choice == "auto", parsed
            if response is not None:
                jsonschema.validate(json.loads(parsed.content), response)
            continue
        assert len(parsed.calls) == 1 or (parallel and choice in ("required", "auto"))
        for call in parsed.calls:
            assert call.complete and (call.name == choice if choice in ("weather", "clock") else call.name in ("weather", "clock"))
            jsonschema.validate(json.loads(call.arguments), WEATHER if call.name == "weather" else {"type": "object"})
            assert set(json.loads(call.arguments)) <= {"city", "days"}  # closed to keys the parameters do not list


class Unit(str, Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Place(BaseModel):
    city: str = Field(max_length=12)
    country: Optional[str] = Field(default=None, max_length=12)


class Reading(BaseModel):
    """$ref at depth one (the Enum), two (Place, inside a list of models) and an Optional model."""
    unit: Unit
    places: list[Place] = Field(max_length=2)
    home: Optional[Place]


class Node(BaseModel):
    """A recursive model: its $ref points at its own definition."""
    name: str = Field(max_length=8)
    children: list["Node"] = Field(max_length=2)


DEFS_TOOLS = [openai.pydantic_function_tool(Reading, name="reading"), openai.pydantic_function_tool(Node, name="tree")]
DEFS_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in DEFS_TOOLS}


@pytest.mark.parametrize("syntax", ["generic", "hermes"])
@pytest.mark.parametrize("choice, parallel, response", [("required", True, None), ("required", False, None),
                                                        ("reading", True, None), ("auto", True, None),
                                                        ("auto", False, Place.model_json_schema())])
def test_tool_grammars_resolve_the_tools_own_defs(llm, syntax, choice, parallel, response):
    """Parameters with ``$defs`` and ``$ref`` (as ``pydantic_function_tool`` writes them) hold a random model's
    calls to the tool's own schema, with its definitions, in both syntaxes, for every choice; so does an
    answer schema with its own ``$defs``."""
    spec = tools.grammar(check_tools(DEFS_TOOLS), choice, parallel, syntax, response and closed(response))
    if spec is None:
        assert (syntax, choice) == ("hermes", "auto")
        return
    seqs = run(llm, [llm.validate([1, 2], 128, structured_outputs=spec, temperature=1.0, seed=s) for s in range(6)])
    finished = [s for s in seqs if s.finish_reason is FinishReason.STOP]
    assert finished
    for seq in finished:
        parsed = tools.parse(llm.decode(seq.output_ids), final=True)
        if not parsed.calls:
            assert choice == "auto"
            if response is not None:
                jsonschema.validate(json.loads(parsed.content), response)
            continue
        assert len(parsed.calls) == 1 or parallel
        for call in parsed.calls:
            assert call.name == choice or choice not in DEFS_SCHEMAS
            jsonschema.validate(json.loads(call.arguments), DEFS_SCHEMAS[call.name])


def accepts(model_dir, spec: dict, text: str) -> bool:
    """Whether the grammar takes ``text`` whole, token by token as the engine feeds it."""
    from llm.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    matcher = Grammars(tokenizer, len(tokenizer), {tokenizer.eos_token_id}).matcher(llguidance_grammar(spec))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


GOOD = {"unit": "celsius", "places": [{"city": "Oslo", "country": None}], "home": {"city": "Rome", "country": "IT"}}
TREE = {"name": "a", "children": [{"name": "b", "children": [{"name": "c", "children": []}]}]}


@pytest.mark.parametrize("syntax", ["generic", "hermes"])
@pytest.mark.parametrize("name, arguments, valid", [
    ("reading", GOOD, True),
    ("reading", {**GOOD, "unit": "kelvin"}, False),  # depth one: the Enum's definition
    ("reading", {**GOOD, "places": [{"city": "Oslo", "country": None, "x": 1}]}, False),  # depth two, in a list
    ("reading", {**GOOD, "home": None}, True),  # the Optional's other branch
    ("reading", {**GOOD, "home": {"city": 5, "country": None}}, False),
    ("tree", TREE, True),
    ("tree", {"name": "a", "children": [{"name": "b", "children": [{"name": "c"}]}]}, False),  # depth three: recursion
])
def test_defs_are_resolved_at_every_depth(model_dir, syntax, name, arguments, valid):
    """A call's arguments are taken exactly when they follow the tool's own schema (jsonschema agrees)."""
    from jsonschema import Draft202012Validator

    assert Draft202012Validator(DEFS_SCHEMAS[name]).is_valid(arguments) == valid
    spec = tools.grammar(check_tools(DEFS_TOOLS), name, True, syntax)
    text = (f'{{"tool_calls":[{json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))}]}}'
            if syntax == "generic" else f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>')
    assert accepts(model_dir, spec, text) == valid
