"""``make generate``: write what ``contract/schema.py`` decides into the files Triton and readers see.

Triton reads each model's tensors from its ``config.pbtxt``, and a reader looks for the request fields in
docs/api.md; both are checked in, so the schema's text is written between markers there, and
``tests/test_generated.py`` fails (naming the file) when one is stale. ``--check`` only reports.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

from contract.schema import LLM_OUTPUTS, PREPROCESS_OUTPUTS, REQUEST, RESPONSE, Field, llm_fields, request_fields

ROOT = Path(__file__).resolve().parents[1]
REPOSITORY = ROOT / "ensemble_repo"
BEGIN = "BEGIN generated from contract/schema.py by make generate: edit the schema, not these lines"
END = "END generated"

# (field, optional in this model, allow_ragged_batch in this model)
Tensor = tuple[Field, bool, bool]


def _inputs(fields: tuple[Field, ...], ragged: bool = True) -> list[Tensor]:
    return [(f, True, ragged and f.ragged) for f in fields]


def _outputs(fields: tuple[Field, ...]) -> list[Tensor]:
    return [(f, False, False) for f in fields]


input_ids, fingerprint, _, reasoning_state, coalesce = PREPROCESS_OUTPUTS
# model: its inputs, its outputs, and whether the help text goes beside them (the public interface,
# documented in ensemble's config, and what each model hands the next)
MODELS: dict[str, tuple[list[Tensor], list[Tensor], tuple[bool, bool]]] = {
    "ensemble": (_inputs(REQUEST, ragged=False), _outputs(RESPONSE), (True, True)),
    "ensemble_infer": (_inputs(tuple(f for f in REQUEST if f.name != "stream")), _outputs(RESPONSE), (False, False)),
    "preprocess": (_inputs(request_fields("preprocess")), _outputs(PREPROCESS_OUTPUTS), (False, True)),
    "llm": ([(input_ids, False, True), *_inputs(llm_fields()), (fingerprint, True, False), (reasoning_state, True, False),
             (coalesce, True, False)],
            _outputs(LLM_OUTPUTS), (False, True)),
    "postprocess": ([(f, f.optional, f.ragged) for f in LLM_OUTPUTS], _outputs(RESPONSE), (False, False)),
}
CONFIGS = {"ensemble": ["config.pbtxt"], "ensemble_infer": ["config.pbtxt"], "preprocess": ["config.pbtxt"],
           "llm": ["config.pbtxt", "configs/cpu.pbtxt"], "postprocess": ["config.pbtxt"]}


def _comment(text: str, indent: str) -> list[str]:
    return [f"{indent}# {line}" for line in textwrap.wrap(text, 106 - len(indent))] if text else []


def _section(kind: str, tensors: list[Tensor], helped: bool) -> list[str]:
    lines = [f"{kind} ["]
    for n, (f, optional, ragged) in enumerate(tensors):
        if helped:
            lines += _comment(f.help, "  ")
        attributes = (" optional: true" if optional else "") + (" allow_ragged_batch: true" if ragged else "")
        comma = "," if n < len(tensors) - 1 else ""
        lines.append(f'  {{ name: "{f.name}" data_type: {f.data_type} dims: [ {", ".join(map(str, f.dims))} ]{attributes} }}{comma}')
    return lines + ["]"]


def internal_name(f: Field, model: str) -> str:
    """The ensemble's name for what ``model`` hands the next step: prefixed with the model where the name
    also means a request field, a response field or (for llm's) what preprocess gives (one name per
    tensor inside the ensemble)."""
    public = {g.name for g in REQUEST + RESPONSE + (PREPROCESS_OUTPUTS if model == "llm" else ())}
    return f"{model}_{f.name}" if f.name in public else f.name


def _steps() -> list[str]:
    def step(model: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]]) -> list[str]:
        return ["    {", f'      model_name: "{model}"', "      model_version: -1",
                *(f'      input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs),
                *(f'      output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs), "    }"]

    pre_in, pre_out = MODELS["preprocess"][:2]
    prepared = {f.name: internal_name(f, "preprocess") for f, _, _ in pre_out}  # preprocess's outputs, llm's inputs
    handed_on = [(f.name, internal_name(f, "llm")) for f in LLM_OUTPUTS]  # llm's outputs are postprocess's inputs
    first = step("preprocess", [(f.name, f.name) for f, _, _ in pre_in], list(prepared.items()))
    second = step("llm", [(f.name, prepared.get(f.name, f.name)) for f, _, _ in MODELS["llm"][0]], handed_on)
    third = step("postprocess", handed_on, [(f.name, f.name) for f, _, _ in MODELS["postprocess"][1]])
    return ["ensemble_scheduling {", "  step [", *first[:-1], "    },", *second[:-1], "    },", *third, "  ]", "}"]


def config_block(model: str) -> str:
    inputs, outputs, (help_in, help_out) = MODELS[model]
    lines = _section("input", inputs, help_in) + _section("output", outputs, help_out)
    if model == "ensemble":
        lines += _steps()
    return "\n".join([f"# {BEGIN}", *lines, f"# {END}"])


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(f: Field) -> str:
    if f.default is None:
        return ""
    if isinstance(f.default, bool):
        return f"`{str(f.default).lower()}`"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def api_table() -> str:
    """docs/api.md's table of the request fields and the response's tensors."""
    rows = ["| input | type | default | range | meaning |", "|---|---|---|---|---|"]
    for f in REQUEST:
        rows.append(f"| `{f.name}` | `{f.data_type}` `{list(f.dims)}` | {_default(f)} | {f.range_text()} | {_cell(f.help)} |")
    rows += ["", "| output | type | meaning |", "|---|---|---|"]
    rows += [f"| `{f.name}` | `{f.data_type}` `{list(f.dims)}` | {_cell(f.help)} |" for f in RESPONSE]
    return "\n".join([f"<!-- {BEGIN} -->", *rows, f"<!-- {END} -->"])


def _replace(text: str, block: str, path: Path) -> str:
    """``text`` with its generated block (from the BEGIN line to the END line) replaced by ``block``."""
    lines = text.split("\n")
    begin = [i for i, line in enumerate(lines) if BEGIN in line]
    end = [i for i, line in enumerate(lines) if line.strip() in (f"# {END}", f"<!-- {END} -->")]
    if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
        raise ValueError(f"{path}: needs exactly one generated block (a line with {BEGIN!r}, then one with {END!r})")
    return "\n".join(lines[:begin[0]] + block.split("\n") + lines[end[0] + 1:])


def expected() -> dict[Path, str]:
    """Every generated file as the schema says it should read."""
    files = {}
    for model, names in CONFIGS.items():
        for name in names:
            path = REPOSITORY / model / name
            files[path] = _replace(path.read_text(), config_block(model), path)
    api = ROOT / "docs" / "api.md"
    files[api] = _replace(api.read_text(), api_table(), api)
    return files


def stale() -> list[Path]:
    return [path for path, text in expected().items() if path.read_text() != text]


def main(argv: list[str]) -> int:
    if "--check" in argv:
        old = stale()
        for path in old:
            print(f"{path.relative_to(ROOT)} is stale: run make generate", file=sys.stderr)
        return 1 if old else 0
    for path, text in expected().items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
