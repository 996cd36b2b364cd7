"""Decode loops on one stream (``CacheDecodeSteps``): ``client.decode_steps()``.

A step on an open stream is one message each way, about half the host time of a unary call
(numbers in ``_call_streams``).

Each ``step`` takes what ``decode_step`` takes. A handle remembers its steps' requests (one per
set of cache ids, up to ``MAX_TEMPLATES``): a step with the same cache ids and options as an
earlier one and new k/v of the same shapes and dtypes reuses its checked header and swaps in
the new tensors, so a 64-sequence step no longer checks 64 ids and builds a header each time
(client Python 345-510 -> 291-314 us a step, 2-core dev box). A template is also compiled to
its wire frame (``_Compiled``): tensors like its own are joined into the message as they are,
and the answer's OUT is read at its known offset (B=1 155 -> 35 us, B=64 348 -> 115 us). The
stream is opened at the first step (and again after one ended: a failed step, a server
restart); a step's ``timeout`` (the handle's, per step) cancels the stream when it runs out.
The stream is opened with in-band errors: a failed step is answered by its error and the
stream goes on, so ``submit`` may send steps before earlier answers are read (``PendingStep``;
the server runs them at once, those on one cache in order). A step too large for one
message, or a server without the rpc, goes through ``decode_step``'s path instead, with the
same settings.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import math
import threading
import time
from typing import Any, NamedTuple

import grpc
import numpy as np

from attention_client import _argnames as argnames
from attention_client._call_streams import (
    STATUS,
    AsyncSocketStream,
    AsyncStreamCall,
    SocketStream,
    StreamCall,
    StreamError,
    not_sent,
    unimplemented,
)
from attention_client._channel import (
    DEFAULT,
    STEP_METHODS,
    CallSettings,
    check_timeout,
    merge_metadata,
)
from attention_client._core import Steps, _io
from attention_client._errors import (
    OUTCOME_UNKNOWN,
    AttentionInputError,
    from_rpc_error,
    make_error,
)
from attention_client._regions import pointer
from attention_client._requests import PreparedRequest, ScoreMods, stats_dict
from attention_client._tensors import (
    RegionTensor,
    WireTensor,
    is_torch_tensor,
    result_flavour,
    storage_dtype,
    to_wire,
    torch_bits,
)
from attention_wire.messages import (
    IN_BAND,
    STEP_ERRORS_HEADER,
    call_error,
    chunk_head,
    message_frame,
    output_chunk_lead,
    parse_result,
    step_timeout,
)
from attention_wire.pb import attention_pb2 as pb

_CALL = "CacheDecode"  # what errors and metrics call a step
# Step templates a handle keeps (one per layer in a decode loop; a 256-id key is ~10 KB).
MAX_TEMPLATES = 512
METHOD = STEP_METHODS[_CALL]


class _Compiled:
    """A step template in wire pieces: the message's frame around q, k and v
    (``message_frame``) and the bytes its answer's OUT chunk starts with. A later step whose
    tensors have the template's type, dtype, shape and device (CPU, contiguous, no grad) joins
    their bytes into the frame, and its answer's OUT is read at its known offset; a step or an
    answer that differs in any way goes the general way (``_reused``, ``parse_result``).
    Client Python per step, canned answers (dev box): B=1 155 -> 35 us, B=64 348 -> 115."""

    __slots__ = ("prep", "frame", "specs", "lead", "out_count", "out_storage")

    def __init__(self, prep: PreparedRequest, specs: tuple[Any, ...]) -> None:
        self.prep = prep
        self.specs = specs  # per tensor: (class, dtype, shape, bits), as the user passed them
        self.frame = message_frame(prep.header, [t.nbytes for t in prep.tensors])
        shape = prep.out_shape
        assert shape is not None
        self.out_storage = storage_dtype(prep.out_dtype)
        self.out_count = math.prod(shape)
        head = chunk_head(pb.OUT, prep.out_dtype, tuple(shape), 0, shape[0])
        self.lead = output_chunk_lead(head, self.out_count * self.out_storage.itemsize)

    @staticmethod
    def of(prep: PreparedRequest, tensors: tuple[Any, Any, Any]) -> _Compiled | None:
        """``prep`` compiled, when it is a bytes-only step with OUT alone to read back and
        ``tensors`` (the user's q, k, v) are of kinds ``views`` takes; else None."""
        if (prep.placement is not None or prep.out_shape is None or prep.cache is None
                or prep.streamed_lse_shape is not None or prep.user_out is not None
                or not all(isinstance(t, WireTensor) for t in prep.tensors)):
            return None
        if not all(type(x) is np.ndarray or is_torch_tensor(x) for x in tensors):
            return None  # numpy subclasses (memmap, ...): the general path
        if any(type(x) is np.ndarray and x.dtype.byteorder == ">" for x in tensors):
            return None  # sent little-endian: a copy the general path makes
        # Numpy arrays are joined as bytes (a dtype of ml_dtypes has no buffer format).
        specs = tuple((type(x), x.dtype, tuple(x.shape),
                       np.uint8 if type(x) is np.ndarray else torch_bits(x.dtype))
                      for x in tensors)
        compiled = _Compiled(prep, specs)
        return compiled if compiled.views(*tensors) is not None else None

    def views(self, q: Any, k: Any, v: Any) -> tuple[Any, Any, Any] | None:
        """The three tensors' bytes (no copy), or None when one is not like the template's."""
        out = []
        for x, (cls, dtype, shape, bits) in zip((q, k, v), self.specs, strict=True):
            if type(x) is not cls or x.dtype != dtype or tuple(x.shape) != shape:
                return None
            if cls is np.ndarray:
                if not x.flags.c_contiguous:
                    return None
                out.append(x.view(bits))
                continue
            if x.device.type != "cpu" or x.requires_grad or not x.is_contiguous():
                return None
            out.append(x.view(bits).numpy())
        return out[0], out[1], out[2]

    def parts(self, views: tuple[Any, Any, Any], tail: bytes) -> tuple[Any, ...]:
        """The step's message in pieces (the step socket sends them as they are)."""
        f = self.frame
        return (f[0], views[0], f[1], views[1], f[2], views[2], tail)

    def message(self, views: tuple[Any, Any, Any], tail: bytes) -> bytes:
        return b"".join(self.parts(views, tail))

    def answer(self, raw: bytes) -> tuple[np.ndarray, dict[str, Any]] | None:
        """(out in its storage dtype, the stats) when ``raw`` is one OUT chunk of every row as
        the template expects and then the RequestStats alone; None: read it the general way
        (which also reports what is wrong with it)."""
        lead = self.lead
        if memoryview(raw)[: len(lead)] != lead:
            return None
        end = len(lead) + self.out_count * self.out_storage.itemsize
        rest = parse_result(memoryview(raw)[end:])
        if len(rest) != 1 or not isinstance(rest[0], pb.RequestStats):
            return None
        out = np.frombuffer(raw, self.out_storage, self.out_count, len(lead))
        # Read-only bytes, or misaligned (the lead is ~20 bytes): a copy. A step socket's
        # answer is a fresh array, used in place when aligned.
        if isinstance(raw, bytes) or not out.flags.aligned:
            out = out.copy()
        return out, stats_dict(rest[0])

    def result(self, out: np.ndarray, stats: dict[str, Any]) -> Any:
        """The user's result, as the general path's ``take_stats`` and ``result`` make it
        (the template itself is left as it is)."""
        self.prep.checked_lengths(stats)
        return self.prep.result(out, None)


class _Template(NamedTuple):
    """A checked step request kept for later steps like it, and its compiled form (None: a
    step ``_Compiled`` does not cover). A region step's template (its tensors and ``out=``
    in registered regions, nothing staged) keeps its whole message instead (``message``: no
    tensor bytes, so a step on the same tensors sends the same bytes)."""

    prep: PreparedRequest
    compiled: _Compiled | None
    message: bytes | None = None

    def regions_open(self) -> bool:
        spans = [t.span for t in self.prep.tensors] + [self.prep.out_span]
        return all(not s.region.closed for s in spans)  # type: ignore[union-attr]


def _region_key(base: tuple[Any, ...], tensors: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """A region step's template key: the step's ``_key`` and where each of q, k, v and
    ``out`` lies (type, address, device, dtype, shape); None when one of them has no single
    place (not contiguous) or needs grad."""
    where = []
    for x in tensors:
        ptr = pointer(x)
        if ptr is None or (is_torch_tensor(x) and x.requires_grad):
            return None
        where.append((type(x), ptr, x.dtype, tuple(x.shape)))
    return ("regions", *base, *where)


class PendingStep:
    """A step sent on its handle's stream (``submit``), its answer not read yet: ``result()``
    returns what ``step`` would have, or raises its error (a coroutine on the async client).
    Answers are read in the order the steps were sent, whichever ``result()`` asks first."""

    __slots__ = ("_handle", "stream", "prep", "compiled", "tensors", "settings",
                 "waiting", "raw", "failure", "first_failure", "rerun", "outcome")

    def __init__(self, handle: _StepsBase, stream: Any, prep: PreparedRequest,
                 compiled: _Compiled | None, tensors: tuple[Any, Any, Any],
                 settings: CallSettings) -> None:
        self._handle = handle
        self.stream = stream  # the stream it was sent on (None: resolved when submitted)
        self.prep, self.compiled, self.tensors = prep, compiled, tensors
        self.settings = settings
        self.waiting = stream is not None  # sent, its answer not read yet
        self.raw: bytes | None = None  # its answer
        self.failure: grpc.RpcError | None = None  # its stream's failure, which ended it
        self.first_failure = False  # ... at this step (the steps after it were not answered)
        self.rerun = False  # never sent (no such rpc, or the stream had ended): the long way
        # (True, its result) or (False, its error), once made (at once: ``_resolved``).
        self.outcome: tuple[bool, Any] | None = None

    def done(self) -> bool:
        """Whether its answer (or its stream's end) has been read: ``result()`` waits for
        nothing."""
        return not self.waiting

    def result(self) -> Any:
        """The step's result (a coroutine on the async client): ``out`` or ``(out, lse)``."""
        return self._handle._drive(self._handle._result(self))


class _StepsBase:
    """Both handles' steps, written once as steps their client drives (see ``_core``)."""

    def __init__(self, client: Any, timeout: Any, metadata: Any,
                 wait_for_ready: bool | None, make_lock: Any, step_socket: Any = None) -> None:
        self._client = client
        # Sends (and the stream's opening) one at a time, and reads one at a time: a step
        # waiting for its answer does not hold up the next step's send.
        self._send_lock, self._read_lock = make_lock(), make_lock()
        self._stream: Any = None  # a StreamCall or AsyncStreamCall, opened at the first step
        self._pending: collections.deque[PendingStep] = collections.deque()  # sent, unread
        self._timeout, self._metadata, self._wait_for_ready = timeout, metadata, wait_for_ready
        self._fixed: CallSettings | None = None  # the first step's settings (``_settings``)
        self._seconds: float | None = None  # and its timeout, checked then
        # Its connection, by number: the async client may replace connections (``spread``)
        # before the first step. Its caches' server's (``_cache_lane``).
        self._lane_no = client._cache_lane()
        self._unsupported = False  # the server has no CacheDecodeSteps: decode_step's path
        self.closed = False
        # Checked requests by options key (ids included): the templates of later steps like
        # them. One per layer's caches: a model host steps layer 0, 1, ..., L-1 in turn, so a
        # template of the last step alone never matched (bench_offload, 2 layers).
        self._templates: dict[tuple[Any, ...], _Template] = {}
        self._socket = _socket_arg(step_socket)  # the step socket: True, a path, or None

    @property
    def _lane(self) -> dict[str, Any]:
        return self._client._lanes[self._lane_no]

    def _settings(self) -> CallSettings:
        """A step's settings: the handle's (its metadata checked once), a deadline of its
        own. Checking the metadata again each step took ~40 us of a B=1 step (dev box)."""
        fixed, client = self._fixed, self._client
        if fixed is None or client.closed:  # the client's refusal, once closed
            fixed = client._settings(self._timeout, self._metadata, self._wait_for_ready,
                                     argnames.DECODE_STEP)
            self._seconds = (client.timeout if self._timeout is DEFAULT
                             else check_timeout(self._timeout))
            self._fixed = fixed
            return fixed
        seconds = self._seconds
        return CallSettings(None if seconds is None else time.monotonic() + seconds,
                            fixed.metadata, fixed.wait_for_ready, fixed.names)

    def _check_open(self) -> None:
        if self.closed:
            raise make_error(grpc.StatusCode.FAILED_PRECONDITION,
                             "this decode_steps handle is closed", _CALL)

    @staticmethod
    def _key(cache_ids: Any, k_new: Any, v_new: Any, options: tuple[Any, ...]
             ) -> tuple[Any, ...] | None:
        """What a step's header depends on besides its tensors; None: a step no template
        covers (no new tokens: the layout comes from the caches; ALiBi slopes: an array; ids
        not a list or tuple; an option given as a list, which does not hash)."""
        if k_new is None or v_new is None or options[-1] is not None:
            return None
        if type(cache_ids) is not list and type(cache_ids) is not tuple:
            return None
        key = (tuple(cache_ids), *options)  # compared by value with the last step's
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def _reused(self, template: PreparedRequest | None, q: Any, k_new: Any, v_new: Any
                ) -> PreparedRequest | None:
        """The template's request with these tensors, if their wire shapes and dtypes match
        it (so the checks it passed hold); else None."""
        if template is None:
            return None
        try:
            wq, wk, wv = to_wire(q, "q"), to_wire(k_new, "k_new"), to_wire(v_new, "v_new")
        except Exception:  # noqa: BLE001 (the long way raises it with the usual message)
            return None
        if any(w.shape != t.shape or w.dtype != t.dtype
               for w, t in zip((wq, wk, wv), template.tensors, strict=True)):
            return None
        prep = copy.copy(template)
        prep.tensors = (wq, wk, wv)
        prep.result_dtype, prep.result_device = result_flavour(q)
        prep.cache_lengths = prep.stats = None
        return prep

    def _remember(self, key: tuple[Any, ...] | None, prep: PreparedRequest,
                  tensors: tuple[Any, Any, Any]) -> None:
        if key is not None and prep.placement is None:
            if len(self._templates) >= MAX_TEMPLATES:
                del self._templates[next(iter(self._templates))]  # the oldest
            # A copy: the step itself goes on to read its reply into ``prep``, and a template
            # must not hold a step's outputs (a failed or unread step never drops them).
            template = copy.copy(prep)
            template.forget_reply()
            self._templates[key] = _Template(template, _Compiled.of(template, tensors))

    def _remember_regions(self, key: tuple[Any, ...], prep: PreparedRequest) -> None:
        """A region step's request and message, when every tensor lies in a region as given
        (nothing staged, ``out=`` in one): later steps on the same tensors send it again."""
        placement = prep.placement
        if (placement is None or placement.scratch or prep.out_span is None
                or prep.streamed_lse_shape is not None
                or not all(isinstance(t, RegionTensor) for t in prep.tensors)):
            return
        message = self._client._one_message(prep, b"")
        if message is None:
            return
        if len(self._templates) >= MAX_TEMPLATES:
            del self._templates[next(iter(self._templates))]  # the oldest
        self._templates[key] = _Template(prep, None, message)

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
        pending = yield from self._submit(
            q, cache_ids, k_new, v_new, store, softmax_scale, num_splits, return_lse,
            window_size, softcap, alibi_slopes, out, use_regions)
        return (yield from self._result(pending))

    @_io
    def submit(self, q: Any, cache_ids: Any, k_new: Any = None, v_new: Any = None,
               **options: Any) -> PendingStep:
        """Send one step (what ``step`` takes) without waiting for its answer: a
        ``PendingStep`` whose ``result()`` gives it (a coroutine on the async client, for
        both). Steps sent ahead run on the server while earlier ones compute (up to
        ``info()["steps_in_flight"]`` at once; more wait to be read), steps on one cache in
        the order sent; answers come in that order. A failed step raises from its own
        ``result()`` and changes no cache; the steps around it are answered. Each step's
        timeout runs from its submit: one that runs out cancels the stream, and the steps
        sent after it raise too (read ``cache.info()``: they may have run)."""
        return (yield from self._submit(q, cache_ids, k_new, v_new, **options))

    def _submit(
        self, q: Any, cache_ids: Any, k_new: Any = None, v_new: Any = None,
        store: bool = True, softmax_scale: float | None = None, num_splits: int = 0,
        return_lse: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Any = None, out: Any = None, use_regions: bool | None = None,
    ) -> Steps:
        """A step's request, sent on the handle's stream: its PendingStep. A step like its
        compiled template joins its tensors' bytes into the template's frame; a step too
        large for one message, or one to a server without the rpc, runs at once the long
        way (its PendingStep holds the result)."""
        self._check_open()
        client = self._client
        settings = self._settings()
        base = self._key(cache_ids, k_new, v_new, (store, softmax_scale, num_splits,
                                                    return_lse, window_size, softcap,
                                                    alibi_slopes))
        wanted = client._regions_wanted(use_regions)
        # Bytes-only steps: a template per key; region steps with ``out=`` (and no lse): a
        # kept message per key and tensor places; any other step: none.
        key = base if out is None and not wanted else None
        region_key = None
        if base is not None and out is not None and wanted and not return_lse:
            region_key = _region_key(base, (q, k_new, v_new, out))
        template = None if key is None else self._templates.get(key)
        compiled = template.compiled if template is not None else None
        views = compiled.views(q, k_new, v_new) if compiled is not None else None
        tensors = (q, k_new, v_new)
        tail = step_timeout(settings.deadline)
        if region_key is not None:
            kept = self._templates.get(region_key)
            if kept is not None and kept.regions_open() and not self._unsupported:
                # The same tensors in the same regions: the same message, no bytes in it.
                assert kept.message is not None and kept.prep.placement is not None
                prep = copy.copy(kept.prep)
                prep.cache_lengths = prep.stats = None
                prep.placement.synchronize()  # the GPU work filling them is done
                return (yield from self._send(prep, None, kept.message + tail, tensors,
                                              settings))
        if views is not None and not self._unsupported:
            assert compiled is not None
            message = (compiled.parts(views, tail) if self._socket
                       else compiled.message(views, tail))
            return (yield from self._send(compiled.prep, compiled, message, tensors, settings))
        prep = self._reused(template.prep if template is not None else None, q, k_new, v_new)
        if prep is None:
            prep = yield client._decode_step_request(
                settings, q, cache_ids, k_new, v_new, store, softmax_scale, num_splits,
                return_lse, ScoreMods.of(window_size, softcap, alibi_slopes), out, use_regions,
            )
            self._remember(key, prep, tensors)
            if region_key is not None:
                self._remember_regions(region_key, prep)
        message = client._one_message(prep, tail)
        if message is None or self._unsupported:
            return (yield from self._resolved(prep, settings))
        return (yield from self._send(prep, None, message, tensors, settings))

    def _resolved(self, prep: PreparedRequest, settings: CallSettings) -> Steps:
        """A step run at once the long way (``decode_step``'s): a PendingStep of its result."""
        pending = PendingStep(self, None, prep, None, (None, None, None), settings)
        with self._client._layouts_checked(prep):
            pending.outcome = (True, (yield self._client._run(prep, settings)))
        return pending

    def _send(self, prep: PreparedRequest, compiled: _Compiled | None,
              message: bytes | tuple[Any, ...], tensors: tuple[Any, Any, Any],
              settings: CallSettings) -> Steps:
        """``message`` on the handle's stream (opened first when there is none, or it
        ended): its PendingStep, or the step run at once when the stream's rpc is missing."""
        client = self._client
        # The GPU work that fills region tensors is done before the request goes.
        if compiled is None:
            client._expect_reply(prep)
        yield self._send_lock.acquire()
        try:
            stream = self._stream
            if stream is None or stream.failure is not None or not stream.alive():
                self._stream = None  # an ended stream's steps read its end
                try:  # a lost connection is placed first
                    yield client._ready_lane(self._lane_no, settings, _CALL)
                except BaseException:  # cancelled, or past its deadline: nothing was sent
                    if prep.placement is not None:
                        prep.placement.finish(ok=True)
                    raise
                stream = self._stream = yield self._open(settings)
            try:
                yield stream.send(message)
            except grpc.RpcError as err:  # asyncio: the stream had ended (the steps sent
                self._stream = None  # before this one still read their answers from it)
                if not not_sent(err, stream):
                    client._abandon(prep)
                    raise from_rpc_error(err, _CALL, settings.names) from err
                if unimplemented(err):
                    self._unsupported = True
                stream = None  # run it the long way, below
            except BaseException:  # the caller went away mid-send: the stream's state is unknown
                stream.failure = StreamError(grpc.StatusCode.CANCELLED, _GONE)
                stream.drop()
                client._abandon(prep)
                raise
            if stream is not None:
                pending = PendingStep(self, stream, prep, compiled, tensors, settings)
                self._pending.append(pending)
                return pending
        finally:
            self._send_lock.release()
        if compiled is not None:
            prep = self._general(compiled, tensors)
        return (yield from self._resolved(prep, settings))

    def _general(self, compiled: _Compiled, tensors: tuple[Any, Any, Any]) -> PreparedRequest:
        """A compiled step's request for the general path (its send, or its answer, went
        another way)."""
        prep = self._reused(compiled.prep, *tensors)
        assert prep is not None  # the tensors matched the template's specs
        return prep

    def _result(self, pending: PendingStep) -> Steps:
        """``pending``'s result: its answer read (and those sent before it), then made, once:
        a later ``result()`` returns (or raises) the same."""
        if pending.outcome is None:
            if pending.waiting:
                yield from self._read_until(pending)
            try:
                pending.outcome = (True, (yield from self._made(pending)))
            except Exception as exc:
                pending.outcome = (False, exc)
        ok, got = pending.outcome
        if not ok:
            raise got
        return got

    def _made(self, pending: PendingStep) -> Steps:
        """The result of a step whose answer (or its stream's end) has been read."""
        client, prep = self._client, pending.prep
        if pending.compiled is not None:
            raw = pending.raw
            if raw is not None:
                got = pending.compiled.answer(raw)
                if got is not None:
                    client.last_stats = got[1]
                    return pending.compiled.result(*got)
            prep = self._general(pending.compiled, pending.tensors)
        if pending.rerun:  # it never went out: the long way
            return (yield from self._resolved(prep, pending.settings)).outcome[1]  # type: ignore[index]
        with client._layouts_checked(prep):
            if pending.failure is not None:
                client._abandon(prep)
                raise self._failure_error(pending) from pending.failure
            assert pending.raw is not None
            answer = parse_result(pending.raw)
            stats = bool(answer) and isinstance(answer[-1], pb.RequestStats)
            error = None if stats else call_error(pending.raw)
            if error is not None:  # answered in-band: this step failed, changing nothing
                client._abandon(prep)
                raise from_rpc_error(StreamError(STATUS.get(error.code, grpc.StatusCode.UNKNOWN),
                                                 error.details), _CALL, pending.settings.names)
            if not prep.expecting_reply:  # a compiled step's, made for the general path
                client._expect_reply(prep)
            return client._assemble(prep, answer)

    @staticmethod
    def _failure_error(pending: PendingStep) -> Exception:
        """The error of a step its stream's failure ended: the failure itself for the step it
        failed at; for the steps sent after that one, which were not answered, the same code
        when the failure leaves their outcome unknown (a deadline, a cancel, a lost server),
        else ABORTED: a server that ends the stream at a refused step runs none after it."""
        failure = pending.failure
        assert failure is not None
        if pending.first_failure:
            return from_rpc_error(failure, _CALL, pending.settings.names)
        code = failure.code() if callable(getattr(failure, "code", None)) else None
        if code in OUTCOME_UNKNOWN:
            return make_error(code, "the stream failed at an earlier step and this one was not "
                              f"answered (it may have run: read cache.info()): "
                              f"{failure.details()}", _CALL)
        return make_error(grpc.StatusCode.ABORTED, "not run: the stream ended at an earlier "
                          f"step's failure, and this one was not answered ({failure.details()})",
                          _CALL)

    def _read_until(self, pending: PendingStep) -> Steps:
        """Read answers in order, each into its step, up to ``pending``'s; a stream that
        failed ends each of its unread steps (the first one with its error)."""
        yield self._read_lock.acquire()
        try:
            while pending.waiting:
                head = self._pending[0]
                stream = head.stream
                if stream.failure is None:  # else it failed at an earlier step
                    try:
                        head.raw = yield self._receive(stream, head.settings)
                    except grpc.RpcError as err:
                        stream.failure = err
                        stream.drop()
                        head.first_failure = True
                    except BaseException:  # the caller went away mid-read: state unknown
                        stream.failure = StreamError(grpc.StatusCode.CANCELLED, _GONE)
                        stream.drop()
                        self._pending.popleft()
                        head.waiting, head.failure = False, stream.failure
                        head.first_failure = True
                        self._client._abandon(head.prep)  # its scratch waits for the region
                        raise
                    else:
                        self._pending.popleft()
                        head.waiting = False
                        continue
                self._pending.popleft()
                head.waiting = False
                head.failure = stream.failure
                if not_sent(stream.failure, stream):  # none of its steps went out
                    head.rerun = True
                    if unimplemented(stream.failure):
                        self._unsupported = True
        finally:
            self._read_lock.release()


_GONE = "a step's caller went away mid-step (the stream's state is unknown)"


class DecodeSteps(_StepsBase):
    """A decode loop on one ``CacheDecodeSteps`` stream (``AttentionClient.decode_steps``)."""

    def __init__(self, client: Any, timeout: Any = DEFAULT, metadata: Any = None,
                 wait_for_ready: bool | None = None, step_socket: str | bool | None = None,
                 spin_us: float = 0) -> None:
        super().__init__(client, timeout, metadata, wait_for_ready, threading.Lock, step_socket)
        self._spin_s = _spin_arg(spin_us, self._socket) * 1e-6

    def _open(self, settings: CallSettings) -> StreamCall | SocketStream:
        if not self._socket:
            return StreamCall(self._lane[METHOD], _in_band(settings))
        info = self._client.info()  # the path (step_socket=True) and how many may be unread
        try:
            return SocketStream(_socket_path(self._socket, info), settings,
                                info["steps_in_flight"], info["instance_id"], self._spin_s)
        except grpc.RpcError as err:
            raise from_rpc_error(err, _CALL, settings.names) from None

    def _receive(self, stream: StreamCall, settings: CallSettings) -> bytes:
        return stream.receive(settings.deadline, self._client._streams.watchdog)

    def close(self) -> None:
        """End the stream (the server sees it end cleanly, after answering the steps sent;
        their ``result()`` still reads them). Idempotent."""
        if self.closed:
            return
        self.closed = True
        with self._send_lock:
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
                 wait_for_ready: bool | None = None, step_socket: str | bool | None = None,
                 spin_us: float = 0) -> None:
        super().__init__(client, timeout, metadata, wait_for_ready, asyncio.Lock, step_socket)
        if _spin_arg(spin_us, self._socket):
            raise AttentionInputError("spin_us: the asyncio client waits for its answers on "
                                      "its event loop (spin_us is the sync client's)")

    async def _open(self, settings: CallSettings) -> AsyncStreamCall | AsyncSocketStream:
        if not self._socket:
            return AsyncStreamCall(self._lane[METHOD], _in_band(settings))
        info = await self._client.info()
        try:
            return await AsyncSocketStream.open(_socket_path(self._socket, info), settings,
                                                info["steps_in_flight"], info["instance_id"])
        except grpc.RpcError as err:
            raise from_rpc_error(err, _CALL, settings.names) from None

    def _receive(self, stream: AsyncStreamCall, settings: CallSettings) -> Any:
        return stream.receive(settings.deadline)

    async def close(self) -> None:
        """End the stream cleanly (see DecodeSteps.close). Idempotent."""
        if self.closed:
            return
        self.closed = True
        async with self._send_lock:
            stream, self._stream = self._stream, None
            if stream is not None:
                await stream.close()

    async def __aenter__(self) -> AsyncDecodeSteps:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _in_band(settings: CallSettings) -> CallSettings:
    """A step stream's settings: failed steps answered in-band, steps sent ahead."""
    return dataclasses.replace(
        settings, metadata=merge_metadata(settings.metadata, ((STEP_ERRORS_HEADER, IN_BAND),)))


def _socket_arg(step_socket: Any) -> str | bool | None:
    if step_socket is not None and not isinstance(step_socket, str | bool):
        raise AttentionInputError(
            f"step_socket must be a path, True or None, got {step_socket!r}")
    return step_socket or None  # False, "": gRPC


# Longest wait for an answer spent polling (``spin_us``): past it the caller blocks as without.
MAX_SPIN_US = 10_000


def _spin_arg(spin_us: Any, step_socket: str | bool | None) -> float:
    """``spin_us`` checked: microseconds in [0, MAX_SPIN_US], nonzero only on the step socket."""
    if (isinstance(spin_us, bool) or not isinstance(spin_us, int | float)
            or not 0 <= spin_us <= MAX_SPIN_US):
        raise AttentionInputError(f"spin_us must be a number of microseconds in [0, "
                                  f"{MAX_SPIN_US}], got {spin_us!r}")
    if spin_us and not step_socket:
        raise AttentionInputError("spin_us: only steps through the step socket wait by polling "
                                  "(step_socket=True or a path)")
    return float(spin_us)


def _socket_path(step_socket: str | bool, info: dict[str, Any]) -> str:
    """The step socket's path: the one given, or the server's (``step_socket=True``)."""
    path = info["step_socket"] if step_socket is True else step_socket
    if not path:
        raise make_error(grpc.StatusCode.FAILED_PRECONDITION,
                         "step_socket=True: the server has no step socket (it starts one "
                         "with --step-socket PATH)", _CALL)
    return path  # type: ignore[return-value]
