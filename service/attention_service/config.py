"""Server configuration: command-line flags with environment-variable equivalents.

Precedence: flag > environment variable > default. The names are pinned in docs/CONTRACTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

from attention_service.cpus import check_setting

# gRPC's default receive limit; the server keeps it so default clients interoperate.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# Room left in a response message for the non-data fields of an OutputChunk.
MESSAGE_OVERHEAD_BYTES = 4096
MAX_FRONTENDS = 64
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_cpu_limit(root: str | None = None) -> int | None:
    """The CPU quota of this process's cgroup, rounded up to whole CPUs (``docker --cpus``, a
    Kubernetes CPU limit), or None when there is none: cgroup v2's ``cpu.max`` ("QUOTA PERIOD"
    or "max PERIOD"), else v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none).
    ``root``: where the cgroup files are (default ``CGROUP_ROOT``)."""
    base = CGROUP_ROOT if root is None else root

    def read(name: str) -> str | None:
        try:
            with open(os.path.join(base, name)) as f:
                return f.read().strip()
        except OSError:
            return None

    try:
        v2 = read("cpu.max")
        if v2 is not None:
            quota, _, period = v2.partition(" ")
            if quota == "max":
                return None
            return max(1, math.ceil(int(quota) / int(period or 100000)))
        quota_us, period_us = read("cpu/cpu.cfs_quota_us"), read("cpu/cpu.cfs_period_us")
        if quota_us is None or period_us is None or int(quota_us) <= 0:
            return None
        return max(1, math.ceil(int(quota_us) / int(period_us)))
    except (ValueError, ZeroDivisionError):  # a format we do not know: no limit assumed
        return None


def usable_cpus() -> int:
    """CPUs this process may use: its affinity (a container's cpuset, ``taskset``), capped by
    its cgroup's CPU quota (``docker --cpus``, a Kubernetes CPU limit), not the host's count,
    which a container given 2 of 64 cores would otherwise size itself by."""
    try:
        cpus = len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this platform
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return cpus if limit is None else min(cpus, limit)


def auto_frontends(cores: int | None = None) -> int:
    """``--frontends 0``: one gRPC front end per two usable cores, at most 8, at least 1 (a 2-core
    box runs one process). Measured on a 16-vCPU H100 host with the load generator on the
    same cores (git history: benchmarks/results/issue10/roundtrip_*): aggregate gRPC payload
    at 8 / 16
    clients was 1.68 / 1.42 GB/s with 1 process, 5.15 / 5.35 with 4 front ends and
    5.96 / 5.83 with 8; clients on other hosts leave the server more of the cores."""
    cores = cores if cores is not None else usable_cpus()
    return max(1, min(8, cores // 2))


# --arena-bytes 0 (auto): what the front ends' arenas hold together, and the bounds of one. A
# call whose tensors do not fit its front end's free arena space goes through a one-off
# segment: page faults in the front end, pageable copies in the engine. One H200 replica on 6
# cores (3 front ends), 32 clients of prefill uploads (256-4096 tokens, H 32/8, D 128; git
# history: stop 79): 256 MiB each 149-156 calls/s, the engine 72 ms a call, queued 27 ms;
# 1 GiB each 210 calls/s, 8.6 ms, 0.2 ms.
AUTO_ARENA_TOTAL = 4 << 30
AUTO_ARENA_MIN, AUTO_ARENA_MAX = 256 << 20, 1 << 30


def auto_arena_bytes(frontends: int) -> int:
    """``--arena-bytes 0``: AUTO_ARENA_TOTAL over ``frontends``, in whole MiB, within bounds."""
    share = AUTO_ARENA_TOTAL // max(1, frontends) >> 20 << 20
    return max(AUTO_ARENA_MIN, min(AUTO_ARENA_MAX, share))


# --spin-us -1 (auto): how long to poll, and the usable cores it takes. Measured with fresh
# servers interleaved (16 vCPUs, 8 front ends; git history:
# benchmarks/results/issue11/2026-11-27d/): 2000 us
# cut a one-client decode step's p50 overhead over the kernel from 0.99-1.09 to 0.70-0.80 ms on
# an H100 host (0.89-1.02 -> 0.66-0.75 on an H200), every paired round, steps/s at 8 and 64
# clients unchanged; on the 2-core dev box the pollers took the client's cores and the
# overhead doubled (2.2 -> 4.0 ms), hence off there.
AUTO_SPIN_US = 2000.0
AUTO_SPIN_MIN_CPUS = 8


def auto_spin_us(cores: int | None = None) -> float:
    """``--spin-us -1``: AUTO_SPIN_US with at least AUTO_SPIN_MIN_CPUS usable cores, else 0."""
    cores = cores if cores is not None else usable_cpus()
    return AUTO_SPIN_US if cores >= AUTO_SPIN_MIN_CPUS else 0.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    device: str = "auto"  # auto | cuda | cpu
    # The GPU this replica drives (one replica per GPU behind Envoy): an index into the GPUs
    # CUDA_VISIBLE_DEVICES shows (all when unset), or a GPU UUID; "" = the first visible.
    gpu: str = ""
    metrics_port: int = 8000  # 0 = ephemeral, -1 = off
    # Front end i also listens on frontend_ports + i (0 = off): a proxy that lists each as an
    # endpoint of its own balances calls over them, where the shared port leaves that to the
    # kernel's hash of connections (docs/deploy.md).
    frontend_ports: int = 0
    # A Unix socket the engine process listens on for decode steps from model hosts on this
    # machine, with no gRPC or front end in between ("" = off; attention_service.step_socket).
    step_socket: str = ""
    # /metrics has no auth: loopback unless asked (the container image binds all interfaces,
    # where Prometheus scrapes it over the compose network).
    metrics_host: str = "127.0.0.1"
    max_request_bytes: int = 1 << 30
    chunk_bytes: int = 1 << 20
    auth_token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    # PEM of the CA(s) that sign client certificates: set, the port requires and verifies a
    # client certificate on every connection (mutual TLS). Needs tls_cert/tls_key.
    tls_client_ca: str | None = None
    grace_seconds: float = 30.0
    warmup: bool = True
    batching: bool = True
    # Measured with tools/tuning/tune_batching.py on an H100 (docs/service.md): a 4096-token
    # budget caps batches at ~9 small requests (25% fewer req/s at 64 clients than 16384;
    # 65536 gains nothing), and 0.5 ms beat 2 ms in all four budget x client-count cells.
    max_batch_tokens: int = 16384
    max_queue_delay_ms: float = 0.5
    max_queue_size: int = 1024
    # Admission limits per request (docs/service.md, "Admission"): sequences in one request,
    # query heads per kv head, and attention FLOPs (2e15: a 128K-token causal prefill of
    # 128 x 128 heads is 5.6e14).
    max_sequences: int = 1 << 16
    max_heads_ratio: int = 128
    max_request_flops: float = 2e15
    # Host bytes (pinned on cuda) that the uploads in flight in one front-end process may
    # reserve together; at least max_request_bytes.
    max_upload_bytes: int = 4 << 30
    # The fraction of max_upload_bytes the uploads of one caller (its token with auth, else
    # its host) may hold together, so one caller cannot hold the whole budget.
    max_upload_share: float = 0.5
    # Proxies (comma-separated addresses or CIDRs) whose x-attention-caller header names the
    # caller: behind Envoy every client's peer is Envoy, one caller for the share above.
    trusted_proxies: str = ""
    # Seconds an incomplete upload may go without a message before it ends (DEADLINE_EXCEEDED)
    # and its reservation is given back (0 = never).
    upload_idle_timeout: float = 10.0
    # Bytes per second an upload must average once upload_idle_timeout has passed since its
    # header (0 = no minimum): a stream that dribbles bytes cannot hold its reservation.
    min_upload_rate: int = 1 << 20
    log_level: str = "INFO"
    # One log line per call that ended OK or was cancelled by its client (at INFO). Off, those
    # lines go at DEBUG: a Locust run wrote 5.9 MB of them in 6 minutes. Failed calls are
    # logged either way (WARNING; INTERNAL at ERROR).
    access_log: bool = False
    # Process model: 1 = one process; N > 1 = N gRPC front-end processes over one engine
    # process; 0 = auto_frontends() from the core count.
    frontends: int = 0
    # Shared memory per front-end process for request/response tensors (pinned by the engine);
    # 0 = auto_arena_bytes() from the front-end count.
    arena_bytes: int = 0
    # Same-host shared-memory regions: on, off, or auto (on when auth is on or the bind address
    # is loopback; off otherwise, so no remote caller can make the server map host memory).
    regions: str = "auto"
    # NIXL regions (any host) among them, when NIXL is installed (a caller's agent metadata is
    # read by NIXL in a helper process first: NIXL's parser can crash on bad bytes; docs).
    nixl: bool = True
    # Regions one caller (token) may have registered at once, and the bytes of its system
    # regions together (0 = no limit): the server maps those and, on cuda, page-locks them, so
    # with several tokens this keeps one from pinning the host's memory. CUDA IPC regions are
    # the caller's own device memory and count only towards the number.
    max_regions_per_caller: int = 64
    system_region_bytes_per_caller: int = 0
    # The bytes of server GPU memory one caller's NIXL regions of GPU memory may hold together
    # (their mirrors; 0 = no limit but the GPU's own): apart from the host bytes above.
    gpu_region_bytes_per_caller: int = 0
    # Seconds a region may go unused before the server drops it (0 = never): a client killed
    # without unregistering would otherwise hold its mapping (page-locked on cuda) and its
    # caller's region quota until a restart. attention_client registers it again when needed.
    region_ttl: float = 600.0
    # Server-side KV caches (CreateCaches / CacheDecode ...): the pool's bytes, allocated once
    # at start on the engine's device (0 = caches off; -1 = auto: a quarter of the device
    # memory free at start on cuda, 256 MiB of lazily touched host memory on cpu).
    kv_cache_bytes: int = -1
    # The most pool bytes one caller (token) may hold, in whole pages (0 = no limit but the
    # pool's): with several tokens, keeps one from filling the pool for the others.
    kv_cache_bytes_per_caller: int = 0
    # One page of that pool: 256 KiB holds 64 tokens of the common 8 kv heads x 128 bf16
    # layout. Measured on an H100 (git history: benchmarks/results/issue11/paged_*):
    # 64-token pages read
    # K/V at 0.95-1.11x our contiguous decode kernel where 16-token pages gave 0.91-1.05x
    # (batch 64 x 8K: 2994 vs 2541 GB/s); the cost is up to one page of slack per cache.
    kv_page_bytes: int = 256 << 10
    # Idle seconds after which a cache no call uses is released (0 = never).
    kv_cache_ttl: float = 600.0
    # Caches one caller (token) may hold at once.
    max_caches: int = 1 << 20
    # CacheDecode launches replay CUDA graphs captured per shape bucket (engine/decode_steps.py);
    # off runs the same staged launch eagerly. Ignored on cpu.
    cuda_graphs: bool = True
    # Microseconds a process of the group polls for its next message before it sleeps: the
    # engine's reader after each request while the engine is idle, a front end while its one
    # call waits for a launch of one request (0 = never; -1 = auto_spin_us(): on with 8+
    # usable cores). See docs/service.md, "Polling".
    spin_us: float = -1.0
    # CPUs of the process group (attention_service/cpus.py): the engine's (auto: the lowest 3
    # of a cpuset narrower than the host with 10+ usable CPUs, else not placed; none: not
    # placed; or a list such as 0-2) and the front ends' (empty: the CPUs the engine leaves,
    # when it is placed; or a list).
    engine_cpus: str = "auto"
    frontend_cpus: str = ""

    def describe_access(self, port: int) -> str:
        """The startup line that says who can reach the server and how: bind address, TLS,
        auth, regions, and whether completed calls are logged."""
        tls = ("mutual TLS" if self.tls_client_ca else "TLS") if self.tls_cert else "no TLS"
        auth = (f"bearer auth ({len(self.tokens)} token{'s' if len(self.tokens) > 1 else ''})"
                if self.auth_token else "no auth")
        regions = "regions on" if self.regions_allowed else "regions off"
        calls = "access log on" if self.access_log else "completed calls not logged (--access-log)"
        return f"serving {self.host}:{port}: {tls}, {auth}, {regions}, {calls}"

    def __post_init__(self) -> None:
        if self.step_socket:  # advertised to clients (ServerInfo): one meaning on this machine
            object.__setattr__(self, "step_socket", os.path.abspath(self.step_socket))
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device must be auto, cuda or cpu, got {self.device!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.frontend_ports and not 1 <= self.frontend_ports <= 65536 - MAX_FRONTENDS:
            raise ValueError(f"frontend_ports must be 0 (off) or a port in [1, "
                             f"{65536 - MAX_FRONTENDS}], got {self.frontend_ports}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [-1, 65535], got {self.metrics_port}")
        if self.max_request_bytes <= 0:
            raise ValueError("max_request_bytes must be positive")
        # Output slices must fit the peer's default 4 MiB receive limit.
        if not 1 <= self.chunk_bytes <= MAX_MESSAGE_BYTES - MESSAGE_OVERHEAD_BYTES:
            raise ValueError(
                f"chunk_bytes must be in [1, {MAX_MESSAGE_BYTES - MESSAGE_OVERHEAD_BYTES}]"
            )
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca needs tls_cert and tls_key (mutual TLS is TLS)")
        for name in ("grace_seconds", "max_queue_delay_ms", "max_request_flops", "kv_cache_ttl",
                     "region_ttl", "spin_us", "max_upload_share", "upload_idle_timeout"):
            if not math.isfinite(getattr(self, name)):  # nan passes every comparison below
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got "
                             f"{self.log_level!r}")
        if self.grace_seconds < 0:
            raise ValueError("grace_seconds must be >= 0")
        if self.max_batch_tokens <= 0 or self.max_queue_size <= 0 or self.max_queue_delay_ms < 0:
            raise ValueError("max_batch_tokens and max_queue_size must be positive and "
                             "max_queue_delay_ms >= 0")
        if self.max_sequences < 1 or self.max_heads_ratio < 1 or self.max_request_flops <= 0:
            raise ValueError("max_sequences, max_heads_ratio and max_request_flops must be "
                             "positive")
        if self.max_upload_bytes < self.max_request_bytes:
            raise ValueError("max_upload_bytes must be >= max_request_bytes (else the largest "
                             "allowed request could never be admitted)")
        if not 0 < self.max_upload_share <= 1:
            raise ValueError("max_upload_share must be in (0, 1]")
        if self.max_upload_bytes * self.max_upload_share < self.max_request_bytes:
            raise ValueError("max_upload_bytes * max_upload_share must be >= max_request_bytes "
                             "(else one caller's largest allowed request could never be "
                             "admitted)")
        if self.upload_idle_timeout < 0 or self.min_upload_rate < 0:
            raise ValueError("upload_idle_timeout and min_upload_rate must be >= 0 (0 = off)")
        if not 0 <= self.frontends <= MAX_FRONTENDS:
            raise ValueError(f"frontends must be in [0, {MAX_FRONTENDS}] (0 = auto)")
        if self.arena_bytes and self.arena_bytes < 1 << 20:
            raise ValueError("arena_bytes must be at least 1 MiB (0 = auto)")
        if self.regions not in ("auto", "on", "off"):
            raise ValueError(f"regions must be auto, on or off, got {self.regions!r}")
        # ListRegions answers in one message: 10000 regions of ~160 bytes fit 4 MiB.
        if not 1 <= self.max_regions_per_caller <= 10000 or (
            self.system_region_bytes_per_caller < 0 or self.gpu_region_bytes_per_caller < 0
        ):
            raise ValueError("max_regions_per_caller must be in [1, 10000], and "
                             "system_region_bytes_per_caller and gpu_region_bytes_per_caller "
                             ">= 0 (0 = no limit)")
        if self.kv_cache_bytes < -1:
            raise ValueError("kv_cache_bytes must be >= 0 (or -1 = auto)")
        if self.kv_page_bytes < 256 or self.kv_page_bytes % 256:
            raise ValueError("kv_page_bytes must be a positive multiple of 256")
        if 0 < self.kv_cache_bytes < self.kv_page_bytes:  # it would round down to no pool
            raise ValueError(f"kv_cache_bytes must be 0 (caches off), -1 (auto) or at least one "
                             f"page (kv_page_bytes = {self.kv_page_bytes})")
        if self.kv_cache_bytes_per_caller and (
            self.kv_cache_bytes_per_caller < self.kv_page_bytes
        ):
            raise ValueError("kv_cache_bytes_per_caller must be 0 (no limit) or at least one "
                             f"page (kv_page_bytes = {self.kv_page_bytes})")
        if self.region_ttl < 0:
            raise ValueError("region_ttl must be >= 0 (0 = never)")
        if not (0 <= self.spin_us <= 1e6 or self.spin_us == -1):
            raise ValueError("spin_us must be in [0, 1000000] (0 = never) or -1 (auto)")
        if self.kv_cache_ttl < 0 or self.max_caches < 1:
            raise ValueError("kv_cache_ttl must be >= 0 and max_caches >= 1")
        if self.gpu and not (self.gpu.isdigit() or self.gpu.startswith(("GPU-", "MIG-"))):
            raise ValueError(f"gpu must be an index (0, 1, ...) or a GPU UUID (GPU-...), got "
                             f"{self.gpu!r}")
        check_setting("engine_cpus", self.engine_cpus, ("auto", "none"))
        check_setting("frontend_cpus", self.frontend_cpus, ("",))
        if self.auth_token is not None and not all(self.tokens):
            raise ValueError("auth_token: empty token in the comma-separated list")
        self.proxy_networks  # noqa: B018 (raises on a bad entry, naming it)

    @property
    def tokens(self) -> tuple[str, ...]:
        """The accepted bearer tokens (``--auth-token`` is a comma-separated list); each one is
        its own principal: it sees only the regions it registered."""
        if not self.auth_token:
            return ()
        return tuple(t.strip() for t in self.auth_token.split(","))

    @property
    def proxy_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """``trusted_proxies`` parsed (an address is a network of one)."""
        nets = []
        for part in self.trusted_proxies.split(","):
            if part.strip():
                try:
                    nets.append(ipaddress.ip_network(part.strip(), strict=False))
                except ValueError:
                    raise ValueError(f"trusted_proxies: {part.strip()!r} is not an address or "
                                     "a CIDR (e.g. 10.0.0.5 or 10.0.0.0/8)") from None
        return tuple(nets)

    @property
    def spin_seconds(self) -> float:
        """How long the group's processes poll before they sleep (``spin_us``, auto resolved)."""
        return (self.spin_us if self.spin_us >= 0 else auto_spin_us()) / 1e6

    @property
    def process_count(self) -> int:
        """Front-end processes: 1 means a single process (front end and engine together)."""
        return self.frontends or auto_frontends()

    @property
    def regions_allowed(self) -> bool:
        if self.regions != "auto":
            return self.regions == "on"
        return bool(self.auth_token) or is_loopback(self.host)

    def visible_devices(self, visible: str | None) -> str | None:
        """CUDA_VISIBLE_DEVICES for this replica, given the current value (None: unset):
        ``gpu`` picked out of it, or None to leave it as it is."""
        if not self.gpu:
            return None
        if visible is None or not self.gpu.isdigit():
            return self.gpu
        shown = [d.strip() for d in visible.split(",") if d.strip()]
        index = int(self.gpu)
        if index >= len(shown):
            raise ValueError(f"--gpu {index}: CUDA_VISIBLE_DEVICES={visible!r} shows "
                             f"{len(shown)} GPU(s)")
        return shown[index]

    def replace(self, **changes: object) -> ServerConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _bool_env(value: str) -> bool:
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def _word(value: str) -> str:
    """A keyword value (device, regions): case-insensitive, as booleans and levels are."""
    return value.strip().lower()


# field name -> (flag, env var, parser of the env string)
_ENV: dict[str, tuple[str, str, type | object]] = {
    "host": ("--host", "ATTENTION_HOST", str),
    "port": ("--port", "ATTENTION_PORT", int),
    "device": ("--device", "ATTENTION_DEVICE", _word),
    "gpu": ("--gpu", "ATTENTION_GPU", str),
    "frontend_ports": ("--frontend-ports", "ATTENTION_FRONTEND_PORTS", int),
    "step_socket": ("--step-socket", "ATTENTION_STEP_SOCKET", str),
    "metrics_port": ("--metrics-port", "ATTENTION_METRICS_PORT", int),
    "metrics_host": ("--metrics-host", "ATTENTION_METRICS_HOST", str),
    "max_request_bytes": ("--max-request-bytes", "ATTENTION_MAX_REQUEST_BYTES", int),
    "chunk_bytes": ("--chunk-bytes", "ATTENTION_CHUNK_BYTES", int),
    "auth_token": ("--auth-token", "ATTENTION_AUTH_TOKEN", str),
    "tls_cert": ("--tls-cert", "ATTENTION_TLS_CERT", str),
    "tls_key": ("--tls-key", "ATTENTION_TLS_KEY", str),
    "tls_client_ca": ("--tls-client-ca", "ATTENTION_TLS_CLIENT_CA", str),
    "grace_seconds": ("--grace-seconds", "ATTENTION_GRACE_SECONDS", float),
    "warmup": ("--warmup", "ATTENTION_WARMUP", _bool_env),
    "batching": ("--batching", "ATTENTION_BATCHING", _bool_env),
    "max_batch_tokens": ("--max-batch-tokens", "ATTENTION_MAX_BATCH_TOKENS", int),
    "max_queue_delay_ms": ("--max-queue-delay-ms", "ATTENTION_MAX_QUEUE_DELAY_MS", float),
    "max_queue_size": ("--max-queue-size", "ATTENTION_MAX_QUEUE_SIZE", int),
    "max_sequences": ("--max-sequences", "ATTENTION_MAX_SEQUENCES", int),
    "max_heads_ratio": ("--max-heads-ratio", "ATTENTION_MAX_HEADS_RATIO", int),
    "max_request_flops": ("--max-request-flops", "ATTENTION_MAX_REQUEST_FLOPS", float),
    "max_upload_bytes": ("--max-upload-bytes", "ATTENTION_MAX_UPLOAD_BYTES", int),
    "max_upload_share": ("--max-upload-share", "ATTENTION_MAX_UPLOAD_SHARE", float),
    "trusted_proxies": ("--trusted-proxies", "ATTENTION_TRUSTED_PROXIES", str),
    "upload_idle_timeout": ("--upload-idle-timeout", "ATTENTION_UPLOAD_IDLE_TIMEOUT", float),
    "min_upload_rate": ("--min-upload-rate", "ATTENTION_MIN_UPLOAD_RATE", int),
    "log_level": ("--log-level", "ATTENTION_LOG_LEVEL", str),
    "access_log": ("--access-log", "ATTENTION_ACCESS_LOG", _bool_env),
    "frontends": ("--frontends", "ATTENTION_FRONTENDS", int),
    "arena_bytes": ("--arena-bytes", "ATTENTION_ARENA_BYTES", int),
    "regions": ("--regions", "ATTENTION_REGIONS", _word),
    "nixl": ("--nixl", "ATTENTION_NIXL", _bool_env),
    "max_regions_per_caller": ("--max-regions-per-caller", "ATTENTION_MAX_REGIONS_PER_CALLER",
                               int),
    "system_region_bytes_per_caller": ("--system-region-bytes-per-caller",
                                       "ATTENTION_SYSTEM_REGION_BYTES_PER_CALLER", int),
    "gpu_region_bytes_per_caller": ("--gpu-region-bytes-per-caller",
                                    "ATTENTION_GPU_REGION_BYTES_PER_CALLER", int),
    "region_ttl": ("--region-ttl", "ATTENTION_REGION_TTL", float),
    "kv_cache_bytes": ("--kv-cache-bytes", "ATTENTION_KV_CACHE_BYTES", int),
    "kv_page_bytes": ("--kv-page-bytes", "ATTENTION_KV_PAGE_BYTES", int),
    "kv_cache_bytes_per_caller": ("--kv-cache-bytes-per-caller",
                                  "ATTENTION_KV_CACHE_BYTES_PER_CALLER", int),
    "kv_cache_ttl": ("--kv-cache-ttl", "ATTENTION_KV_CACHE_TTL", float),
    "max_caches": ("--max-caches", "ATTENTION_MAX_CACHES", int),
    "cuda_graphs": ("--cuda-graphs", "ATTENTION_CUDA_GRAPHS", _bool_env),
    "spin_us": ("--spin-us", "ATTENTION_SPIN_US", float),
    "engine_cpus": ("--engine-cpus", "ATTENTION_ENGINE_CPUS", _word),
    "frontend_cpus": ("--frontend-cpus", "ATTENTION_FRONTEND_CPUS", _word),
}


# One line of --help per setting; a default that stands for something says what.
_HELP: dict[str, str] = {
    "host": "address to bind (0.0.0.0: every interface; 127.0.0.1: this host only)",
    "port": "the gRPC port to listen on (0: any free port, which the startup line prints)",
    "device": "auto (cuda when a GPU is visible, else cpu), cuda or cpu",
    "gpu": "the GPU to drive: an index among the visible GPUs, or a GPU UUID (empty: the "
           "first visible; one replica per GPU: docs/deploy.md)",
    "frontend_ports": "front end i also listens on this port + i, for a proxy that balances "
                      "over front ends (0: off)",
    "step_socket": "a Unix socket path where the engine also takes decode steps from model hosts "
                 "on this machine, with no gRPC in between (empty: off; docs/service.md)",
    "metrics_port": "Prometheus /metrics port (0: a free port; -1: no metrics endpoint)",
    "metrics_host": "address the metrics endpoint binds",
    "max_request_bytes": "largest request a call may upload, its tensors' bytes together",
    "chunk_bytes": "largest output slice per response message",
    "auth_token": "bearer token(s) a call must carry, comma-separated (unset: no auth); "
                  "visible in ps: prefer --auth-token-file",
    "auth_token_file": "read the bearer token(s) from this file (one per line or "
                       "comma-separated), so they are not on the command line",
    "tls_cert": "a PEM certificate chain file: the port serves TLS (needs --tls-key too)",
    "tls_key": "the PEM private key file of --tls-cert (read once at start)",
    "tls_client_ca": "PEM CA(s) of client certificates: require mutual TLS",
    "grace_seconds": "on SIGTERM, how long in-flight calls may finish before they are cut",
    "warmup": "compile the kernels before serving (a first call otherwise waits for them)",
    "batching": "merge concurrent requests of one kind into one launch",
    "max_batch_tokens": "most tokens one merged launch may hold",
    "max_queue_delay_ms": "longest a request waits for others to batch with",
    "max_queue_size": "requests queued per kind before new ones get RESOURCE_EXHAUSTED",
    "max_sequences": "most sequences in one request",
    "max_heads_ratio": "most query heads per kv head",
    "max_request_flops": "most attention FLOPs in one request (cached keys included)",
    "max_upload_bytes": "host bytes the uploads in flight of one front end may reserve together",
    "max_upload_share": "fraction of --max-upload-bytes one caller's uploads may hold (its "
                        "token with auth, else its host)",
    "trusted_proxies": "addresses or CIDRs, comma-separated, of proxies (Envoy) whose "
                       "x-attention-caller header names the caller's host (unset: none)",
    "upload_idle_timeout": "seconds an incomplete upload may go without a message before it "
                           "ends (0: never)",
    "min_upload_rate": "bytes/s an upload must average once --upload-idle-timeout has passed "
                       "(0: no minimum)",
    "log_level": "DEBUG, INFO, WARNING or ERROR",
    "access_log": "one INFO line per completed call (failed calls are always logged)",
    "frontends": "gRPC front-end processes (0: auto, one per two usable cores, 1 to 8; "
                 "1: a single process)",
    "arena_bytes": "shared memory per front end for request and response tensors, page-locked "
                   "on cuda (0: auto, 4 GiB over the front ends, 256 MiB to 1 GiB each)",
    "regions": "same-host shared-memory registration: on, off or auto (on with auth or a "
               "loopback bind)",
    "nixl": "NIXL regions (any host; needs NIXL installed and regions on): --no-nixl keeps "
            "callers' NIXL metadata out of the engine process",
    "max_regions_per_caller": "regions one caller may hold at once",
    "system_region_bytes_per_caller": "bytes of system regions (and NIXL mirrors in host "
                                      "memory) one caller may hold (0: no limit)",
    "gpu_region_bytes_per_caller": "bytes of server GPU memory one caller's NIXL regions of "
                                   "GPU memory may hold (0: no limit)",
    "region_ttl": "seconds a region may go unused before it is dropped (0: never)",
    "kv_cache_bytes": "KV-cache pool (0: caches off; -1: auto, a quarter of the free GPU "
                      "memory on cuda, 256 MiB on cpu)",
    "kv_page_bytes": "one page of the KV-cache pool",
    "kv_cache_bytes_per_caller": "pool bytes one caller may hold (0: no limit)",
    "kv_cache_ttl": "idle seconds after which a cache is released (0: never)",
    "max_caches": "caches one caller may hold at once",
    "cuda_graphs": "replay CUDA graphs for cached decode steps (off: the same work eagerly)",
    "spin_us": "microseconds a process polls for its next message before sleeping (0: never; "
               "-1: auto, on with 8+ usable cores)",
    "engine_cpus": "CPUs of the engine process: auto, none, or a list such as 0-2",
    "frontend_cpus": "CPUs of the front ends, a list such as 3-15 (empty: those the engine "
                     "leaves, when it is placed)",
}


class _Parser(argparse.ArgumentParser):
    """Refuses a bad flag in one line, as every other startup error (argparse would print the
    whole usage first: ~30 lines for this many flags)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (--help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="attention-server",
        description="Remote attention gRPC server. Every flag has an ATTENTION_* env equivalent.",
    )
    d = ServerConfig()
    for name, (flag, env, kind) in _ENV.items():
        default = getattr(d, name)
        if kind is _bool_env:
            p.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                help=f"{_HELP[name]} [{env}=1/0] (default: {'on' if default else 'off'})",
            )
            continue
        shown = "unset" if default is None else repr(default) if default == "" else default
        p.add_argument(
            flag, dest=name, type=kind, default=None,  # type: ignore[arg-type]
            help=f"{_HELP[name]} [{env}] (default: {shown})",
        )
    p.add_argument("--auth-token-file", dest="auth_token_file", default=None,
                   help=f"{_HELP['auth_token_file']} [ATTENTION_AUTH_TOKEN_FILE]")
    return p


def _read_token_file(path: str) -> str:
    """The tokens in ``path``, comma-joined (lines or commas; blank lines ignored)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--auth-token-file: {exc.strerror}: {path}") from None
    tokens = [t.strip() for line in text.splitlines() for t in line.split(",") if t.strip()]
    if not tokens:
        raise ValueError(f"--auth-token-file: no token in {path}")
    return ",".join(tokens)


def load_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Flags override environment variables, which override the defaults."""
    environ = os.environ if environ is None else environ
    args = build_parser().parse_args(argv)
    values: dict[str, object] = {}
    for name, (_flag, env, kind) in _ENV.items():
        flag_value = getattr(args, name)
        if flag_value is not None:
            values[name] = flag_value
        elif env in environ:
            try:
                values[name] = kind(environ[env])  # type: ignore[operator]
            except ValueError as exc:
                raise ValueError(f"{env}: {exc}") from exc
    for name in ("auth_token", "tls_cert", "tls_key", "tls_client_ca"):
        if values.get(name) == "":
            values[name] = None  # an empty env var means unset
    token_file = args.auth_token_file or environ.get("ATTENTION_AUTH_TOKEN_FILE") or None
    if token_file is not None:
        if values.get("auth_token") is not None:
            raise ValueError("--auth-token and --auth-token-file: give one of them")
        values["auth_token"] = _read_token_file(token_file)
    try:
        return ServerConfig(**values)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(_in_flag_names(str(exc))) from None


_FIELD = re.compile(r"\b(" + "|".join(sorted(_ENV, key=len, reverse=True)) + r")\b")


def _in_flag_names(message: str) -> str:
    """A check's message in the names an operator sets: each setting's field becomes its flag
    and variable (``grace_seconds must be >= 0`` -> ``--grace-seconds
    (ATTENTION_GRACE_SECONDS) must be >= 0``)."""
    def named(match: re.Match[str]) -> str:
        flag, env, _ = _ENV[match.group(0)]
        return f"{flag} ({env})"

    return _FIELD.sub(named, message)
