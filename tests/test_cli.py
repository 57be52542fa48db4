"""The README's commands: the launcher (make run / make serve) and the client CLI, as a user runs them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from launcher.install import install_tritonserver, server_env
from launcher.paths import MODEL_REPOSITORY, REPO_ROOT
from launcher.process import Ports
from launcher.tritonserver import TritonServer


def run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, **kwargs)


def port_env(ports: Ports, model_dir) -> dict:
    return {**os.environ, "HTTP_PORT": str(ports.http), "GRPC_PORT": str(ports.grpc),
            "METRICS_PORT": str(ports.metrics), "OPENAI_PORT": str(ports.openai), "MODEL_DIR": str(model_dir)}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_client_cli_prints_the_reply(server, protocol):
    port = server.ports.http if protocol == "http" else server.ports.grpc
    result = run(["-m", "client", "Name a fruit.", "--url", f"127.0.0.1:{port}", "--protocol", protocol, "--max-tokens", "8"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_client_cli_reports_server_errors(server):
    result = run(["-m", "client", "hi", "--url", f"127.0.0.1:{server.ports.http}", "--max-tokens", "0"])
    assert result.returncode == 1 and "max_tokens must be in [1, 512], got 0" in result.stderr


@pytest.mark.parametrize("protocol, stream", [("http", True), ("http", False), ("grpc", True)])
def test_client_cli_says_in_one_line_when_nothing_listens(protocol, stream):
    port = Ports.free().http
    result = run(["-m", "client", "Hi", "--url", f"127.0.0.1:{port}", "--protocol", protocol]
                 + ([] if stream else ["--no-stream"]))
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert result.stderr.startswith("error: "), result.stderr


def test_launcher_run_once_answers_a_prompt_and_exits(model_dir):
    result = run(["-m", "launcher", "run", "--once", "--prompt", "What is 2 + 2?", "--max-tokens", "8"],
                 env=port_env(Ports.free(), model_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    prompt_line, reply = result.stdout.split("\n", 1)
    assert prompt_line == "> What is 2 + 2?" and reply.strip() and not reply.startswith("Chunk(")  # the text, as the README shows


def test_launcher_refuses_a_port_already_in_use(server, model_dir):
    ports = Ports.free()
    ports.http = server.ports.http
    result = run(["-m", "launcher", "run", "--once"], env=port_env(ports, model_dir))
    assert result.returncode == 1 and f"port {server.ports.http} (HTTP_PORT) is already in use" in result.stderr


def test_launcher_serve_honours_the_port_variables_and_leaves_on_sigterm(model_dir):
    ports = Ports.free()
    serve = subprocess.Popen([sys.executable, "-m", "launcher", "serve"], cwd=REPO_ROOT, env=port_env(ports, model_dir),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{ports.http}/v2/health/ready", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.5)
        assert requests.get(f"http://127.0.0.1:{ports.metrics}/metrics", timeout=10).status_code == 200
        openai_url = f"http://127.0.0.1:{ports.openai}"  # the OpenAI API beside Triton, named after the model folder
        deadline = time.monotonic() + 60
        while not _answers(f"{openai_url}/health"):
            assert time.monotonic() < deadline, "the OpenAI front end never became healthy"
            time.sleep(0.5)
        assert requests.get(f"{openai_url}/v1/models", timeout=10).json()["data"][0]["id"] == model_dir.name
        url = f"http://127.0.0.1:{ports.http}/v2/models/ensemble/generate"
        with ThreadPoolExecutor(1) as pool:  # SIGTERM mid-reply: that reply still completes, new ones are refused
            body = {"text_input": "Tell me a story.", "max_tokens": 128, "ignore_eos": True}
            in_flight = pool.submit(requests.post, url, json=body, timeout=120)
            running = re.compile(r"^llm_requests_running\{.*\} 1$", re.M)
            deadline = time.monotonic() + 60
            while not running.search(requests.get(f"http://127.0.0.1:{ports.metrics}/metrics", timeout=10).text):
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.1)
            serve.send_signal(signal.SIGTERM)
            time.sleep(1)
            try:
                late = requests.post(url, json={"text_input": "Hi", "max_tokens": 2}, timeout=30)
                assert late.status_code != 200 and late.json()["error"]
            except requests.ConnectionError:
                pass
            reply = in_flight.result()
        assert reply.status_code == 200 and reply.json()["completion_tokens"] == 128
        assert serve.wait(timeout=60) == 0
        for url in (f"http://127.0.0.1:{ports.http}/v2/health/live", f"{openai_url}/health"):
            with pytest.raises(requests.ConnectionError):
                requests.get(url, timeout=2)
    finally:
        serve.kill()


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def test_launcher_serve_without_openai_starts_triton_alone(model_dir):
    ports = Ports.free()
    serve = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--no-openai"], cwd=REPO_ROOT,
                             env=port_env(ports, model_dir), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not _answers(f"http://127.0.0.1:{ports.http}/v2/health/ready"):
            assert time.monotonic() < deadline and serve.poll() is None, "tritonserver never became ready"
            time.sleep(0.5)
        assert not _answers(f"http://127.0.0.1:{ports.openai}/health")
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)


def test_docker_entrypoint_runs_the_openai_front_end(server, model_dir, tmp_path):
    port = Ports.free().openai
    env = {**os.environ, "TRITON_GRPC_URL": server.grpc_url, "OPENAI_PORT": str(port), "MODEL_DIR": str(model_dir),
           "PYTHONPATH": str(REPO_ROOT), "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen([str(REPO_ROOT / "docker" / "entrypoint.sh"), "openai"], env=env,
                            stdout=(tmp_path / "openai.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not _answers(f"http://127.0.0.1:{port}/health"):
            assert time.monotonic() < deadline and proc.poll() is None, (tmp_path / "openai.log").read_text()
            time.sleep(0.3)
        reply = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": model_dir.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_docker_entrypoint_falls_back_to_the_cpu_without_a_gpu(model_dir, tmp_path):
    """The image's entrypoint, run here with the wheel's tritonserver (this machine has no GPU)."""
    ports = Ports.free()
    home = install_tritonserver()
    env = server_env({"MODEL_DIR": str(model_dir), "MODEL_REPOSITORY": str(MODEL_REPOSITORY)})
    env["PATH"] = f"{home / 'bin'}{os.pathsep}{env['PATH']}"
    env |= {"HTTP_PORT": str(ports.http), "GRPC_PORT": str(ports.grpc), "METRICS_PORT": str(ports.metrics)}
    log = (tmp_path / "entrypoint.log").open("wb")
    proc = subprocess.Popen(
        [str(REPO_ROOT / "docker" / "entrypoint.sh"), f"--backend-directory={home / 'backends'}"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        server = TritonServer(ports=ports, log_path=tmp_path / "entrypoint.log", process=proc)
        server.wait_ready(timeout=600)  # a first start compiles the automatic dtype's graphs (minutes on 2 cores)
        reply = requests.post(f"{server.url}/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 4}, timeout=120)
        assert reply.status_code == 200 and reply.json()["text_output"].strip()
        log_text = (tmp_path / "entrypoint.log").read_text()
        assert "serving llm on the CPU" in log_text and "ADMIN_KEY is not set" in log_text
        assert requests.post(f"{server.url}/v2/repository/index", timeout=30).status_code == 403  # locked
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


@pytest.mark.parametrize("remove, named", [
    ("config.json", "missing config.json"),
    ("model.safetensors model.gguf", "missing weights (model.safetensors or"),  # the default folder has both
    ("tokenizer.json", "missing a tokenizer (tokenizer.json or"),
])
def test_launcher_refuses_an_incomplete_model_dir_at_once_naming_the_missing_file(model_dir, tmp_path, remove, named):
    folder = tmp_path / "model"
    folder.mkdir()
    for file in model_dir.iterdir():
        if file.name not in remove.split():
            (folder / file.name).symlink_to(file)
    started = time.monotonic()
    result = run(["-m", "launcher", "run", "--once"], env=port_env(Ports.free(), folder))
    assert result.returncode == 1 and named in result.stderr, result.stderr[-2000:]
    assert time.monotonic() - started < 30  # before tritonserver starts, not after a failed load


def test_launcher_warns_about_a_model_dir_without_a_chat_template(model_dir, tmp_path):
    from launcher.model_folder import check_model_dir

    folder = tmp_path / "model"
    folder.mkdir()
    for file in model_dir.iterdir():
        (folder / file.name).symlink_to(file)
    assert check_model_dir(folder) == []
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    [warning] = check_model_dir(folder)
    assert "no chat template" in warning and "apply_chat_template=false" in warning


def test_launcher_serve_stops_in_seconds_even_after_a_failed_tokenizer_swap(model_dir, tmp_path):
    """Triton 2.51 keeps a model whose load failed "live" until its 30 s exit timeout; the launcher sees
    every stub gone and ends it, so an idle server stops in seconds without "Exit timeout expired"."""
    from client.admin import swap_tokenizer

    ports, log = Ports.free(), tmp_path / "serve.log"
    env = {**port_env(ports, model_dir), "ADMIN_KEY": "stop-test-key"}
    serve = subprocess.Popen([sys.executable, "-m", "launcher", "serve", "--no-openai"], cwd=REPO_ROOT, env=env,
                             stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not _answers(f"http://127.0.0.1:{ports.http}/v2/health/ready"):
            assert time.monotonic() < deadline and serve.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        with pytest.raises(RuntimeError, match="outside MODEL_ROOTS"):
            swap_tokenizer(f"127.0.0.1:{ports.grpc}", "/etc", admin_key="stop-test-key")
        started = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
        took = time.monotonic() - started
    finally:
        serve.kill()
    output = log.read_text(errors="replace")
    assert "Exit timeout expired" not in output and "every model is unloaded" in output
    assert took < 15, f"stopping took {took:.1f} s"  # Triton alone: its whole 30 s exit timeout
