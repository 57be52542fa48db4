"""``triton_glue.params``: a model's config parameters as a typed dataclass, environment variables expanded."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from triton_glue.params import read_parameters


def params(**values: str) -> dict:
    return {"name": "m", "parameters": {k: {"string_value": v} for k, v in values.items()}}


@dataclass(frozen=True)
class Sample:
    path: str
    count: int = 3
    flag: bool = False


def test_parameters_expand_environment_variables(monkeypatch):
    monkeypatch.setenv("SOME_DIR", "/models/x")
    assert read_parameters(params(path="${SOME_DIR}/tok", count="7", flag="true"), Sample) == Sample("/models/x/tok", 7, True)


def test_parameters_name_the_unset_variable(monkeypatch):
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    with pytest.raises(ValueError, match=r"'path' references \$\{NOT_SET_ANYWHERE\}"):
        read_parameters(params(path="${NOT_SET_ANYWHERE}"), Sample)


def test_parameters_name_the_bad_key():
    with pytest.raises(ValueError, match="'count' must be int"):
        read_parameters(params(path="p", count="many"), Sample)


def test_parameters_report_a_missing_required_key():
    with pytest.raises(ValueError, match="missing a required parameter"):
        read_parameters(params(count="1"), Sample)


def test_parameters_take_environment_defaults_nested_and_name_the_key_when_unset(monkeypatch):
    @dataclass
    class Config:
        tokenizer_dir: str
        kv_cache_tokens: int = 0

    def config(tokenizer_dir: str, kv: str) -> dict:
        return {"name": "m", "parameters": {"tokenizer_dir": {"string_value": tokenizer_dir}, "kv_cache_tokens": {"string_value": kv}}}

    monkeypatch.setenv("MODEL_DIR", "/models/a")
    monkeypatch.delenv("TOKENIZER_DIR", raising=False)
    monkeypatch.delenv("KV_CACHE_TOKENS", raising=False)
    assert read_parameters(config("${TOKENIZER_DIR:-${MODEL_DIR}}", "${KV_CACHE_TOKENS:-16384}"), Config) == Config("/models/a", 16384)
    monkeypatch.setenv("TOKENIZER_DIR", "/models/b")
    monkeypatch.setenv("KV_CACHE_TOKENS", "32768")
    assert read_parameters(config("${TOKENIZER_DIR:-${MODEL_DIR}}", "${KV_CACHE_TOKENS:-16384}"), Config) == Config("/models/b", 32768)
    with pytest.raises(ValueError, match=r"parameter 'tokenizer_dir' references \$\{UNSET_DIR\}"):
        read_parameters(config("${UNSET_DIR}", "1"), Config)
