"""deploy/kubernetes/, validated offline: rendered, schema-checked, and held to the image, the repository
and a running server. No cluster here: what needs one is listed in docs/scaling.md."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import psutil
import pytest
import requests
import yaml

from launcher.model_folder import DEFAULT_MODEL_DIR
from launcher.install import install_tritonserver, server_env
from launcher.paths import CACHE_DIR, COMPILE_CACHE, MODEL_REPOSITORY, REPO_ROOT
from launcher.process import DEFAULT_DRAIN_TIMEOUT, DRAIN_SLACK, EXIT_AFTER_DRAIN, Ports, wait_healthy
from launcher.tritonserver import TritonServer
from openai_frontend.shutdown import MARGIN

K8S = REPO_ROOT / "deploy" / "kubernetes"
SCHEMAS = K8S / "schemas"
KUBERNETES_VERSION = "1.37.0"
OVERLAYS = ("cpu", "gpu")
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitor_v1.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "serving.kserve.io_inferenceservice_v1beta1.json",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "serving.kserve.io_servingruntime_v1alpha1.json",
}


@functools.cache  # one kubectl run per overlay; the tests only read what it renders
def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the manifests (kubectl kustomize)"
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def kserve() -> list[dict]:
    return [yaml.safe_load(p.read_text()) for p in sorted((K8S / "kserve").glob("*.yaml"))]


def one(objects: list[dict], kind: str) -> dict:
    [found] = [o for o in objects if o["kind"] == kind]
    return found


def containers(objects: list[dict]) -> dict[str, dict]:
    spec = one(objects, "Deployment")["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec["initContainers"] + spec["containers"]}


def environment(objects: list[dict], container: dict) -> dict[str, str]:
    """A container's environment as the pod gets it: its ConfigMaps, then its literal values."""
    env = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env |= next(o["data"] for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name)
    env |= {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return env


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request) -> list[dict]:
    return render(request.param)


def schema(name: str) -> jsonschema.Validator:
    document = json.loads((SCHEMAS / name).read_text())
    return jsonschema.validators.validator_for(document)(document)


# Schemas


def test_every_kubernetes_object_passes_the_strict_schemas_of_a_recent_kubernetes(rendered):
    for obj in rendered:
        if (obj["apiVersion"], obj["kind"]) not in CRD_SCHEMAS:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_the_schema_check_rejects_a_broken_object(rendered):
    deployment = json.loads(json.dumps(one(rendered, "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("objects", [pytest.param(render, id="overlays"), pytest.param(kserve, id="kserve")])
def test_custom_resources_pass_their_published_schemas(objects):
    found = [o for o in ([*render("cpu"), *render("gpu")] if objects is render else kserve())
             if (o["apiVersion"], o["kind"]) in CRD_SCHEMAS]
    assert found
    for obj in found:
        schema(CRD_SCHEMAS[obj["apiVersion"], obj["kind"]]).validate(obj)
        broken = json.loads(json.dumps(obj))
        broken["spec"]["unknownField"] = 1
        assert not schema(CRD_SCHEMAS[obj["apiVersion"], obj["kind"]]).is_valid(broken)


def adapter_rules() -> list[dict]:
    return yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]


def test_the_prometheus_adapter_rules_pass_the_schema_of_its_config():
    validator = schema("prometheus-adapter_config.json")
    validator.validate({"rules": adapter_rules()})
    assert not validator.is_valid({"rules": [{"seriesQuerry": "llm_requests_running"}]})


# The manifests against the image and the repository


def test_no_secret_value_is_in_a_manifest(rendered):
    assert not [o for o in rendered if o["kind"] == "Secret"]
    for container in containers(rendered).values():
        for env in container.get("env", []):
            if "KEY" in env["name"]:
                assert "valueFrom" in env and "value" not in env, env["name"]


def test_the_pod_runs_the_image_as_its_non_root_user_on_a_read_only_root(rendered):
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    compose = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())
    uid = int(re.search(r"useradd .*--uid (\d+) triton-server", dockerfile).group(1))
    pod = one(rendered, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == uid
    for container in containers(rendered).values():
        assert container["image"] == compose["services"]["triton"]["image"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_ports_match_the_image_the_service_and_the_monitor(rendered):
    dockerfile = (REPO_ROOT / "Dockerfile").read_text()
    exposed = set(map(int, re.search(r"^EXPOSE (.+)$", dockerfile, re.M).group(1).split()))
    named = {p["name"]: p["containerPort"] for c in containers(rendered).values() for p in c.get("ports", [])}
    ports = Ports()  # the defaults, which the pod keeps
    assert named == {"http": ports.http, "grpc": ports.grpc, "metrics": ports.metrics, "openai": ports.openai}
    assert exposed == {ports.http, ports.grpc, ports.metrics}
    assert {p["targetPort"] for p in one(rendered, "Service")["spec"]["ports"]} == set(named)
    assert {e["port"] for e in one(rendered, "PodMonitor")["spec"]["podMetricsEndpoints"]} == {"metrics", "openai"}


def test_probes_and_the_init_container_run_launcher_commands_that_exist(rendered):
    from launcher.__main__ import main

    commands = []
    for container in containers(rendered).values():
        if "command" in container:
            commands.append(container["command"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "exec" in container.get(probe, {}):
                commands.append(container[probe]["exec"]["command"])
    assert ["python3", "-m", "launcher", "health"] in commands
    for command in commands:
        assert command[:3] == ["python3", "-m", "launcher"], command
        with pytest.raises(SystemExit) as usage:  # argparse knows the subcommand and its flags
            main([*command[3:], "--help"])
        assert usage.value.code == 0


def test_the_startup_budget_covers_the_measured_cold_start(rendered):
    triton = containers(rendered)["triton"]
    startup = triton["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 2 * 160  # 160 s measured on 2 cores


def test_every_environment_variable_the_pod_sets_is_read_by_the_repository(rendered):
    external = {"HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"}  # read by the shell, torch and Triton
    sources = "\n".join(p.read_text() for p in [*REPO_ROOT.glob("*/*.py"), *MODEL_REPOSITORY.rglob("*.pbtxt"),
                                                REPO_ROOT / "docker" / "entrypoint.sh"])
    for container in containers(rendered).values():
        env = environment(rendered, container) | {e["name"]: "" for e in container.get("env", [])}
        for name in set(env) - external:
            assert re.search(rf"\b{name}\b", sources), f"{container['name']}: {name} is read by nothing"


def test_the_configmap_tunables_are_the_configs_own_defaults():
    """The ConfigMap changes nothing until an operator edits it: each value is the config's default."""
    data = one(render("cpu"), "ConfigMap")["data"]
    defaults = dict(re.findall(r'"\$\{(\w+):-([^}$]+)\}"', (MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text()))
    assert defaults and set(defaults) <= set(data)
    for name, value in defaults.items():
        assert data[name] == value, name
    assert data["TOKENIZER_DIR"] == data["MODEL_DIR"] and Path(data["MODEL_DIR"]).parent == Path(data["MODEL_ROOTS"])


def test_volumes_match_compose_and_the_drain(rendered):
    compose = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())["services"]["triton"]
    pod = one(rendered, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": compose["shm_size"].replace("gb", "Gi")}
    claims = {o["metadata"]["name"] for o in rendered if o["kind"] == "PersistentVolumeClaim"}
    assert {volumes[name]["persistentVolumeClaim"]["claimName"] for name in ("models", "compile-cache")} == claims
    env = environment(rendered, containers(rendered)["triton"])
    mounts = {m["name"]: m["mountPath"] for m in containers(rendered)["triton"]["volumeMounts"]}
    assert mounts["models"] == env["MODEL_ROOTS"] and Path(env["MODEL_DIR"]).is_relative_to(mounts["models"])
    assert mounts["dshm"] == "/dev/shm"
    # The compile cache: where the image puts it, on the volume compose keeps, for torch and Triton both.
    image_env = dict(re.findall(r"\b(TORCHINDUCTOR_CACHE_DIR|TRITON_CACHE_DIR)=(\S+)", (REPO_ROOT / "Dockerfile").read_text()))
    assert f"compile-cache:{mounts['compile-cache']}" in compose["volumes"]
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert env[name] == image_env[name] and Path(env[name]).parent == Path(mounts["compile-cache"]), name
    # A rolling update never cuts a stream: each container's preStop pause, its drain and its exit fit.
    drain = float(environment(rendered, containers(rendered)["triton"])["DRAIN_TIMEOUT"])
    for name, after in (("triton", DRAIN_SLACK + EXIT_AFTER_DRAIN), ("openai", MARGIN + EXIT_AFTER_DRAIN)):
        pause = int(containers(rendered)[name]["lifecycle"]["preStop"]["exec"]["command"][1])
        assert float(environment(rendered, containers(rendered)[name])["DRAIN_TIMEOUT"]) == drain
        assert pod["terminationGracePeriodSeconds"] >= pause + drain + after, name


def test_the_budget_and_autoscaler_select_the_pods_of_the_deployment(rendered):
    labels = one(rendered, "Deployment")["spec"]["template"]["metadata"]["labels"]
    for kind in ("PodDisruptionBudget", "PodMonitor"):
        assert one(rendered, kind)["spec"]["selector"]["matchLabels"].items() <= labels.items(), kind
    assert one(rendered, "Service")["spec"]["selector"].items() <= labels.items()
    target = one(rendered, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", one(rendered, "Deployment")["metadata"]["name"])


def measured_running_target() -> int:
    """The highest concurrency at which make bench measured a p50 time to first token at or under 0.5 s
    on both workloads (ensemble over generate_stream): one replica's operating point."""
    points = json.loads((REPO_ROOT / "docs" / "benchmark" / "results.json").read_text())["points"]
    ok = {}
    for p in points:
        if p["system"] == "ensemble_http" and p["workload"] in ("fixed", "variable"):
            ok.setdefault(p["concurrency"], []).append(p["ttft_p50_ms"] <= 500)
    return max(c for c, fine in ok.items() if len(fine) == 2 and all(fine))


def hpa_targets(objects: list[dict]) -> dict[str, str]:
    hpa = one(objects, "HorizontalPodAutoscaler")["spec"]["metrics"]
    return {m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"] for m in hpa}


def test_the_cpu_autoscaling_target_is_the_measured_capacity_of_a_replica():
    assert int(hpa_targets(render("cpu"))["llm_requests_running"]) == measured_running_target() == 16
    isvc = one(kserve(), "InferenceService")["spec"]["predictor"]
    assert (isvc["scaleMetric"], isvc["scaleTarget"]) == ("concurrency", measured_running_target())


def test_the_gpu_autoscaling_target_fits_the_running_rows():
    limit = int(re.search(r'"\$\{MAX_RUNNING_REQUESTS:-(\d+)\}"', (MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text()).group(1))
    assert 0 < int(hpa_targets(render("gpu"))["llm_requests_running"]) <= limit


def test_the_gpu_overlay_asks_for_a_gpu_and_tolerates_gpu_nodes():
    pod = one(render("gpu"), "Deployment")["spec"]["template"]["spec"]
    triton = next(c for c in pod["containers"] if c["name"] == "triton")
    assert triton["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"]) and pod["nodeSelector"]
    cpu = one(render("cpu"), "Deployment")["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in json.dumps(cpu)


def test_the_autoscaler_reads_exactly_the_metrics_the_adapter_serves(rendered):
    served = {rule["name"]["as"] for rule in adapter_rules()}
    assert set(hpa_targets(rendered)) <= served


def test_kserve_runs_this_image_on_the_same_model_volume():
    runtime, isvc = one(kserve(), "ServingRuntime"), one(kserve(), "InferenceService")
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["storageUri"] == "pvc://triton-chat-models"
    assert "triton-chat-models" in {o["metadata"]["name"] for o in render("cpu") if o["kind"] == "PersistentVolumeClaim"}
    container = runtime["spec"]["containers"][0]
    assert container["image"] == containers(render("cpu"))["triton"]["image"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert [int(env["HTTP_PORT"])] == [p["containerPort"] for p in container["ports"]]  # KServe's 8080
    drain = float(env.get("DRAIN_TIMEOUT", DEFAULT_DRAIN_TIMEOUT))  # the launcher's default, unless set
    assert isvc["spec"]["predictor"]["terminationGracePeriodSeconds"] >= drain + DRAIN_SLACK + EXIT_AFTER_DRAIN


# Against a running server


def test_every_metric_the_autoscaler_and_adapter_name_is_on_a_live_server(server):
    exported = requests.get(f"http://127.0.0.1:{server.ports.metrics}/metrics", timeout=30).text
    names = set(re.findall(r"^(\w+)\{", exported, re.M))
    for rule in adapter_rules():
        for series in re.findall(r"\b(llm_\w+)\{", rule["seriesQuery"] + rule["metricsQuery"]):
            assert series in names, series


def test_the_entrypoint_serves_with_the_deployments_environment_and_its_probes_pass(tmp_path):
    """docker/entrypoint.sh with the Deployment's command and environment, against this machine's
    tritonserver. What differs, and why: /models and /tmp are folders here; the ports are free ones (the
    entrypoint reads HTTP_PORT/GRPC_PORT/METRICS_PORT, which the pod leaves at their defaults); the
    backends come from the local wheel; the compile cache is the local one (no second 160 s compile). It
    runs from the repository root, as the pod runs from the image's WORKDIR, /opt/chat."""
    objects = render("cpu")
    pods = containers(objects)
    models = tmp_path / "models"
    models.mkdir()

    def localized(env: dict[str, str]) -> dict[str, str]:
        here = {k: re.sub(r"^/models\b", str(models), re.sub(r"^/tmp\b", str(tmp_path), v)) for k, v in env.items()}
        return server_env(here) | {"TORCHINDUCTOR_CACHE_DIR": str(COMPILE_CACHE / "inductor"),
                                   "TRITON_CACHE_DIR": str(COMPILE_CACHE / "triton")}

    init = pods["model"]
    seeded = subprocess.run(init["command"], env=localized(environment(objects, init)), cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert seeded.returncode == 0, seeded.stderr
    assert (models / DEFAULT_MODEL_DIR.name / "config.json").exists()

    ports, home = Ports.free(), install_tritonserver()
    env = localized(environment(objects, pods["triton"]))
    env |= {"PATH": f"{home / 'bin'}{os.pathsep}{env['PATH']}", "MODEL_REPOSITORY": str(MODEL_REPOSITORY),
            "HTTP_PORT": str(ports.http), "GRPC_PORT": str(ports.grpc), "METRICS_PORT": str(ports.metrics)}
    log = tmp_path / "entrypoint.log"
    proc = subprocess.Popen([str(REPO_ROOT / "docker" / "entrypoint.sh"), *pods["triton"]["args"],
                             f"--backend-directory={home / 'backends'}"],
                            env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        server = TritonServer(ports=ports, log_path=log, process=proc)
        server.wait_ready(timeout=600)  # a cold compile of the automatic dtype's graphs: up to ~5 minutes on 2 cores
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = pods["triton"][probe]["exec"]["command"]
            result = subprocess.run(command, env=env, capture_output=True, text=True,
                                    timeout=pods["triton"][probe]["timeoutSeconds"])
            assert result.returncode == 0, (probe, result.stderr)
        reply = requests.post(f"{server.url}/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 4}, timeout=120)
        assert reply.status_code == 200 and reply.json()["completion_tokens"] > 0
        assert f"preprocess: tokenizer {models / DEFAULT_MODEL_DIR.name}" in log.read_text(errors="replace")
        openai = pods["openai"]  # the second container: the front end on this tritonserver
        openai_env = localized(environment(objects, openai)) | {
            "TRITON_GRPC_URL": f"127.0.0.1:{ports.grpc}", "OPENAI_PORT": str(ports.openai)}
        front = subprocess.Popen([str(REPO_ROOT / "docker" / "entrypoint.sh"), *openai["args"]], env=openai_env,
                                 stdout=(tmp_path / "openai.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(f"http://127.0.0.1:{ports.openai}{openai['readinessProbe']['httpGet']['path']}", front,
                         "the openai container", 60)
            models_list = requests.get(f"http://127.0.0.1:{ports.openai}/v1/models", timeout=10).json()
            assert models_list["data"][0]["id"] == environment(objects, openai)["OPENAI_MODEL_NAME"]
        finally:
            os.killpg(front.pid, signal.SIGTERM)
            front.wait(timeout=30)
        rss = pod_memory(proc.pid)
        (CACHE_DIR / "k8s.json").write_text(json.dumps({"rss_mib": rss / 2**20}, indent=2))
        requested = quantity(pods["triton"]["resources"]["requests"]["memory"])
        assert rss < requested, f"the triton container uses {rss / 2**20:.0f} MiB; it requests {requested / 2**20:.0f} MiB"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def pod_memory(pid: int) -> int:
    """Resident bytes of the container's main process (launcher supervise, with the watchdog), tritonserver
    and its stubs: what the triton container holds."""
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def quantity(value: str) -> int:
    """A Kubernetes memory quantity in bytes (Mi, Gi)."""
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", value).groups()
    return int(number) * {"Mi": 2**20, "Gi": 2**30}[unit]
