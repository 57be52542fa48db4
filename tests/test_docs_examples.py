"""Every example of the README, docs/openai.md and docs/api.md that talks to a server runs as written,
copied and pasted, against the test server, and gives what the page shows.

An example is a fenced block naming ``localhost:8000`` (Triton's HTTP), ``:8001`` (gRPC), ``:8002``
(metrics) or ``:9000`` (the OpenAI API); each address becomes the session server's. Three kinds:

- ``python``: a whole program (imports, client, model), run in a process of its own as a reader runs it
  after ``make serve`` (the installed packages only; from the repository's root when it imports our
  ``client``);
- ``bash``: commands whose output the next block shows (or ``# `` comments under them);
- a transcript: ``$ `` command lines, each followed by its output.

What a 135M model writes depends on the CPU and the dtype (the pages show one run's, naming both; the
suite serves float32 activations), so a reply is checked for shape: the JSON keys and metric names the page shows are
in the real output. An error does not depend on either: it must be the page's, word for word. The
reasoning example needs a thinking template, swapped in for it as the reasoning suite does. Examples with a
reader's own paths (docs/configuration.md's tokenizer swap, docs/operations.md's compose commands) are
procedures, not runnable as written, and stay out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from client.admin import swap_tokenizer
from conftest import with_template
from launcher.paths import REPO_ROOT

PAGES = ("README.md", "docs/openai.md", "docs/api.md")
FENCE = re.compile(r"```(\w*)\n(.*?)```\n", re.S)
ADDRESS = re.compile(r"localhost:(8000|8001|8002|9000)")
KEY = re.compile(r'(?<!\\)"(\w+)":')  # a JSON key, not one inside a string (the model's own JSON)
METRIC = re.compile(r"(\w+)\{\w+=\"")  # a Prometheus sample's name (curl's JSON has no newline before it)
THINK_TEMPLATE = Path(__file__).parent / "templates" / "think.jinja"


@dataclass(frozen=True)
class Example:
    page: str
    kind: str  # python, bash or transcript
    code: str
    shown: str  # the output the page shows, "" where it shows none


def page_examples(page: str) -> list[Example]:
    fences = list(FENCE.finditer((REPO_ROOT / page).read_text()))
    found = []
    for fence, after in zip(fences, fences[1:] + [None]):
        language, body = fence.groups()
        if not ADDRESS.search(body) or language not in ("python", "bash", ""):
            continue
        adjacent = after is not None and after.start() == fence.end() and not after.group(2).startswith("$ ")
        if language == "" and body.startswith("$ "):
            found.append(Example(page, "transcript", body, ""))
        elif language == "bash":
            comments = "\n".join(line[2:] for line in body.splitlines() if line.startswith("# "))
            found.append(Example(page, "bash", body, after.group(2) if adjacent else comments))
        elif language == "python":
            found.append(Example(page, "python", body, after.group(2) if adjacent else ""))
    return found


def examples() -> list[Example]:
    return [example for page in PAGES for example in page_examples(page)]


def example_id(index: int) -> str:
    example = examples()[index]
    return f"{Path(example.page).stem}-{example.kind}{index}"


@pytest.fixture
def addresses(server, openai_frontend) -> dict[str, str]:
    """Each documented port's address on the session's servers."""
    host = "127.0.0.1"
    return {"8000": f"{host}:{server.ports.http}", "8001": f"{host}:{server.ports.grpc}",
            "8002": f"{host}:{server.ports.metrics}", "9000": openai_frontend.url.removeprefix("http://")}


@pytest.fixture
def thinking(server, grpc_url, model_dir, tmp_path):
    folder = with_template(model_dir, tmp_path, THINK_TEMPLATE)
    swap_tokenizer(grpc_url, str(folder), ("preprocess",), server.admin_key)
    yield
    swap_tokenizer(grpc_url, str(model_dir), ("preprocess",), server.admin_key)


def shape(output: str) -> set[str]:
    """What an output shows whatever the model said: its JSON keys (outside strings) and metric names."""
    return set(KEY.findall(output)) | set(METRIC.findall(output))


def is_error(output: str) -> bool:
    """An error as the pages show one: the OpenAI API's or Triton's object, or the client CLI's line."""
    return output.startswith(('{"error"', "error:"))


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ""}  # as a reader runs it: the installed packages only
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


@pytest.mark.parametrize("index", range(len(examples())), ids=example_id)
def test_an_example_runs_as_written(addresses, request, index):
    example = examples()[index]
    if "think.jinja" in example.code:
        request.getfixturevalue("thinking")
    code = ADDRESS.sub(lambda port: addresses[port.group(1)], example.code)
    if example.kind == "python":
        done = run([sys.executable, "-c", code], REPO_ROOT if "from client" in code else REPO_ROOT.parent)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() or "print(" not in code, done.stderr[-3000:]
        assert shape(example.shown) <= shape(done.stdout), done.stdout
    elif example.kind == "bash":
        done = run(["bash", "-o", "pipefail", "-c", code], REPO_ROOT)
        assert done.returncode == 0 and done.stdout.strip(), done.stderr
        assert shape(example.shown) <= shape(done.stdout), done.stdout
    else:
        check_transcript(code, example.code)


def check_transcript(code: str, written: str) -> None:
    """Run a transcript's commands (``code``, on the session's ports) in one shell (a variable one line
    sets, the next uses); each command's output has the shape of the one ``written`` on the page, and an
    error is the page's own."""
    commands = [line[2:] for line in code.splitlines() if line.startswith("$ ")]
    shown = [output.strip() for output in re.split(r"^\$ .*\n?", written, flags=re.M)[1:]]
    marker = "----- next -----"
    done = run(["bash", "-c", f"\necho '{marker}'\n".join(f"{{ {command}\n}} 2>&1" for command in commands)], REPO_ROOT)
    for command, expected, output in zip(commands, shown, done.stdout.split(marker + "\n"), strict=True):
        output = output.strip()
        if is_error(expected):
            assert output == expected, command
        else:
            assert bool(output) == bool(expected) and shape(expected) <= shape(output), (command, output)
