"""Decode loops on one stream (``CacheDecodeSteps``): ``client.decode_steps()``.

A unary call sets up and tears down an HTTP/2 stream per step; a step on an open stream is one
message each way. Measured on the 2-core dev box (grpcio 1.85, 12 KB up / 8 KB down, a bare
echo server, p50): sync client 551 -> 302 us per step, server CPU 404 -> 169 us; aio client
573 -> 251 us, server CPU 399 -> 155 us.

Each ``step`` takes what ``decode_step`` takes. The stream is opened at the first step (and
again after one ended: a failed step, a server restart); a step's ``timeout`` (the handle's,
per step) cancels the stream when it runs out. Steps on one handle run one at a time (a lock);
open a handle per concurrent loop. A step too large for one message, or a server without the
rpc, goes through ``decode_step``'s path instead, with the same settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from attention_client import _argnames as argnames
from attention_client._channel import DEFAULT, CallSettings
from attention_client._errors import from_rpc_error, make_error
from attention_client._score import ScoreMods
from attention_client._wire import parse_result

METHOD = "CacheDecodeSteps"
_CALL = "CacheDecode"  # what errors and metrics call a step


class _Watchdog:
    """Cancels the stream when a step's deadline passes. One thread per handle, started with
    the first deadline; in a steady loop it wakes about once per timeout, not once per step
    (a later deadline does not wake it)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: float | None = None  # the current step's deadline (monotonic)
        self._sleeping_until: float | None = None
        self._call: Any = None
        self._thread: threading.Thread | None = None
        self.fired = False
        self.closed = False

    def arm(self, due: float, call: Any) -> None:
        with self._cond:
            self._due, self._call, self.fired = due, call, False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="attention-steps-watchdog")
                self._thread.start()
            elif self._sleeping_until is None or due < self._sleeping_until:
                self._cond.notify()

    def disarm(self) -> None:
        self._due = self._call = None  # read under the lock by the watchdog; a race only
        # delays the check to its next wake-up

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self.closed:
                due = self._due
                now = time.monotonic()
                if due is not None and now >= due:
                    call, self._due, self._call = self._call, None, None
                    self.fired = True
                    if call is not None:
                        call.cancel()
                    continue
                self._sleeping_until = due
                self._cond.wait(None if due is None else due - now)
                self._sleeping_until = None


class _StepsBase:
    """The settings and per-step preparation both handles share."""

    def __init__(self, client: Any, timeout: Any, metadata: Any,
                 wait_for_ready: bool | None) -> None:
        self._client = client
        self._timeout, self._metadata, self._wait_for_ready = timeout, metadata, wait_for_ready
        self._lane = client._lanes[next(client._turn) % len(client._lanes)]
        self._unsupported = False  # the server has no CacheDecodeSteps: decode_step's path
        self._answered = False  # a step of this handle ever came back through the stream
        self.closed = False

    def _settings(self) -> CallSettings:
        return self._client._settings(self._timeout, self._metadata, self._wait_for_ready,
                                      argnames.cache_decode("cache_ids"))

    def _check_open(self) -> None:
        if self.closed:
            raise make_error(grpc.StatusCode.FAILED_PRECONDITION,
                             "this decode_steps handle is closed", _CALL)

    def _failed(self, prep: Any, err: grpc.RpcError, settings: CallSettings,
                expired: bool) -> Exception | None:
        """The error to raise for a step whose stream failed; None: no such rpc on the
        server (nothing ran), take decode_step's path from now on."""
        code = err.code() if callable(getattr(err, "code", None)) else None
        if code is grpc.StatusCode.UNIMPLEMENTED and not self._answered:
            self._unsupported = True
            return None
        self._client._abandon(prep)
        if expired:
            return make_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                              "the step's timeout ran out (the stream was cancelled)", _CALL)
        return from_rpc_error(err, _CALL, settings.names)


class DecodeSteps(_StepsBase):
    """A decode loop on one ``CacheDecodeSteps`` stream (``AttentionClient.decode_steps``)."""

    def __init__(self, client: Any, timeout: Any = DEFAULT, metadata: Any = None,
                 wait_for_ready: bool | None = None) -> None:
        super().__init__(client, timeout, metadata, wait_for_ready)
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[bytes | None] | None = None
        self._call: Any = None
        self._watchdog = _Watchdog()

    def step(
        self, q: Any, cache_ids: Any, k_new: Any = None, v_new: Any = None, *,
        store: bool = True, softmax_scale: float | None = None, num_splits: int = 0,
        return_lse: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Any = None,
    ) -> Any:
        """One decode step, as ``AttentionClient.decode_step`` takes and returns it."""
        self._check_open()
        client = self._client
        settings = self._settings()
        prep = client._decode_step_request(
            settings, q, cache_ids, k_new, v_new, store, softmax_scale, num_splits, return_lse,
            ScoreMods.of(window_size, softcap, alibi_slopes),
        )
        message = client._one_message(prep)
        if message is None or self._unsupported:
            return client._run(prep, settings)
        assembler = client._assembler(prep)
        with self._lock:
            try:
                raw = self._exchange(message, settings)
            except grpc.RpcError as err:
                self._drop()
                error = self._failed(prep, err, settings, self._watchdog.fired)
                if error is None:
                    return client._run(prep, settings)
                raise error from err
            except BaseException:
                self._drop()  # the caller went away mid-step: the stream's state is unknown
                client._abandon(prep)
                raise
        self._answered = True
        return client._assemble(prep, assembler, parse_result(raw))

    def _exchange(self, message: bytes, settings: CallSettings) -> bytes:
        if self._call is None or self._call.done():
            self._open(settings)
        assert self._queue is not None
        self._queue.put(message)
        if settings.deadline is not None:
            self._watchdog.arm(settings.deadline, self._call)
        try:
            raw = next(self._call)
        except StopIteration:  # ended with OK but without this step's answer
            raise make_error(grpc.StatusCode.UNAVAILABLE,
                             "the step stream ended before the step was answered",
                             _CALL) from None
        finally:
            self._watchdog.disarm()
        return raw

    def _open(self, settings: CallSettings) -> None:
        self._queue = requests = queue.SimpleQueue()

        def messages() -> Iterator[bytes]:
            while (msg := requests.get()) is not None:
                yield msg

        kwargs = settings.kwargs()
        self._call = self._lane[METHOD](messages(), metadata=kwargs["metadata"],
                                        wait_for_ready=kwargs["wait_for_ready"])

    def _drop(self) -> None:
        """Forget the stream (ended, failed or in an unknown state): cancel it."""
        if self._queue is not None:
            self._queue.put(None)
        if self._call is not None:
            self._call.cancel()
        self._call = self._queue = None

    def close(self) -> None:
        """End the stream (the server sees it end cleanly). Idempotent."""
        if self.closed:
            return
        self.closed = True
        with self._lock:
            if self._queue is not None:
                self._queue.put(None)  # half-close: the server ends the stream with OK
            self._call = self._queue = None
        self._watchdog.close()

    def __enter__(self) -> DecodeSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncDecodeSteps(_StepsBase):
    """``DecodeSteps`` for ``AsyncAttentionClient`` (``async with client.decode_steps()``)."""

    def __init__(self, client: Any, timeout: Any = DEFAULT, metadata: Any = None,
                 wait_for_ready: bool | None = None) -> None:
        super().__init__(client, timeout, metadata, wait_for_ready)
        self._lock = asyncio.Lock()
        self._call: Any = None

    async def step(
        self, q: Any, cache_ids: Any, k_new: Any = None, v_new: Any = None, *,
        store: bool = True, softmax_scale: float | None = None, num_splits: int = 0,
        return_lse: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Any = None,
    ) -> Any:
        """See DecodeSteps.step."""
        self._check_open()
        client = self._client
        settings = self._settings()
        prep = await client._decode_step_request(
            settings, q, cache_ids, k_new, v_new, store, softmax_scale, num_splits, return_lse,
            ScoreMods.of(window_size, softcap, alibi_slopes),
        )
        message = client._one_message(prep)
        if message is None or self._unsupported:
            return await client._run(prep, settings)
        assembler = client._assembler(prep)
        async with self._lock:
            expired = False
            try:
                raw = await self._exchange(message, settings)
            except asyncio.TimeoutError:
                expired = True
                err: Any = None
            except grpc.RpcError as exc:
                err = exc
            except BaseException:
                self._drop()
                client._abandon(prep)
                raise
            else:
                self._answered = True
                return client._assemble(prep, assembler, parse_result(raw))
            self._drop()
            if expired:
                client._abandon(prep)
                raise make_error(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 "the step's timeout ran out (the stream was cancelled)", _CALL)
            error = self._failed(prep, err, settings, False)
            if error is None:
                return await client._run(prep, settings)
            raise error from err

    async def _exchange(self, message: bytes, settings: CallSettings) -> bytes:
        if self._call is None or self._call.done():
            kwargs = settings.kwargs()
            self._call = self._lane[METHOD](metadata=kwargs["metadata"],
                                            wait_for_ready=kwargs["wait_for_ready"])
        call = self._call
        await call.write(message)
        read = call.read()
        raw = await (read if settings.deadline is None else
                     asyncio.wait_for(read, max(settings.deadline - time.monotonic(), 0.0)))
        if raw is grpc.aio.EOF:
            raise make_error(grpc.StatusCode.UNAVAILABLE,
                             "the step stream ended before the step was answered", _CALL)
        return raw

    def _drop(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._call = None

    async def close(self) -> None:
        """End the stream cleanly. Idempotent."""
        if self.closed:
            return
        self.closed = True
        async with self._lock:
            call, self._call = self._call, None
            if call is not None and not call.done():
                with contextlib.suppress(grpc.RpcError):
                    await call.done_writing()

    async def __aenter__(self) -> AsyncDecodeSteps:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
