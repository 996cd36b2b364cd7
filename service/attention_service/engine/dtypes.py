"""Wire dtype enum <-> torch dtype: a leaf every engine layer can import (the pool, the launch
paths, the backends, the warm-up), so none of them needs another for it."""

from __future__ import annotations

import torch

from attention_wire.pb import attention_pb2 as pb

TORCH_DTYPES: dict[int, torch.dtype] = {
    pb.FLOAT16: torch.float16, pb.BFLOAT16: torch.bfloat16, pb.FLOAT32: torch.float32,
    pb.FLOAT8_E4M3: torch.float8_e4m3fn,
}
WIRE_DTYPES: dict[torch.dtype, int] = {v: k for k, v in TORCH_DTYPES.items()}
