"""The Kubernetes manifests in deploy/k8s, checked against batchserve itself so they cannot
rot: every flag they pass exists, every probe and scrape path is served, every metric the
autoscaler reads is exported, and the pod outlives its own drain."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from batchserve.cli import config_from_args

from .conftest import ROOT, GatedBackend

K8S = ROOT / "deploy/k8s"


def manifests() -> dict[str, Any]:
    """Each file's one document, by kind (the adapter's ConfigMap as ConfigMap)."""
    documents = {}
    for path in sorted(K8S.glob("*.yaml")):
        (document,) = list(yaml.safe_load_all(path.read_text()))
        documents[document["kind"]] = document
    return documents


def container(documents: dict[str, Any]) -> dict[str, Any]:
    (only,) = documents["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


def flags(args: list[str]) -> dict[str, str]:
    """--name=value arguments after `-m batchserve`."""
    start = args.index("batchserve") + 1
    return dict(arg[2:].split("=", 1) for arg in args[start:])


def test_every_manifest_parses_and_the_set_is_complete() -> None:
    assert set(manifests()) == {
        "Deployment", "Service", "PodMonitor", "HorizontalPodAutoscaler", "ConfigMap",
    }  # fmt: skip


def test_the_container_passes_only_flags_batchserve_has_and_listens_where_it_says() -> None:
    documents = manifests()
    spec = container(documents)
    given = flags(spec["args"])
    # every name is a flag and every value valid (argparse exits on an unknown flag)
    config_from_args([f"--{name}={value}" for name, value in given.items()])
    (port,) = spec["ports"]
    assert int(given["port"]) == port["containerPort"]
    assert given["host"] == "0.0.0.0"
    named = {port["name"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert spec[probe]["httpGet"]["port"] in named
    (service_port,) = documents["Service"]["spec"]["ports"]
    assert service_port["targetPort"] in named
    (endpoint,) = documents["PodMonitor"]["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in named
    selector = documents["Deployment"]["spec"]["selector"]["matchLabels"]
    assert documents["Service"]["spec"]["selector"] == selector
    assert documents["PodMonitor"]["spec"]["selector"]["matchLabels"] == selector


def test_the_pod_outlives_its_pre_stop_and_its_drain() -> None:
    documents = manifests()
    spec = container(documents)
    pod = documents["Deployment"]["spec"]["template"]["spec"]
    sleep = int(spec["lifecycle"]["preStop"]["exec"]["command"][-1])
    drain_s = float(flags(spec["args"])["drain-timeout-s"])
    assert pod["terminationGracePeriodSeconds"] > sleep + drain_s
    assert spec["resources"]["limits"]["nvidia.com/gpu"] >= 1


async def test_probe_and_scrape_paths_are_served_and_scaling_metrics_exported(
    start_server, gated: GatedBackend
) -> None:
    documents = manifests()
    spec = container(documents)
    client, _ = await start_server(gated)
    paths = {spec[probe]["httpGet"]["path"] for probe in ("readinessProbe", "livenessProbe")}
    (endpoint,) = documents["PodMonitor"]["spec"]["podMetricsEndpoints"]
    for path in {*paths, endpoint["path"]}:
        answer = await client.get(path)
        assert answer.status == 200, path
    exported = set(re.findall(r"^# TYPE (\S+) ", await (await client.get("/metrics")).text(), re.M))
    rules = yaml.safe_load(documents["ConfigMap"]["data"]["config.yaml"])["rules"]
    served = set()
    for rule in rules:
        series = rule["seriesQuery"].split("{")[0]
        assert series in exported
        served.add(rule["name"]["as"])
    hpa = documents["HorizontalPodAutoscaler"]["spec"]
    assert {metric["pods"]["metric"]["name"] for metric in hpa["metrics"]} <= served
    target = hpa["scaleTargetRef"]
    assert target["name"] == documents["Deployment"]["metadata"]["name"]


def test_the_operating_guide_shows_the_tested_files() -> None:
    # The operating guide (docs/operating.md, linked from README) is where the deploy files
    # are shown now; every one of them must be named there.
    guide = (ROOT / "docs" / "operating.md").read_text()
    for path in [*sorted(K8S.glob("*.yaml")), ROOT / "deploy/nginx/batchserve.conf"]:
        assert f"(../{path.relative_to(ROOT)})" in guide
    assert Path(ROOT / "examples/webapp.py").exists()


GATEWAY = K8S / "gateway"


def gateway_documents() -> dict[tuple[str, str], Any]:
    """deploy/k8s/gateway's documents by (kind, name)."""
    documents = {}
    for path in sorted(GATEWAY.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            documents[document["kind"], document["metadata"]["name"]] = document
    return documents


async def test_the_inference_pool_selects_the_pods_and_its_picker_reads_what_is_exported(
    start_server, gated: GatedBackend
) -> None:
    documents, pods = gateway_documents(), container(manifests())
    pool = documents["InferencePool", "batchserve"]["spec"]
    assert (
        pool["selector"]["matchLabels"]
        == manifests()["Deployment"]["spec"]["selector"]["matchLabels"]
    )
    assert [port["number"] for port in pool["targetPorts"]] == [
        port["containerPort"] for port in pods["ports"]
    ]
    (rule,) = documents["HTTPRoute", "batchserve"]["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["kind"], backend["name"]) == ("InferencePool", "batchserve")
    picker = documents["Deployment", pool["endpointPickerRef"]["name"]]
    service = documents["Service", pool["endpointPickerRef"]["name"]]
    (epp,) = picker["spec"]["template"]["spec"]["containers"]
    args = dict(arg[2:].split("=", 1) for arg in epp["args"])
    assert pool["endpointPickerRef"]["port"]["number"] == service["spec"]["ports"][0]["port"]
    assert args["pool-name"] == "batchserve"
    config = documents["ConfigMap", "batchserve-epp"]["data"]
    assert args["config-file"].rsplit("/", 1)[1] in config
    yaml.safe_load(config["epp.yaml"])
    # every metric the picker is told to read is a gauge /metrics serves, unlabelled
    client, _ = await start_server(gated, trust_gateway_headers=True)
    scraped = await client.get(args["model-server-metrics-path"])
    assert scraped.status == 200
    text = await scraped.text()
    for flag in ("total-queued-requests-metric", "total-running-requests-metric",
                 "kv-cache-usage-percentage-metric", "lora-info-metric"):  # fmt: skip
        name = args[flag]
        assert f"# TYPE {name} gauge" in text, name
        assert re.search(rf"^{re.escape(name)}[ {{]", text, re.M), name
    guide = (ROOT / "docs" / "operating.md").read_text()
    for path in sorted(GATEWAY.glob("*.yaml")):
        assert f"(../{path.relative_to(ROOT)})" in guide
    assert "--trust-gateway-headers" in guide
