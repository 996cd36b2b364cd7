"""Against the real server (cpu backend): health probe, and every dashboard metric exported."""

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
    REPO,
    catalog_from_exposition,
    check_dashboard,
    contract_metrics,
    dashboard_queries,
    template_metrics,
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


def test_every_contract_metric_is_exported(exposition: str) -> None:
    catalog = catalog_from_exposition(exposition)
    for name, (kind, labels) in contract_metrics().items():
        sample = f"{name}_count" if kind == "histogram" else name
        assert sample in catalog, f"{name} missing from /metrics"
        assert labels <= catalog[sample][1], f"{name}: labels {catalog[sample][1]} != {labels}"


def test_every_dashboard_query_reads_exported_series(exposition: str) -> None:
    """Each panel's PromQL names series the running server exports, with their labels."""
    dashboard = json.loads(DASHBOARD.read_text())
    catalog = catalog_from_exposition(exposition)
    assert check_dashboard(dashboard, catalog, target_labels()) == []


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
    """Prefill, decode and one rejected call, repeatedly, for ``seconds``."""
    from attention_client import AttentionClient, AttentionError

    rng = np.random.default_rng(1)
    q = rng.standard_normal((24, 4, 64)).astype(np.float16)
    k = rng.standard_normal((24, 2, 64)).astype(np.float16)
    deadline = time.monotonic() + seconds
    with AttentionClient(target, timeout=60) as client:
        while time.monotonic() < deadline:
            client.attention(q, k, k, cu_seqlens=[0, 10, 24], causal=True)
            client.decode(q[:2], k, k, [0, 7, 24])
            with pytest.raises(AttentionError):
                client.attention(q, k, k, cu_seqlens=[0, 10, 30])
            time.sleep(0.2)


def test_dashboard_queries_return_data_in_prometheus(server: Server, tmp_path: Path) -> None:
    """A real Prometheus scrapes the server; every panel query must return series."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("prometheus not installed (optional: apt-get install prometheus)")
    config = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"  # the shipped config, faster and local
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "attention"]
    job["static_configs"][0]["targets"] = [server.metrics_url.split("/")[2]]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        api = f"http://127.0.0.1:{s.getsockname()[1]}"
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

    def query(expr: str) -> list[dict]:
        url = f"{api}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as r:
            reply = json.load(r)
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

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
        time.sleep(3.0)  # a few scrapes after the last call
        dashboard = json.loads(DASHBOARD.read_text())
        empty = []
        for title, expr in dashboard_queries(dashboard):
            # What Grafana substitutes: a window holding many 1 s scrapes, all instances.
            expr = expr.replace("$__rate_interval", "30s").replace("$instance", ".*")
            if not query(expr):
                empty.append(f"{title}: {expr}")
        assert not empty, "queries without data:\n" + "\n".join(empty)
        for metric, label in template_metrics(dashboard):
            assert all(label in r["metric"] for r in query(metric)), metric
    finally:
        proc.terminate()
        proc.wait(timeout=30)
