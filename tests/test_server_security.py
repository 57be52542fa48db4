"""The APIs that change the server need the admin key; inference and health stay open; folders stay
inside MODEL_ROOTS."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.admin import ADMIN_HEADER, GRPC_ADMIN_HEADER, swap_tokenizer
from launcher.paths import CACHE_DIR

WRONG = {ADMIN_HEADER: "not-the-key"}


@pytest.mark.parametrize("headers", [{}, WRONG], ids=["no key", "wrong key"])
def test_http_admin_apis_refuse_requests_without_the_key(server, http_url, headers):
    before = server.loads("preprocess")
    calls = [
        ("post", "/v2/repository/models/preprocess/load", {"parameters": {"file:1/model.py": "aW1wb3J0IG9z"}}),
        ("post", "/v2/repository/models/llm/unload", {}),
        ("post", "/v2/repository/index", {}),
        ("get", "/v2/systemsharedmemory/status", None),
        ("post", "/v2/logging", {"log_verbose_level": 1}),
        ("get", "/v2/trace/setting", None),
    ]
    for method, path, body in calls:
        reply = requests.request(method, http_url + path, json=body, headers=headers, timeout=30)
        assert reply.status_code == 403, (path, reply.text)
        assert f"expecting header '{ADMIN_HEADER}'" in reply.json()["error"], path
    assert server.loads("preprocess") == before
    assert requests.get(f"{http_url}/v2/models/llm/ready", timeout=30).status_code == 200


def test_grpc_admin_apis_refuse_requests_without_the_key(server):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.ports.grpc}")
    try:
        for headers in (None, {GRPC_ADMIN_HEADER: "not-the-key"}, {ADMIN_HEADER: server.admin_key}):
            with pytest.raises(InferenceServerException, match=f"restricted, expecting header '{GRPC_ADMIN_HEADER}'"):
                client.unload_model("llm", headers=headers)
            with pytest.raises(InferenceServerException, match=GRPC_ADMIN_HEADER):
                client.get_model_repository_index(headers=headers)
        index = client.get_model_repository_index(headers={GRPC_ADMIN_HEADER: server.admin_key}, as_json=True)
        assert {m["name"] for m in index["models"]} >= {"ensemble", "llm", "preprocess", "postprocess"}
        assert client.is_model_ready("llm")
    finally:
        client.close()


def test_inference_health_metadata_and_statistics_need_no_key(server, http_url, generate):
    for path in ("/v2/health/live", "/v2/health/ready", "/v2", "/v2/models/ensemble", "/v2/models/ensemble/config",
                 "/v2/models/stats"):
        assert requests.get(http_url + path, timeout=30).status_code == 200, path
    assert generate({"text_input": "Hi", "max_tokens": 2}).status_code == 200
    assert requests.get(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=30).status_code == 200


@pytest.mark.parametrize("key, says", [("", "none was given: set ADMIN_KEY"), ("not-the-key", "is not the server's")])
def test_the_swap_command_says_when_the_admin_key_is_missing_or_wrong(server, grpc_url, model_dir, key, says, monkeypatch,
                                                                       capsys):
    """``python -m client.admin swap-tokenizer`` as an operator runs it, with ADMIN_KEY unset or wrong."""
    from client.admin import main

    monkeypatch.setenv("ADMIN_KEY", key)
    before = server.loads("preprocess")
    assert main(["swap-tokenizer", str(model_dir), "--url", grpc_url]) == 1
    error = capsys.readouterr().err
    assert says in error and "ADMIN_KEY" in error and "Traceback" not in error, error
    assert server.loads("preprocess") == before


def test_authenticated_tokenizer_swap_reloads_preprocess(server, grpc_url, model_dir, generate):
    before = server.loads("preprocess")
    swap_tokenizer(grpc_url, str(model_dir), admin_key=server.admin_key)
    assert server.loads("preprocess") == before + 1
    assert generate({"text_input": "Hi", "max_tokens": 2}).status_code == 200


@pytest.fixture
def outside_roots(model_dir):
    """A real tokenizer in a folder that is in none of the server's MODEL_ROOTS."""
    folder = Path(tempfile.mkdtemp(prefix="outside-roots-", dir=CACHE_DIR))
    for file in model_dir.glob("tokenizer*"):
        shutil.copy2(file, folder / file.name)
    yield folder
    shutil.rmtree(folder)


def test_folders_outside_model_roots_are_refused_even_through_a_symlink(server, grpc_url, generate, outside_roots, tmp_path):
    link = tmp_path / "link"  # tmp_path is inside MODEL_ROOTS; what it points to is not
    link.symlink_to(outside_roots)
    for folder in (outside_roots, link):
        with pytest.raises(RuntimeError, match="outside MODEL_ROOTS") as refused:
            swap_tokenizer(grpc_url, str(folder), admin_key=server.admin_key)
        assert "At:" not in str(refused.value) and not str(refused.value).endswith(";")  # no Python stack
    assert generate({"text_input": "Hi", "max_tokens": 2}).status_code == 200
