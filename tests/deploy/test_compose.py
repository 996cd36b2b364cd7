"""docker-compose.yml (and the cpu override), parsed and validated by Docker Compose itself.

`docker compose config` loads, merges, interpolates and validates the files against the
Compose specification without a Docker engine; the JSON it prints is what `up` would run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
import yaml

from ._helpers import REPO, compose_command, contract_envs

BASE = ["-f", "docker-compose.yml"]
CPU = [*BASE, "-f", "docker-compose.cpu.yml"]


def _config(files: list[str], *extra: str, **set_env: str) -> dict:
    # A clean environment: the defaults written in the files are what gets checked.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ATTENTION_", "LOADTEST_", "ENVOY_"))} | set_env
    res = subprocess.run(
        [*compose_command(), *files, "--profile", "loadtest", *extra, "config", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def gpu() -> dict:
    return _config(BASE)


@pytest.fixture(scope="module")
def cpu() -> dict:
    return _config(CPU)


def test_compose_rejects_an_invalid_file(tmp_path) -> None:
    """The validator is real: a misspelt key fails."""
    bad = tmp_path / "compose.yml"
    bad.write_text("services:\n  a:\n    image: busybox:1.36\n    restart_policy: always\n")
    res = subprocess.run(
        [*compose_command(), "-f", str(bad), "config", "-q"], capture_output=True, text=True
    )
    assert res.returncode != 0 and "restart_policy" in res.stderr


def test_services(gpu: dict) -> None:
    assert set(gpu["services"]) == {"attention", "prometheus", "grafana", "loadtest"}
    for name, svc in gpu["services"].items():
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: unpinned {image}"


def test_attention_reserves_the_gpu(gpu: dict) -> None:
    att = gpu["services"]["attention"]
    (device,) = att["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert att["environment"]["ATTENTION_DEVICE"] == "cuda"
    assert att["build"]["target"] == "runtime"


def test_attention_runtime_settings(gpu: dict) -> None:
    att = gpu["services"]["attention"]
    assert att["restart"] in ("always", "unless-stopped", "on-failure")
    assert att["healthcheck"]["test"] == ["CMD", "python", "/opt/attention/healthcheck.py"]
    published = {(p["target"], str(p["published"]), p.get("host_ip", "")) for p in att["ports"]}
    # The gRPC port for clients; /metrics (no auth) on the host's loopback only.
    assert published == {(50051, "50051", ""), (8000, "8000", "127.0.0.1")}
    env = att["environment"]
    assert (env["ATTENTION_PORT"], env["ATTENTION_METRICS_PORT"]) == ("50051", "8000")
    # Drains in-flight calls (ATTENTION_GRACE_SECONDS) before Docker's SIGKILL.
    grace = float(env["ATTENTION_GRACE_SECONDS"])
    stop = att["stop_grace_period"]
    assert stop.endswith("s") and float(stop[:-1]) > grace


def test_monitoring_is_published_on_loopback_only(gpu: dict) -> None:
    """Prometheus and Grafana have no auth in front of them (Grafana: anonymous viewing,
    admin/admin unless set), and Prometheus takes no lifecycle calls (/-/quit)."""
    for name, port in (("prometheus", 9090), ("grafana", 3000)):
        (p,) = gpu["services"][name]["ports"]
        assert (p["target"], p.get("host_ip")) == (port, "127.0.0.1"), name
    assert "--web.enable-lifecycle" not in gpu["services"]["prometheus"]["command"]


def test_every_contract_variable_is_configurable(gpu: dict) -> None:
    env = gpu["services"]["attention"]["environment"]
    names = {k for k in env if k.startswith("ATTENTION_")}
    # The server's settings, and every setting of the health probe (its client certificate
    # for mutual TLS, the name it checks the server's certificate for, its timeout).
    probe = set(re.findall(r"ATTENTION_HEALTHCHECK_[A-Z_]+",
                           (REPO / "deploy" / "healthcheck.py").read_text()))
    assert {"ATTENTION_HEALTHCHECK_TLS_NAME", "ATTENTION_HEALTHCHECK_CLIENT_CERT"} <= probe
    # ... and the kernels' knobs the service docs tell operators to set (warm-up workers).
    kernels = set(re.findall(r"ATTENTION_KERNELS_[A-Z_]+",
                             (REPO / "docs" / "service.md").read_text()))
    assert "ATTENTION_KERNELS_WARMUP_WORKERS" in kernels
    # ... and the engine's environment-only switches documented there.
    env_only = set(re.findall(r"\| \(environment only\) \| `(ATTENTION_[A-Z_]+)`",
                              (REPO / "docs" / "service.md").read_text()))
    assert "ATTENTION_PACK_KERNEL" in env_only
    assert names == contract_envs() | probe | kernels | env_only
    # Unset optional ones stay unset (null = passed through only when set in the shell).
    assert env["ATTENTION_AUTH_TOKEN"] is None and env["ATTENTION_TLS_CERT"] is None
    # The process model is the server's default (front ends by core count), regions its auto.
    assert env["ATTENTION_FRONTENDS"] == "0" and env["ATTENTION_REGIONS"] is None


def test_cpu_override_drops_the_gpu(cpu: dict) -> None:
    att = cpu["services"]["attention"]
    assert "deploy" not in att or not att["deploy"].get("resources")
    assert att["environment"]["ATTENTION_DEVICE"] == "cpu"
    assert att["build"]["args"]["TORCH_INDEX_URL"].endswith("/cpu")
    assert not att["build"]["args"]["BASE_IMAGE"].startswith("nvidia/")
    assert att["image"] != _config(BASE)["services"]["attention"]["image"]
    assert set(cpu["services"]) == {"attention", "prometheus", "grafana", "loadtest"}


def test_monitoring_mounts_the_deploy_files(gpu: dict) -> None:
    def mounts(svc: str) -> dict[str, str]:
        return {v["target"]: v.get("source", "") for v in gpu["services"][svc]["volumes"]}

    prom = mounts("prometheus")
    assert prom["/etc/prometheus/prometheus.yml"] == str(REPO / "deploy/prometheus/prometheus.yml")
    # prometheus.yml's rule_files (rules/*.yml) resolve beside it in the container.
    assert prom["/etc/prometheus/rules"] == str(REPO / "deploy/prometheus/rules")
    graf = mounts("grafana")
    assert graf["/etc/grafana/provisioning"] == str(REPO / "deploy/grafana/provisioning")
    provider = yaml.safe_load(
        (REPO / "deploy/grafana/provisioning/dashboards/attention.yml").read_text()
    )
    path = provider["providers"][0]["options"]["path"]
    assert graf[path] == str(REPO / "deploy/grafana/dashboards")


def test_loadtest_profile(gpu: dict) -> None:
    lt = gpu["services"]["loadtest"]
    assert lt["profiles"] == ["loadtest"]
    assert lt["build"]["target"] == "loadtest"
    assert lt["depends_on"]["attention"]["condition"] == "service_healthy"
    env = lt["environment"]
    assert env["LOCUST_HOST"] == "attention:50051" and env["LOCUST_HEADLESS"] == "true"
    assert env["LOCUST_CSV"].startswith("/results/")
    # Every LOADTEST_* knob the locustfile documents can be passed through (the target is
    # LOCUST_HOST here), and the token is the server's unless LOADTEST_TOKEN names one.
    doc = (REPO / "loadtest/locustfile.py").read_text()
    documented = set(re.findall(r"^  (LOADTEST_[A-Z_]+) ", doc, re.M)) - {"LOADTEST_TARGET"}
    knobs = {k for k in env if k.startswith("LOADTEST_")}
    assert len(documented) > 10 and knobs == documented
    assert env["LOADTEST_TOKEN"] == ""  # the clean environment: no token


def test_profiles_hide_the_loadtest_by_default() -> None:
    res = subprocess.run(
        [*compose_command(), *BASE, "config", "--services"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert res.returncode == 0, res.stderr
    assert set(res.stdout.split()) == {"attention", "prometheus", "grafana"}


def test_dcgm_exporter_profile() -> None:
    """Off by default; `--profile dcgm` adds NVIDIA's exporter with every GPU reserved."""
    dcgm = _config(BASE, "--profile", "dcgm")["services"]["dcgm-exporter"]
    assert dcgm["profiles"] == ["dcgm"]
    image = dcgm["image"]
    assert image.startswith("nvcr.io/nvidia/k8s/dcgm-exporter:") and not image.endswith("latest")
    (device,) = dcgm["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "SYS_ADMIN" in dcgm["cap_add"]


def test_the_contract_lists_every_server_setting() -> None:
    """Every variable the server reads (config._ENV) is in docs/CONTRACTS.md, hence in the
    compose file (the test above): ATTENTION_TLS_CLIENT_CA was missing from both."""
    from attention_service.config import _ENV

    assert {env for _, env, _ in _ENV.values()} <= contract_envs()



@pytest.mark.parametrize(("profile", "gpus"), [(None, 2), ("gpus-4", 4), ("gpus-8", 8)])
def test_replicas_override_runs_one_replica_per_gpu_behind_envoy(profile: str | None,
                                                                 gpus: int) -> None:
    # Issue 64: docker-compose.replicas.yml, for 2, 4 and 8 GPUs.
    extra = ("--profile", profile) if profile else ()
    cfg = _config([*BASE, "-f", "docker-compose.replicas.yml"], *extra)
    services = cfg["services"]
    replicas = sorted((n for n in services if n.startswith("attention")),
                      key=lambda n: int(n.rpartition("-")[2]) if "-" in n else 0)
    assert len(replicas) == gpus
    for i, name in enumerate(replicas):
        svc = services[name]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["device_ids"] == [str(i)] and "count" not in device
        assert not svc.get("ports")  # Envoy is the door
        if i:  # the others answer the name Envoy and Prometheus resolve
            assert svc["networks"]["default"]["aliases"] == ["attention"]
            assert svc["image"] == services["attention"]["image"]
            assert svc["environment"] == services["attention"]["environment"]
    envoy = services["envoy"]
    assert [p["target"] for p in envoy["ports"]] == [50051, 9901]
    assert envoy["ports"][1]["host_ip"] == "127.0.0.1"  # the admin has no auth
    (mount,) = envoy["volumes"]
    assert mount["source"] == str(REPO / "deploy" / "envoy" / "envoy.yaml")
    assert envoy["command"][envoy["command"].index("-c") + 1] == mount["target"]
    assert "LOCUST_HOST=envoy:50051" in services["loadtest"]["environment"] or \
        services["loadtest"]["environment"].get("LOCUST_HOST") == "envoy:50051"


def test_the_latency_profile_keeps_envoys_cpus_awake() -> None:
    # Envoy's hop on a B=1 step is two wake-ups of its CPUs (docs/deploy.md, "Envoy on a
    # latency budget"): ENVOY_CPUS pins Envoy, the profile adds a keep-awake on the same CPUs.
    files = [*BASE, "-f", "docker-compose.replicas.yml"]
    plain = _config(files)["services"]
    assert "envoy-keep-awake" not in plain and not plain["envoy"].get("cpuset")
    services = _config(files, "--profile", "latency", ENVOY_CPUS="12-15")["services"]
    awake = services["envoy-keep-awake"]
    assert services["envoy"]["cpuset"] == awake["cpuset"] == "12-15"
    assert awake["entrypoint"] == ["attention-keep-awake", "--cpus", "12-15"]
    assert awake["image"] == services["attention"]["image"]  # the tool comes with the server
    assert awake["network_mode"] == "none" and not awake.get("ports")

