"""The README and docs/ stay true to the repository: links resolve, commands name real targets and modules."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

from launcher.paths import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md")), *sorted((REPO_ROOT / "deploy").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def links(page: Path) -> list[str]:
    return [link for link in LINK.findall(FENCE.sub("", page.read_text())) if not re.match(r"[a-z]+:", link)]


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO_ROOT / "Makefile").read_text(), re.M))


def commands(page: Path) -> list[str]:
    """Command lines of the page's shell blocks, and ``$ ``-prompted lines of its other blocks."""
    found = []
    for language, block in FENCE.findall(page.read_text()):
        for line in block.splitlines():
            if line.startswith("$ "):
                found.append(line[2:])
            elif language in ("bash", "sh") and line and not line.startswith((" ", "#")):
                found.append(line)
    return found


def test_the_readme_is_a_front_door_of_about_three_screens():
    assert len((REPO_ROOT / "README.md").read_text().splitlines()) <= 120


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_link_resolves(page):
    for link in links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} (no such file)"
        if anchor and target.suffix == ".md":
            assert anchor in anchors(target), f"{page.name}: {link} (no such heading)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_command_names_a_real_make_target_or_module(page):
    targets = make_targets()
    for command in commands(page):
        for target in re.findall(r"(?:^|&& |; )make ([\w-]+)", command):
            assert target in targets, f"{page.name}: make {target}"
        for module in re.findall(r"python3? -m ([\w.]+)", command):
            assert importlib.util.find_spec(module) is not None, f"{page.name}: python -m {module}"


def test_the_checkers_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n[a](missing.md) [b](#title) [c](#nowhere)\n```bash\nmake nonsense\n```\n")
    assert links(page) == ["missing.md", "#title", "#nowhere"] and "title" in anchors(page)
    assert commands(page) == ["make nonsense"] and "nonsense" not in make_targets()


def test_make_help_lists_every_target():
    helped = subprocess.run(["make", "-s", "help"], cwd=REPO_ROOT, capture_output=True, text=True).stdout
    for target in make_targets() - {"help", "venv", "model", "clean"}:
        assert f"make {target}" in helped, target
