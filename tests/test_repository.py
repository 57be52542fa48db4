"""Static checks that the model configs, the client, the Dockerfile and compose.yaml agree."""

from __future__ import annotations

import ast
import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

import tritonclient.http as httpclient

from client import Prompt, build_inputs
from contract import schema
from contract.schema import Field
from launcher.paths import MODEL_REPOSITORY, REPO_ROOT
from launcher.process import DEFAULT_DRAIN_TIMEOUT, DRAIN_SLACK, EXIT_AFTER_DRAIN
from openai_frontend.shutdown import MARGIN

SCHEMA = REPO_ROOT.parent / "shared" / "schemas" / "compose-spec.json"
PORTS = {8000, 8001, 8002}


def config(model: str, name: str = "config.pbtxt") -> model_config_pb2.ModelConfig:
    path = MODEL_REPOSITORY / model / name
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (REPO_ROOT / "Dockerfile").read_text()


# model configs


def test_every_ensemble_step_maps_real_tensors_of_matching_type():
    ensemble = config("ensemble")
    produced = {t.name: t.data_type for t in ensemble.input}
    for step in ensemble.ensemble_scheduling.step:
        model = config(step.model_name)
        inputs = {t.name: t.data_type for t in model.input}
        outputs = {t.name: t.data_type for t in model.output}
        for key, value in step.input_map.items():
            assert key in inputs and produced[value] == inputs[key], (step.model_name, key)
        assert {t.name for t in model.input if not t.optional} <= set(step.input_map), step.model_name
        for key, value in step.output_map.items():
            # One name per tensor; a model's copy of a request or response field it hands on carries its prefix.
            assert value in (key, f"{step.model_name}_{key}"), "one name per tensor, everywhere"
            produced[value] = outputs[key]
        assert ensemble.max_batch_size <= model.max_batch_size
    assert {t.name: t.data_type for t in ensemble.output}.items() <= produced.items()


def declared(tensors) -> list[tuple]:
    """A config's tensors as contract/schema.py declares them."""
    kind = model_config_pb2.DataType.Name
    return sorted((t.name, kind(t.data_type), tuple(t.dims), getattr(t, "optional", False)) for t in tensors)


def fields(*groups: tuple[Field, ...], optional: bool | None = None) -> list[tuple]:
    return sorted((f.name, f.data_type, f.dims, f.optional if optional is None else optional) for g in groups for f in g)


@pytest.mark.parametrize("model, inputs, outputs", [
    ("ensemble", fields(schema.REQUEST), fields(schema.RESPONSE, optional=False)),
    ("ensemble_infer", [f for f in fields(schema.REQUEST) if f[0] != "stream"], fields(schema.RESPONSE)),
    ("preprocess", fields(schema.request_fields("preprocess")), fields(schema.PREPROCESS_OUTPUTS)),
    ("llm", sorted(fields(schema.request_fields("llm")) + fields(schema.PREPROCESS_OUTPUTS[:1])
                   + fields(schema.PREPROCESS_OUTPUTS[1:], optional=True)), fields(schema.LLM_OUTPUTS, optional=False)),
    ("postprocess", None, fields(schema.RESPONSE)),
])
def test_configs_declare_the_tensors_of_contract_schema(model, inputs, outputs):
    """contract/schema.py is the one declaration; a config that disagrees names the model and tensor."""
    found = config(model)
    if inputs is not None:
        assert declared(found.input) == inputs, model
    assert declared(found.output) == outputs, model


def test_postprocess_takes_what_llm_gives():
    post = {name: rest[:2] for name, *rest in declared(config("postprocess").input)}
    assert post == {name: [data_type, dims] for name, data_type, dims, _ in fields(schema.LLM_OUTPUTS)}


def test_the_ensemble_routes_each_request_field_to_the_models_that_read_it():
    steps = config("ensemble").ensemble_scheduling.step
    for field in schema.REQUEST:
        readers = {s.model_name for s in steps if field.name in s.input_map.values()}
        assert readers == set(field.to), field.name


def test_llm_defaults_its_reply_budget_as_contract_schema_says():
    for name in ("config.pbtxt", "configs/cpu.pbtxt"):
        parameters = config("llm", name).parameters
        assert parameters["default_max_tokens"].string_value == f"${{DEFAULT_MAX_TOKENS:-{schema.DEFAULT_MAX_TOKENS}}}"
        assert parameters["max_tokens_limit"].string_value == f"${{MAX_TOKENS_LIMIT:-{schema.MAX_TOKENS_LIMIT}}}"


def test_the_client_prompt_has_a_field_for_every_request_tensor_but_stream():
    from dataclasses import fields as dataclass_fields

    assert {f.name for f in dataclass_fields(Prompt)} == {f.name for f in schema.REQUEST} - {"stream"}


def test_llm_cpu_config_differs_from_the_gpu_one_only_in_instance_kind():
    gpu, cpu = config("llm"), config("llm", "configs/cpu.pbtxt")
    assert [g.kind for g in gpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
    assert [g.kind for g in cpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]
    del gpu.instance_group[:], cpu.instance_group[:]
    assert gpu == cpu


def test_llm_is_decoupled_and_takes_prompts_of_different_lengths_together():
    llm = config("llm")
    assert llm.model_transaction_policy.decoupled and llm.max_batch_size > 1
    assert next(t for t in llm.input if t.name == "input_ids").allow_ragged_batch


def test_ensemble_infer_is_not_decoupled():
    assert not config("ensemble_infer").model_transaction_policy.decoupled  # Triton serves infer only on such models


def test_ensemble_infer_guards_every_decoupled_step_of_the_ensemble():
    """A dead stub strands requests only in a decoupled model; the guard must watch each such step."""
    steps = {s.model_name for s in config("ensemble").ensemble_scheduling.step}
    decoupled = {m for m in steps if config(m).model_transaction_policy.decoupled}
    guarded = config("ensemble_infer").parameters["guarded_models"].string_value.split(",")
    assert decoupled == set(guarded) == {"llm"}


def test_postprocess_sees_cancelled_requests():
    assert not config("postprocess").HasField("dynamic_batching")  # it would drop them unseen


def test_tokenizer_models_run_on_the_cpu():
    for model in ("preprocess", "postprocess"):
        assert [g.kind for g in config(model).instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_CPU]


def test_client_sends_exactly_the_ensemble_input_names():
    prompt = Prompt("hi", 4, system_prompt="sys", apply_chat_template=False, temperature=0.5, top_p=0.9, top_k=40,
                    repetition_penalty=1.1, seed=7, stop=["\n"], ignore_eos=True, presence_penalty=0.1,
                    frequency_penalty=0.2, logprobs=True, top_logprobs=2, prompt_logprobs=1, min_p=0.1,
                    logit_bias={"5": -100}, min_tokens=2, stop_token_ids=[7], structured_outputs={"regex": "a"},
                    tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="f", parallel_tool_calls=False,
                    cache_salt="tenant", chat_template_kwargs={"enable_thinking": False})
    names = {i.name() for i in build_inputs(httpclient, prompt, stream=True)}
    conversation = Prompt(messages=[{"role": "user", "content": "hi"}])
    assert {i.name() for i in build_inputs(httpclient, conversation)} == {"messages"}
    assert names | {"messages"} == {t.name for t in config("ensemble").input}


# Dockerfile and compose.yaml (no Docker engine here: check them against the repository)


@pytest.fixture(scope="module")
def compose_schema() -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(json.loads(SCHEMA.read_text()))  # the spec says draft-07


def test_compose_matches_the_compose_specification(compose, compose_schema):
    compose_schema.validate(compose)


def test_the_schema_check_rejects_a_broken_compose_file(compose, compose_schema):
    broken = copy.deepcopy(compose)
    broken["services"]["triton"]["shm_size"] = ["2gb"]
    with pytest.raises(jsonschema.ValidationError):
        compose_schema.validate(broken)


def test_compose_builds_this_dockerfile_and_mounts_existing_folders(compose):
    service = compose["services"]["triton"]
    assert (REPO_ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    for volume in service["volumes"]:
        source = volume.split(":")[0]
        if source.startswith("."):  # a bind mount
            assert (REPO_ROOT / source).is_dir(), volume
        else:  # a named volume, declared at the top level
            assert source in compose["volumes"], volume


def test_compose_keeps_the_compile_cache_where_the_image_puts_it(compose, dockerfile):
    """A container that starts again (or a new one) loads llm's compiled forward pass instead of
    compiling it: the image's TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR lie in compose's named volume."""
    [target] = [v.split(":")[1] for v in compose["services"]["triton"]["volumes"] if v.startswith("compile-cache:")]
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        path = re.search(rf"\b{name}=(\S+)", dockerfile).group(1)
        assert Path(path).parent == Path(target), name
    assert f"mkdir -p {target}" in dockerfile  # so the new volume takes the image's owner, not root's


def seconds(duration: str) -> float:
    return float(re.fullmatch(r"(\d+)s", duration).group(1))


def test_compose_gives_each_service_its_drain(compose):
    """docker compose stop/down sends SIGTERM, then SIGKILL past stop_grace_period: each service's period
    covers its drain (DRAIN_TIMEOUT, the launcher's default) and its exit after it, so no stream is cut."""
    for name, after in (("triton", DRAIN_SLACK + EXIT_AFTER_DRAIN), ("openai", MARGIN + EXIT_AFTER_DRAIN)):
        service = compose["services"][name]
        assert service["environment"]["DRAIN_TIMEOUT"] == f"${{DRAIN_TIMEOUT:-{DEFAULT_DRAIN_TIMEOUT:g}}}", name
        assert seconds(service["stop_grace_period"]) >= DEFAULT_DRAIN_TIMEOUT + after, name


def test_compose_publishes_tritons_ports_and_checks_readiness(compose, dockerfile):
    service = compose["services"]["triton"]
    published = {int(p.split(":")[-1]) for p in service["ports"]}
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split()}
    assert published == exposed == PORTS
    assert service["healthcheck"]["test"] == ["CMD", "python3", "-m", "launcher", "health"]
    assert "CMD python3 -m launcher health" in dockerfile


def test_compose_reserves_gpus_and_enough_shared_memory(compose):
    service = compose["services"]["triton"]
    (device,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    size = re.fullmatch(r"(\d+)([mg])b", service["shm_size"].lower())
    assert int(size.group(1)) * (1024 if size.group(2) == "g" else 1) >= 1024


def test_compose_default_model_is_the_one_baked_into_the_image(compose, dockerfile):
    default = re.search(r"\$\{MODEL_DIR:-([^}]+)\}", compose["services"]["triton"]["environment"]["MODEL_DIR"]).group(1)
    assert f"MODEL_DIR={default}" in dockerfile
    assert "launcher prepare" in dockerfile


def test_dockerfile_uses_triton_2_51_and_copies_what_exists(dockerfile):
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:24\.10-py3$", dockerfile, re.M)
    for sources in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for source in sources.split():
            assert (REPO_ROOT / source).exists(), source
    entrypoint = (REPO_ROOT / "docker" / "entrypoint.sh").read_text()
    assert "COPY ensemble_repo/ ensemble_repo/" in dockerfile and "WORKDIR /opt/chat" in dockerfile
    assert "/opt/chat/ensemble_repo" in entrypoint and "--model-config-name=cpu" in entrypoint
    assert re.search(r'^ENTRYPOINT \["triton-chat-entrypoint"\]$', dockerfile, re.M)
    assert "COPY docker/entrypoint.sh /usr/local/bin/triton-chat-entrypoint" in dockerfile


def test_dockerfile_pins_the_same_torch_as_the_requirements(dockerfile):
    pinned = re.search(r"^torch==(\S+)$", (REPO_ROOT / "requirements-models.txt").read_text(), re.M).group(1)
    assert f"torch=={pinned}" in dockerfile


def project_imports(path: Path) -> set[str]:
    packages = {p.parent.name for p in REPO_ROOT.glob("*/__init__.py")}
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names & packages


def test_the_image_holds_every_package_the_models_import(dockerfile):
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", dockerfile, re.M))
    needed, todo = set(), list(MODEL_REPOSITORY.glob("*/1/model.py"))
    while todo:
        for package in project_imports(todo.pop()) - needed:
            needed.add(package)
            todo += list((REPO_ROOT / package).glob("*.py"))
    assert needed and needed <= copied, needed - copied


def test_the_image_runs_as_a_non_root_user_that_owns_its_cache(dockerfile):
    users = re.findall(r"^USER (\S+)$", dockerfile, re.M)
    assert users and users[-1] not in ("root", "0")
    assert f"chown -R {users[-1]} /opt/chat/cache" in dockerfile


def test_launcher_and_image_restrict_the_same_admin_apis_with_the_key_from_the_environment(compose):
    from launcher.tritonserver import ADMIN_HEADER, RESTRICTED_APIS, TritonServer

    entrypoint = (REPO_ROOT / "docker" / "entrypoint.sh").read_text()
    assert f'restricted="{RESTRICTED_APIS}:{ADMIN_HEADER}=${{ADMIN_KEY}}"' in entrypoint
    assert '--http-restricted-api="$restricted" --grpc-restricted-protocol="$restricted"' in entrypoint
    assert compose["services"]["triton"]["environment"]["ADMIN_KEY"] == "${ADMIN_KEY:-}"
    command = TritonServer(admin_key="k").command()
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        assert f"{flag}={RESTRICTED_APIS}:{ADMIN_HEADER}=k" in command
    assert set(RESTRICTED_APIS.split(",")) >= {"model-repository", "shared-memory"}


def test_launcher_and_image_give_the_python_backend_threads_for_every_infer_call_and_then_some():
    from launcher.tritonserver import PYTHON_BACKEND_THREADS, TritonServer

    flag = f"--backend-config=python,thread-pool-size={PYTHON_BACKEND_THREADS}"
    assert flag in TritonServer(admin_key="k").command()
    assert flag in (REPO_ROOT / "docker" / "entrypoint.sh").read_text()
    max_in_flight = int(config("ensemble_infer").parameters["max_in_flight"].string_value)
    assert PYTHON_BACKEND_THREADS >= max_in_flight + 128  # room left for calls stranded by dead stubs


def test_launcher_and_image_turn_off_the_gpu_pools_and_metrics_alike_on_a_cpu_host():
    from launcher.tritonserver import CPU_ONLY_FLAGS, TritonServer

    entrypoint = (REPO_ROOT / "docker" / "entrypoint.sh").read_text()
    assert f'config="--model-config-name=cpu {" ".join(CPU_ONLY_FLAGS)}"' in entrypoint
    command = TritonServer(admin_key="k", model_config_name="cpu").command()
    assert command[-len(CPU_ONLY_FLAGS):] == CPU_ONLY_FLAGS
    assert not set(CPU_ONLY_FLAGS) & set(TritonServer(admin_key="k", model_config_name="").command())
