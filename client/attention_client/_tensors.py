"""Tensor codec: user arrays (numpy or torch) <-> little-endian row-major bytes on the wire.

torch is never imported here: a tensor is recognised through ``sys.modules`` (if torch is not
imported, the caller cannot hold a tensor), so the client works where torch is not installed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_client._errors import AttentionInputError
from attention_wire.pb import attention_pb2 as pb

# Storage dtype of each wire dtype. bfloat16 is held as int16 bits: numpy has no bfloat16 of its
# own, and torch can reinterpret int16 storage as bfloat16 with a free ``.view``.
_STORAGE = {
    pb.FLOAT16: np.dtype("<f2"),
    pb.BFLOAT16: np.dtype("<i2"),
    pb.FLOAT32: np.dtype("<f4"),
    pb.FLOAT8_E4M3: np.dtype("u1"),  # e4m3fn bits: keys and values only
}
QUERY_DTYPES = (pb.FLOAT16, pb.BFLOAT16, pb.FLOAT32)
FP8_QUERY_DTYPES = (pb.FLOAT16, pb.BFLOAT16)  # the query dtypes FP8 keys and values go with


def storage_dtype(wire_dtype: int) -> np.dtype:
    return _STORAGE[wire_dtype]


def dtype_name(wire_dtype: int) -> str:
    return pb.DType.Name(wire_dtype)


def result_flavour(x: Any, bfloat16: bool = False) -> tuple[Any, Any]:
    """The dtype and device a call's results take after the caller's tensor ``x`` (q's): a
    torch tensor's dtype and device, or a numpy array's dtype (little-endian) and None.
    ``bfloat16``: bfloat16 instead, the output of FP8 queries (torch's; numpy's from
    ml_dtypes, which the FP8 inputs came from)."""
    torch_x = is_torch_tensor(x)
    if bfloat16:
        if torch_x:
            import torch

            return torch.bfloat16, x.device
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16), None
    if torch_x:
        return x.dtype, x.device
    return (x.dtype.newbyteorder("<") if x.dtype.byteorder == ">" else x.dtype), None


@dataclass(frozen=True)
class WireTensor:
    """A C-contiguous little-endian array ready to be sent as raw bytes."""

    name: str
    array: np.ndarray
    dtype: int  # pb.DType

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def byte_view(self) -> memoryview:
        """The raw bytes without a copy (the array is contiguous)."""
        return memoryview(self.array.reshape(-1).view(np.uint8))

    def reshaped(self, shape: tuple[int, ...]) -> WireTensor:
        return WireTensor(self.name, self.array.reshape(shape), self.dtype)


@dataclass(frozen=True)
class RegionTensor:
    """A tensor the server reads from (or writes into) a registered region: no wire bytes."""

    name: str
    shape: tuple[int, ...]
    dtype: int  # pb.DType
    span: Any  # _regions.Span

    @property
    def nbytes(self) -> int:
        return int(self.span.nbytes)

    def byte_view(self) -> memoryview:
        return memoryview(b"")  # nothing to send

    def reshaped(self, shape: tuple[int, ...]) -> RegionTensor:
        return RegionTensor(self.name, shape, self.dtype, self.span)


def _torch_module() -> Any:
    return sys.modules.get("torch")


def is_torch_tensor(x: Any) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(x, torch.Tensor)


def is_4d(x: Any) -> bool:
    """Whether ``x`` is a [B, N, H, D] batch (what picks a call's 4-D argument names)."""
    return getattr(x, "ndim", 0) == 4


def _torch_wire_dtype(x: Any, name: str) -> int:
    torch = _torch_module()
    wire = {torch.float16: pb.FLOAT16, torch.bfloat16: pb.BFLOAT16, torch.float32: pb.FLOAT32,
            torch.float8_e4m3fn: pb.FLOAT8_E4M3}
    if x.dtype not in wire:
        raise AttentionInputError(
            f"{name} has unsupported dtype {x.dtype}: use float16, bfloat16 or float32 "
            "(float8_e4m3fn for keys and values)"
        )
    return wire[x.dtype]


def _numpy_wire_dtype(x: np.ndarray, name: str) -> int:
    if x.dtype.kind == "f" and x.dtype.itemsize == 2:
        return pb.FLOAT16
    if x.dtype.kind == "f" and x.dtype.itemsize == 4:
        return pb.FLOAT32
    # ml_dtypes' types (only present if ml_dtypes is loaded).
    if x.dtype.name == "bfloat16":
        return pb.BFLOAT16
    if x.dtype.name == "float8_e4m3fn":
        return pb.FLOAT8_E4M3
    raise AttentionInputError(
        f"{name} has unsupported dtype {x.dtype}: use float16, float32 or bfloat16 (ml_dtypes; "
        "float8_e4m3fn for keys and values)"
    )


_DTYPE_NAMES = {
    "float16": pb.FLOAT16, "half": pb.FLOAT16, "fp16": pb.FLOAT16,
    "bfloat16": pb.BFLOAT16, "bf16": pb.BFLOAT16,
    "float32": pb.FLOAT32, "float": pb.FLOAT32, "fp32": pb.FLOAT32,
    "float8_e4m3fn": pb.FLOAT8_E4M3, "float8_e4m3": pb.FLOAT8_E4M3, "fp8": pb.FLOAT8_E4M3,
    "e4m3": pb.FLOAT8_E4M3,
}


def as_wire_dtype(dtype: Any, name: str = "dtype") -> int:
    """A dtype given as a numpy dtype (or type), a torch dtype, or a name ("float16",
    "bfloat16", "float32", or the wire's "FLOAT16" ...) -> its pb.DType."""
    torch = _torch_module()
    if torch is not None and isinstance(dtype, torch.dtype):
        return _torch_wire_dtype(torch.empty(0, dtype=dtype), name)
    if isinstance(dtype, str):
        wire = _DTYPE_NAMES.get(dtype.lower().removeprefix("torch."))
        if wire is None:
            raise AttentionInputError(
                f"{name} {dtype!r} unsupported: use float16, bfloat16 or float32 (or "
                "float8_e4m3fn for keys and values)"
            )
        return wire
    try:
        np_dtype = np.dtype(dtype)
    except TypeError:
        raise AttentionInputError(
            f"{name} must be a numpy or torch dtype or a name like 'float16', got {dtype!r}"
        ) from None
    return _numpy_wire_dtype(np.empty(0, np_dtype), name)


def describe(x: Any, name: str) -> tuple[tuple[int, ...], int]:
    """Shape and wire dtype of a user tensor, without touching its bytes."""
    if is_torch_tensor(x):
        return tuple(x.shape), _torch_wire_dtype(x, name)
    if isinstance(x, np.ndarray):
        return tuple(x.shape), _numpy_wire_dtype(x, name)
    raise AttentionInputError(
        f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}"
    )


def _from_torch(x: Any, name: str) -> WireTensor:
    torch = _torch_module()
    wire_dtype = _torch_wire_dtype(x, name)
    t = x.detach().contiguous()
    if t.device.type != "cpu":
        # Into pinned memory (torch caches pinned blocks, so repeat calls reuse them): the DMA
        # runs at full PCIe speed, where ``.cpu()`` stages through pageable memory and pays
        # fresh page faults for every new buffer.
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)  # blocking: the bytes are complete when this returns
        t = host
    bits = torch_bits(x.dtype)
    if bits is not x.dtype:
        t = t.view(bits)  # numpy cannot hold bfloat16 or float8; the bits are what we send
    return WireTensor(name, t.numpy(), wire_dtype)


def torch_bits(dtype: Any) -> Any:
    """The torch dtype a tensor of ``dtype`` is viewed as for numpy: bfloat16 as int16,
    float8_e4m3fn as uint8 (the bits), any other as it is."""
    torch = _torch_module()
    return {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}.get(dtype, dtype)


def _from_numpy(x: np.ndarray, name: str) -> WireTensor:
    wire = _numpy_wire_dtype(x, name)
    if x.dtype.byteorder == ">":
        x = x.astype(x.dtype.newbyteorder("<"))
    x = np.ascontiguousarray(x)  # no copy when already C-contiguous
    if wire == pb.BFLOAT16:
        x = x.view(np.int16)
    elif wire == pb.FLOAT8_E4M3:
        x = x.view(np.uint8)
    return WireTensor(name, x, wire)


def to_wire(x: Any, name: str) -> WireTensor:
    """Encode one user tensor; raises AttentionInputError naming ``name`` for unsupported inputs."""
    if is_torch_tensor(x):
        return _from_torch(x, name)
    if isinstance(x, np.ndarray):
        return _from_numpy(x, name)
    raise AttentionInputError(
        f"{name} must be a numpy array or a torch tensor, got {type(x).__name__}"
    )


def to_user(storage: Any, dtype: Any, device: Any, *, is_lse: bool = False) -> Any:
    """Give a received array back in the caller's flavour (``result_flavour``: ``dtype``, and
    ``device`` None for numpy, a torch device for torch). ``storage`` is a numpy array of the
    wire's storage dtype, or (a CUDA region's output) a torch tensor of it; it becomes the
    result without a copy where the flavour allows."""
    if device is None:
        return storage if is_lse else storage.view(dtype)
    import torch  # present: the caller passed a tensor

    t = storage if isinstance(storage, torch.Tensor) else torch.from_numpy(storage)
    if not is_lse and dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    if device.type != "cpu":
        t = t.to(device)
    return t


def as_cu_seqlens(x: Any, name: str) -> np.ndarray:
    """Accept a list, numpy array or torch tensor of integers; return int32 ``[batch + 1]``."""
    if is_torch_tensor(x):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1 or arr.shape[0] < 1:
        raise AttentionInputError(f"{name} must be 1-D with batch+1 entries, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise AttentionInputError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        raise AttentionInputError(f"{name} values must fit in int32")
    return arr.astype(np.int32, copy=False)


def real_number(x: Any) -> bool:
    """A Python int or float, a numpy integer or floating scalar, or a 0-d numpy array or torch
    tensor of such a dtype; never a bool, a string or a bytes-like object."""
    if isinstance(x, bool):
        return False
    if isinstance(x, (int, float, np.integer, np.floating)):
        return True
    if is_torch_tensor(x):
        return x.ndim == 0 and not x.dtype.is_complex and str(x.dtype) != "torch.bool"
    return isinstance(x, np.ndarray) and x.ndim == 0 and x.dtype.kind in "iuf"
