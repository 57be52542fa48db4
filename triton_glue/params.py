"""Typed reading of a model's ``parameters { key: ... value: { string_value: ... } }`` block.

Values may reference environment variables as ``${NAME}`` (the launcher and compose set ``MODEL_DIR``)
or ``${NAME:-default}``, nested (``${TOKENIZER_DIR:-${MODEL_DIR}}``), so the same ``ensemble_repo/``
serves a local checkout, a container and a Kubernetes pod whose ConfigMap sets the tunables. A bad or
missing value fails the model load with a message that names the key.
"""

from __future__ import annotations

import os
import re
from dataclasses import fields, is_dataclass
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")
_ENV_REF = re.compile(r"\$\{(\w+)(?::-([^${}]*))?\}")  # innermost first: a default holds no reference


def _expand(key: str, value: str) -> str:
    def env(match: re.Match) -> str:
        name, default = match.groups()
        if os.environ.get(name):
            return os.environ[name]
        if default is None:
            raise ValueError(f"parameter '{key}' references ${{{name}}}, which is not set in the environment")
        return default

    while (expanded := _ENV_REF.sub(env, value)) != value:
        value = expanded
    return value


def _convert(key: str, value: str, kind: type) -> Any:
    try:
        if kind is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        return kind(value)
    except ValueError:
        raise ValueError(f"parameter '{key}' must be {kind.__name__}, got {value!r}") from None


def read_parameters(model_config: dict, cls: type[T]) -> T:
    """Build the dataclass ``cls`` from the config's parameters; fields without defaults are required."""
    assert is_dataclass(cls)
    raw = {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}
    types = get_type_hints(cls)
    values = {f.name: _convert(f.name, _expand(f.name, raw[f.name]), types[f.name]) for f in fields(cls) if f.name in raw}
    try:
        return cls(**values)
    except TypeError as e:
        raise ValueError(f"model '{model_config.get('name')}' is missing a required parameter: {e}") from None
