"""/metrics: exactly the names, types and labels of docs/CONTRACTS.md, and they move."""

from __future__ import annotations

import logging
import os
import re
import sys
import types
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch

from attention_service.link import EngineInfo
from attention_service.metrics import LiveCollector
from attention_service.server import gpu_uuid
from attention_wire.pb import attention_pb2 as pb

from .group_helpers import Group
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


def _contract_metrics(nvml: bool = False) -> dict[str, tuple[str, set[str]]]:
    """name -> (type, labels) from the metrics table of docs/CONTRACTS.md; those marked (NVML)
    (a GPU's readings, absent on the cpu backend) only with ``nvml``."""
    rows = {}
    for line in CONTRACTS.read_text().splitlines():
        m = re.match(r"\| `(attention_\w+)` \| (\w+)[^|]*\| ([^|]+) \|", line)
        if m and ("(NVML)" in m.group(3)) == nvml:
            text = re.sub(r"\(.*?\)", "", m.group(3))  # drop notes like (`h2d`, ...)
            labels = {x.strip() for x in text.split(",")} - {"-", ""}
            rows[m.group(1)] = (m.group(2), labels)
    return rows


def test_contract_table_parsed() -> None:
    rows = _contract_metrics()
    assert len(rows) == 40 and rows["attention_stage_seconds"] == ("histogram", {"rpc", "stage"})
    assert rows["attention_process_cpu_seconds_total"] == ("counter", {"role", "pid"})
    assert len(_contract_metrics(nvml=True)) == 8


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
    # The engine's share of the call: observed once, within the call's whole duration.
    assert delta("attention_engine_seconds", "attention_engine_seconds_count", **pre) == 1
    engine = delta("attention_engine_seconds", "attention_engine_seconds_sum", **pre)
    assert 0 < engine <= delta("attention_request_duration_seconds",
                               "attention_request_duration_seconds_sum", rpc="Prefill",
                               code="OK")
    assert delta("attention_launch_issue_seconds", "attention_launch_issue_seconds_count",
                 **pre) == 1
    assert delta("attention_launch_issue_seconds", "attention_launch_issue_seconds_sum",
                 **pre) > 0
    for stage in ("h2d", "kernel", "d2h"):
        assert delta("attention_stage_seconds", "attention_stage_seconds_count",
                     rpc="Decode", stage=stage) == 1
    # Per launch: one observation each, in base units (FLOP/s, bytes/s), labelled by rpc.
    assert delta("attention_prefill_kernel_flops_per_second",
                 "attention_prefill_kernel_flops_per_second_count", **pre) == 1
    assert delta("attention_decode_kernel_bytes_per_second",
                 "attention_decode_kernel_bytes_per_second_count", rpc="Decode") == 1
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


@pytest.mark.parametrize("access_log", [True, False])
def test_one_log_line_per_request(start_server, caplog, access_log) -> None:  # type: ignore[no-untyped-def]
    server = start_server(access_log=access_log)
    caplog.set_level(logging.DEBUG, logger="attention_service")
    q, k, v = random_qkv(4, 4, 2, 1, 8, torch.float32)
    list(server.stub().Prefill(prefill_messages(q, k, v, [0, 4]), timeout=10))
    with pytest.raises(grpc.RpcError):
        list(server.stub().Prefill(prefill_messages(q, k, v, [0, 3]), timeout=10))
    records = [r for r in caplog.records if r.getMessage().startswith("rpc=Prefill")]
    lines = [r.getMessage() for r in records]
    assert len(lines) == 2
    assert "code=OK" in lines[0] and f"bytes_in={q.nbytes + k.nbytes + v.nbytes}" in lines[0]
    assert "duration_ms=" in lines[0] and "bytes_out=" in lines[0]
    assert "code=INVALID_ARGUMENT" in lines[1] and "cu_seqlens_q" in lines[1]
    # Failures at WARNING; the traffic at INFO with --access-log, else at DEBUG: a default
    # server's log holds the failed calls, not one line per call.
    ok_level = logging.INFO if access_log else logging.DEBUG
    assert [r.levelno for r in records] == [ok_level, logging.WARNING]


def test_a_failed_calls_log_line_outranks_the_traffic() -> None:
    from attention_service.frontend.servicer import call_log_level

    assert call_log_level("OK") == call_log_level("CANCELLED") == logging.INFO
    assert call_log_level("OK", access_log=False) == logging.DEBUG
    for code in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAVAILABLE",
                 "UNAUTHENTICATED", "NOT_FOUND", "ABORTED"):
        assert call_log_level(code) == logging.WARNING, code
    assert call_log_level("INTERNAL") == logging.ERROR


@pytest.mark.parametrize(("host", "bound"), [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_metrics_bind_loopback_unless_told(start_server, host, bound) -> None:  # type: ignore[no-untyped-def]
    # /metrics has no auth: a bare server must not expose it on every interface.
    srv = start_server(metrics_port=0, **({} if host is None else {"metrics_host": host}))
    assert srv.server.metrics._http.server_address[0] == bound
    assert "attention_requests" in srv.scrape()


def test_kernel_work_counters_move_by_the_work_done(start_server) -> None:  # type: ignore[no-untyped-def]
    """Kernel seconds, FLOPs and K/V bytes per rpc: their rates divide into the kernels'
    time-weighted throughput, so each must count exactly the work of each launch."""
    srv = start_server(metrics_port=0)
    before = srv.scrape()
    h, hkv, d = 4, 2, 16
    q, k, v = random_qkv(10, 12, h, hkv, d, torch.float32)
    cu_q, cu_k = [0, 4, 10], [0, 5, 12]
    resp = list(srv.stub().Prefill(prefill_messages(q, k, v, cu_q, cu_k), timeout=10))
    dq = torch.zeros(2, h, d)
    list(srv.stub().Decode(decode_messages(dq, k, v, cu_k), timeout=10))
    after = srv.scrape()

    def delta(name: str, rpc: str) -> float:
        family = name.removesuffix("_total")
        return sample(after, family, name, rpc=rpc) - sample(before, family, name, rpc=rpc)

    # 4 FLOPs per (query, key) pair per head and head dim (QK^T and PV, multiply-add each).
    prefill_pairs = 4 * 5 + 6 * 7  # no causal mask: every query sees its sequence's keys
    assert delta("attention_kernel_flops_total", "Prefill") == 4 * prefill_pairs * h * d
    assert delta("attention_kernel_flops_total", "Prefill") == resp[-1].stats.flops
    decode_pairs = 12  # one query per sequence over its 5 + 7 keys
    assert delta("attention_kernel_flops_total", "Decode") == 4 * decode_pairs * h * d
    # K and V, float32: every key of every sequence is read once.
    kv_bytes = k.nbytes + v.nbytes
    assert kv_bytes == 2 * 12 * hkv * d * 4
    assert delta("attention_kernel_kv_bytes_total", "Prefill") == kv_bytes
    assert delta("attention_kernel_kv_bytes_total", "Decode") == kv_bytes
    for rpc in ("Prefill", "Decode"):
        assert delta("attention_kernel_seconds_total", rpc) > 0
        # The same seconds as the kernel stage's histogram.
        assert delta("attention_kernel_seconds_total", rpc) == pytest.approx(
            sample(after, "attention_stage_seconds", "attention_stage_seconds_sum", rpc=rpc,
                   stage="kernel")
            - sample(before, "attention_stage_seconds", "attention_stage_seconds_sum", rpc=rpc,
                     stage="kernel")
        )
    for rpc in ("AppendKV", "CachePrefill", "CacheDecode"):  # untouched, but there from start
        assert delta("attention_kernel_seconds_total", rpc) == 0
        assert "rpc" in after["attention_kernel_seconds"].samples[0].labels
    # The per-launch rate is that launch's work over its kernel seconds.
    seconds = delta("attention_kernel_seconds_total", "Decode")
    per_launch = (
        sample(after, "attention_decode_kernel_bytes_per_second",
               "attention_decode_kernel_bytes_per_second_sum", rpc="Decode")
        - sample(before, "attention_decode_kernel_bytes_per_second",
                 "attention_decode_kernel_bytes_per_second_sum", rpc="Decode")
    )
    assert per_launch == pytest.approx(kv_bytes / seconds)


def _text(srv) -> str:  # type: ignore[no-untyped-def]
    url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"
    return urllib.request.urlopen(url, timeout=10).read().decode()


def test_standard_collectors_and_no_created_series(start_server) -> None:  # type: ignore[no-untyped-def]
    srv = start_server(metrics_port=0)
    q, k, v = random_qkv(4, 4, 2, 1, 8, torch.float32)
    list(srv.stub().Prefill(prefill_messages(q, k, v, [0, 4]), timeout=10))
    text = _text(srv)
    assert "_created" not in text
    families = srv.scrape()
    for name in ("process_cpu_seconds", "process_resident_memory_bytes",
                 "process_start_time_seconds", "python_info", "python_gc_collections"):
        assert name in families, name
    # This process, by role and pid, beside the standard series.
    pid = str(os.getpid())
    cpu = families["attention_process_cpu_seconds"].samples
    assert [(s.labels["role"], s.labels["pid"]) for s in cpu] == [("server", pid)]
    assert cpu[0].value > 0
    main = sample(families, "attention_process_main_thread_cpu_seconds",
                  "attention_process_main_thread_cpu_seconds_total", pid=pid)
    assert 0 < main <= cpu[0].value
    rss = sample(families, "attention_process_resident_memory_bytes",
                 "attention_process_resident_memory_bytes", role="server")
    assert rss == pytest.approx(
        sample(families, "process_resident_memory_bytes", "process_resident_memory_bytes"),
        rel=0.2,
    )
    capacity = sample(families, "attention_queue_capacity", "attention_queue_capacity")
    assert capacity == srv.config.max_queue_size


def test_get_server_info_duration_is_measured(start_server) -> None:  # type: ignore[no-untyped-def]
    srv = start_server(metrics_port=0)
    for _ in range(3):
        srv.stub().GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    m = srv.scrape()
    labels = {"rpc": "GetServerInfo", "code": "OK"}
    dur = "attention_request_duration_seconds"
    assert sample(m, dur, f"{dur}_count", **labels) == 3
    assert 0 < sample(m, dur, f"{dur}_sum", **labels) < 3.0


# --- NVML ------------------------------------------------------------------------------------


class _FakeNvml(types.ModuleType):
    """pynvml as nvidia-ml-py presents it, for two GPUs; ours is the second."""

    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1

    class NVMLError(Exception):
        pass

    def __init__(self, *, fail_init: bool = False, power: bool = True) -> None:
        super().__init__("pynvml")
        self.fail_init, self.power, self.inits = fail_init, power, 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h:08x}-0000-0000-0000-00000000000{h}"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(gpu=87, memory=41)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(used=30 << 30, total=80 << 30, free=50 << 30)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if not self.power:
            raise self.NVMLError("Not Supported")
        return 412_500  # mW

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return 700_000

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 63

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        return 1980  # MHz


def _live(gpu_uuid: str | None) -> LiveCollector:
    info = EngineInfo(device="H100", backend="cuda", batching=True, regions=False, frontends=1,
                      torch_version="t", triton_version="t", cuda_version="c")
    return LiveCollector(info, {}, lambda op: 0, lambda: (0, 0), lambda: 1, gpu_uuid=gpu_uuid)


def _gauges(collector: LiveCollector) -> dict[str, float]:
    return {m.name: m.samples[0].value for m in collector.collect()
            if m.name.startswith("attention_gpu_") and m.samples}


OURS = "00000001" + "0" * 23 + "1"  # GPU 1's UUID, as server.gpu_uuid gives it (bare hex)


def test_nvml_gauges(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml())
    got = _gauges(_live(OURS))
    assert got == {
        "attention_gpu_memory_allocated_bytes": 0, "attention_gpu_memory_reserved_bytes": 0,
        "attention_gpu_utilization_ratio": 0.87, "attention_gpu_memory_busy_ratio": 0.41,
        "attention_gpu_memory_used_bytes": 30 << 30, "attention_gpu_memory_total_bytes": 80 << 30,
        "attention_gpu_power_watts": 412.5, "attention_gpu_power_limit_watts": 700.0,
        "attention_gpu_temperature_celsius": 63, "attention_gpu_sm_clock_hertz": 1.98e9,
    }
    names = {n for n in got if n not in ("attention_gpu_memory_allocated_bytes",
                                         "attention_gpu_memory_reserved_bytes")}
    assert names == set(_contract_metrics(nvml=True))


def test_nvml_reading_not_supported_is_left_out(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(power=False))
    got = _gauges(_live(OURS))
    assert "attention_gpu_power_watts" not in got and "attention_gpu_utilization_ratio" in got


@pytest.mark.parametrize("case", ["no library", "no driver", "another GPU", "cpu backend"])
def test_no_nvml_no_gauges_no_error(monkeypatch, case) -> None:  # type: ignore[no-untyped-def]
    nvml = _FakeNvml(fail_init=case == "no driver")
    monkeypatch.setitem(sys.modules, "pynvml", None if case == "no library" else nvml)
    uuid = {"another GPU": "ab" * 16, "cpu backend": None}.get(case, OURS)
    collector = _live(uuid)
    for _ in range(2):  # NVML is tried once, not at every scrape
        assert set(_gauges(collector)) == {"attention_gpu_memory_allocated_bytes",
                                           "attention_gpu_memory_reserved_bytes"}
    assert nvml.inits == (0 if case in ("no library", "cpu backend") else 1)


def test_gpu_uuid_only_for_the_cuda_backend() -> None:
    assert gpu_uuid(types.SimpleNamespace(name="cpu")) is None  # type: ignore[arg-type]


# --- the process group ----------------------------------------------------------------------


def test_process_group_reports_every_process() -> None:
    """Multiprocess mode cannot merge process_* series: the engine reports its own (standard
    collectors) and every process of the group by role and pid (read from /proc)."""
    g = Group(2)
    try:
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{g.metrics_port}/metrics", timeout=10
        ).read().decode()
        m = g.scrape()
    finally:
        assert g.stop() == 0
    assert "_created" not in text
    assert "process_cpu_seconds" in m and "python_info" in m
    cpu = {(s.labels["role"], int(s.labels["pid"])): s.value
           for s in m["attention_process_cpu_seconds"].samples}
    expected = {("engine", g.proc.pid)} | {("frontend", p) for p in g.frontend_pids().values()}
    assert set(cpu) == expected and len(expected) == 3
    assert all(v > 0 for v in cpu.values())
    rss = {(s.labels["role"], int(s.labels["pid"])): s.value
           for s in m["attention_process_resident_memory_bytes"].samples}
    assert set(rss) == expected
    # The engine holds torch; front ends never import it, so they are far smaller.
    engine = rss[("engine", g.proc.pid)]
    assert all(v < engine for (role, _), v in rss.items() if role == "frontend")
    # The standard series are the engine's own.
    assert sample(m, "process_resident_memory_bytes", "process_resident_memory_bytes") == (
        pytest.approx(engine, rel=0.2)
    )


def test_stores_leave_no_empty_rate_series() -> None:
    """AppendKV launches count their batches, stages and kernel time, but attend to nothing:
    no attention_prefill_kernel_flops_per_second series of theirs (an empty one is a NaN line
    on the dashboard's per-launch median); the prefill ops observe it."""
    from attention_service.metrics import Metrics
    from attention_service.params import Op

    m = Metrics()
    for op in (Op.APPEND_KV, Op.PREFILL):
        m.observe_launch(op, requests=2, tokens=64, flops=10**9, kv_bytes=10**6, h2d=1e-4,
                         kernel=1e-3, d2h=1e-4)
    rate_rpcs = {s.labels["rpc"] for fam in m.registry.collect()
                 if fam.name == "attention_prefill_kernel_flops_per_second"
                 for s in fam.samples}
    assert rate_rpcs == {"Prefill"}
    batches = {s.labels["rpc"]: s.value for fam in m.registry.collect()
               if fam.name == "attention_batches" for s in fam.samples
               if s.name == "attention_batches_total"}
    assert batches["AppendKV"] == batches["Prefill"] == 1


def test_held_series_read_as_written_at_once() -> None:
    """``Metrics(held=True)`` (the serving process's): the per-call and per-launch series
    hold their values in plain numbers until a scrape, which then reads exactly what direct
    writes give (counts, sums, every bucket, a NaN in no bucket); nothing is lost between
    scrapes."""
    from attention_service.metrics import Metrics
    from attention_service.params import Op

    def samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in m.registry.collect() if fam.name.startswith("attention_")
                for s in fam.samples if not s.name.startswith("attention_process")}

    def traffic(m: Metrics, rounds: range) -> None:
        for i in rounds:
            m.observe_launch(Op.CACHE_DECODE, requests=1 + i % 3, tokens=64 * i, flops=10**6 * i,
                             kv_bytes=10**5 * (i + 1), h2d=0.0, kernel=1e-4 * (i % 4),
                             d2h=0.0, issue=2e-5 * i)
            m.observe_request("CacheDecode", "OK" if i % 5 else "ABORTED", 1e-3 * i,
                              bytes_in=100 * i, bytes_out=50 * i, tokens=i, flops=10 * i,
                              queue_seconds=float("nan") if i == 7 else 1e-4 * i)

    direct, held = Metrics(), Metrics(held=True)
    traffic(direct, range(20))
    traffic(held, range(20))
    assert held.requests.labels(rpc="CacheDecode", code="OK")._value.get() == 0  # held
    want, got = samples(direct), samples(held)
    assert got == pytest.approx(want, nan_ok=True)
    assert got[("attention_requests_total", (("code", "OK"), ("rpc", "CacheDecode")))] == 16
    traffic(direct, range(20, 30))
    traffic(held, range(20, 30))
    assert samples(held) == pytest.approx(samples(direct), nan_ok=True)
    # A scrape of some names only (``/metrics?name[]=...``) writes them first too.
    held.observe_request("CacheDecode", "OK", 1e-3)
    only = held.registry.restricted_registry(["attention_requests_total"])
    assert [s.value for fam in only.collect() for s in fam.samples
            if s.labels == {"rpc": "CacheDecode", "code": "OK"}] == [25]  # 24 + this one
    with pytest.raises(ValueError):  # refused at the caller, as a direct counter does
        held.observe_request("CacheDecode", "OK", 1e-3, bytes_in=-1)
