"""Every Python example and every ``$ curl`` transcript of docs/openai.md and docs/api.md's OpenAI
section runs as written, copied and pasted, against a real server.

Each block is a whole program (imports, client, model): it runs in a process of its own against the
session's front end (``localhost:9000`` becomes its port), the way a reader runs it after ``make serve``.
What it prints is the output of a 135M model, which depends on the CPU and the dtype (the docs show a
run's, naming both): the test asserts that it runs and prints, not the words. The reasoning example
needs a thinking template, swapped in for it as the reasoning suite does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from client.admin import swap_tokenizer
from conftest import with_template
from launcher.paths import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "openai.md"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
TRANSCRIPT = re.compile(r"```\n(\$ .*?)```", re.S)  # a fence without a language holding commands and their output
THINK_TEMPLATE = Path(__file__).parent / "templates" / "think.jinja"


def examples() -> list[str]:
    return BLOCK.findall(PAGE.read_text())


@pytest.fixture
def thinking(server, grpc_url, model_dir, tmp_path):
    folder = with_template(model_dir, tmp_path, THINK_TEMPLATE)
    swap_tokenizer(grpc_url, str(folder), ("preprocess",), server.admin_key)
    yield
    swap_tokenizer(grpc_url, str(model_dir), ("preprocess",), server.admin_key)


@pytest.mark.parametrize("index", range(len(examples())), ids=lambda i: f"block{i + 1}")
def test_an_example_runs_as_written(openai_frontend, request, index):
    block = examples()[index]
    if "think.jinja" in block:
        request.getfixturevalue("thinking")
    code = block.replace("http://localhost:9000", openai_frontend.url)
    env = {**os.environ, "PYTHONPATH": ""}  # as a reader runs it: the installed packages only
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO_ROOT.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() or "print(" not in block, done.stderr[-3000:]


def transcripts() -> list[tuple[str, list[str]]]:
    """Each transcript's commands (the ``$ `` lines), by page."""
    return [(page, [line[2:] for line in block.splitlines() if line.startswith("$ ")])
            for page in ("openai.md", "api.md") for block in TRANSCRIPT.findall((REPO_ROOT / "docs" / page).read_text())
            if "localhost:9000" in block]


@pytest.mark.parametrize("index", range(len(transcripts())), ids=lambda i: f"{transcripts()[i][0]}-{i}")
def test_a_transcript_runs_as_written(openai_frontend, index):
    """Run in one shell (a variable one line sets, the next uses): each curl gets an OpenAI object, an
    error object or a stream from the server."""
    _, commands = transcripts()[index]
    marker = "----- next -----"
    script = f"\necho '{marker}'\n".join(c.replace("localhost:9000", openai_frontend.url.removeprefix("http://"))
                                         for c in commands)
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    for command, output in zip(commands, done.stdout.split(marker + "\n")):
        if command.startswith("curl"):
            assert output.startswith(("{", "data: ")), (command, output)
