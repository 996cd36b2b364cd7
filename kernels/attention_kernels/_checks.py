"""Input checks shared by the kernels and the reference.

Shape, dtype and layout checks never touch tensor values, so they cost no host-device sync and
run on every call. ``check_cu_seqlens_values`` reads the values (a sync on a GPU tensor): the
reference and the service call it on host tensors; the kernel hot path does not.
"""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def supported_head_dim(head_dim: int) -> bool:
    """Every multiple of 8 from 8 to 256 (padded to a power of two inside the kernels)."""
    return 8 <= head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_name: str = "q") -> None:
    for name, t in ((q_name, q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES and t.dtype != torch.float64:
            raise ValueError(f"{name} has unsupported dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    if k.shape[2] != head_dim:
        raise ValueError(f"head_dim of {q_name} ({head_dim}) and k ({k.shape[2]}) differ")
    if not supported_head_dim(head_dim):
        raise ValueError(f"head_dim {head_dim} unsupported: must be a multiple of 8 in [8, 256]")
    if num_kv_heads == 0 or num_heads == 0:
        raise ValueError("num_heads and num_kv_heads must be positive")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )


def _check_cu(cu: torch.Tensor, name: str, device: torch.device) -> None:
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name} must be 1-D with batch+1 entries, got {tuple(cu.shape)}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but q is on {device}")


def check_prefill_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
) -> None:
    _check_qkv(q, k, v)
    _check_cu(cu_seqlens_q, "cu_seqlens_q", q.device)
    _check_cu(cu_seqlens_k, "cu_seqlens_k", q.device)
    if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0] - 1} sequences but cu_seqlens_k has "
            f"{cu_seqlens_k.shape[0] - 1}"
        )


def check_decode_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_k: torch.Tensor
) -> None:
    _check_qkv(q, k, v)
    _check_cu(cu_seqlens_k, "cu_seqlens_k", q.device)
    if cu_seqlens_k.shape[0] != q.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens_k must have batch+1 = {q.shape[0] + 1} entries (q has batch "
            f"{q.shape[0]}), got {cu_seqlens_k.shape[0]}"
        )


def check_cu_seqlens_values(cu: list[int] | torch.Tensor, total: int, name: str) -> None:
    """Values check: starts at 0, non-decreasing, ends at ``total``. Reads values (host)."""
    vals = cu.tolist() if isinstance(cu, torch.Tensor) else list(cu)
    if not vals or vals[0] != 0:
        raise ValueError(f"{name} must start at 0")
    for i in range(1, len(vals)):
        if vals[i] < vals[i - 1]:
            raise ValueError(f"{name} must be non-decreasing (entry {i}: {vals[i]} < {vals[i-1]})")
    if vals[-1] != total:
        raise ValueError(f"{name} must end at the token count {total}, got {vals[-1]}")


def output_buffer(buf: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device, name: str) -> torch.Tensor:
    """A caller-provided output buffer after checks, or a fresh one."""
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(buf.shape) != shape or buf.dtype != dtype or buf.device != device:
        raise ValueError(f"{name} must be {dtype} {list(shape)} on {device}, got "
                         f"{buf.dtype} {list(buf.shape)} on {buf.device}")
    if not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return buf
