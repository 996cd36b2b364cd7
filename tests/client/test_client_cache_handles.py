"""A cache handle's bookkeeping when a create's answer is lost: a stand-in for the client's
rpcs that keeps the server's set of cache ids and can drop an answer after acting on it (a
deadline that ran out on the way back)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from attention_client import AsyncAttentionClient, AttentionClient
from attention_client._caches import AsyncKvCache, KvCache
from attention_client._channel import CallSettings
from attention_client._errors import (
    AttentionError,
    AttentionInputError,
    AttentionTimeoutError,
    make_error,
)
from attention_client._layouts import KvLayout
from attention_wire.pb import attention_pb2 as pb

LAYOUT = KvLayout.of(2, 16, "float32", None, None, None)


class Rpcs:
    """The rpcs a KvCache makes, over a set of ids; ``lose`` drops the next create's answer
    after the create happened, ``refuse`` refuses the next create with that status."""

    def __init__(self) -> None:
        self.caches: set[str] = set()
        self.lose = False
        self.refuse: grpc.StatusCode | None = None
        self.creates: list[tuple[str, ...]] = []
        self._cache_layouts: dict = {}

    _drive = AttentionClient._drive  # the faces' step runners
    _placed = AttentionClient._placed  # prepare a request, through _placement below

    def _settings(self, *args):  # noqa: ANN002
        return CallSettings(deadline=None, metadata=(), wait_for_ready=None)

    def _placement(self, use_regions):  # noqa: ANN001
        return None  # no regions: tensors go as bytes

    def _unary_rpc(self, method: str, request, settings, headers=None):  # noqa: ANN001
        ids = tuple(request.cache_ids) if method != "ForkCache" else (request.target_id,)
        if method in ("CreateCaches", "ForkCache"):
            self.creates.append(ids)
            if self.refuse is not None:
                code, self.refuse = self.refuse, None
                raise make_error(code, "refused", method)
            if self.caches & set(ids):
                raise make_error(grpc.StatusCode.ALREADY_EXISTS, "exists", method)
            self.caches |= set(ids)
            if self.lose:
                self.lose = False
                raise make_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline", method)
            if method == "ForkCache":
                return pb.CacheInfo(cache_id=ids[0], layout=LAYOUT.message())
            return pb.CreateCachesResponse()
        if method == "ReleaseCaches":
            if set(ids) - self.caches:
                raise make_error(grpc.StatusCode.NOT_FOUND, "no such cache", method)
            self.caches -= set(ids)
            return pb.ReleaseCachesResponse(released=len(ids))
        raise AssertionError(method)

    def _run(self, prep, settings):  # noqa: ANN001
        missing = set(prep.cache.ids) - self.caches
        if missing:
            raise make_error(grpc.StatusCode.NOT_FOUND, f"no cache {sorted(missing)}", "x")
        return "ran"


class AsyncRpcs(Rpcs):
    _drive = AsyncAttentionClient._drive

    async def _unary_rpc(self, method: str, request, settings, headers=None):  # noqa: ANN001
        return Rpcs._unary_rpc(self, method, request, settings)

    async def _run(self, prep, settings):  # noqa: ANN001
        return Rpcs._run(self, prep, settings)


def kv(rows: int) -> np.ndarray:
    return np.zeros((rows, 2, 16), np.float32)


def test_a_create_whose_answer_was_lost_is_released_and_can_be_made_again() -> None:
    rpcs = Rpcs()
    cache = KvCache(rpcs, LAYOUT)  # type: ignore[arg-type]
    rpcs.lose = True
    with pytest.raises(AttentionTimeoutError):
        cache.create("a")
    assert rpcs.caches == {"a"} and cache.ids == []  # made on the server, unknown to the call
    cache.create("a")  # ALREADY_EXISTS is that earlier create
    assert cache.ids == ["a"]
    rpcs.lose = True
    with pytest.raises(AttentionTimeoutError):
        cache.append(["b", "c"], kv(2), kv(2), [0, 1, 2])  # the implicit create's answer
    assert cache.append(["b", "c"], kv(2), kv(2), [0, 1, 2]) == "ran"  # made again: theirs
    assert rpcs.creates[-2:] == [("b",), ("c",)]  # one by one
    assert cache.release() == 3 and rpcs.caches == set()


def test_release_takes_the_lost_creates_and_skips_those_never_made() -> None:
    rpcs = Rpcs()
    with KvCache(rpcs, LAYOUT) as cache:  # type: ignore[arg-type]
        cache.create("kept")
        rpcs.lose = True
        with pytest.raises(AttentionTimeoutError):
            cache.append("lost", kv(1), kv(1))
        rpcs.lose = True
        with pytest.raises(AttentionTimeoutError):
            cache.fork("kept", "forked")
        # An answer lost before the server acted looks the same: release skips its NOT_FOUND.
        with pytest.raises(AttentionError):
            cache._unsure["never"] = None
            raise make_error(grpc.StatusCode.DEADLINE_EXCEEDED, "lost", "CreateCaches")
        assert rpcs.caches == {"kept", "lost", "forked"}
    assert rpcs.caches == set() and cache.ids == [] and not cache._unsure


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.INVALID_ARGUMENT])
def test_a_refused_create_is_not_remembered(code: grpc.StatusCode) -> None:
    rpcs = Rpcs()
    cache = KvCache(rpcs, LAYOUT)  # type: ignore[arg-type]
    rpcs.refuse = code
    with pytest.raises(AttentionError) as info:
        cache.create("a")
    assert info.value.code == code and not cache._unsure
    assert cache.release() == 0


def test_the_async_handle_does_the_same() -> None:
    async def main() -> None:
        rpcs = AsyncRpcs()
        cache = AsyncKvCache(rpcs, LAYOUT)  # type: ignore[arg-type]
        rpcs.lose = True
        with pytest.raises(AttentionTimeoutError):
            await cache.append("a", kv(1), kv(1))
        assert rpcs.caches == {"a"} and cache.ids == []
        rpcs.lose = True
        with pytest.raises(AttentionTimeoutError):
            await cache.create("b")
        assert await cache.append("a", kv(1), kv(1)) == "ran"
        assert await cache.release() == 2 and rpcs.caches == set()

    asyncio.run(main())


@pytest.mark.parametrize("length", [np.int64(3), np.int32(0), 5])
def test_fork_takes_any_integer_length(length: object) -> None:
    request = KvCache._fork_request("a", "b", length)  # type: ignore[arg-type]
    assert request.length == int(length)  # type: ignore[call-overload]


def test_fork_length_torch_integer() -> None:
    torch = pytest.importorskip("torch")
    assert KvCache._fork_request("a", "b", torch.tensor(7)).length == 7


@pytest.mark.parametrize("length", [True, -1, 2.0, "3", np.float32(1)])
def test_fork_refuses_other_lengths(length: object) -> None:
    with pytest.raises(ValueError, match="length must be a non-negative int"):
        KvCache._fork_request("a", "b", length)  # type: ignore[arg-type]


def test_a_handle_carries_its_session_and_the_replica_it_learns() -> None:
    # Behind Envoy (issue 64): the session key on every call, the replica pin once answered.
    rpcs = Rpcs()
    own = KvCache(rpcs, LAYOUT)  # type: ignore[arg-type]
    other = KvCache(rpcs, LAYOUT)  # type: ignore[arg-type]
    assert own.session != other.session and len(own.session) == 32  # one key per handle
    named = KvCache(rpcs, LAYOUT, session="user-7")  # type: ignore[arg-type]
    assert named.session_metadata == (("x-attention-session", "user-7"),)
    named._note_replica({"x-attention-replica": "MTI3LjAuMC4xOjUx"})
    settings = named._settings(None, None, None)
    assert settings.metadata == (("x-attention-session", "user-7"),
                                 ("x-attention-replica", "MTI3LjAuMC4xOjUx"))
    for bad in ("", "a\nb", "é", 7, "x" * 257):
        with pytest.raises(AttentionInputError, match="session must be"):
            KvCache(rpcs, LAYOUT, session=bad)  # type: ignore[arg-type]
