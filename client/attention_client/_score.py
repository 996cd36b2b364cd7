"""flash_attn's score modifiers as the client takes them (``window_size``, ``softcap``,
``alibi_slopes``), checked here and sent as the header's ``ScoreOptions``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from attention_client._errors import AttentionInputError
from attention_client._tensors import real_number
from attention_wire.pb import attention_pb2 as pb

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
