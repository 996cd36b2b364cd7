"""Helpers of the batching tests: cpu backends that hold launches on demand or launch as
cuda's do, and requests that carry their own float64 oracle."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from attention_service.engine.backends import CpuBackend, PendingLaunch

from .svc_helpers import (
    TOLERANCE,
    Response,
    ServerHandle,
    collect,
    cu_from_lengths,
    decode_messages,
    decode_oracle,
    make_config,
    prefill_messages,
    prefill_oracle,
    random_qkv,
)


class AsyncCpu(CpuBackend):
    """The cpu backend launching as cuda's does (``async_launch``, two launch slots): the
    executor may issue on the submitting thread and keep two launches in flight. A launch
    spends ``launch_s`` being issued (launches that overlap set ``overlapped``) and its wait
    ``device_s`` more (the kernel's time, read when it is issued); ``threads`` records the
    thread each launch was issued on."""

    max_inflight = 2
    async_launch = True

    def __init__(self, launch_s: float = 0.0, device_s: float = 0.0) -> None:
        super().__init__()
        self.launch_s, self.device_s = launch_s, device_s
        self.threads: list[str] = []
        self.active = 0
        self.overlapped = False

    def launch(self, plan: Any) -> PendingLaunch:
        self.active += 1
        self.overlapped |= self.active > 1
        try:
            self.threads.append(threading.current_thread().name)
            time.sleep(self.launch_s)
            done = super().launch(plan)
        finally:
            self.active -= 1
        device_s = self.device_s
        return later(done, lambda: time.sleep(device_s)) if device_s else done


def later(done: PendingLaunch, before: Callable[[], object]) -> PendingLaunch:
    """``done``, its ``wait`` first calling ``before`` (the device still busy meanwhile)."""

    class _Later:
        def wait(self) -> Any:
            before()
            return done.wait()

    return _Later()  # type: ignore[return-value]


class Steps:
    """Mixin for a backend: launch ``i`` waits until ``open(i)`` (or ``open_all()``), so tests
    decide when the device frees up and what piles up in the queue meanwhile. ``plans`` lists
    every launch's BatchPlan in order."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list[Any] = []
        self._cv = threading.Condition()
        self._opened: set[int] = set()
        self._all = False

    def launch(self, plan: Any) -> PendingLaunch:
        with self._cv:
            index = len(self.plans)
            self.plans.append(plan)
            self._cv.notify_all()
            if not self._cv.wait_for(lambda: self._all or index in self._opened, timeout=30):
                raise RuntimeError(f"test never opened launch {index}")
        return super().launch(plan)  # type: ignore[misc, no-any-return]

    def open(self, index: int) -> None:
        with self._cv:
            self._opened.add(index)
            self._cv.notify_all()

    def open_all(self) -> None:
        with self._cv:
            self._all = True
            self._cv.notify_all()

    def reset(self) -> None:
        """Forget launches so far and hold the next ones (e.g. after a warm-up)."""
        with self._cv:
            self.plans.clear()
            self._opened.clear()
            self._all = False

    def wait_launches(self, n: int, timeout: float = 10.0) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: len(self.plans) >= n, timeout=timeout)

    def batch_sizes(self) -> list[int]:
        with self._cv:
            return [len(p) for p in self.plans]


class StepBackend(Steps, CpuBackend):
    """The cpu backend with launches held until the test opens them."""


@contextlib.contextmanager
def held_gpu_server() -> Iterator[tuple[ServerHandle, Any]]:
    """A batching cuda server whose launches wait for the test (``Steps``), warmed up with
    launches open; every launch is opened on the way out so nothing hangs."""
    from attention_service.engine.backends import CudaBackend

    class CudaStepBackend(Steps, CudaBackend):
        pass

    backend = CudaStepBackend()
    backend.open_all()  # the warm-up's own launches must not wait for the test
    backend.warmup()
    backend.reset()
    handle = ServerHandle(make_config(device="cuda", batching=True, metrics_port=0,
                                      warmup=False), backend=backend)
    try:
        yield handle, backend
    finally:
        backend.open_all()
        handle.close()


@dataclass
class Req:
    """One request's messages and the float64 answer it must get back."""

    rpc: str
    messages: list[Any]
    out: torch.Tensor
    lse: torch.Tensor | None  # None when the request does not ask for lse
    dtype: torch.dtype
    tokens: int

    def send(self, srv: Any, timeout: float = 30) -> Any:
        """Start the call (sync stub); returns the response iterator / call object."""
        stub = srv.stub()
        method = stub.Prefill if self.rpc == "Prefill" else stub.Decode
        return method(iter(self.messages), timeout=timeout)

    def check(self, resp: Response) -> None:
        tol = TOLERANCE[self.dtype]
        assert resp.out.dtype == self.dtype and resp.out.shape == self.out.shape
        torch.testing.assert_close(resp.out.double(), self.out, atol=tol, rtol=tol)
        if self.lse is None:
            assert resp.lse is None
        else:
            assert resp.lse is not None and resp.lse.shape == self.lse.shape
            torch.testing.assert_close(resp.lse.double(), self.lse.double(), atol=1e-4,
                                       rtol=1e-4)


def prefill_req(
    seed: int, lengths: list[int], *, heads: int = 4, kv_heads: int = 2, dim: int = 16,
    dtype: torch.dtype = torch.float32, causal: bool = True, lse: bool = False,
    k_lengths: list[int] | None = None, scale: float | None = None,
) -> Req:
    cu_q = cu_from_lengths(lengths)
    cu_k = cu_from_lengths(k_lengths) if k_lengths is not None else None
    total_k = (cu_k or cu_q)[-1]
    q, k, v = random_qkv(cu_q[-1], total_k, heads, kv_heads, dim, dtype, seed=seed)
    out, lse_ref = prefill_oracle(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=scale)
    msgs = list(prefill_messages(q, k, v, cu_q, cu_k, causal=causal, scale=scale,
                                 return_lse=lse))
    return Req("Prefill", msgs, out, lse_ref if lse else None, dtype, cu_q[-1])


def decode_req(
    seed: int, k_lengths: list[int], *, heads: int = 4, kv_heads: int = 2, dim: int = 16,
    dtype: torch.dtype = torch.float32, lse: bool = False, num_splits: int = 0,
) -> Req:
    cu_k = cu_from_lengths(k_lengths)
    q, k, v = random_qkv(len(k_lengths), cu_k[-1], heads, kv_heads, dim, dtype, seed=seed)
    out, lse_ref = decode_oracle(q, k, v, cu_k)
    msgs = list(decode_messages(q, k, v, cu_k, num_splits=num_splits, return_lse=lse))
    return Req("Decode", msgs, out, lse_ref if lse else None, dtype, cu_k[-1])


def start_all(pool: ThreadPoolExecutor, srv: Any, reqs: list[Req]) -> list[Future[Response]]:
    """Send every request concurrently (one pool thread each); futures of their responses."""
    return [pool.submit(lambda r=r: collect(r.send(srv))) for r in reqs]


