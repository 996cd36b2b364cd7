"""Against the real server (cpu backend): health probe, every dashboard and rule metric exported,
and (with Debian's prometheus installed) every panel query and recording rule evaluated by a real
Prometheus scraping it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from ._helpers import (
    DASHBOARD,
    PROMETHEUS,
    REPO,
    RULES,
    catalog_from_exposition,
    check_dashboard,
    check_queries,
    contract_envoy_metrics,
    contract_metrics,
    dashboard_queries,
    free_ports,
    grafana_to_promql,
    optional_metrics,
    parse_promql,
    rule_queries,
    rules,
    template_metrics,
    with_recorded_series,
)
from .conftest import Server
from .test_monitoring_config import target_labels

HEALTHCHECK = REPO / "deploy" / "healthcheck.py"


def _probe(target: str | None = None, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ATTENTION_")}
    args = [sys.executable, str(HEALTHCHECK)] + ([target] if target else [])
    return subprocess.run(args, capture_output=True, text=True, env={**clean, **env}, timeout=30)


def test_healthcheck_reports_serving(server: Server) -> None:
    port = server.target.rsplit(":", 1)[1]
    res = _probe(ATTENTION_PORT=port)  # as in the container: the port from the environment
    assert res.returncode == 0, res.stderr
    assert "SERVING" in res.stdout


def test_healthcheck_fails_without_a_server(server: Server) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    res = _probe(dead, ATTENTION_HEALTHCHECK_TIMEOUT="2")
    assert res.returncode == 1 and "UNAVAILABLE" in res.stderr


@pytest.fixture(scope="module")
def exposition(server: Server) -> str:
    """/metrics after a prefill, a decode, a server-side error and an info call."""
    from attention_client import AttentionClient, AttentionError

    rng = np.random.default_rng(0)
    h, hkv, d = 4, 2, 64
    with AttentionClient(server.target, timeout=60) as client:
        q = rng.standard_normal((24, h, d)).astype(np.float16)
        k = rng.standard_normal((24, hkv, d)).astype(np.float16)
        out = client.attention(q, k, k.copy(), cu_seqlens=[0, 10, 24], causal=True)
        assert out.shape == q.shape
        qd = rng.standard_normal((2, h, d)).astype(np.float16)
        assert client.decode(qd, k, k.copy(), [0, 7, 24]).shape == qd.shape
        client.info()
        # cu_seqlens ending past the tensor: only the server checks values (INVALID_ARGUMENT).
        with pytest.raises(AttentionError):
            client.attention(q, k, k.copy(), cu_seqlens=[0, 10, 30])
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        return r.read().decode()


def _without_optional(dashboard: dict) -> dict:
    """The dashboard less the queries that read only (NVML) metrics, absent on cpu, and
    Envoy's (tests/deploy/test_envoy.py checks those against a running Envoy)."""
    optional = optional_metrics() | set(contract_envoy_metrics())
    d = json.loads(json.dumps(dashboard))
    for p in d["panels"]:
        p["targets"] = [
            t for t in p.get("targets", [])
            if not {s.name for s in parse_promql(t["expr"]).selectors} <= optional
        ]
    return d


def test_every_contract_metric_is_exported(exposition: str) -> None:
    catalog = catalog_from_exposition(exposition)
    for name, (kind, labels) in contract_metrics().items():
        if name in optional_metrics():
            assert name not in catalog, f"{name}: NVML on a cpu server"
            continue
        sample = f"{name}_count" if kind == "histogram" else name
        assert sample in catalog, f"{name} missing from /metrics"
        assert labels <= catalog[sample][1], f"{name}: labels {catalog[sample][1]} != {labels}"


def test_every_dashboard_query_reads_exported_series(exposition: str) -> None:
    """Each panel's PromQL names series the running server exports, with their labels."""
    dashboard = _without_optional(json.loads(DASHBOARD.read_text()))
    catalog = catalog_from_exposition(exposition)
    assert check_dashboard(dashboard, catalog, target_labels()) == []


def test_every_rule_reads_exported_series(exposition: str) -> None:
    catalog = with_recorded_series(catalog_from_exposition(exposition))
    assert check_queries(rule_queries(), catalog, target_labels()) == []


def test_standard_series_and_no_created(exposition: str) -> None:
    catalog = catalog_from_exposition(exposition)
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"} <= set(
        catalog
    )
    assert not [line for line in exposition.splitlines() if "_created" in line]
    assert catalog["attention_process_cpu_seconds_total"][1] == {"role", "pid"}


def test_error_codes_are_labelled(exposition: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    seen = {
        (s.labels["rpc"], s.labels["code"])
        for f in text_string_to_metric_families(exposition)
        for s in f.samples
        if s.name == "attention_requests_total" and s.value > 0
    }
    assert {("Prefill", "OK"), ("Decode", "OK"), ("Prefill", "INVALID_ARGUMENT")} <= seen


def _traffic(target: str, seconds: float) -> None:
    """Prefill, decode, a KV cache's append, prefill and decode, and one rejected call,
    repeatedly, for ``seconds``."""
    from attention_client import AttentionClient, AttentionError

    rng = np.random.default_rng(1)
    q = rng.standard_normal((24, 4, 64)).astype(np.float16)
    k = rng.standard_normal((24, 2, 64)).astype(np.float16)
    deadline = time.monotonic() + seconds
    with AttentionClient(target, timeout=60) as client:
        while time.monotonic() < deadline:
            client.attention(q, k, k, cu_seqlens=[0, 10, 24], causal=True)
            client.decode(q[:2], k, k, [0, 7, 24])
            with client.kv_cache(2, 64, "float16") as cache:
                cache.append(["live"], k[:8], k[:8])
                cache.prefill(q[:4], ["live"], k[:4], k[:4])
                cache.decode(q[:1], ["live"])
            with pytest.raises(AttentionError):
                client.attention(q, k, k, cu_seqlens=[0, 10, 30])
            time.sleep(0.2)


def test_dashboard_and_rules_return_data_in_prometheus(server: Server, tmp_path: Path) -> None:
    """A real Prometheus scrapes the server with the shipped config and rules; every panel
    query and every recording rule must return series, and every rule evaluate cleanly."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus not installed: Debian's prometheus package (apt-get install -y "
                    "--no-install-recommends prometheus; .ci/run does it when root)")
    config = yaml.safe_load(PROMETHEUS.read_text())
    # The shipped config, faster and local.
    config["global"]["scrape_interval"] = config["global"]["evaluation_interval"] = "1s"
    config["rule_files"] = [str(RULES)]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "attention"]
    del job["dns_sd_configs"]  # the compose network's names: here, the live server itself
    job["static_configs"] = [{"targets": [server.metrics_url.split("/")[2]]}]
    config["scrape_configs"] = [j for j in config["scrape_configs"] if j["job_name"] != "envoy"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    api = f"http://127.0.0.1:{free_ports()}"  # below the ephemeral range: see free_ports
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                prometheus,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address={api[7:]}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def get(path: str, **params: str) -> dict:
        url = f"{api}/api/v1/{path}?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            reply = json.load(r)
        assert reply["status"] == "success", reply
        return reply["data"]

    def query(expr: str) -> list[dict]:
        return get("query", query=expr)["result"]

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if query('up{job="attention"} == 1'):
                    break
            except OSError:
                pass  # not listening yet
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        _traffic(server.target, 4.0)
        time.sleep(3.0)  # a few scrapes and rule evaluations after the last call
        dashboard = _without_optional(json.loads(DASHBOARD.read_text()))
        empty = []
        for title, expr in dashboard_queries(dashboard):
            # What Grafana substitutes: a window holding many 1 s scrapes, all instances.
            expr = grafana_to_promql(expr.replace("$__rate_interval", "30s"))
            if not query(expr.replace("$instance", ".*")):
                empty.append(f"{title}: {expr}")
        for rule in rules():
            if "record" in rule and not query(rule["record"]):
                empty.append(f"recorded {rule['record']}: {rule['expr']}")
        assert not empty, "queries without data:\n" + "\n".join(empty)
        for metric, label in template_metrics(dashboard):
            assert all(label in r["metric"] for r in query(metric)), metric
        loaded = [r for g in get("rules")["groups"] for r in g["rules"]]
        assert len(loaded) == len(rules())
        for r in loaded:
            assert r["health"] == "ok" and not r.get("lastError"), r
        # Nothing is wrong with this server: no alert fires.
        assert [r["name"] for r in loaded if r.get("state") == "firing"] == []
    finally:
        proc.terminate()
        proc.wait(timeout=30)
