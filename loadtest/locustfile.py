"""Locust load test of the attention service over gRPC (prefill, decode and decode sessions,
weighted).

    locust -f loadtest/locustfile.py --headless -u 16 -r 4 -t 3m --stop-timeout 30 \
        --host 127.0.0.1:50051 --csv loadtest/results/run [--processes 4]

One Locust process saturates about one core moving tensor bytes; ``--processes N`` forks N load
workers (gRPC on gevent survives the fork because no channel exists before it).

Locust speaks HTTP only; other protocols follow its documented pattern: make the protocol
library gevent-cooperative (gRPC: ``grpc.experimental.gevent.init_gevent()`` before any channel
exists), time each call and fire a ``request`` event with its response time and length, passing
the exception when the call failed. The process exits non-zero if any request failed (or none
ran), so a CI step or a script can gate on it.

Everything is configurable through environment variables (defaults in brackets):
  LOADTEST_TARGET          host:port when --host is not given                 [127.0.0.1:50051]
  LOADTEST_TOKEN           bearer token (the server's ATTENTION_AUTH_TOKEN;   [none]
                           of a comma-separated list, the first)
  LOADTEST_TLS             1/true = TLS with system roots, or a root PEM path [plaintext]
  LOADTEST_TIMEOUT         per-call deadline, seconds                         [60]
  LOADTEST_DTYPE           float16 | bfloat16 | float32                       [float16]
  LOADTEST_KV_DTYPE        float8_e4m3fn: FP8 keys/values (with a 16-bit     [LOADTEST_DTYPE]
                           LOADTEST_DTYPE): Prefill/Decode send e4m3 k/v with
                           per-head scales, sessions use FP8 caches
  LOADTEST_HEADS           query heads                                        [32]
  LOADTEST_KV_HEADS        key/value heads (GQA when fewer than heads)        [8]
  LOADTEST_HEAD_DIM        head dim                                           [128]
  LOADTEST_PREFILL_LEN     LO:HI sequence length of a prefill sequence        [64:2048]
  LOADTEST_PREFILL_BATCH   most sequences in one prefill request              [4]
  LOADTEST_CAUSAL          1 = causal prefill, 0 = full                       [1]
  LOADTEST_DECODE_CONTEXT  LO:HI keys of a decode sequence                    [128:4096]
  LOADTEST_DECODE_BATCH    most sequences in one decode request               [16]
  LOADTEST_PREFILL_WEIGHT  relative weight of the prefill task                [1]
  LOADTEST_DECODE_WEIGHT   relative weight of the decode task                 [4]
  LOADTEST_SESSION_WEIGHT  relative weight of the decode-session task         [1]
  LOADTEST_SESSION_STEPS   decode steps per session                           [16]
  LOADTEST_WAIT            LO:HI seconds a user waits between calls           [0:0]
  LOADTEST_SEED            seed of the shape sampler                          [0]
Lengths are drawn log-uniformly from LO:HI, so short sequences are common and long ones still
appear (a mix like real traffic); each request holds 1..BATCH sequences. A decode session keeps
its KV cache on the server: it creates a cache, appends a prompt of DECODE_CONTEXT tokens once
(``AppendKV``), runs SESSION_STEPS one-token steps (``CacheDecode``) and releases the cache
(``ReleaseCaches``); each of those is its own row in Locust's table. With FP8 keys and values
the prompt goes in LOADTEST_DTYPE (the server quantizes it into the FP8 cache) and each step's
new token already in e4m3, so both ways into an FP8 cache are loaded.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time

# First, before any channel exists: run gRPC's I/O on gevent, not on its own threads.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import numpy as np  # noqa: E402
from locust import User, between, events, task  # noqa: E402
from locust.runners import WorkerRunner  # noqa: E402

from attention_client import AttentionClient  # noqa: E402

log = logging.getLogger("loadtest")


def _int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


def _range(name: str, default: str, cast=int) -> tuple:
    lo, _, hi = (os.environ.get(name) or default).partition(":")
    lo, hi = cast(lo), cast(hi or lo)
    if not 0 <= lo <= hi:
        raise ValueError(f"{name} must be LO:HI with 0 <= LO <= HI, got {lo}:{hi}")
    return lo, hi


# Seconds a user waits after a failed call before its next one.
FAILURE_PAUSE_S = 0.5
TARGET = os.environ.get("LOADTEST_TARGET") or "127.0.0.1:50051"
# The server takes a comma-separated list of tokens (ATTENTION_AUTH_TOKEN); a user sends one.
TOKEN = (os.environ.get("LOADTEST_TOKEN") or "").split(",")[0].strip() or None
_TLS = (os.environ.get("LOADTEST_TLS") or "").strip()
TLS: bool | str | None = (
    None if _TLS.lower() in ("", "0", "false", "no", "off")
    else True if _TLS.lower() in ("1", "true", "yes", "on") else _TLS
)
TIMEOUT = float(os.environ.get("LOADTEST_TIMEOUT") or 60)
DTYPE = os.environ.get("LOADTEST_DTYPE") or "float16"
KV_DTYPE = os.environ.get("LOADTEST_KV_DTYPE") or DTYPE
HEADS = _int("LOADTEST_HEADS", 32)
KV_HEADS = _int("LOADTEST_KV_HEADS", 8)
HEAD_DIM = _int("LOADTEST_HEAD_DIM", 128)
PREFILL_LEN = _range("LOADTEST_PREFILL_LEN", "64:2048")
PREFILL_BATCH = _int("LOADTEST_PREFILL_BATCH", 4)
CAUSAL = (os.environ.get("LOADTEST_CAUSAL") or "1") != "0"
DECODE_CONTEXT = _range("LOADTEST_DECODE_CONTEXT", "128:4096")
DECODE_BATCH = _int("LOADTEST_DECODE_BATCH", 16)
PREFILL_WEIGHT = _int("LOADTEST_PREFILL_WEIGHT", 1)
DECODE_WEIGHT = _int("LOADTEST_DECODE_WEIGHT", 4)
SESSION_WEIGHT = _int("LOADTEST_SESSION_WEIGHT", 1)
SESSION_STEPS = _int("LOADTEST_SESSION_STEPS", 16)
WAIT = _range("LOADTEST_WAIT", "0:0", cast=float)
SEED = _int("LOADTEST_SEED", 0)

if HEADS % KV_HEADS:
    raise ValueError(f"LOADTEST_HEADS={HEADS} must be a multiple of LOADTEST_KV_HEADS={KV_HEADS}")
if min(PREFILL_LEN[0], DECODE_CONTEXT[0]) < 1 or min(PREFILL_BATCH, DECODE_BATCH) < 1:
    raise ValueError("lengths and batch sizes must be at least 1")
FP8 = KV_DTYPE != DTYPE
if FP8 and (KV_DTYPE != "float8_e4m3fn" or DTYPE == "float32"):
    raise ValueError(f"LOADTEST_KV_DTYPE={KV_DTYPE!r}: leave it unset, or float8_e4m3fn with a "
                     "float16/bfloat16 LOADTEST_DTYPE")
# e4m3 values stand for value * FP8_SCALE: the pool's standard normals (|x| < 6) stay under
# e4m3's 448 after dividing by it, and the server quantizes the sessions' prompts with it.
FP8_SCALE = 1 / 64
SCALES = {"k_scale": [FP8_SCALE] * KV_HEADS, "v_scale": [FP8_SCALE] * KV_HEADS} if FP8 else {}


def _numpy_dtype(name: str) -> np.dtype:
    if name in ("bfloat16", "float8_e4m3fn"):
        import ml_dtypes  # the client sends ml_dtypes arrays as BFLOAT16 / FLOAT8_E4M3

        return np.dtype(getattr(ml_dtypes, name))
    if name in ("float16", "float32"):
        return np.dtype(name)
    raise ValueError(f"LOADTEST_DTYPE must be float16, bfloat16 or float32, got {name!r}")


_POOL: np.ndarray | None = None
_KV_POOL: np.ndarray | None = None  # FP8 runs: the same values in e4m3 (/ FP8_SCALE)
_WINDOW = 1 << 20  # random offsets into the pool, so calls do not all send identical bytes


def _pool() -> np.ndarray:
    """One read-only block of random values shared by all users; tensors are views into it.

    Generating fresh tensors per call would make the load generator, not the server, the
    bottleneck; a view costs nothing and the client sends it without a copy.
    """
    global _POOL, _KV_POOL
    if _POOL is None:
        most = max(
            PREFILL_BATCH * PREFILL_LEN[1] * HEADS * HEAD_DIM,
            DECODE_BATCH * DECODE_CONTEXT[1] * KV_HEADS * HEAD_DIM,
        )
        block = np.random.default_rng(SEED).standard_normal(_WINDOW, dtype=np.float32)
        reps = math.ceil((most + _WINDOW) / _WINDOW)
        _POOL = np.tile(block.astype(_numpy_dtype(DTYPE)), reps)
        _POOL.flags.writeable = False
        if FP8:
            _KV_POOL = np.tile((block / FP8_SCALE).astype(_numpy_dtype(KV_DTYPE)), reps)
            _KV_POOL.flags.writeable = False
    return _POOL


def _tensor(rng: random.Random, rows: int, heads: int, kv: bool = False) -> np.ndarray:
    """``[rows, heads, HEAD_DIM]`` of LOADTEST_DTYPE (``kv`` in an FP8 run: e4m3)."""
    n = rows * heads * HEAD_DIM
    start = rng.randrange(_WINDOW)
    pool = _pool() if not (kv and FP8) else _KV_POOL
    assert pool is not None
    return pool[start : start + n].reshape(rows, heads, HEAD_DIM)


def _lengths(rng: random.Random, lo_hi: tuple[int, int], most: int) -> list[int]:
    lo, hi = lo_hi
    count = rng.randint(1, most)
    return [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) for _ in range(count)]


def _cu(lengths: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


class AttentionUser(User):
    """One caller with its own channel, issuing prefill and decode calls back to back."""

    wait_time = between(*WAIT)

    def on_start(self) -> None:
        target = (self.host or TARGET).removeprefix("grpc://")
        # A connection of its own, as a separate caller would have: grpc otherwise shares one
        # among a process's equal channels, and a server with several front ends spreads
        # connections (SO_REUSEPORT), not calls.
        self.client = AttentionClient(target, token=TOKEN, tls=TLS, timeout=TIMEOUT,
                                      options=[("grpc.use_local_subchannel_pool", 1)])
        # Per-user sampler: reproducible for a given seed, different across users.
        self.rng = random.Random(f"{SEED}-{id(self)}")
        self.sessions = 0
        _pool()

    def on_stop(self) -> None:
        self.client.close()

    def _call(self, name: str, tokens: int, fn, expected_shape: tuple[int, ...]) -> bool:
        """Time one call and report it to Locust; any exception is a failed request. Returns
        whether it succeeded."""
        start = time.perf_counter()
        length, exc = 0, None
        try:
            out = np.asarray(fn())
            length = int(out.nbytes)
            if tuple(out.shape) != expected_shape:
                raise AssertionError(f"output shape {tuple(out.shape)} != {expected_shape}")
        except Exception as e:  # reported, not raised: Locust counts it as a failure
            exc = e
        self.environment.events.request.fire(
            request_type="grpc",
            name=name,
            response_time=(time.perf_counter() - start) * 1000.0,
            response_length=length,
            exception=exc,
            context={"tokens": tokens},
        )
        if exc is not None:
            # A server that refuses at once (down, no token) would otherwise take hundreds of
            # failed calls a second per user: pause, so the failure count stays readable.
            time.sleep(FAILURE_PAUSE_S)
        return exc is None

    @task(PREFILL_WEIGHT)
    def prefill(self) -> None:
        lengths = _lengths(self.rng, PREFILL_LEN, PREFILL_BATCH)
        total = sum(lengths)
        q = _tensor(self.rng, total, HEADS)
        k = _tensor(self.rng, total, KV_HEADS, kv=True)
        v = _tensor(self.rng, total, KV_HEADS, kv=True)
        cu = _cu(lengths)
        self._call(
            "Prefill",
            total,
            lambda: self.client.attention(q, k, v, cu_seqlens=cu, causal=CAUSAL, **SCALES),
            q.shape,
        )

    @task(DECODE_WEIGHT)
    def decode(self) -> None:
        contexts = _lengths(self.rng, DECODE_CONTEXT, DECODE_BATCH)
        q = _tensor(self.rng, len(contexts), HEADS)
        k = _tensor(self.rng, sum(contexts), KV_HEADS, kv=True)
        v = _tensor(self.rng, sum(contexts), KV_HEADS, kv=True)
        cu = _cu(contexts)
        self._call(
            "Decode",
            sum(contexts),
            lambda: self.client.decode(q, k, v, cu, **SCALES),
            q.shape,
        )


    @task(SESSION_WEIGHT)
    def session(self) -> None:
        context = _lengths(self.rng, DECODE_CONTEXT, 1)[0]
        cache_id = f"locust-{os.getpid()}-{id(self)}-{self.sessions}"
        self.sessions += 1
        fp8 = {"kv_dtype": KV_DTYPE, **SCALES} if FP8 else {}
        cache = self.client.kv_cache(KV_HEADS, HEAD_DIM, DTYPE, **fp8)
        k = _tensor(self.rng, context, KV_HEADS)
        v = _tensor(self.rng, context, KV_HEADS)
        ok = self._call("AppendKV", context, lambda: cache.append(cache_id, k, v), (1,))
        for step in range(SESSION_STEPS if ok else 0):
            q = _tensor(self.rng, 1, HEADS)
            k1 = _tensor(self.rng, 1, KV_HEADS, kv=True)
            v1 = _tensor(self.rng, 1, KV_HEADS, kv=True)
            if not self._call("CacheDecode", context + step + 1,
                              lambda q=q, k1=k1, v1=v1: cache.decode(q, [cache_id], k1, v1),
                              q.shape):
                break
        # Released and timed like every call when the session made its cache; otherwise
        # released quietly (a create whose answer was lost may still have made it).
        if cache.ids:
            self._call("ReleaseCaches", 0, lambda: [cache.release()], (1,))
        else:
            with contextlib.suppress(Exception):
                cache.release()


@events.test_start.add_listener
def _describe(environment, **_kwargs) -> None:
    log.info(
        "target=%s dtype=%s kv_dtype=%s heads=%d/%d head_dim=%d prefill len=%s x<=%d causal=%s "
        "decode ctx=%s x<=%d session steps=%d weights prefill:decode:session=%d:%d:%d",
        environment.host or TARGET,
        DTYPE,
        KV_DTYPE,
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        PREFILL_LEN,
        PREFILL_BATCH,
        CAUSAL,
        DECODE_CONTEXT,
        DECODE_BATCH,
        SESSION_STEPS,
        PREFILL_WEIGHT,
        DECODE_WEIGHT,
        SESSION_WEIGHT,
    )


@events.quitting.add_listener
def _gate(environment, **_kwargs) -> None:
    """Fail the process on any failed request, or when nothing ran at all. Workers (under
    ``--processes N`` or ``--worker``) report to the master and hold no totals of their own."""
    if isinstance(environment.runner, WorkerRunner):
        return
    total = environment.stats.total
    if total.num_failures > 0 or total.fail_ratio > 0:
        log.error("%d of %d requests failed", total.num_failures, total.num_requests)
        environment.process_exit_code = 1
    elif total.num_requests == 0:
        log.error("no request completed")
        environment.process_exit_code = 1
