"""What every request is made of: user arguments turned into a validated request (header
bytes, tensors, the expected outputs), and the checked per-call options that become header
fields (``ScoreMods``: window_size / softcap / alibi_slopes; ``KvScales``: FP8 scales). The
ops themselves: ``_prefill`` (Prefill, CachePrefill, AppendKV) and ``_decode`` (Decode,
CacheDecode).

Client-side checks only catch the obvious (rank, dtype, matching shapes): the server is the
authority on everything else (head dims, cu_seqlens values, limits) and answers
INVALID_ARGUMENT naming the field. With a ``Placement`` (registered regions, see _regions.py)
tensors that live in (or are staged into) a region travel as spans instead of bytes, and the
outputs go into q's region when it has room.

The KV-cache ops reuse the same headers with a ``CacheTarget``; AppendKV and CachePrefill send
bytes, CacheDecode may use regions as Decode does, and their tensors are checked against the
caches' layout when the caller knows it (a ``KvLayout``; both in ``_layouts``).

At the end, the reply: the ``PreparedRequest`` fills its outputs from the parsed responses.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from attention_client._errors import AttentionInputError, ProtocolError
from attention_client._regions import Placement, Span
from attention_client._tensors import (
    FP8_QUERY_DTYPES,
    QUERY_DTYPES,
    RegionTensor,
    WireTensor,
    describe,
    dtype_name,
    is_torch_tensor,
    real_number,
    result_flavour,
    storage_dtype,
    to_user,
    to_wire,
)
from attention_wire.messages import OutputSlice, out_dtype
from attention_wire.pb import attention_pb2 as pb

Tensor = WireTensor | RegionTensor

PREFILL = "Prefill"
DECODE = "Decode"
# Head dims the server takes (every one from 1: the kernels pad and mask).
MAX_HEAD_DIM = 256
APPEND_KV = "AppendKV"
CACHE_PREFILL = "CachePrefill"
CACHE_DECODE = "CacheDecode"


# gRPC's default receive limit is 4 MiB; every message we send stays below this, header included.
MAX_HEADER_BYTES = 3 * 1024 * 1024 + 512 * 1024


# ---- per-call options that become header fields: score modifiers, FP8 scales ----
# flash_attn's score modifiers as the client takes them (``window_size``, ``softcap``,
# ``alibi_slopes``), checked here and sent as the header's ``ScoreOptions``.

INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class ScoreMods:
    """Sliding window ``(left, right)`` (-1: unbounded), softcap (0: off), ALiBi slopes
    (float32, ``[H]`` or ``[B, H]``; None: off)."""

    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    slopes: np.ndarray | None = None

    @staticmethod
    def of(window_size: Any = (-1, -1), softcap: Any = 0.0,
           alibi_slopes: Any = None) -> ScoreMods | None:
        """Checked options; None when none is set (the header then carries no ScoreOptions)."""
        window = _window(window_size)
        cap = _softcap(softcap)
        slopes = _slopes(alibi_slopes)
        if window == (-1, -1) and cap == 0.0 and slopes is None:
            return None
        return ScoreMods(window, cap, slopes)

    def message(self, num_heads: int, batch: int) -> pb.ScoreOptions:
        msg = pb.ScoreOptions(softcap=self.softcap)
        if self.window[0] != -1:
            msg.window_left = self.window[0]
        if self.window[1] != -1:
            msg.window_right = self.window[1]
        if self.slopes is not None:
            s = self.slopes
            want = ((num_heads,), (batch, num_heads))
            if s.shape not in want:
                raise AttentionInputError(
                    f"alibi_slopes must have shape [{num_heads}] (num_heads) or "
                    f"[{batch}, {num_heads}] (batch, num_heads), got {list(s.shape)}"
                )
            msg.alibi_slopes.extend(s.reshape(-1).tolist())
        return msg


def _window(window_size: Any) -> tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise AttentionInputError(
            f"window_size must be a pair (left, right), got {window_size!r}"
        ) from None
    out = []
    for name, x in (("window_size[0]", left), ("window_size[1]", right)):
        if isinstance(x, bool) or not isinstance(x, int | np.integer):
            raise AttentionInputError(f"{name} must be an int, got {x!r}")
        if not -1 <= int(x) <= INT32_MAX:
            raise AttentionInputError(f"{name} must be >= -1 (-1: unbounded), got {x}")
        out.append(int(x))
    return out[0], out[1]


def _softcap(softcap: Any) -> float:
    if not real_number(softcap):  # float() would take "1.5" and True
        raise AttentionInputError(f"softcap must be a number, got {type(softcap).__name__} "
                                  f"{softcap!r}")
    cap = float(softcap)
    if not (math.isfinite(cap) and cap >= 0):
        raise AttentionInputError(f"softcap must be finite and >= 0 (0: off), got {softcap}")
    return cap


def _slopes(alibi_slopes: Any) -> np.ndarray | None:
    if alibi_slopes is None:
        return None
    if hasattr(alibi_slopes, "detach"):  # a torch tensor, on any device
        alibi_slopes = alibi_slopes.detach().float().cpu().numpy()
    try:
        s = np.asarray(alibi_slopes, dtype=np.float32)
    except (TypeError, ValueError):
        raise AttentionInputError("alibi_slopes must be numbers, [H] or [B, H]") from None
    if s.ndim not in (1, 2) or s.shape[-1] == 0:  # [0, H]: per sequence, of an empty batch
        raise AttentionInputError(f"alibi_slopes must be [H] or [B, H], got shape {s.shape}")
    if not np.isfinite(s).all():
        raise AttentionInputError("alibi_slopes must be finite")
    return s


# (k scales, v scales) per kv head, and FP8 queries' (``q_scale``) as a third entry; in a
# stateless call each may be a row of those per sequence instead (``scale_rows``).
KvScales = tuple[tuple[Any, ...], ...]


def scale_rows(part: tuple[Any, ...]) -> bool:
    """Whether one entry of KvScales is a row per sequence (a tuple of float tuples)."""
    return bool(part) and isinstance(part[0], tuple)
_SCALE_NAMES = ("k_scale", "v_scale", "q_scale")


def kv_scales_of(k_scale: Any, v_scale: Any, q_scale: Any = None, rows: bool = True
                 ) -> KvScales | None:
    """``k_scale`` and ``v_scale`` (a list, numpy array or torch tensor of one float per kv
    head, or with ``rows`` ``[batch, num_kv_heads]``: a row per sequence; both or neither),
    and ``q_scale`` with them for float8_e4m3fn queries, as float tuples (a tuple of row
    tuples for 2-D); None when none is given."""
    if k_scale is None and v_scale is None and q_scale is None:
        return None
    given = (k_scale, v_scale) if q_scale is None else (k_scale, v_scale, q_scale)
    out = []
    for x, name in zip(given, _SCALE_NAMES, strict=False):
        if x is None:
            raise AttentionInputError(f"{name} is missing: give k_scale and v_scale together"
                                      + (" (and with q_scale)" if q_scale is not None else ""))
        if is_torch_tensor(x):
            x = x.detach().float().cpu().numpy()
        try:
            # float32, as the wire carries them: what is checked (and compared) is what the
            # server gets (1e-50 would arrive as 0, 1e39 as inf).
            with np.errstate(over="ignore", under="ignore"):
                arr = np.asarray(x, dtype=np.float64).astype(np.float32)
        except (TypeError, ValueError):
            raise AttentionInputError(f"{name} must hold floats, got {x!r}") from None
        if arr.ndim not in ((1, 2) if rows else (1,)) or not arr.size:
            raise AttentionInputError(
                f"{name} must be [num_kv_heads]" + (" or [batch, num_kv_heads]" if rows else "")
                + f", got shape {arr.shape}")
        if not (np.isfinite(arr).all() and (arr > 0).all()):
            raise AttentionInputError(f"{name} must be finite and > 0 as float32, got "
                                      f"{arr.tolist()}")
        # tolist() gives the same Python floats as float() of each entry, in one go.
        out.append(tuple(map(tuple, arr.tolist())) if arr.ndim == 2 else tuple(arr.tolist()))
    return tuple(out)


def scales_message(scales: KvScales) -> pb.KvScales:
    """Rows per sequence go sequence-major, as the proto says."""
    k, v, q = (tuple(itertools.chain.from_iterable(p)) if scale_rows(p) else p
               for p in (*scales[:2], scales[2] if len(scales) > 2 else ()))
    return pb.KvScales(k=k, v=v, q=q)


def check_scale_heads(scales: KvScales, heads: int, sequences: int = 0) -> None:
    """One scale per kv head, or (a stateless call of ``sequences``) a row of them per
    sequence."""
    for part, name in zip(scales, _SCALE_NAMES, strict=False):
        if scale_rows(part):
            if len(part) != sequences or any(len(r) != heads for r in part):
                raise AttentionInputError(
                    f"{name} has shape [{len(part)}, {len(part[0])}]: give [{heads}] (one per "
                    f"kv head) or [{sequences}, {heads}] (a row per sequence)")
        elif len(part) != heads:
            raise AttentionInputError(f"{name} has {len(part)} entries for {heads} kv heads")


def _set_kv_scales(header: Any, wq: Tensor, wk: Tensor, scales: KvScales | None,
                   sequences: int) -> None:
    """A stateless call's FP8 scales into its header (per kv head, or a row per sequence):
    required with FP8 k/v (and the query scales with FP8 q), refused otherwise."""
    fp8_q = wq.dtype == pb.FLOAT8_E4M3
    if scales is not None and fp8_q != (len(scales) > 2):
        raise AttentionInputError(
            "float8_e4m3fn q needs q_scale (one float per kv head: "
            "attention_kernels.fp8.quantize_queries makes it)" if fp8_q else
            f"q_scale given, but q is {dtype_name(wq.dtype)}: it is for float8_e4m3fn q")
    if wk.dtype != pb.FLOAT8_E4M3:
        if scales is not None:
            raise AttentionInputError(f"k_scale/v_scale given, but k is "
                                      f"{dtype_name(wk.dtype)}: they are for float8_e4m3fn k/v")
        return
    if scales is None:
        raise AttentionInputError(
            "float8_e4m3fn q, k and v need q_scale, k_scale and v_scale" if fp8_q else
            "float8_e4m3fn k and v need k_scale and v_scale (one float per kv head: "
            "attention_kernels.quantize_kv makes them)")
    check_scale_heads(scales, wk.shape[-2], sequences)
    header.kv_scales.CopyFrom(scales_message(scales))


class CacheCall(Protocol):
    """The caches a cache op runs against, as its request holds them (``_layouts.CacheTarget``:
    typed here by what a request uses, so that this module needs none of the caches' own)."""

    @property
    def ids(self) -> tuple[str, ...]: ...

    @property
    def layout(self) -> Any: ...  # the caches' KvLayout when known, else None

    def message(self) -> pb.CacheTarget: ...


@dataclass
class PreparedRequest:
    """Everything needed to send one call and to rebuild its result."""

    method: str  # PREFILL | DECODE | APPEND_KV | CACHE_PREFILL | CACHE_DECODE (the rpc)
    header: bytes  # serialized PrefillHeader / DecodeHeader
    tensors: tuple[Tensor, Tensor, Tensor]  # q, k, v: wire bytes, or spans of regions
    out_shape: tuple[int, ...] | None  # OUT as the server sends it (None: AppendKV, no output)
    out_dtype: int  # pb.DType of OUT (``attention_wire.messages.out_dtype``)
    lse_shape: tuple[int, ...] | None  # LSE as the server sends it, None if not requested
    result_dtype: Any  # the dtype results come back in: q's (numpy's or torch's)
    result_device: Any  # and q's device (torch); None: results are numpy arrays
    user_shape: tuple[int, ...]  # out's shape as the caller sees it
    lse_fix: Callable[[Any], Any]  # server lse layout -> the caller's
    placement: Placement | None = None
    out_span: Span | None = None  # OUT written into a region instead of streamed
    lse_span: Span | None = None
    user_out: Any = None  # ``out=``: returned as the result once the server wrote it
    cache: CacheCall | None = None  # the cache ops' caches
    cache_lengths: list[int] | None = None  # their lengths after the call (set on completion)
    stats: dict[str, Any] | None = None  # the call's RequestStats (set on completion)
    # The reply being read (``expect_reply``): None until then.
    _reply: dict[int, tuple[int, np.ndarray, np.ndarray, np.ndarray, int, str]] | None = field(
        default=None, init=False, repr=False)
    _reply_stats: pb.RequestStats | None = field(default=None, init=False, repr=False)

    @property
    def streamed_out_shape(self) -> tuple[int, ...] | None:
        return None if self.out_span is not None else self.out_shape

    def take_stats(self, stats: dict[str, Any]) -> None:
        """Note the completed call's RequestStats (and the cache ops' ``cache_lengths``)."""
        self.stats = stats
        if self.cache is not None:
            self.cache_lengths = self.checked_lengths(stats)

    def checked_lengths(self, stats: dict[str, Any]) -> list[int]:
        """The stats' ``cache_lengths``, one per cache of this cache op (ProtocolError if
        not)."""
        assert self.cache is not None
        lengths = [int(n) for n in stats.get("cache_lengths", ())]
        if len(lengths) != len(self.cache.ids):
            raise ProtocolError(
                f"RequestStats.cache_lengths has {len(lengths)} entries for "
                f"{len(self.cache.ids)} caches", self.method,
            )
        return lengths

    @property
    def streamed_lse_shape(self) -> tuple[int, ...] | None:
        return None if self.lse_span is not None else self.lse_shape

    def result(self, out: Any, lse: Any) -> Any:
        """The user's result: ``out``/``lse`` as streamed (storage arrays), or read from the
        region spans the server wrote (a private copy; ``out=`` is returned as it is).
        AppendKV, which has no output: the caches' lengths."""
        if self.out_shape is None:
            return self.cache_lengths
        if self.placement is not None and self.lse_span is not None:
            assert self.lse_shape is not None
            lse = self.placement.read(self.lse_span, self.lse_shape, pb.FLOAT32)
        if self.user_out is not None:
            result = self.user_out
        else:
            if self.placement is not None and self.out_span is not None:
                out = self.placement.read(self.out_span, self.out_shape, self.out_dtype)
            result = to_user(out.reshape(self.user_shape), self.result_dtype,
                             self.result_device)
        if lse is None:
            return result
        return result, to_user(self.lse_fix(lse), self.result_dtype, self.result_device,
                               is_lse=True)

    # ---- its reply: ``expect_reply`` before the request goes (the output arrays are made
    # then, not after the server ran the call), every parsed response (``messages.
    # parse_response``) to ``add_reply``, then ``reply``. An output whose shape is None is
    # not streamed (it went into a region, or lse was not asked for) and must not arrive.

    def expect_reply(self) -> None:
        """Start (or restart, for a call sent again) this call's reply."""
        # Per output field (pb.OUT, pb.LSE) that streams back, worked out once: its wire
        # dtype, the storage array it is copied into, that array as rows of bytes, which of
        # its rows have arrived, the bytes of one row, and the field's name.
        self._reply = {}
        for field_no, shape, dtype in ((pb.OUT, self.streamed_out_shape, self.out_dtype),
                                       (pb.LSE, self.streamed_lse_shape, pb.FLOAT32)):
            if shape is not None:
                array = np.empty(tuple(int(d) for d in shape), storage_dtype(dtype))
                rows, row_bytes = array.shape[0], _row_bytes(array)
                by_row = array.reshape(-1).view(np.uint8).reshape(rows, row_bytes)
                self._reply[field_no] = (dtype, array, by_row, np.zeros(rows, dtype=bool),
                                         row_bytes, pb.OutputField.Name(field_no))
        self._reply_stats = None

    @property
    def expecting_reply(self) -> bool:
        return self._reply is not None

    def add_reply(self, response: OutputSlice | pb.RequestStats | None) -> None:
        assert self._reply is not None, "expect_reply() first"
        if self._reply_stats is not None:
            raise ProtocolError("message after the final RequestStats", self.method)
        if isinstance(response, pb.RequestStats):
            self._reply_stats = response
            return
        if response is None:
            raise ProtocolError("response message with no payload", self.method)
        chunk = response
        if chunk.field not in self._reply:
            raise ProtocolError(
                f"unexpected output field {pb.OutputField.Name(chunk.field)}"
                if chunk.field in pb.OutputField.values()
                else f"unknown output field {chunk.field}",
                self.method,
            )
        self._fill(chunk)

    def _fill(self, chunk: OutputSlice) -> None:
        """Copy ``chunk``'s rows into its field's array, each row checked to come once."""
        wire_dtype, array, by_row, seen, row_bytes, name = self._reply[chunk.field]  # type: ignore[index]
        if chunk.dtype != wire_dtype or chunk.shape != array.shape:
            raise ProtocolError(
                f"{name} chunk has spec {_name(chunk.dtype)}{list(chunk.shape)}, "
                f"expected {dtype_name(wire_dtype)}{list(array.shape)}",
                self.method,
            )
        rows = array.shape[0]
        start, count = chunk.row_start, chunk.row_count
        if start < 0 or count < 0 or start + count > rows:
            raise ProtocolError(
                f"{name} rows [{start}, {start + count}) outside [0, {rows})", self.method
            )
        data = chunk.data
        if len(data) != count * row_bytes:
            raise ProtocolError(
                f"{name} rows [{start}, {start + count}) carry {len(data)} bytes, "
                f"expected {count * row_bytes}",
                self.method,
            )
        if seen[start : start + count].any():
            raise ProtocolError(
                f"{name} rows [{start}, {start + count}) arrived more than once", self.method
            )
        seen[start : start + count] = True
        if count:
            by_row[start : start + count] = np.frombuffer(data, np.uint8).reshape(
                count, row_bytes
            )

    def reply(self) -> tuple[np.ndarray | None, np.ndarray | None, dict[str, Any]]:
        """(out, lse, stats) once every row and the stats have come; ProtocolError if not."""
        assert self._reply is not None, "expect_reply() first"
        for _, array, _, seen, row_bytes, name in self._reply.values():
            if row_bytes == 0 or seen.all():  # zero-width rows carry nothing to wait for
                continue
            missing = np.flatnonzero(~seen)
            raise ProtocolError(
                f"{name} is missing {missing.size} of {array.shape[0]} "
                f"rows (first missing row {int(missing[0])})",
                self.method,
            )
        if self._reply_stats is None:
            raise ProtocolError("response stream ended without RequestStats", self.method)
        got = self._array(pb.OUT), self._array(pb.LSE), stats_dict(self._reply_stats)
        self.forget_reply()  # read once; a request kept as a template holds no outputs
        return got

    def forget_reply(self) -> None:
        self._reply = self._reply_stats = None

    def _array(self, field_no: int) -> np.ndarray | None:
        entry = self._reply.get(field_no)  # type: ignore[union-attr]
        return None if entry is None else entry[1]


def tensor_of(x: Any, name: str, placement: Placement | None) -> Tensor:
    placed = placement.input(x, name) if placement is not None else None
    return placed if placed is not None else to_wire(x, name)


def encode_qkv(
    q: Any, k: Any, v: Any, placement: Placement | None = None,
    names: tuple[str, str, str] = ("q", "k", "v"), fp8_queries: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Encode q, k, v (q None: k alone, and the q returned is k);
    AttentionInputError when their dtypes or k/v shapes differ. ``fp8_queries``: the call
    takes float8_e4m3fn queries beside float8_e4m3fn keys and values (a stateless prefill or
    decode)."""
    first = (q, names[0]) if q is not None else (k, names[1])
    describe(*first)  # q's errors (else k's) before the others'
    wk, wv = tensor_of(k, names[1], placement), tensor_of(v, names[2], placement)
    wq = tensor_of(q, names[0], placement) if q is not None else wk
    fp8_q = fp8_queries and wq.dtype == pb.FLOAT8_E4M3
    if q is not None and wq.dtype not in QUERY_DTYPES and not fp8_q:
        also = (" (float8_e4m3fn queries: attention() and decode() only)"
                if wq.dtype == pb.FLOAT8_E4M3 else "")
        raise AttentionInputError(f"{names[0]} has dtype {dtype_name(wq.dtype)}: queries take "
                                  f"float16, bfloat16 or float32{also}")
    fp8_pair = wk.dtype == wv.dtype == pb.FLOAT8_E4M3 and wq.dtype in FP8_QUERY_DTYPES
    if not (wq.dtype == wk.dtype == wv.dtype or fp8_pair):
        given = (wq, wk, wv) if q is not None else (wk, wv)
        dtypes = ", ".join(pb.DType.Name(t.dtype) for t in given)
        raise AttentionInputError(
            f"{', '.join(t.name for t in given)} must share one dtype (or k and v be "
            f"float8_e4m3fn beside float16/bfloat16 queries), got {dtypes}"
        )
    if wk.shape != wv.shape:
        raise AttentionInputError(
            f"{names[2]} shape {wv.shape} differs from {names[1]} shape {wk.shape}"
        )
    for t in (wq, wk):
        if t.shape and not 1 <= t.shape[-1] <= MAX_HEAD_DIM:
            raise AttentionInputError(f"{t.name} has head_dim {t.shape[-1]} (shape {t.shape}): "
                                      f"must be in [1, {MAX_HEAD_DIM}]")
    return wq, wk, wv


def require_rank(t: Tensor, rank: int, layout: str) -> None:
    if len(t.shape) != rank:
        raise AttentionInputError(f"{t.name} must be {rank}-D {layout}, got shape {t.shape}")


def _nbytes(shape: tuple[int, ...], wire_dtype: int) -> int:
    return math.prod(shape) * storage_dtype(wire_dtype).itemsize


def spec(t: Tensor) -> pb.TensorSpec:
    return pb.TensorSpec(dtype=t.dtype, shape=t.shape)


def _check_out(out: Any, user_shape: tuple[int, ...], wire_dtype: int) -> None:
    """``out=`` must be what the result would be: its bytes are the server's output as they
    are, so another dtype or shape of the same size would read as garbage."""
    shape, dtype = describe(out, "out")
    if dtype != wire_dtype or shape != tuple(user_shape):
        raise AttentionInputError(
            f"out has shape {shape} and dtype {dtype_name(dtype)}: the result has shape "
            f"{tuple(user_shape)} and dtype {dtype_name(wire_dtype)} (q's; bfloat16 for "
            "float8_e4m3fn q)"
        )


def place_tensors(
    header: Any, tensors: tuple[Tensor, ...], placement: Placement | None, out: Any,
    out_nbytes: int, lse_nbytes: int, user_shape: tuple[int, ...],
) -> tuple[Span | None, Span | None]:
    """Spans of the inputs in regions, and of the outputs (``out=``, whose shape must be
    ``user_shape`` and dtype q's, or scratch near q)."""
    # By wire field: the caller's names differ (a cache step's k_new, v_new).
    spans = {field: t.span for field, t in zip(("q", "k", "v"), tensors, strict=True)
             if isinstance(t, RegionTensor)}
    out_span = lse_span = None
    if out is not None:
        _check_out(out, user_shape, out_dtype(tensors[0].dtype))
        if not out_nbytes:  # an empty batch: nothing to write; ``out`` is returned as it is
            out = None
    if placement is not None:
        if out is not None:
            out_span = placement.user_output(out)
            if out_span is None:
                raise AttentionInputError(
                    "out must be a contiguous tensor inside a registered region"
                )
            assert out_span.nbytes == out_nbytes  # its shape and dtype were checked
        q_span = spans.get("q")
        if q_span is not None:
            if out_span is None:
                out_span = placement.output(q_span, out_nbytes)
            if lse_nbytes:
                lse_span = placement.output(q_span, lse_nbytes)
    elif out is not None:
        raise AttentionInputError(
            "out= must lie in a registered region (register_shm / register_cuda), and the "
            "call must use regions (use_regions on, the default)"
        )
    if out_span is not None:
        spans["out"] = out_span
    if lse_span is not None:
        spans["lse"] = lse_span
    if spans:
        header.regions.CopyFrom(pb.TensorRegions(**{n: s.message() for n, s in spans.items()}))
    return out_span, lse_span


def finish_request(
    method: str, header: Any, wq: Tensor, wk: Tensor, wv: Tensor, like: Any, sequences: int,
    lse_shape: tuple[int, int] | None, user_shape: tuple[int, ...],
    lse_fix: Callable[[Any], Any], *, softmax_scale: float | None,
    placement: Placement | None, out: Any, cache: CacheCall | None,
    score: ScoreMods | None, kv_scales: KvScales | None,
) -> PreparedRequest:
    """What both header kinds (``_prefill``, ``_decode``) end with: the caches or the FP8
    scales, score options over ``sequences``, the softmax scale, the outputs' placement, and
    the request itself, whose results take the flavour of ``like`` (the caller's q)."""
    if cache is not None:
        header.cache.CopyFrom(cache.message())
    else:
        _set_kv_scales(header, wq, wk, kv_scales, sequences)
    if score is not None:
        header.score.CopyFrom(score.message(wq.shape[1], sequences))
    scale = _scale(softmax_scale)
    if scale is not None:
        header.softmax_scale = scale
    out_span, lse_span = place_tensors(
        header, (wq, wk, wv), placement, out, _nbytes(wq.shape, out_dtype(wq.dtype)),
        _nbytes(lse_shape, pb.FLOAT32) if lse_shape else 0, user_shape,
    )
    result_dtype, result_device = result_flavour(like, bfloat16=wq.dtype == pb.FLOAT8_E4M3)
    return PreparedRequest(
        method=method, header=checked_header(header), tensors=(wq, wk, wv),
        out_shape=wq.shape, out_dtype=out_dtype(wq.dtype), lse_shape=lse_shape,
        result_dtype=result_dtype, result_device=result_device, user_shape=user_shape,
        lse_fix=lse_fix, placement=placement, out_span=out_span, lse_span=lse_span,
        user_out=out, cache=cache,
    )


def as_flag(value: Any, name: str) -> bool:
    """A bool argument: True/False (numpy's too) or 0/1; anything else (``causal="no"``,
    which ``bool()`` would take as True) is refused, naming ``name``."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer) and value in (0, 1):
        return bool(value)
    raise AttentionInputError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _scale(softmax_scale: float | None) -> float | None:
    if softmax_scale is None:
        return None
    if not real_number(softmax_scale):  # float() would take "0.5", True, bytearray ...
        raise AttentionInputError(
            f"softmax_scale must be a real number, got {type(softmax_scale).__name__} "
            f"{softmax_scale!r}")
    try:
        scale = float(softmax_scale)
    except (TypeError, ValueError):
        scale = math.nan
    if not math.isfinite(scale):
        raise AttentionInputError(f"softmax_scale must be finite, got {softmax_scale!r}")
    return scale


def checked_header(header: Any) -> bytes:
    data = header.SerializeToString()
    if len(data) > MAX_HEADER_BYTES:
        raise AttentionInputError(
            f"request header is {len(data)} bytes (cu_seqlens too long), over the "
            f"{MAX_HEADER_BYTES} byte limit that keeps messages under gRPC's 4 MiB default: "
            "split the batch over several calls"
        )
    return data


def same_lse(lse: Any) -> Any:
    return lse


# ---- the reply: OUT/LSE row slices -> preallocated arrays, with every row checked ----------
# Each slice (parsed by ``attention_wire.messages`` without copying its bytes) is copied
# straight into its rows of the final array: the one copy on the client. Every row must arrive
# exactly once and the stream must end with RequestStats; anything else raises ProtocolError,
# never a silently wrong tensor.


def _name(dtype: int) -> str:
    return dtype_name(dtype) if dtype in pb.DType.values() else f"dtype {dtype}"


def stats_dict(stats: pb.RequestStats) -> dict[str, Any]:
    """The stats as plain Python values (repeated fields as lists)."""
    out = {name: getattr(stats, name) for name in _STATS_SCALARS}
    for name in _STATS_LISTS:
        out[name] = list(getattr(stats, name))
    return out


def _is_repeated(field: Any) -> bool:
    # FieldDescriptor.label is deprecated in newer protobuf; is_repeated replaces it.
    rep = getattr(field, "is_repeated", None)
    return bool(rep) if rep is not None else field.label == field.LABEL_REPEATED


# RequestStats' fields by kind, read once (every call's stats go through stats_dict).
_STATS_SCALARS = tuple(f.name for f in pb.RequestStats.DESCRIPTOR.fields if not _is_repeated(f))
_STATS_LISTS = tuple(f.name for f in pb.RequestStats.DESCRIPTOR.fields if _is_repeated(f))


def _row_bytes(array: np.ndarray) -> int:
    return math.prod(array.shape[1:]) * array.itemsize
