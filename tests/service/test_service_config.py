"""Flags, environment variables and defaults (docs/CONTRACTS.md table)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from attention_service.config import ServerConfig, build_parser, load_config

CONTRACTS = Path(__file__).resolve().parents[2] / "docs" / "CONTRACTS.md"


def test_defaults() -> None:
    c = load_config([], {})
    assert c == ServerConfig()
    assert (c.host, c.port, c.device, c.metrics_port) == ("0.0.0.0", 50051, "auto", 8000)
    assert (c.max_request_bytes, c.chunk_bytes) == (1 << 30, 1 << 20)
    assert c.auth_token is None and c.tls_cert is None and c.tls_key is None
    assert (c.grace_seconds, c.warmup, c.batching, c.max_queue_size) == (30.0, True, True, 1024)
    assert c.log_level == "INFO"


def test_env_then_flags_override() -> None:
    env = {
        "ATTENTION_PORT": "6000", "ATTENTION_DEVICE": "cpu", "ATTENTION_METRICS_PORT": "-1",
        "ATTENTION_MAX_REQUEST_BYTES": "1000", "ATTENTION_CHUNK_BYTES": "4096",
        "ATTENTION_AUTH_TOKEN": "t", "ATTENTION_GRACE_SECONDS": "2.5", "ATTENTION_WARMUP": "0",
        "ATTENTION_BATCHING": "false", "ATTENTION_MAX_BATCH_TOKENS": "8192",
        "ATTENTION_MAX_QUEUE_DELAY_MS": "1.5", "ATTENTION_MAX_QUEUE_SIZE": "7",
        "ATTENTION_LOG_LEVEL": "DEBUG", "ATTENTION_HOST": "127.0.0.1",
    }
    c = load_config([], env)
    assert (c.port, c.device, c.metrics_port, c.max_request_bytes) == (6000, "cpu", -1, 1000)
    assert (c.chunk_bytes, c.auth_token, c.grace_seconds, c.warmup) == (4096, "t", 2.5, False)
    assert (c.batching, c.max_batch_tokens, c.max_queue_delay_ms) == (False, 8192, 1.5)
    assert (c.max_queue_size, c.log_level, c.host) == (7, "DEBUG", "127.0.0.1")
    c = load_config(["--port", "7000", "--warmup", "--batching", "--auth-token", "u"], env)
    assert (c.port, c.warmup, c.batching, c.auth_token) == (7000, True, True, "u")
    assert load_config(["--no-warmup"], {}).warmup is False


def test_empty_env_means_unset() -> None:
    assert load_config([], {"ATTENTION_AUTH_TOKEN": ""}).auth_token is None


@pytest.mark.parametrize(
    "argv,env",
    [
        (["--device", "tpu"], {}),
        (["--chunk-bytes", "0"], {}),
        (["--chunk-bytes", str(8 << 20)], {}),  # would break the peer's 4 MiB default limit
        (["--tls-cert", "c.pem"], {}),  # cert without key
        (["--metrics-port", "-2"], {}),
        ([], {"ATTENTION_WARMUP": "maybe"}),
        ([], {"ATTENTION_PORT": "http"}),
        (["--kv-cache-bytes", "200000"], {}),  # under one 256 KiB page: would mean no pool
        # nan passes every comparison: it used to turn the drain and these limits off
        (["--grace-seconds", "nan"], {}),
        (["--max-request-flops", "nan"], {}),
        (["--max-queue-delay-ms", "nan"], {}),
        ([], {"ATTENTION_KV_CACHE_TTL": "nan"}),
        (["--kv-cache-ttl", "inf"], {}),
        ([], {"ATTENTION_REGION_TTL": "nan"}),
        (["--region-ttl", "-1"], {}),
        (["--log-level", "verbose"], {}),  # a traceback from logging before
        (["--kv-cache-bytes", "4096", "--kv-page-bytes", "8192"], {}),
        (["--max-upload-share", "0"], {}),
        (["--max-upload-share", "nan"], {}),
        (["--max-upload-share", "0.1"], {}),  # 410 MiB: under the 1 GiB largest request
        ([], {"ATTENTION_UPLOAD_IDLE_TIMEOUT": "-1"}),
        (["--min-upload-rate", "-5"], {}),
        (["--max-regions-per-caller", "20000"], {}),  # ListRegions' reply would pass 4 MiB
        (["--trusted-proxies", "10.0.0.0/33"], {}),
        ([], {"ATTENTION_TRUSTED_PROXIES": "10.0.0.1,envoy"}),  # names, not addresses
    ],
)
def test_invalid_values_rejected(argv: list[str], env: dict[str, str]) -> None:
    """Refused, in the names the operator set (flag and variable), not the config's fields."""
    with pytest.raises(ValueError) as info:
        load_config(argv, env)
    message = str(info.value)
    assert "ATTENTION_" in message, message
    assert not re.search(r"(?<![-_A-Z])[a-z]+_[a-z_]+\b", message), message  # no field names


@pytest.mark.parametrize("nbytes", ["0", "-1", str(256 << 10), str(300 << 10)])
def test_kv_cache_bytes_off_auto_or_a_page_and_more(nbytes: str) -> None:
    assert load_config(["--kv-cache-bytes", nbytes], {}).kv_cache_bytes == int(nbytes)


def test_every_contract_flag_and_env_exists() -> None:
    help_text = build_parser().format_help()
    rows = [ln for ln in CONTRACTS.read_text().splitlines() if ln.startswith("| `--")]
    assert len(rows) >= 15
    for row in rows:
        for flag in re.findall(r"`(--[\w-]+)`", row.split("|")[1]):
            assert flag in help_text, flag
        for env in re.findall(r"`(ATTENTION_\w+)`", row.split("|")[2]):
            assert env in help_text, env


def test_auto_frontends_count_the_cpus_this_process_may_use(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A container pinned to 2 CPUs of a 64-core host runs one front end, not eight: the
    count comes from the process's affinity (cpuset, taskset), not the host's core count."""
    import os

    from attention_service import config

    monkeypatch.setattr(config, "CGROUP_ROOT", str(tmp_path))  # no quota (this host may have one)

    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert config.usable_cpus() == 2
    assert config.auto_frontends() == 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert config.auto_frontends() == 8


def test_auto_arena_bytes_share_4_gib_between_the_front_ends() -> None:
    from attention_service.config import ServerConfig, auto_arena_bytes

    mib = 1 << 20
    assert [auto_arena_bytes(n) // mib for n in (1, 3, 4, 5, 8, 16, 32)] == [
        1024, 1024, 1024, 819, 512, 256, 256]
    assert ServerConfig().arena_bytes == 0  # auto
    assert ServerConfig(arena_bytes=mib).arena_bytes == mib
    with pytest.raises(ValueError, match="arena_bytes must be at least 1 MiB"):
        ServerConfig(arena_bytes=mib - 1)


@pytest.mark.parametrize(("files", "want"), [
    ({"cpu.max": "200000 100000"}, 2),  # cgroup v2: docker --cpus 2
    ({"cpu.max": "150000 100000"}, 2),  # 1.5 CPUs: rounded up
    ({"cpu.max": "50000 100000"}, 1),
    ({"cpu.max": "max 100000"}, None),  # no quota
    ({"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}, 3),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    ({"cpu.max": "garbage"}, None),
    ({}, None),  # no cgroup files (not Linux, or not mounted)
])
def test_cgroup_cpu_limit(tmp_path, files: dict[str, str], want: int | None) -> None:  # type: ignore[no-untyped-def]
    from attention_service import config

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text + "\n")
    assert config.cgroup_cpu_limit(str(tmp_path)) == want


def test_a_cpu_quota_caps_the_front_ends(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A container limited to 2 CPUs (a quota, not a cpuset) on a 16-core host runs one front
    end, not eight."""
    import os

    from attention_service import config

    (tmp_path / "cpu.max").write_text("200000 100000\n")
    monkeypatch.setattr(config, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert config.usable_cpus() == 2 and config.auto_frontends() == 1


def test_warmup_workers_follow_the_quota_unless_set(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The engine's kernel warm-up compiles in one worker per usable CPU (quota included, at
    most 16), or leaves the count to ATTENTION_KERNELS_WARMUP_WORKERS when that is set."""
    import os

    from attention_service import config
    from attention_service.engine.backends import warmup_workers

    monkeypatch.setattr(config, "CGROUP_ROOT", str(tmp_path))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.delenv("ATTENTION_KERNELS_WARMUP_WORKERS", raising=False)
    assert warmup_workers() == 16
    (tmp_path / "cpu.max").write_text("300000 100000\n")
    assert warmup_workers() == 3
    monkeypatch.setenv("ATTENTION_KERNELS_WARMUP_WORKERS", "5")
    assert warmup_workers() is None


@pytest.mark.parametrize("argv", [["--port", "abc"], ["--no-such-flag"], ["--frontends"]])
def test_a_bad_flag_is_refused_in_one_line(argv: list[str], capsys) -> None:  # type: ignore[no-untyped-def]
    """As every startup error: one line on stderr naming the flag, exit status 2 (argparse
    printed its whole usage first)."""
    from attention_service.__main__ import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attention-server: "), err
    assert argv[0] in err


def test_keywords_are_case_insensitive() -> None:
    """As booleans and the log level are: ATTENTION_DEVICE=CPU, ATTENTION_REGIONS=ON."""
    cfg = load_config(["--regions", "OFF"], {"ATTENTION_DEVICE": "CPU"})
    assert (cfg.device, cfg.regions) == ("cpu", "off")
    assert load_config([], {"ATTENTION_REGIONS": " On "}).regions == "on"
    assert load_config(["--log-level", "debug"], {}).log_level == "debug"


def test_every_flag_says_what_it_does() -> None:
    """--help: each flag has a description before its [ENV] and default, and a default that
    stands for something (-1, 0, empty) is explained in words."""
    parser = build_parser()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        text = action.help or ""
        description = text.split("[ATTENTION_", 1)[0].strip()
        assert len(description) >= 12, (action.option_strings, text)
    helps = {a.option_strings[0]: a.help or "" for a in parser._actions if a.option_strings}
    for flag, words in (("--frontends", "0: auto"), ("--spin-us", "-1: auto"),
                        ("--kv-cache-bytes", "-1: auto"), ("--frontend-cpus", "empty:")):
        assert words in helps[flag], flag


def test_the_token_can_come_from_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "tokens"
    path.write_text("first-token\n\n second-token , third-token\n")
    config = load_config(["--auth-token-file", str(path)], {})
    assert config.tokens == ("first-token", "second-token", "third-token")
    assert load_config([], {"ATTENTION_AUTH_TOKEN_FILE": str(path)}).tokens == config.tokens
    with pytest.raises(ValueError, match="give one of them"):
        load_config(["--auth-token", "x", "--auth-token-file", str(path)], {})
    with pytest.raises(ValueError, match="No such file"):
        load_config(["--auth-token-file", str(tmp_path / "missing")], {})
    (tmp_path / "empty").write_text("\n , \n")
    with pytest.raises(ValueError, match="no token"):
        load_config(["--auth-token-file", str(tmp_path / "empty")], {})


def test_the_startup_line_says_who_can_reach_the_server(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plain = load_config(["--host", "127.0.0.1"], {}).describe_access(5)
    assert plain == ("serving 127.0.0.1:5: no TLS, no auth, regions on, completed calls not "
                     "logged (--access-log)")
    authed = load_config(["--auth-token", "a,b", "--access-log", "--regions", "off"], {})
    line = authed.describe_access(7)
    assert "bearer auth (2 tokens)" in line and "regions off" in line
    assert "access log on" in line and "a,b" not in line


def test_gpu_picks_one_of_the_visible_gpus() -> None:
    # One replica per GPU (issue 64): an index into CUDA_VISIBLE_DEVICES, or a UUID as is.
    cfg = load_config(["--gpu", "1"], {})
    assert cfg.visible_devices(None) == "1"
    assert cfg.visible_devices("3, 5") == "5"
    with pytest.raises(ValueError, match=r"--gpu 1: CUDA_VISIBLE_DEVICES='4' shows 1 GPU"):
        cfg.visible_devices("4")
    assert load_config([], {"ATTENTION_GPU": "GPU-0f1e"}).visible_devices("0,1") == "GPU-0f1e"
    assert load_config([], {}).visible_devices("2") is None  # unset: left as it is
    with pytest.raises(ValueError, match="--gpu"):
        load_config(["--gpu", "first"], {})
