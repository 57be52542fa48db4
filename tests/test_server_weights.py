"""``WEIGHTS=int8`` and ``int4`` on a real server, in the automatic dtype as a user runs it: the load says
what it keeps, and replies, structured outputs, tools and the prefix cache work as in every setting,
through Triton's API and the official ``openai`` client."""

from __future__ import annotations

import json

import openai
import pytest
import requests

from conftest import metric_value, running_frontend, running_server
from launcher.model_folder import gguf_path, model_folder
from launcher.tritonserver import TritonServer
from llm import kernels
from test_server_tools import DEFS_TOOLS, TRIP_ASK, Trip


@pytest.fixture(scope="module", params=["int8", "int4", "gguf"])
def quantized(request, model_dir, tmp_path_factory) -> tuple[str, TritonServer]:
    """The shipped repository with ``WEIGHTS`` set, one server per setting; ``gguf``: ``MODEL_DIR`` naming
    the shipped Q4_1 file (the launcher prepares its folder) and ``WEIGHTS`` unset, so the file's own int4."""
    if request.param == "gguf":
        servers = running_server(model_folder(gguf_path()), tmp_path_factory)
    else:
        servers = running_server(model_dir, tmp_path_factory, WEIGHTS=request.param)
    for server in servers:
        yield ("int4" if request.param == "gguf" else request.param), server


@pytest.fixture(scope="module")
def client(quantized, model_dir, tmp_path_factory) -> openai.OpenAI:
    for frontend in running_frontend(quantized[1], model_dir, tmp_path_factory):
        yield openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_the_load_names_the_setting_and_the_bytes_a_step_reads(quantized, server):
    setting, triton = quantized
    log = triton.log_path.read_text()
    mib = metric_value(triton, 'llm_weight_bytes') / 2**20
    ours = kernels.load() is None  # int8 and int4 in bfloat16 on a CPU with AVX2 or better: "our AVX2 kernels"
    assert f"{setting} linear layers on {kernels.describe() if ours else 'torch weight-only kernels'}" in log
    # int4 reads the shipped Q4_1 blocks as they are, from the default folder's linked GGUF or the file's own
    source = "model.gguf (Q4_1 x 210)" if setting == "int4" else "Hugging Face weights"
    assert f"weights {setting} from {source}: {mib:.0f} MiB read a step" in log
    # The session server reads 4 bytes a weight in float32, 2 in bf16; int8 about 1 (plus the 16-bit output
    # layer), int4 less.
    per_weight = 2 if "weights bf16" in server.log_path.read_text(errors="replace") else 4
    float32_mib = metric_value(server, 'llm_weight_bytes') / 2**20 * 4 / per_weight
    assert mib < float32_mib * {"int8": 0.45, "int4": 0.35}[setting]


def test_greedy_replies_are_whole_and_repeat(quantized):
    """Raw text shorter than a KV block: the second request finds nothing cached, so it runs the very same
    steps (in bfloat16 a prefix served from the cache may round differently and flip a near tie)."""
    _, triton = quantized
    compiled = metric_value(triton, "llm_compilations_total")
    body = {"text_input": "Rivers of Europe:", "apply_chat_template": False, "max_tokens": 24, "ignore_eos": True}
    replies = [requests.post(f"http://127.0.0.1:{triton.ports.http}/v2/models/ensemble/generate", json=body,
                             timeout=300).json() for _ in range(2)]
    assert replies[0]["completion_tokens"] == 24 and replies[0]["text_output"].strip()
    assert replies[0]["text_output"] == replies[1]["text_output"]
    assert metric_value(triton, "llm_compilations_total") == compiled  # every shape ran at load, quantized too


def test_structured_outputs_and_tools_parse(client):
    """The integer is bounded: an unbounded one may run on in digits past the token budget (measured)."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**9}},
              "required": ["city", "population"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "The largest city of France, as JSON."}],
        max_tokens=64, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    found = json.loads(reply.choices[0].message.content)
    assert set(found) == {"city", "population"} and isinstance(found["population"], int)
    parsed = client.chat.completions.parse(model="SmolLM2-135M-Instruct", messages=TRIP_ASK, tools=DEFS_TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "plan_trip"}},
                                           max_tokens=160)
    call = parsed.choices[0].message.tool_calls[0]
    assert call.function.name == "plan_trip" and isinstance(call.function.parsed_arguments, Trip)


def test_a_repeated_prompt_is_served_from_the_prefix_cache(client):
    system = "You answer questions about geography in one short sentence. " * 12
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Where is Lyon?"}]
    first = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8)
    again = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 64
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
