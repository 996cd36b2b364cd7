"""Raw-stub helpers for the KV-cache rpcs: request streams and a reference model of caches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from attention_wire.pb import attention_pb2 as pb

from .svc_helpers import (
    TOLERANCE,
    chunk_messages,
    collect,
    cu_from_lengths,
    decode_oracle,
    spec,
)

PB = {torch.float16: pb.FLOAT16, torch.bfloat16: pb.BFLOAT16, torch.float32: pb.FLOAT32}


def layout(dtype: torch.dtype, kv_heads: int, dim: int) -> pb.CacheLayout:
    return pb.CacheLayout(dtype=PB[dtype], num_kv_heads=kv_heads, head_dim=dim)


def append_messages(
    ids: Sequence[str], k: torch.Tensor, v: torch.Tensor, lens: Sequence[int]
) -> Iterator[pb.PrefillRequest]:
    header = pb.PrefillHeader(k=spec(k), v=spec(v), cu_seqlens_k=cu_from_lengths(list(lens)),
                              cache=pb.CacheTarget(cache_ids=ids))
    yield pb.PrefillRequest(header=header)
    yield from chunk_messages(pb.PrefillRequest, {pb.K: k, pb.V: v})


def cache_prefill_messages(
    ids: Sequence[str], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    q_lens: Sequence[int], k_lens: Sequence[int], *, causal: bool = True, store: bool = True,
    return_lse: bool = True,
) -> Iterator[pb.PrefillRequest]:
    header = pb.PrefillHeader(
        q=spec(q), k=spec(k), v=spec(v), cu_seqlens_q=cu_from_lengths(list(q_lens)),
        cu_seqlens_k=cu_from_lengths(list(k_lens)), causal=causal, return_lse=return_lse,
        cache=pb.CacheTarget(cache_ids=ids, store=store),
    )
    yield pb.PrefillRequest(header=header)
    yield from chunk_messages(pb.PrefillRequest, {pb.Q: q, pb.K: k, pb.V: v})


def cache_decode_messages(
    ids: Sequence[str], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    store: bool = True, return_lse: bool = True, cu_k: Sequence[int] = (),
) -> Iterator[pb.DecodeRequest]:
    header = pb.DecodeHeader(q=spec(q), k=spec(k), v=spec(v), return_lse=return_lse,
                             cu_seqlens_k=list(cu_k),
                             cache=pb.CacheTarget(cache_ids=ids, store=store))
    yield pb.DecodeRequest(header=header)
    yield from chunk_messages(pb.DecodeRequest, {pb.Q: q, pb.K: k, pb.V: v})


class Model:
    """What each cache should hold: the oracle's side of the test."""

    def __init__(self, kv_heads: int, dim: int, dtype: torch.dtype) -> None:
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.shape, self.dtype = (kv_heads, dim), dtype

    def create(self, ids: Sequence[str]) -> None:
        for i in ids:
            self.k[i] = torch.empty(0, *self.shape, dtype=self.dtype)
            self.v[i] = torch.empty(0, *self.shape, dtype=self.dtype)

    def append(self, ids: Sequence[str], k: torch.Tensor, v: torch.Tensor,
               lens: Sequence[int]) -> None:
        at = 0
        for i, n in zip(ids, lens, strict=True):
            self.k[i] = torch.cat([self.k[i], k[at : at + n]])
            self.v[i] = torch.cat([self.v[i], v[at : at + n]])
            at += n

    def packed(self, ids: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The caches' keys and values packed, and their cu_seqlens."""
        k = torch.cat([self.k[i] for i in ids])
        v = torch.cat([self.v[i] for i in ids])
        return k, v, cu_from_lengths([self.k[i].shape[0] for i in ids])


def rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def session(stub: Any, prefix: str, lens: list[int], dtype: torch.dtype = torch.float32,
             heads: int = 4, kv_heads: int = 2, dim: int = 16, seed: int = 0,
             metadata: Any = None) -> tuple[list[str], Model]:
    ids = [f"{prefix}{i}" for i in range(len(lens))]
    stub.CreateCaches(pb.CreateCachesRequest(cache_ids=ids, layout=layout(dtype, kv_heads, dim)),
                      timeout=10, metadata=metadata)
    model = Model(kv_heads, dim, dtype)
    model.create(ids)
    k, v = rand(sum(lens), kv_heads, dim, seed=seed, dtype=dtype), rand(
        sum(lens), kv_heads, dim, seed=seed + 1, dtype=dtype)
    r = collect(stub.AppendKV(append_messages(ids, k, v, lens), timeout=30, metadata=metadata))
    assert list(r.stats.cache_lengths) == lens and not r.tensors  # stats only
    model.append(ids, k, v, lens)
    return ids, model


def decode_step(stub: Any, ids: list[str], model: Model, heads: int, seed: int, *,
                new: bool = True, store: bool = True, metadata: Any = None,
                tol: float | None = None, lse_tol: float = 1e-4) -> Any:
    """One CacheDecode step checked against the reference (``tol``: the output's tolerance,
    by default the cpu backend's for the dtype); the model follows when it stores."""
    kv_heads, dim = model.shape
    batch = len(ids)
    q = rand(batch, heads, dim, seed=seed, dtype=model.dtype)
    n = batch if new else 0
    k = rand(n, kv_heads, dim, seed=seed + 1, dtype=model.dtype)
    v = rand(n, kv_heads, dim, seed=seed + 2, dtype=model.dtype)
    r = collect(stub.CacheDecode(cache_decode_messages(ids, q, k, v, store=store), timeout=30,
                                 metadata=metadata))
    trial = Model(kv_heads, dim, model.dtype)
    trial.k, trial.v = dict(model.k), dict(model.v)
    if new:
        trial.append(ids, k, v, [1] * batch)
    kk, vv, cu = trial.packed(ids)
    out, lse = decode_oracle(q, kk, vv, cu)
    tol = TOLERANCE[model.dtype] if tol is None else tol
    assert not r.out.isnan().any()
    torch.testing.assert_close(r.out.double(), out, atol=tol, rtol=tol)
    torch.testing.assert_close(r.lse.double(), lse.double(), atol=lse_tol, rtol=lse_tol)
    if store:
        model.k, model.v = trial.k, trial.v
    assert list(r.stats.cache_lengths) == [model.k[i].shape[0] for i in ids]
    return r
