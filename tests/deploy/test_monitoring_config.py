"""Prometheus and Grafana files: they parse, agree with each other and with the contract."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from ._helpers import DASHBOARD, REPO, catalog_from_contract, check_dashboard, dashboard_queries

PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())


def target_labels() -> set[str]:
    """Labels Prometheus attaches to every scraped series (instance, job, static labels)."""
    labels = {"instance", "job"}
    for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]:
        for static in job.get("static_configs", []):
            labels |= set(static.get("labels", {}))
    return labels


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


# --- Prometheus -------------------------------------------------------------------------------


def test_prometheus_scrapes_the_service() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert set(config) <= {"global", "scrape_configs", "rule_files", "alerting"}
    interval = config["global"]["scrape_interval"]
    assert re.fullmatch(r"\d+[smh]", interval)
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "attention"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for s in job["static_configs"] for t in s["targets"]]
    env = dict(e.split("=", 1) for e in COMPOSE["services"]["attention"]["environment"] if "=" in e)
    assert targets == [f"attention:{env['ATTENTION_METRICS_PORT']}"]
    names = [j["job_name"] for j in config["scrape_configs"]]
    assert len(names) == len(set(names))


def test_promtool_accepts_the_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (optional: apt-get install prometheus)")
    res = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_parses_every_dashboard_query(tmp_path) -> None:
    """Prometheus' own PromQL parser, fed the panels' queries as recording rules."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (optional: apt-get install prometheus)")
    rules = []
    for i, (_, expr) in enumerate(dashboard_queries(dashboard())):
        # Grafana substitutes its variables before Prometheus sees the query.
        expr = expr.replace("$__rate_interval", "1m").replace("$instance", ".*")
        rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    res = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# --- Grafana provisioning ---------------------------------------------------------------------


def test_datasource_points_at_prometheus() -> None:
    ds = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["access"] == "proxy"
    assert source["url"] == "http://prometheus:9090" and "prometheus" in COMPOSE["services"]
    assert source["uid"] == "prometheus" and source["isDefault"] is True


def test_dashboard_provider() -> None:
    dp = yaml.safe_load((PROVISIONING / "dashboards" / "attention.yml").read_text())
    assert dp["apiVersion"] == 1
    (provider,) = dp["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")


# --- the dashboard ----------------------------------------------------------------------------


def _panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out += p.get("panels", [])
    return out


def test_dashboard_is_well_formed() -> None:
    d = dashboard()
    assert d["uid"] and d["title"] and isinstance(d["schemaVersion"], int)
    panels = _panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "prometheus"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip()
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]


def test_dashboard_queries_only_contract_metrics() -> None:
    assert check_dashboard(dashboard(), catalog_from_contract(), target_labels()) == []


@pytest.mark.parametrize(
    ("topic", "pattern"),
    [
        ("request rate", r"rate\(attention_requests_total"),
        ("p50 latency", r"histogram_quantile\(0\.5, .*attention_request_duration_seconds_bucket"),
        ("p95 latency", r"histogram_quantile\(0\.95, .*attention_request_duration_seconds_bucket"),
        ("p99 latency", r"histogram_quantile\(0\.99, .*attention_request_duration_seconds_bucket"),
        ("queue wait", r"attention_queue_wait_seconds"),
        ("kernel TFLOP/s", r"attention_prefill_kernel_tflops"),
        ("kernel GB/s", r"attention_decode_kernel_gbps"),
        ("batch size", r"attention_batch_requests"),
        ("errors by code", r'by \([^)]*code[^)]*\).*code!="OK"'),
        ("in flight", r"attention_inflight_requests"),
        ("queue depth", r"attention_queue_depth"),
        ("GPU memory", r"attention_gpu_memory_(allocated|reserved)_bytes"),
    ],
)
def test_dashboard_shows(topic: str, pattern: str) -> None:
    assert any(re.search(pattern, e) for _, e in dashboard_queries(dashboard())), topic


def test_latency_panel_groups_by_rpc() -> None:
    exprs = [
        e
        for _, e in dashboard_queries(dashboard())
        if "attention_request_duration_seconds_bucket" in e
    ]
    assert len(exprs) >= 3 and all(re.search(r"by \(rpc, le\)", e) for e in exprs)
