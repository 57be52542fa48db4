"""The import graph: arrows point down the layers of docs/architecture.md, never up or sideways; the
drawing of it there, and the files and symbols that page names, are the code's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from launcher.paths import REPO_ROOT
from layers import ARCHITECTURE, LAYER, drawing, drawn, edges, imports


def test_every_python_package_of_the_repository_has_a_layer():
    packages = {p.parent.name for p in REPO_ROOT.glob("*/__init__.py")}
    assert packages <= set(LAYER), packages - set(LAYER)


@pytest.mark.parametrize("source, target, path", edges(), ids=lambda v: str(v) if isinstance(v, Path) else v)
def test_imports_point_down_a_layer(source, target, path):
    if source != target:
        assert LAYER[target] < LAYER[source], f"{path.relative_to(REPO_ROOT)} imports {target}: up or sideways"


def test_the_checker_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from launcher.tritonserver import REPO_ROOT\nimport llm.engine\n")
    assert imports(module) == {"launcher", "llm"}


def test_each_package_says_what_it_is_for():
    for package in set(LAYER) - {"ensemble_repo"}:
        doc = ast.get_docstring(ast.parse((REPO_ROOT / package / "__init__.py").read_text()))
        assert doc and len(doc) > 40, package


def test_only_the_triton_layer_imports_the_python_backend():
    """Anything importing triton_python_backend_utils is Triton-stub code: it lives in triton_glue (and the
    benchmark's own models, its baseline and its stand-in, which Triton loads from bench's repositories)."""
    importing = {str(path.relative_to(REPO_ROOT)) for package in LAYER for path in (REPO_ROOT / package).rglob("*.py")
                 if "triton_python_backend_utils" in path.read_text()}
    bench_models = {"bench/static_model.py", "bench/standin_model.py"}
    assert importing and all(p.startswith("triton_glue/") or p in bench_models for p in importing), importing


# Names one thing has in two packages: Triton's and Python's required names, and a concept each layer
# has its own part of (a tool's syntax and its rendering, a grammar's text and its masks, the engine's
# events and their Triton metrics).
SAME_THING = {"TritonPythonModel", "__main__", "grammar", "tools", "metrics"}


def test_no_two_packages_give_one_name_to_different_things():
    """A class or a module name belongs to one package (``SAME_THING`` excepted): two ``triton.py``
    files, one running the server and one calling it, read as one thing and were not."""
    owners: dict[str, set[str]] = {}
    for package in set(LAYER) - {"ensemble_repo"}:
        for path in (REPO_ROOT / package).rglob("*.py"):
            names = {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
            if path.name != "__init__.py":
                names.add(path.stem)
            for name in names:
                owners.setdefault(name, set()).add(package)
    shared = {name: sorted(packages) for name, packages in owners.items() if len(packages) > 1 and name not in SAME_THING}
    assert not shared, shared


def test_the_drawing_of_the_layers_is_the_codes():
    assert drawn() == drawing(), "run python tests/layers.py --write"


def test_every_file_and_symbol_the_architecture_names_exists():
    """A path in backticks is a file of the repository; ``Class.method`` a method of that class, defined
    in the file that defines the class."""
    text = ARCHITECTURE.read_text()
    for path in re.findall(r"`((?:[a-z_]+/)+[a-z_]+\.(?:py|cpp))`", text):
        assert (REPO_ROOT / path).is_file(), path
    sources = {path: path.read_text() for package in LAYER for path in (REPO_ROOT / package).rglob("*.py")}
    for owner, member in re.findall(r"`([A-Z][A-Za-z]+)\.([a-z_]+)`", text):
        homes = [source for source in sources.values() if re.search(rf"^class {owner}\b", source, re.M)]
        assert homes, f"no class {owner}"
        assert any(re.search(rf"^    (?:async )?def {member}\b|^    {member}:", home, re.M) for home in homes), \
            f"{owner}.{member}"
