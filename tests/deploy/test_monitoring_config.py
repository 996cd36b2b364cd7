"""Prometheus and Grafana files: they parse, agree with each other and with the contract.

PromQL is checked twice: by promql-parser (requirements-dev.txt, so always) and, when Debian's
`prometheus` package is installed (.ci/run installs it where it runs as root with apt-get), by
Prometheus' own promtool: `check config` (with the rule files it loads), `check rules`, and
`test rules`, which evaluates the recording and alerting rules over synthetic series.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from ._helpers import (
    DASHBOARD,
    PROMETHEUS,
    REPO,
    RULES,
    RULES_TESTS,
    catalog_from_contract,
    check_dashboard,
    check_queries,
    dashboard_queries,
    envoy_catalog,
    grafana_to_promql,
    parse_promql,
    rule_queries,
    rules,
    with_recorded_series,
)

PROVISIONING = REPO / "deploy" / "grafana" / "provisioning"
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())


def target_labels() -> set[str]:
    """Labels Prometheus attaches to every scraped series (instance, job, static labels)."""
    labels = {"instance", "job"}
    for job in yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]:
        for static in job.get("static_configs", []):
            labels |= set(static.get("labels", {}))
        labels |= {r["target_label"] for r in job.get("relabel_configs", [])
                   if "target_label" in r}
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
    # Every replica: the service name's A records (one per container), on the metrics port.
    (sd,) = job["dns_sd_configs"]
    env = dict(e.split("=", 1) for e in COMPOSE["services"]["attention"]["environment"] if "=" in e)
    assert (sd["names"], sd["type"], sd["port"]) == (["attention"], "A",
                                                      int(env["ATTENTION_METRICS_PORT"]))
    (envoy,) = [j for j in config["scrape_configs"] if j["job_name"] == "envoy"]
    assert envoy["metrics_path"] == "/stats/prometheus"
    admin = yaml.safe_load((REPO / "deploy/envoy/envoy.yaml").read_text())["admin"]
    assert envoy["dns_sd_configs"][0]["port"] == admin["address"]["socket_address"]["port_value"]
    names = [j["job_name"] for j in config["scrape_configs"]]
    assert len(names) == len(set(names))


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed: Debian's prometheus package (apt-get install -y "
                    "--no-install-recommends prometheus; .ci/run does it when root); "
                    "promql-parser still parses every expression")
    return path


def run_promtool(*args: str) -> None:
    res = subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_accepts_the_config() -> None:
    """The config, and the rule files it loads (rule_files is followed)."""
    run_promtool("check", "config", str(PROMETHEUS))


def test_promtool_accepts_the_rules() -> None:
    run_promtool("check", "rules", str(RULES))


def test_promtool_unit_tests_of_the_rules() -> None:
    """Prometheus' engine evaluates the recording and alerting rules over synthetic series:
    the kernel-time weighted throughput, error ratio, p99, queue saturation, and when each
    alert fires (with its rendered annotations)."""
    run_promtool("test", "rules", str(RULES_TESTS))


def test_promtool_parses_every_dashboard_query(tmp_path) -> None:
    """Prometheus' own PromQL parser, fed the panels' queries as recording rules."""
    tool = promtool()
    rules_ = []
    for i, (_, expr) in enumerate(dashboard_queries(dashboard())):
        # Grafana substitutes its variables before Prometheus sees the query.
        rules_.append({"record": f"dashboard:query_{i}", "expr": grafana_to_promql(expr)})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules_}]}))
    res = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# --- rules ------------------------------------------------------------------------------------


def test_prometheus_loads_the_rules() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    (pattern,) = config["rule_files"]
    # Relative to prometheus.yml: deploy/prometheus/ here, /etc/prometheus/ in compose.
    assert not pattern.startswith("/")
    assert sorted(PROMETHEUS.parent.glob(pattern)) == [RULES]


def test_every_expression_parses() -> None:
    """promql-parser (a real PromQL parser, with type checks) on every rule and panel query:
    the same check as promtool's where promtool is missing."""
    for where, expr in rule_queries() + dashboard_queries(dashboard()):
        try:
            parse_promql(expr)
        except ValueError as exc:
            pytest.fail(f"{where}: {expr}: {exc}")


def test_parser_rejects_bad_promql() -> None:
    """The parser is real: it rejects what Prometheus rejects."""
    for bad in ("rate(attention_requests_total)", "sum by (rpc (x)", "nosuchfunc(x)",
                "attention_requests_total[5m] + 1"):
        with pytest.raises(ValueError):
            parse_promql(bad)


def test_rules_query_only_contract_metrics() -> None:
    catalog = with_recorded_series(catalog_from_contract())
    assert check_queries(rule_queries(), catalog, target_labels()) == []


def test_recording_rule_names() -> None:
    """level:metric:operations, each recorded once, and no rule reads one recorded later."""
    seen: set[str] = set()
    for rule in rules():
        for sel in parse_promql(rule["expr"]).selectors:
            assert ":" not in sel.name or sel.name in seen, (rule, sel.name)
        if "record" in rule:
            assert re.fullmatch(r"[a-z_]+:attention_[a-z_]+:[a-z0-9_]+", rule["record"]), rule
            assert rule["record"] not in seen
            seen.add(rule["record"])


def test_kernel_throughput_is_time_weighted() -> None:
    """Work over kernel seconds, both rates of counters, never a per-launch histogram."""
    exprs = {r.get("record"): r["expr"] for r in rules()}
    for work in ("flops", "kv_bytes"):
        expr = exprs[f"rpc:attention_kernel_{work}_per_second:rate5m"]
        names = [s.name for s in parse_promql(expr).selectors]
        assert names == [f"attention_kernel_{work}_total", "attention_kernel_seconds_total"]


@pytest.mark.parametrize(
    ("alert", "reads"),
    [
        ("AttentionDown", "up"),
        ("AttentionHighErrorRatio", "rpc:attention_server_errors:ratio_rate5m"),
        ("AttentionHighLatencyP99", "rpc:attention_request_duration_seconds:p99_5m"),
        ("AttentionQueueSaturated", "instance:attention_queue_saturation:ratio"),
        ("AttentionFrontendRestarts", "attention_frontend_restarts_total"),
        ("AttentionArenaOverflows", "attention_arena_overflows_total"),
    ],
)
def test_alerts(alert: str, reads: str) -> None:
    (rule,) = [r for r in rules() if r.get("alert") == alert]
    assert [s.name for s in parse_promql(rule["expr"]).selectors] == [reads]
    assert rule["labels"]["severity"] in ("critical", "warning")
    assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    if alert != "AttentionFrontendRestarts":  # one restart is worth a look at once
        assert re.fullmatch(r"\d+m", rule["for"])


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
    catalog = catalog_from_contract() | envoy_catalog()  # Envoy's panels read its stats
    assert check_dashboard(dashboard(), catalog, target_labels()) == []


@pytest.mark.parametrize(
    ("topic", "pattern"),
    [
        ("request rate", r"rate\(attention_requests_total"),
        ("p50 latency", r"histogram_quantile\(0\.5, .*attention_request_duration_seconds_bucket"),
        ("p95 latency", r"histogram_quantile\(0\.95, .*attention_request_duration_seconds_bucket"),
        ("p99 latency", r"histogram_quantile\(0\.99, .*attention_request_duration_seconds_bucket"),
        ("queue wait", r"attention_queue_wait_seconds"),
        ("engine share", r"attention_engine_seconds_sum.*/.*attention_engine_seconds_count"),
        ("launch issue time", r"attention_launch_issue_seconds_sum"),
        ("kernel FLOP/s, time-weighted",
         r"rate\(attention_kernel_flops_total.*\) / .*rate\(attention_kernel_seconds_total"),
        ("kernel bytes/s, time-weighted",
         r"rate\(attention_kernel_kv_bytes_total.*\) / .*rate\(attention_kernel_seconds_total"),
        ("kernel FLOP/s per launch", r"attention_prefill_kernel_flops_per_second_bucket"),
        ("kernel bytes/s per launch", r"attention_decode_kernel_bytes_per_second_bucket"),
        ("kernel busy", r"^sum by \(instance, rpc\) \(rate\(attention_kernel_seconds_total"),
        ("batch size", r"attention_batch_requests"),
        ("errors by code", r'by \([^)]*code[^)]*\).*code!="OK"'),
        ("in flight", r"attention_inflight_requests"),
        ("queue depth", r"attention_queue_depth"),
        ("queue saturation", r"attention_queue_depth.*/.*attention_queue_capacity"),
        ("GPU memory", r"attention_gpu_memory_(allocated|reserved)_bytes"),
        ("GPU utilisation (NVML)", r"attention_gpu_utilization_ratio"),
        ("GPU power (NVML)", r"attention_gpu_power_watts"),
        ("CPU per process", r"rate\(attention_process_cpu_seconds_total"),
        ("event loop CPU", r"rate\(attention_process_main_thread_cpu_seconds_total"),
        ("memory per process", r"attention_process_resident_memory_bytes"),
        ("front ends alive", r"attention_frontends\{"),
        ("front-end restarts", r"increase\(attention_frontend_restarts_total"),
        ("calls lost with a front end", r"increase\(attention_frontend_lost_calls_total"),
        ("launches that merged", r'attention_batch_requests_bucket\{[^}]*le="1\.0"'),
    ],
)
def test_dashboard_shows(topic: str, pattern: str) -> None:
    assert any(re.search(pattern, e) for _, e in dashboard_queries(dashboard())), topic


def test_latency_panel_groups_by_rpc() -> None:
    exprs = [
        e
        for _, e in dashboard_queries(dashboard())
        if "histogram_quantile" in e and "attention_request_duration_seconds_bucket" in e
    ]
    assert len(exprs) >= 3 and all(re.search(r"by \(rpc, le\)", e) for e in exprs)
    # OK calls, as the p99 alert reads them: a refusal answered in microseconds must not
    # pull the latency down, nor a call cut off by its deadline push it up.
    assert all('code="OK"' in e for e in exprs)
    assert 'code="OK"' in RULES.read_text()


def test_batch_size_shows_no_quantile() -> None:
    """A quantile of attention_batch_requests interpolates inside its lowest bucket (le=1):
    0.95 when every launch holds one request. The panel shows the mean and the share of
    launches that merged two or more."""
    exprs = [e for _, e in dashboard_queries(dashboard()) if "attention_batch_requests" in e]
    assert exprs and not any("histogram_quantile" in e for e in exprs)


def test_latency_heatmap() -> None:
    (panel,) = [p for p in _panels(dashboard()) if p["type"] == "heatmap"]
    (target,) = panel["targets"]
    assert target["format"] == "heatmap" and target["legendFormat"] == "{{le}}"
    assert re.fullmatch(
        r"sum by \(le\) \(increase\(attention_request_duration_seconds_bucket\{.*\}"
        r"\[\$__rate_interval\]\)\)", target["expr"]
    )
    # Buckets as Prometheus counts them (no re-bucketing by Grafana), in seconds.
    assert panel["options"]["calculate"] is False and panel["options"]["yAxis"]["unit"] == "s"


# Grafana unit ids: the value of each query is in base units and Grafana scales the prefix.
UNITS = {
    "attention_kernel_flops_total": "flops",  # FLOP/s, shown as TFLOP/s
    "attention_prefill_kernel_flops_per_second_bucket": "flops",
    "attention_kernel_kv_bytes_total": "Bps",  # bytes/s (SI), shown as GB/s
    "attention_decode_kernel_bytes_per_second_bucket": "Bps",
    "attention_process_cpu_seconds_total": "percentunit",  # CPU seconds per second
    "attention_queue_capacity": "percentunit",
    "attention_gpu_utilization_ratio": "percentunit",
    "attention_gpu_power_watts": "watt",
    "attention_request_duration_seconds_bucket": "s",
    "attention_process_resident_memory_bytes": "bytes",
    "attention_input_bytes_total": "Bps",
}


def test_every_panel_has_a_unit() -> None:
    for p in _panels(dashboard()):
        if p["type"] == "timeseries":
            assert p["fieldConfig"]["defaults"].get("unit"), p["title"]
        elif p["type"] == "heatmap":
            assert p["options"]["yAxis"].get("unit"), p["title"]


def _unit(panel: dict) -> str:
    if panel["type"] == "heatmap":
        return panel["options"]["yAxis"]["unit"]
    return panel["fieldConfig"]["defaults"]["unit"]


@pytest.mark.parametrize(("metric", "unit"), sorted(UNITS.items()))
def test_panel_units(metric: str, unit: str) -> None:
    """Every panel that reads ``metric`` shows it in ``unit``."""
    panels = [
        p for p in _panels(dashboard())
        if any(s.name == metric for t in p.get("targets", [])
               for s in parse_promql(t["expr"]).selectors)
    ]
    assert panels, metric
    for p in panels:
        assert _unit(p) == unit, (p["title"], _unit(p))


def test_no_per_launch_gauges_or_bit_units() -> None:
    """Gone: the *_recent gauges (whichever launch came last) and gbps/tflops names."""
    text = DASHBOARD.read_text() + RULES.read_text()
    assert not re.search(r"_recent|gbps|tflops", text)
