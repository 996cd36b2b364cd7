"""/metrics: exactly the names, types and labels of docs/CONTRACTS.md, and they move."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import grpc
import pytest
import torch

from .svc_helpers import (
    decode_messages,
    prefill_messages,
    random_qkv,
    sample,
)

pytestmark = pytest.mark.timeout(60)
CONTRACTS = Path(__file__).resolve().parents[2] / "docs" / "CONTRACTS.md"
# The exposition type of each contract type (an info metric is exposed as a gauge of value 1).
EXPOSED_TYPE = {"counter": "counter", "histogram": "histogram", "gauge": "gauge", "info": "gauge"}


def _contract_metrics() -> dict[str, tuple[str, set[str]]]:
    """name -> (type, labels) from the metrics table of docs/CONTRACTS.md."""
    rows = {}
    for line in CONTRACTS.read_text().splitlines():
        m = re.match(r"\| `(attention_\w+)` \| (\w+)[^|]*\| ([^|]+) \|", line)
        if m:
            text = re.sub(r"\(.*?\)", "", m.group(3))  # drop notes like (`h2d`, ...)
            labels = {x.strip() for x in text.split(",")} - {"-", ""}
            rows[m.group(1)] = (m.group(2), labels)
    return rows


def test_contract_table_parsed() -> None:
    rows = _contract_metrics()
    assert len(rows) == 27 and rows["attention_stage_seconds"] == ("histogram", {"rpc", "stage"})


def test_metric_names_types_labels_match_contract(start_server) -> None:  # type: ignore[no-untyped-def]
    srv = start_server(metrics_port=0)
    q, k, v = random_qkv(8, 8, 2, 1, 8, torch.float32)
    list(srv.stub().Prefill(prefill_messages(q, k, v, [0, 8]), timeout=10))
    list(srv.stub().Decode(decode_messages(q[:1], k, v, [0, 8]), timeout=10))
    families = srv.scrape()
    by_sample: dict[str, tuple[str, set[str]]] = {}
    for fam in families.values():
        for s in fam.samples:
            base = re.sub(r"_(bucket|count|sum|created)$", "", s.name)
            if fam.type == "histogram" and s.name != fam.name:
                labels = set(s.labels) - {"le"}
            else:
                labels = set(s.labels)
            by_sample.setdefault(base if fam.type == "histogram" else s.name,
                                 (fam.type, labels))
    for name, (mtype, labels) in _contract_metrics().items():
        assert name in by_sample, f"{name} missing from /metrics"
        exposed_type, exposed_labels = by_sample[name]
        assert exposed_type == EXPOSED_TYPE[mtype], name
        if mtype == "info":
            assert labels <= exposed_labels, name
        else:
            assert exposed_labels == labels, name


def test_counters_move(start_server) -> None:  # type: ignore[no-untyped-def]
    srv = start_server(metrics_port=0)
    before = srv.scrape()
    q, k, v = random_qkv(10, 12, 4, 2, 16, torch.float32)
    resp = list(srv.stub().Prefill(prefill_messages(q, k, v, [0, 4, 10], [0, 5, 12]), timeout=10))
    stats = resp[-1].stats
    dq = torch.zeros(2, 4, 16)
    list(srv.stub().Decode(decode_messages(dq, k, v, [0, 5, 12]), timeout=10))
    with pytest.raises(grpc.RpcError):
        list(srv.stub().Decode(decode_messages(dq, k, v, [0, 5, 11]), timeout=10))
    after = srv.scrape()

    def delta(family: str, name: str, **labels: str) -> float:
        return sample(after, family, name, **labels) - sample(before, family, name, **labels)

    req = ("attention_requests", "attention_requests_total")
    assert delta(*req, rpc="Prefill", code="OK") == 1
    assert delta(*req, rpc="Decode", code="OK") == 1
    assert delta(*req, rpc="Decode", code="INVALID_ARGUMENT") == 1
    dur = ("attention_request_duration_seconds", "attention_request_duration_seconds_count")
    assert delta(*dur, rpc="Prefill", code="OK") == 1
    pre = {"rpc": "Prefill"}
    assert delta("attention_input_bytes", "attention_input_bytes_total", **pre) == stats.bytes_in
    assert delta("attention_output_bytes", "attention_output_bytes_total", **pre) == (
        stats.bytes_out
    )
    assert delta("attention_tokens", "attention_tokens_total", **pre) == 10
    assert delta("attention_tokens", "attention_tokens_total", rpc="Decode") == 12
    assert delta("attention_flops", "attention_flops_total", **pre) == stats.flops
    assert delta("attention_batches", "attention_batches_total", **pre) == 1
    assert delta("attention_batch_requests", "attention_batch_requests_sum", **pre) == 1
    assert delta("attention_batch_tokens", "attention_batch_tokens_sum", **pre) == 10
    assert delta("attention_queue_wait_seconds", "attention_queue_wait_seconds_count", **pre) == 1
    for stage in ("h2d", "kernel", "d2h"):
        assert delta("attention_stage_seconds", "attention_stage_seconds_count",
                     rpc="Decode", stage=stage) == 1
    assert delta("attention_prefill_kernel_tflops", "attention_prefill_kernel_tflops_count") == 1
    assert delta("attention_decode_kernel_gbps", "attention_decode_kernel_gbps_count") == 1
    assert sample(after, "attention_prefill_kernel_tflops_recent",
                  "attention_prefill_kernel_tflops_recent") > 0
    assert sample(after, "attention_decode_kernel_gbps_recent",
                  "attention_decode_kernel_gbps_recent") > 0
    assert sample(after, "attention_inflight_requests", "attention_inflight_requests") == 0
    assert sample(after, "attention_queue_depth", "attention_queue_depth", rpc="Prefill") == 0
    gpu = "attention_gpu_memory_allocated_bytes"
    assert sample(after, gpu, gpu) == 0
    info = after["attention_device_info"].samples[0]
    assert info.value == 1
    assert info.labels["backend"] == "cpu" and info.labels["device"] == "cpu"
    assert info.labels["torch_version"] == torch.__version__


def test_two_servers_in_one_process_have_separate_registries(start_server) -> None:  # type: ignore[no-untyped-def]
    a, b = start_server(metrics_port=0), start_server(metrics_port=0)
    q, k, v = random_qkv(4, 4, 2, 1, 8, torch.float32)
    list(a.stub().Prefill(prefill_messages(q, k, v, [0, 4]), timeout=10))
    req = ("attention_requests", "attention_requests_total")
    assert sample(a.scrape(), *req, rpc="Prefill", code="OK") == 1
    assert sample(b.scrape(), *req, rpc="Prefill", code="OK") == 0


def test_one_log_line_per_request(server, caplog) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="attention_service")
    q, k, v = random_qkv(4, 4, 2, 1, 8, torch.float32)
    list(server.stub().Prefill(prefill_messages(q, k, v, [0, 4]), timeout=10))
    with pytest.raises(grpc.RpcError):
        list(server.stub().Prefill(prefill_messages(q, k, v, [0, 3]), timeout=10))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rpc=Prefill")]
    assert len(lines) == 2
    assert "code=OK" in lines[0] and f"bytes_in={q.nbytes + k.nbytes + v.nbytes}" in lines[0]
    assert "duration_ms=" in lines[0] and "bytes_out=" in lines[0]
    assert "code=INVALID_ARGUMENT" in lines[1] and "cu_seqlens_q" in lines[1]


@pytest.mark.parametrize(("host", "bound"), [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_metrics_bind_loopback_unless_told(start_server, host, bound) -> None:  # type: ignore[no-untyped-def]
    # /metrics has no auth: a bare server must not expose it on every interface.
    srv = start_server(metrics_port=0, **({} if host is None else {"metrics_host": host}))
    assert srv.server.metrics._http.server_address[0] == bound
    assert "attention_requests" in srv.scrape()
