"""One large stateless call spread over several connections (``stripes=``).

A Python gRPC stream moves about 1 GB/s, on the client and in the server process that holds
its connection alike, so one large call from one client waits on one process on each side
however many front ends the server runs. Attention is independent per kv-head group (a group
is a kv head and the query heads that read it), so such a call splits, exactly, into calls
over disjoint groups: each carries its share of q, k and v, runs as an ordinary request (the
server needs no support for it; the engine may even merge the parts into one launch), and the
outputs join along the head axis. The parts go out at once over different connections, which
the server's front ends take in parallel (SO_REUSEPORT spreads connections over them).

Only what splits without any change in meaning is split: ``q`` / ``k`` / ``v`` as
``[..., heads, head_dim]`` with ``heads % kv_heads == 0``; ALiBi slopes and FP8 scales per
head slice with their heads. Anything else (inputs the server would refuse, tensors in
registered regions, ``out=``) goes as one call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from attention_client._requests import KvScales, ScoreMods, scale_rows
from attention_client._tensors import is_torch_tensor

# Smaller calls go whole: below about this much, the extra call's set-up (about 0.3-0.5 ms
# of client and server CPU) outweighs the transfer time saved at ~1 GB/s per stream.
STRIPE_MIN_BYTES = 4 * 1024 * 1024
MAX_STRIPES = 64


class Part(NamedTuple):
    q_heads: slice
    kv_heads: slice


def _nbytes(x: Any) -> int:
    if is_torch_tensor(x):
        return int(x.numel()) * int(x.element_size())
    return int(x.nbytes)


def _shape(x: Any) -> tuple[int, ...] | None:
    if is_torch_tensor(x) or isinstance(x, np.ndarray):
        return tuple(int(n) for n in x.shape)
    return None


def plan(
    q: Any, k: Any, v: Any, stripes: int, score: ScoreMods | None,
    kv_scales: KvScales | None, min_bytes: int | None = None,
) -> list[Part] | None:
    """The parts of a call split into ``stripes`` kv-head groups (fewer when there are fewer
    kv heads), or None when it goes whole: one stripe, a small request, or inputs that do not
    split cleanly (the whole call then reports what is wrong with them)."""
    if stripes < 2:
        return None
    shapes = [_shape(x) for x in (q, k, v)]
    if any(s is None or len(s) not in (3, 4) or len(s) != len(shapes[0]) for s in shapes):
        return None
    sq, sk, sv = shapes
    assert sq is not None and sk is not None and sv is not None
    heads, kv_heads = sq[-2], sk[-2]
    if sv[-2] != kv_heads or kv_heads < 2 or heads % kv_heads:
        return None
    if sum(_nbytes(x) for x in (q, k, v)) < (STRIPE_MIN_BYTES if min_bytes is None
                                             else min_bytes):
        return None
    if kv_scales is not None and any(
            any(len(r) != kv_heads for r in s) if scale_rows(s) else len(s) != kv_heads
            for s in kv_scales):
        return None
    if score is not None and score.slopes is not None and (
            score.slopes.ndim not in (1, 2) or score.slopes.shape[-1] != heads):
        return None
    count = min(stripes, kv_heads)
    ratio = heads // kv_heads
    parts, start = [], 0
    for i in range(count):
        n = kv_heads // count + (i < kv_heads % count)
        parts.append(Part(slice(ratio * start, ratio * (start + n)), slice(start, start + n)))
        start += n
    return parts


def _heads(x: Any, heads: slice) -> Any:
    return x[..., heads, :]


def part_inputs(
    part: Part, q: Any, k: Any, v: Any, score: ScoreMods | None, kv_scales: KvScales | None,
) -> tuple[Any, Any, Any, ScoreMods | None, KvScales | None]:
    """One part's q, k, v (views: the request encoder makes them contiguous), score options
    and FP8 scales."""
    if score is not None and score.slopes is not None:
        slopes = np.ascontiguousarray(score.slopes[..., part.q_heads])
        score = dataclasses.replace(score, slopes=slopes)
    if kv_scales is not None:
        kv_scales = tuple(tuple(r[part.kv_heads] for r in s) if scale_rows(s)
                          else s[part.kv_heads] for s in kv_scales)
    return (_heads(q, part.q_heads), _heads(k, part.kv_heads), _heads(v, part.kv_heads),
            score, kv_scales)


def lanes(base: int, parts: int, channels: int) -> list[int]:
    """The connection of each part: consecutive from ``base``, so distinct while there are
    at least as many connections as parts (the client keeps ``channels >= stripes``)."""
    return [(base + i) % channels for i in range(parts)]


def caller_stream(x: Any) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """A context that runs a part on the stream the caller has current for ``x``'s device: a
    part on another thread then reads ``x`` after the caller's pending work on it, as the whole
    call would, and its result is allocated on that stream (nothing for host tensors)."""
    if not is_torch_tensor(x) or x.device.type != "cuda":
        return contextlib.nullcontext
    import torch

    stream = torch.cuda.current_stream(x.device)
    return lambda: torch.cuda.stream(stream)


# RequestStats fields that add up over the parts; the others are per launch (the longest
# part's times, the largest launch).
_SUMMED = ("bytes_in", "bytes_out", "flops", "region_bytes_in", "region_bytes_out")


def merge_stats(stats: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """A striped call's RequestStats: bytes and flops summed over its parts, the rest (queue,
    copy and kernel seconds, batch size and tokens) the largest part's."""
    known = [s for s in stats if s is not None]
    if not known:
        return None
    merged = dict(known[0])
    for s in known[1:]:
        for key, value in s.items():
            if key in _SUMMED:
                merged[key] += value
            elif isinstance(value, int | float):
                merged[key] = max(merged[key], value)
    return merged


def join(results: Sequence[Any], return_lse: bool, lse_axis: int) -> Any:
    """The parts' results (``out`` or ``(out, lse)``, in head order) as the whole call's:
    ``out`` joins along its head axis (-2), ``lse`` along ``lse_axis``."""
    def cat(xs: Sequence[Any], axis: int) -> Any:
        if is_torch_tensor(xs[0]):
            import torch

            return torch.cat(list(xs), dim=axis)
        return np.concatenate(xs, axis=axis)

    if not return_lse:
        return cat(results, -2)
    return cat([r[0] for r in results], -2), cat([r[1] for r in results], lse_axis)
