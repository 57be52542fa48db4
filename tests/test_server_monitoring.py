"""The Grafana dashboard and Prometheus config query metrics that the running server really exports."""

from __future__ import annotations

import json
import re

import requests
import yaml

from launcher.install import has_gpu
from launcher.paths import REPO_ROOT

MONITORING = REPO_ROOT / "monitoring"
GPU_ONLY = ("nv_gpu_", "nv_energy_")  # Triton exports these only where it sees a GPU


def dashboard_metrics() -> set[str]:
    dashboard = json.loads((MONITORING / "grafana" / "dashboards" / "triton-chat.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert len(exprs) >= 10
    names = {name for expr in exprs for name in re.findall(r"\b((?:nv|llm|openai)_[a-z0-9_]+)\b", expr)}
    return {re.sub(r"_(bucket|sum|count)$", "", name) for name in names}


def exported(metrics_url: str) -> set[str]:
    """Metric families on a Prometheus endpoint (prometheus_client names counters without ``_total``)."""
    text = requests.get(metrics_url, timeout=30).text
    return {name for family in re.findall(r"^# TYPE (\S+) (\S+)", text, flags=re.M)
            for name in ((family[0], family[0] + "_total") if family[1] == "counter" else (family[0],))}


def test_every_dashboard_query_names_a_metric_the_server_exports(server, openai_frontend, generate):
    assert generate({"text_input": "Hi", "max_tokens": 2}).status_code == 200  # request counters exist from now on
    found = exported(f"http://127.0.0.1:{server.ports.metrics}/metrics") | exported(f"{openai_frontend.url}/metrics")
    wanted = {m for m in dashboard_metrics() if has_gpu() or not m.startswith(GPU_ONLY)}
    assert wanted and wanted <= found, sorted(wanted - found)
    assert {"llm_generation_tokens_total", "llm_requests_rejected_total", "nv_inference_request_success",
            "openai_requests_total", "openai_time_to_first_token_seconds"} <= wanted


def test_prometheus_scrapes_triton_and_grafana_provisions_the_dashboard():
    compose = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())
    prometheus = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert targets == ["triton:8002", "openai:9000"] and {"triton", "openai"} <= set(compose["services"])
    for name in ("prometheus", "grafana"):
        service = compose["services"][name]
        assert service["profiles"] == ["monitoring"]
        for volume in service["volumes"]:
            assert (REPO_ROOT / volume.split(":")[0]).exists(), volume
    provider = yaml.safe_load((MONITORING / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
