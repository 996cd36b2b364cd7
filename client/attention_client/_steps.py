"""Decode loops on one stream (``CacheDecodeSteps``): ``client.decode_steps()``.

A step on an open stream is one message each way, about half the host time of a unary call
(numbers in ``_call_streams``).

Each ``step`` takes what ``decode_step`` takes. A handle remembers its steps' requests (one per
set of cache ids, up to ``MAX_TEMPLATES``): a step with the same cache ids and options as an
earlier one and new k/v of the same shapes and dtypes reuses its checked header and swaps in
the new tensors, so a 64-sequence step no longer checks 64 ids and
builds a header each time (client Python 345-510 -> 291-314 us a step, 2-core dev box). The
stream is opened at the first step (and again after one ended: a failed step, a server
restart); a step's ``timeout`` (the handle's, per step) cancels the stream when it runs out.
Steps on one handle run one at a time (a lock); open a handle per concurrent loop. A step too
large for one message, or a server without the rpc, goes through ``decode_step``'s path
instead, with the same settings.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any

import grpc

from attention_client import _argnames as argnames
from attention_client._call_streams import (
    STEP_METHODS,
    AsyncStreamCall,
    StreamCall,
    not_sent,
    unimplemented,
)
from attention_client._channel import DEFAULT, CallSettings
from attention_client._core import Steps, _io
from attention_client._errors import from_rpc_error, make_error
from attention_client._requests import PreparedRequest
from attention_client._score import ScoreMods
from attention_client._tensors import to_wire
from attention_wire.requests import step_timeout
from attention_wire.responses import parse_result

_CALL = "CacheDecode"  # what errors and metrics call a step
# Step templates a handle keeps (one per layer in a decode loop; a 256-id key is ~10 KB).
MAX_TEMPLATES = 512
METHOD = STEP_METHODS[_CALL]


class _StepsBase:
    """Both handles' steps, written once as steps their client drives (see ``_core``)."""

    def __init__(self, client: Any, timeout: Any, metadata: Any,
                 wait_for_ready: bool | None, lock: Any) -> None:
        self._client = client
        self._lock = lock  # one step at a time: a threading or an asyncio lock
        self._stream: Any = None  # a StreamCall or AsyncStreamCall, opened at the first step
        self._timeout, self._metadata, self._wait_for_ready = timeout, metadata, wait_for_ready
        # Its connection, by number: the async client may replace connections (``spread``)
        # before the first step. Its caches' server's (``_cache_lane``).
        self._lane_no = client._cache_lane()
        self._unsupported = False  # the server has no CacheDecodeSteps: decode_step's path
        self.closed = False
        # Checked requests by options key (ids included): the templates of later steps like
        # them. One per layer's caches: a model host steps layer 0, 1, ..., L-1 in turn, so a
        # template of the last step alone never matched (bench_offload, 2 layers).
        self._templates: dict[tuple[Any, ...], PreparedRequest] = {}

    @property
    def _lane(self) -> dict[str, Any]:
        return self._client._lanes[self._lane_no]

    def _settings(self) -> CallSettings:
        return self._client._settings(self._timeout, self._metadata, self._wait_for_ready,
                                      argnames.cache_decode("cache_ids"))

    def _check_open(self) -> None:
        if self.closed:
            raise make_error(grpc.StatusCode.FAILED_PRECONDITION,
                             "this decode_steps handle is closed", _CALL)

    @staticmethod
    def _key(cache_ids: Any, k_new: Any, v_new: Any, options: tuple[Any, ...], bytes_only: bool
             ) -> tuple[Any, ...] | None:
        """What a step's header depends on besides its tensors' shapes; None: a step the
        template does not cover (no new tokens: the layout comes from the caches; ALiBi
        slopes: an array; ids not a list or tuple; tensors that may go through regions)."""
        if not bytes_only or k_new is None or v_new is None or options[-1] is not None:
            return None
        if type(cache_ids) is not list and type(cache_ids) is not tuple:
            return None
        return (tuple(cache_ids), *options)  # compared by value with the last step's

    def _reused(self, key: tuple[Any, ...] | None, q: Any, k_new: Any, v_new: Any
                ) -> PreparedRequest | None:
        """The last step's request with these tensors, if ``key`` and their wire shapes and
        dtypes match it (so the checks it passed hold); else None."""
        template = None if key is None else self._templates.get(key)
        if template is None:
            return None
        try:
            (wq, origin), (wk, _), (wv, _) = (to_wire(q, "q"), to_wire(k_new, "k_new"),
                                             to_wire(v_new, "v_new"))
        except Exception:  # noqa: BLE001 (the long way raises it with the usual message)
            return None
        if any(w.shape != t.shape or w.dtype != t.dtype
               for w, t in zip((wq, wk, wv), template.tensors, strict=True)):
            return None
        prep = copy.copy(template)
        prep.tensors, prep.origin = (wq, wk, wv), origin
        prep.cache_lengths = prep.stats = None
        return prep

    def _remember(self, key: tuple[Any, ...] | None, prep: PreparedRequest) -> None:
        if key is not None and prep.placement is None:
            if len(self._templates) >= MAX_TEMPLATES:
                del self._templates[next(iter(self._templates))]  # the oldest
            self._templates[key] = prep

    def _failed(self, prep: Any, stream: Any, err: grpc.RpcError,
                settings: CallSettings) -> Exception | None:
        """The error to raise for a step whose stream failed; None: no such rpc on the
        server (nothing ran), take decode_step's path from now on."""
        if not_sent(err, stream):
            if unimplemented(err):
                self._unsupported = True
            return None
        self._client._abandon(prep)
        return from_rpc_error(err, _CALL, settings.names)

    def _drive(self, steps: Steps) -> Any:
        return self._client._drive(steps)

    @_io
    def step(
        self, q: Any, cache_ids: Any, k_new: Any = None, v_new: Any = None, *,
        store: bool = True, softmax_scale: float | None = None, num_splits: int = 0,
        return_lse: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Any = None, out: Any = None, use_regions: bool | None = None,
    ) -> Any:
        """One decode step, as ``AttentionClient.decode_step`` takes and returns it (a
        coroutine on the async client)."""
        self._check_open()
        client = self._client
        settings = self._settings()
        key = self._key(cache_ids, k_new, v_new, (store, softmax_scale, num_splits, return_lse,
                                                   window_size, softcap, alibi_slopes),
                        out is None and not client._regions_wanted(use_regions))
        prep = self._reused(key, q, k_new, v_new)
        if prep is None:
            prep = yield client._decode_step_request(
                settings, q, cache_ids, k_new, v_new, store, softmax_scale, num_splits,
                return_lse, ScoreMods.of(window_size, softcap, alibi_slopes), out, use_regions,
            )
            self._remember(key, prep)
        with client._layouts_checked(prep):
            return (yield from self._exchange(prep, settings))

    def _exchange(self, prep: Any, settings: Any) -> Steps:
        client = self._client
        message = client._one_message(prep, step_timeout(settings.deadline))
        if message is None or self._unsupported:
            return (yield client._run(prep, settings))
        assembler = client._assembler(prep)
        yield self._lock.acquire()
        try:
            if self._stream is None or not self._stream.alive():
                self._drop()
                try:  # a lost connection is placed first
                    yield client._ready_lane(self._lane_no, settings, _CALL)
                except BaseException:  # cancelled, or past its deadline: nothing was sent
                    if prep.placement is not None:
                        prep.placement.finish(ok=True)
                    raise
                self._stream = self._open(settings)
            try:
                raw = yield self._send(message, settings)
            except grpc.RpcError as err:
                stream = self._stream
                self._drop()
                error = self._failed(prep, stream, err, settings)
                if error is None:
                    return (yield client._run(prep, settings))
                raise error from err
            except BaseException:
                self._drop()  # the caller went away mid-step: the stream's state is unknown
                client._abandon(prep)
                raise
        finally:
            self._lock.release()
        return client._assemble(prep, assembler, parse_result(raw))

    def _drop(self) -> None:
        """Forget the stream (ended, failed or in an unknown state): cancel it."""
        if self._stream is not None:
            self._stream.drop()
        self._stream = None


class DecodeSteps(_StepsBase):
    """A decode loop on one ``CacheDecodeSteps`` stream (``AttentionClient.decode_steps``)."""

    def __init__(self, client: Any, timeout: Any = DEFAULT, metadata: Any = None,
                 wait_for_ready: bool | None = None) -> None:
        super().__init__(client, timeout, metadata, wait_for_ready, threading.Lock())

    def _open(self, settings: CallSettings) -> StreamCall:
        return StreamCall(self._lane[METHOD], settings)

    def _send(self, message: bytes, settings: CallSettings) -> Any:
        return self._stream.exchange(message, settings.deadline, self._client._streams.watchdog)

    def close(self) -> None:
        """End the stream (the server sees it end cleanly). Idempotent."""
        if self.closed:
            return
        self.closed = True
        with self._lock:
            if self._stream is not None:
                self._stream.close()
            self._stream = None

    def __enter__(self) -> DecodeSteps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncDecodeSteps(_StepsBase):
    """``DecodeSteps`` for ``AsyncAttentionClient`` (``async with client.decode_steps()``)."""

    def __init__(self, client: Any, timeout: Any = DEFAULT, metadata: Any = None,
                 wait_for_ready: bool | None = None) -> None:
        super().__init__(client, timeout, metadata, wait_for_ready, asyncio.Lock())

    def _open(self, settings: CallSettings) -> AsyncStreamCall:
        return AsyncStreamCall(self._lane[METHOD], settings)

    def _send(self, message: bytes, settings: CallSettings) -> Any:
        return self._stream.exchange(message, settings.deadline)

    async def close(self) -> None:
        """End the stream cleanly. Idempotent."""
        if self.closed:
            return
        self.closed = True
        async with self._lock:
            stream, self._stream = self._stream, None
            if stream is not None:
                await stream.close()

    async def __aenter__(self) -> AsyncDecodeSteps:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
