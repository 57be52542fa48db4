"""The layers and the import graph, read from the source; ``python tests/layers.py --write`` redraws the
drawing in docs/architecture.md, which ``tests/test_layers.py`` holds to the code.

The layers, bottom first. A package may import its own modules and any package of a lower layer.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    {"contract", "ipc"},  # what the models agree on (the request schema), and the processes (files in /dev/shm, /proc)
    {"preprocess", "llm", "postprocess"},  # the work, each usable without a server
    {"triton_glue", "client"},  # inside Triton's stubs / talking to Triton over the wire
    {"ensemble_repo"},  # what Triton loads: re-exports of triton_glue
    {"launcher", "openai_frontend"},  # processes that run or front the server
    {"bench"},
]
LAYER = {package: n for n, packages in enumerate(LAYERS) for package in packages}
ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
BLOCK = re.compile(r"(<!-- BEGIN layers -->\n).*?(<!-- END layers -->)", re.S)


def imports(path: Path) -> set[str]:
    """The project packages ``path`` imports (absolute imports only; the repository uses no others)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            found.add(node.module.split(".")[0])
    return found & set(LAYER)


def edges() -> list[tuple[str, str, Path]]:
    """(importing package, imported package, the file) for every import between project packages."""
    return [(path.relative_to(REPO_ROOT).parts[0], target, path)
            for package in LAYER for path in sorted((REPO_ROOT / package).rglob("*.py"))
            for target in imports(path)]


def drawing() -> str:
    """Each layer, top first, and what each of its packages imports, from the source."""
    uses: dict[str, set[str]] = {package: set() for package in LAYER}
    for source, target, _ in edges():
        if source != target:
            uses[source].add(target)
    lines = []
    for n in reversed(range(len(LAYERS))):
        for package in sorted(LAYERS[n]):
            below = ", ".join(sorted(uses[package], key=lambda p: (-LAYER[p], p))) or "nothing of the project"
            lines.append(f"{n}  {package + '/':<17} imports {below}")
    return "```\n" + "\n".join(lines) + "\n```\n"


def drawn() -> str:
    """The drawing docs/architecture.md holds now."""
    return BLOCK.search(ARCHITECTURE.read_text()).group(0).split("\n", 1)[1].rsplit("<!--", 1)[0]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        ARCHITECTURE.write_text(BLOCK.sub(lambda m: m.group(1) + drawing() + m.group(2), ARCHITECTURE.read_text()))
    else:
        print(drawing(), end="")
