"""What front-end processes and the engine process say to each other (``channel.Channel``).

Small on purpose: tensor bytes never travel here, only where they are. A tensor lives in the
sender's arena (``ArenaSpan``), in a one-off segment whose descriptor rides with the message
(``SegmentSpan``, for a request that does not fit the arena), or in a registered region
(``params.RegionSpan``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from attention_service.config import ServerConfig
from attention_service.ipc.channel import compact
from attention_service.link import EngineInfo, ExecStats
from attention_service.params import BatchKey, Op, Params, RegionSpan
from attention_wire.pb import attention_pb2 as pb

# A tensor in the sender's arena: (byte offset, byte count). A plain tuple, not a NamedTuple,
# because a call carries four or five of them: with interned params (ids; ``Submit.params`` once) a
# decode step's Submit unpickles in 1.8 us instead of 7.7 (NamedTuples unpickle through a
# class lookup and a Python-level ``__getnewargs__`` each).
ArenaSpan = tuple[int, int]


class SegmentSpan(NamedTuple):
    fd_index: int  # index into the descriptors sent with the message
    offset: int
    nbytes: int


Span = ArenaSpan | SegmentSpan | RegionSpan


# ---- engine -> front end ----------------------------------------------------------------

class Hello(NamedTuple):
    """First message to a new front end: what to serve and with what."""

    config: ServerConfig  # its port is the reserved one
    info: EngineInfo
    slot: int
    arena_bytes: int
    cpus: frozenset[int] | None = None  # where it runs (cpus.py); None: where it started


class Serving(NamedTuple):
    """The engine is warm: accept compute calls, answer health SERVING."""


class Done(NamedTuple):
    call_id: int
    stats: ExecStats


compact(Done, 1, lambda m: (m.call_id, tuple(m.stats)),
        lambda t: Done(t[0], ExecStats._make(t[1])))


class Failed(NamedTuple):
    call_id: int
    error: BaseException  # RequestError or Cancelled


class Reply(NamedTuple):
    call_id: int
    value: bytes  # a control rpc's serialized pb reply


# ---- front end -> engine ----------------------------------------------------------------

class Bound(NamedTuple):
    """The front end listens (its port), pid for the record."""

    slot: int
    port: int
    pid: int


class Submit(NamedTuple):
    """A call for the engine. Its ``params`` cross once per channel: a front end's calls
    repeat a few (a decode session's every step has the same), so a Submit names them by
    ``params_id`` and carries them only the first time (later ones: None)."""

    call_id: int
    params_id: int
    spans: dict[str, Span]  # q, k, v, out (and lse when asked for)
    owner: str
    params: Params | None = None


# Submit as a plain tuple (``compact``), new params as their field values: a stateless call of
# new lengths brings new Params, so the engine's reader unpickles one per request. Pickled as a
# frozen dataclass (its class, a state dict, an Op by value) they took ~15 us to unframe and ~14
# to frame; as field values, with the object made without the dataclass ``__init__``
# (``object.__setattr__`` per field, 7.5 us of it), ~4 and ~4 (dev box, 2026-11-28): GIL time
# every other engine thread waits behind. A NamedTuple pickled by class cost ~2.3 us more.
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(Params))
assert _PARAM_FIELDS[0] == "key"
_KEY_FIELDS = len(BatchKey._fields)
_OPS = {op.value: op for op in Op}


def _submit_plain(msg: Submit) -> tuple:
    p = msg.params
    if p is None:
        return msg[:4]
    return (*msg[:4], p.key.op.value, *p.key[1:], *[getattr(p, n) for n in _PARAM_FIELDS[1:]])


def _submit_from_plain(t: tuple) -> Submit:
    if len(t) == 4:
        return tuple.__new__(Submit, (*t, None))
    key = tuple.__new__(BatchKey, (_OPS[t[4]], *t[5 : 4 + _KEY_FIELDS]))
    params = object.__new__(Params)
    state = dict(zip(_PARAM_FIELDS[1:], t[4 + _KEY_FIELDS :], strict=True))
    state["key"] = key
    params.__dict__.update(state)  # the fields as __init__ leaves them (no __post_init__)
    return Submit(*t[:4], params)


compact(Submit, 2, _submit_plain, _submit_from_plain)


class ForgetParams(NamedTuple):
    """Drop every params a Submit brought so far (the front end's table was full; ids start
    over)."""


class Cancel(NamedTuple):
    call_id: int


class ControlCall(NamedTuple):
    call_id: int
    method: str
    request: bytes  # the serialized pb request
    owner: str


def rpc_types(method: str) -> tuple[Any, Any]:
    """(request class, reply class) of an AttentionService control rpc. Generated messages
    cross the channel serialized: they do not pickle (their module is not importable)."""
    desc = pb.DESCRIPTOR.services_by_name["AttentionService"].methods_by_name[method]
    return getattr(pb, desc.input_type.name), getattr(pb, desc.output_type.name)
