"""deploy/k8s/: every manifest valid against a current Kubernetes schema (kubernetes-validate,
strict: an unknown field fails), and the pieces fit each other: selectors match the pods, probes
and Services name ports the containers open, Envoy mounts the ConfigMap made from
deploy/envoy/envoy.yaml and reaches the replicas by the name that file resolves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ._helpers import REPO

kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S = REPO / "deploy" / "k8s"
ENVOY = REPO / "deploy" / "envoy" / "envoy.yaml"
VERSION = "1.34.0"  # a cluster of 2025-2026; gRPC probes, policy/v1 and autoscaling/v2 are GA


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _all() -> dict[tuple[str, str], dict[str, Any]]:
    found = {}
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in _docs(path):
            found[(doc["kind"], doc["metadata"]["name"])] = doc
    return found


CRDS = {"PodMonitor"}  # the Prometheus Operator's: not in the Kubernetes schema


@pytest.mark.parametrize("path", sorted(K8S.rglob("*.yaml")), ids=lambda p: p.name)
def test_every_manifest_validates_strictly(path: Path) -> None:
    for doc in _docs(path):
        if doc["kind"] in CRDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        kubernetes_validate.validate(doc, VERSION, strict=True)


def test_the_validator_refuses_an_unknown_field() -> None:
    doc = _docs(K8S / "attention.yaml")[0]
    doc["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSION, strict=True)


def _pod(deployment: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    spec = deployment["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    return labels, spec["template"]["spec"]


def test_the_pieces_fit() -> None:
    res = _all()
    labels, pod = _pod(res[("Deployment", "attention")])
    (box,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in box["ports"]}
    assert ports == {"grpc": 50051, "metrics": 8000}
    assert box["resources"]["limits"]["nvidia.com/gpu"] == 1  # one GPU per replica
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert box[probe]["grpc"]["port"] == 50051  # grpc.health.v1, as the drain reports
    env = {e["name"]: e["value"] for e in box["env"]}
    assert env["ATTENTION_PORT"] == "50051" and env["ATTENTION_METRICS_PORT"] == "8000"
    # The drain (ATTENTION_GRACE_SECONDS + 5 s) fits the pod's termination grace.
    assert pod["terminationGracePeriodSeconds"] >= int(env["ATTENTION_GRACE_SECONDS"]) + 5

    svc = res[("Service", "attention")]
    assert svc["spec"]["clusterIP"] == "None"  # headless: DNS answers every replica
    assert svc["spec"]["selector"].items() <= labels.items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)
    assert res[("PodDisruptionBudget", "attention")]["spec"]["selector"]["matchLabels"].items() \
        <= labels.items()

    # Envoy resolves that Service by name, on the replicas' port.
    cfg = yaml.safe_load(ENVOY.read_text())
    for cluster in cfg["static_resources"]["clusters"]:
        assert cluster["type"] == "STRICT_DNS"
        (group,) = cluster["load_assignment"]["endpoints"]
        (ep,) = group["lb_endpoints"]
        addr = ep["endpoint"]["address"]["socket_address"]
        assert (addr["address"], addr["port_value"]) == (svc["metadata"]["name"], 50051)

    elabels, epod = _pod(res[("Deployment", "attention-envoy")])
    (envoy,) = epod["containers"]
    (volume,) = epod["volumes"]
    (mount,) = envoy["volumeMounts"]
    assert volume["configMap"]["name"] == "attention-envoy" and mount["name"] == volume["name"]
    config_path = envoy["args"][envoy["args"].index("-c") + 1]
    assert config_path == f"{mount['mountPath']}/envoy.yaml"
    # The documented command makes that ConfigMap from the same file compose mounts.
    assert ("kubectl create configmap attention-envoy "
            "--from-file=envoy.yaml=deploy/envoy/envoy.yaml") in (K8S / "envoy.yaml").read_text()
    admin = cfg["admin"]["address"]["socket_address"]["port_value"]
    listen = cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    eports = {p["name"]: p["containerPort"] for p in envoy["ports"]}
    assert eports == {"grpc": listen, "admin": admin}
    esvc = res[("Service", "attention-envoy")]
    assert esvc["spec"]["selector"].items() <= elabels.items()

    monitors = {name: doc for (kind, name), doc in res.items() if kind == "PodMonitor"}
    assert monitors["attention"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert monitors["attention"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitors["attention-envoy"]["spec"]["podMetricsEndpoints"][0]["path"] == \
        "/stats/prometheus"
    hpa = res[("HorizontalPodAutoscaler", "attention")]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "attention"
