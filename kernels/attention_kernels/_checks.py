"""Input checks shared by the kernels and the reference.

Shape, dtype and layout checks never touch tensor values, so they cost no host-device sync and
run on every call. ``check_cu_seqlens_values`` reads the values (a sync on a GPU tensor): the
reference and the service call it on host tensors; the kernel hot path does not.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# K/V may also be float8_e4m3fn (with per-kv-head scales, ``fp8.py``) beside these queries.
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
FP8_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float64)  # float64: the references
MAX_HEAD_DIM = 256


def supported_head_dim(head_dim: int) -> bool:
    """Every head dim from 1 to 256: the kernels pad it to a power of two (``BLOCK_D``) and
    mask the columns past it, as flash_attn accepts any head dim up to 256 (issue 65). Dims
    whose rows are not 16-byte multiples (bf16: not a multiple of 8) take the pointer kernels,
    never the descriptor (TMA) ones, which serve listed dims only."""
    return 1 <= head_dim <= MAX_HEAD_DIM


def _supported(t: torch.Tensor) -> bool:
    """fp16/bf16/fp32, float64 (the references), or float8_e4m3fn: keys and values, and queries
    beside FP8 keys and values (``_check_common``)."""
    return t.dtype in SUPPORTED_DTYPES or t.dtype == torch.float64 or t.dtype in FP8_KV_DTYPES


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_name: str = "q") -> None:
    for name, t in ((q_name, q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D, got shape {tuple(t.shape)}")
        if not _supported(t):
            raise ValueError(f"{name} has unsupported dtype {t.dtype}")
    _check_common(q, k, v, q_name, "k", "v")


def _check_common(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_name: str, k_name: str,
                  v_name: str) -> None:
    """Dtypes, devices and heads of ``q [.., H, D]`` and ``k, v [.., H_kv, D]`` (each dtype
    already checked to be supported)."""
    fp8 = k.dtype in FP8_KV_DTYPES and q.dtype in FP8_Q_DTYPES
    if k.dtype != v.dtype or (k.dtype != q.dtype and not fp8):
        raise ValueError(f"{q_name}, {k_name}, {v_name} dtypes differ: {q.dtype}, {k.dtype}, "
                         f"{v.dtype} (k and v may be float8_e4m3fn beside fp16/bf16 queries; "
                         f"float8_e4m3fn queries need float8_e4m3fn k and v)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{q_name}, {k_name}, {v_name} devices differ: {q.device}, {k.device}, "
                         f"{v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{k_name} and {v_name} shapes differ: {tuple(k.shape)} vs "
                         f"{tuple(v.shape)}")
    num_heads, head_dim = q.shape[-2], q.shape[-1]
    num_kv_heads = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"head_dim of {q_name} ({head_dim}) and {k_name} ({k.shape[-1]}) differ")
    if not supported_head_dim(head_dim):
        raise ValueError(f"head_dim {head_dim} unsupported: must be in [1, {MAX_HEAD_DIM}]")
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


def check_paged_inputs(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
) -> None:
    """Shapes, dtypes and layout of a paged call; the batch is ``cu_seqlens_q``'s (prefill) or
    ``q``'s (decode, ``cu_seqlens_q`` None). Reads no values."""
    for name, t, dims in (("q", q, 3), ("k_pages", k_pages, 4), ("v_pages", v_pages, 4)):
        if t.dim() != dims:
            layout = ("[tokens, num_heads, head_dim]" if dims == 3 else
                      "[num_pages, page_tokens, num_kv_heads, head_dim]")
            raise ValueError(f"{name} must be {dims}-D {layout}, got shape {tuple(t.shape)}")
        if not _supported(t):
            raise ValueError(f"{name} has unsupported dtype {t.dtype}")
    _check_common(q, k_pages, v_pages, "q", "k_pages", "v_pages")
    if k_pages.shape[1] < 1:
        raise ValueError(f"page_tokens (k_pages.shape[1]) must be positive, got shape "
                         f"{tuple(k_pages.shape)}")
    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        # A copy would be of the whole pool on every call: the caller must lay pages out so.
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride along head_dim, got strides "
                             f"{t.stride()}")
    if cu_seqlens_q is None:
        batch = q.shape[0]
    else:
        _check_cu(cu_seqlens_q, "cu_seqlens_q", q.device)
        batch = cu_seqlens_q.shape[0] - 1
    if block_table.dtype != torch.int32:
        raise ValueError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be 2-D [batch={batch}, max_pages_per_seq], got shape "
                         f"{tuple(block_table.shape)}")
    if seqlens_k.dtype != torch.int32:
        raise ValueError(f"seqlens_k must be int32, got {seqlens_k.dtype}")
    if seqlens_k.dim() != 1 or seqlens_k.shape[0] != batch:
        raise ValueError(f"seqlens_k must be 1-D [batch={batch}], got shape "
                         f"{tuple(seqlens_k.shape)}")
    for name, t in (("block_table", block_table), ("seqlens_k", seqlens_k)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def check_kv_scales(k: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None, batch: int) -> bool:
    """FP8 K/V need float32 ``k_scale`` and ``v_scale`` on K's device, ``[num_kv_heads]`` (one
    per kv head) or ``[batch, num_kv_heads]`` (per sequence and kv head), both the same shape;
    other K/V take none. Returns whether K/V are FP8. Reads no values."""
    fp8 = k.dtype in FP8_KV_DTYPES
    if not fp8:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale are for float8_e4m3fn k and v; k is {k.dtype}")
        return False
    heads = k.shape[-2]
    shapes = ((heads,), (batch, heads))
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"{name} is required with float8_e4m3fn k and v (float32 "
                             f"[num_kv_heads={heads}], see attention_kernels.fp8)")
        if s.dtype != torch.float32 or tuple(s.shape) not in shapes:
            raise ValueError(f"{name} must be float32 [num_kv_heads={heads}] or [batch={batch}, "
                             f"num_kv_heads={heads}], got {s.dtype} {list(s.shape)}")
        if s.device != k.device:
            raise ValueError(f"{name} is on {s.device} but k is on {k.device}")
    assert k_scale is not None and v_scale is not None
    if k_scale.shape != v_scale.shape:
        raise ValueError(f"k_scale {list(k_scale.shape)} and v_scale {list(v_scale.shape)} "
                         "must have the same shape")
    return True


def check_query_scale(q: torch.Tensor, k: torch.Tensor, q_scale: torch.Tensor | None,
                      batch: int) -> bool:
    """float8_e4m3fn queries need a float32 ``q_scale`` on q's device, ``[num_kv_heads]`` or
    ``[batch, num_kv_heads]`` (FlashAttention-3's ``q_descale``: query head ``h`` takes kv
    head ``h // group``'s); other queries take none. Returns whether ``q`` is FP8."""
    if q.dtype not in FP8_KV_DTYPES:
        if q_scale is not None:
            raise ValueError(f"q_scale is for float8_e4m3fn q; q is {q.dtype}")
        return False
    heads = k.shape[-2]
    if q_scale is None:
        raise ValueError(f"q_scale is required with float8_e4m3fn q (float32 "
                         f"[num_kv_heads={heads}], see attention_kernels.fp8)")
    if q_scale.dtype != torch.float32 or tuple(q_scale.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"q_scale must be float32 [num_kv_heads={heads}] or [batch={batch}, "
                         f"num_kv_heads={heads}], got {q_scale.dtype} {list(q_scale.shape)}")
    if q_scale.device != q.device:
        raise ValueError(f"q_scale is on {q_scale.device} but q is on {q.device}")
    return True


def kv_scale_args(kv_scales: tuple[torch.Tensor, torch.Tensor] | None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:
    """The kernels' ``(KScale, VScale, stride_sb)``: the scale of (sequence ``b``, kv head
    ``g``) is at ``KScale + b * stride_sb + g`` (stride 0 for per-head scales)."""
    if kv_scales is None:
        return None, None, 0
    ks, vs = (s.contiguous() for s in kv_scales)
    return ks, vs, (ks.shape[1] if ks.dim() == 2 else 0)


def check_paged_values(block_table: torch.Tensor, seqlens_k: torch.Tensor, num_pages: int,
                       page_tokens: int) -> None:
    """Values check of a paged call (reads values: host): lengths in ``[0, table width *
    page_tokens]`` and every page a sequence uses in ``[0, num_pages)``."""
    lens = seqlens_k.to(device=block_table.device, dtype=torch.int64)
    width = block_table.shape[1]
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError("seqlens_k must be non-negative")
    if lens.numel() and int(lens.max()) > width * page_tokens:
        raise ValueError(f"seqlens_k has a length of {int(lens.max())} keys but block_table rows "
                         f"hold {width} pages of {page_tokens} tokens")
    pages_used = (lens + page_tokens - 1) // page_tokens
    pages = block_table[torch.arange(width, device=lens.device) < pages_used[:, None]]
    if pages.numel() and (int(pages.min()) < 0 or int(pages.max()) >= num_pages):
        raise ValueError(f"block_table names pages outside [0, {num_pages}) within a sequence's "
                         "length")


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


def check_outputs(out: torch.Tensor | None, lse_out: torch.Tensor | None, return_lse: bool,
                  out_shape: tuple[int, ...], lse_shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> None:
    """Caller-provided ``out`` (and ``lse_out``, read only with ``return_lse``) buffers."""
    if out is not None:
        output_buffer(out, out_shape, dtype, device, "out")
    if return_lse and lse_out is not None:
        output_buffer(lse_out, lse_shape, torch.float32, device, "lse_out")


def check_features(
    window_size: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    num_heads: int,
    batch: int,
    device: torch.device,
) -> tuple[int, int]:
    """Sliding window, softcap and ALiBi arguments (flash_attn's semantics); reads no values.
    Returns ``window_size`` as a plain ``(left, right)`` pair of ints.

    ``window_size``: two ints >= -1 (-1: unbounded on that side). ``softcap``: a finite number
    >= 0 (0: off). ``alibi_slopes``: None, or float32 ``[num_heads]`` or ``[batch, num_heads]``
    on the device of ``q``. Its values are trusted like ``cu_seqlens``' (a finiteness check is a
    sync on a GPU, and breaks CUDA-graph capture): the references check them
    (``check_alibi_values``)."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise ValueError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = int(window_size[0]), int(window_size[1])
    if left < -1 or right < -1:
        raise ValueError(f"window_size entries must be >= -1 (-1: unbounded), got "
                         f"{(left, right)}")
    if (not isinstance(softcap, (int, float)) or isinstance(softcap, bool)
            or not math.isfinite(softcap) or softcap < 0):
        raise ValueError(f"softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise ValueError(f"alibi_slopes must be a tensor or None, got "
                             f"{type(alibi_slopes).__name__}")
        if alibi_slopes.dtype != torch.float32:
            raise ValueError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((num_heads,), (batch, num_heads)):
            raise ValueError(f"alibi_slopes must be [num_heads={num_heads}] or [batch={batch}, "
                             f"num_heads={num_heads}], got shape {tuple(alibi_slopes.shape)}")
        if alibi_slopes.device != device:
            raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    return left, right


def check_alibi_values(alibi_slopes: torch.Tensor | None) -> None:
    """Values check of ``alibi_slopes`` (reads values: a sync for a GPU tensor)."""
    if alibi_slopes is not None and not bool(torch.isfinite(alibi_slopes).all()):
        raise ValueError("alibi_slopes must be finite")
