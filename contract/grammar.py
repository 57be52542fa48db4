"""Grammars from what a request asks for: ``structured_outputs`` (vLLM's field) as llguidance's grammar
text. Needs no model, so preprocess checks tool definitions with it and llm compiles what it builds
(llm/grammar.py holds the matchers, the cache and the masks; it says why llguidance).
"""

from __future__ import annotations

import json
import re
from typing import Any

from contract.errors import InvalidInput

KINDS = ("json", "json_object", "regex", "choice", "grammar")  # vLLM's structured_outputs keys


NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema maps
DATA = ("const", "enum", "default", "examples")  # values, not schemas


def subschemas(schema: Any, change) -> Any:
    """``schema`` with ``change`` applied to every schema in it, innermost first, itself last; values
    (``const``, ``enum``, ...) and the names in maps of schemas (``properties``, ``$defs``, ...) are left alone."""
    if isinstance(schema, list):
        return [subschemas(item, change) for item in schema]
    if not isinstance(schema, dict):
        return schema
    return change({key: value if key in DATA else
                   {name: subschemas(s, change) for name, s in value.items()} if key in NAMED and isinstance(value, dict)
                   else subschemas(value, change) for key, value in schema.items()})


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others unless it says otherwise
    (``additionalProperties: false``), as vLLM's default backend (xgrammar's strict mode) and llama.cpp
    read schemas: a small model given the freedom of JSON Schema's default fills objects with keys of its own."""
    def close(s: dict) -> dict:
        open_ = "properties" not in s or {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(s)
        return s if open_ else s | {"additionalProperties": False}
    return subschemas(schema, close)


def moved(schema: Any, to: str) -> Any:
    """``schema`` as it reads once moved to the JSON pointer ``to`` (``#/$defs/x``) inside a larger schema:
    its local references (``#/$defs/Unit``, ``#``, written from its own root, as pydantic and LangChain
    write them) then point into it there. Others (a URL) stay as they are; the grammar library says no."""
    def rebase(s: dict) -> dict:
        ref = s.get("$ref")
        return s | {"$ref": to + ref[1:]} if isinstance(ref, str) and ref.startswith("#") else s
    return subschemas(schema, rebase)


def llguidance_module():
    try:
        import llguidance
    except ImportError:
        raise InvalidInput("structured_outputs needs the llguidance package, which this server lacks "
                           "(requirements-models.txt)") from None
    return llguidance


def llguidance_grammar(spec: dict[str, Any]) -> str:
    """llguidance's grammar for ``spec`` (the ``structured_outputs`` field: exactly one of ``KINDS``), or
    ``InvalidInput`` naming what is wrong. Needs no model."""
    llguidance = llguidance_module()

    kinds = [k for k in KINDS if spec.get(k) not in (None, False)]
    unknown = sorted(set(spec) - set(KINDS))
    if unknown:
        raise InvalidInput(f"structured_outputs has unknown keys {unknown}; it takes one of {list(KINDS)}")
    if len(kinds) != 1:
        raise InvalidInput(f"structured_outputs must set exactly one of {list(KINDS)}, got {kinds or 'none'}")
    kind, value = kinds[0], spec[kinds[0]]
    if kind == "json":
        schema = json.loads(value) if isinstance(value, str) else value
        if not isinstance(schema, (dict, bool)):
            raise InvalidInput("structured_outputs.json must be a JSON schema (an object)")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(closed(schema), defaults={"whitespace_flexible": False})
    elif kind == "json_object":
        if value is not True:
            raise InvalidInput("structured_outputs.json_object must be true")
        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
    elif kind == "regex":
        _text(kind, value)
        grammar = llguidance.LLMatcher.grammar_from_regex(value)
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidInput("structured_outputs.choice must be a non-empty list of non-empty strings")
        grammar = llguidance.LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in value))
    else:
        _text(kind, value)
        grammar = llguidance.LLMatcher.grammar_from_lark(value)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise InvalidInput(f"structured_outputs.{kind} cannot be compiled: {error.strip()}"[:600])
    return grammar


def _text(kind: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidInput(f"structured_outputs.{kind} must be a non-empty string")
