"""What the sync and async clients share: argument checks and request preparation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from attention_client._channel import call_metadata, channel_options, check_timeout, credentials
from attention_client._chunks import DEFAULT_CHUNK_BYTES, check_chunk_bytes
from attention_client._requests import PreparedRequest, prepare_decode, prepare_prefill
from attention_client._responses import ResponseAssembler


class ClientBase:
    """Holds the settings; subclasses own the channel and run the calls."""

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: Any = None,
        timeout: float | None = 60.0,
        max_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        options: Sequence[tuple[str, Any]] | None = None,
    ) -> None:
        self.target = target
        self.timeout = check_timeout(timeout)
        self.max_chunk_bytes = check_chunk_bytes(max_chunk_bytes)
        self._metadata = call_metadata(token)
        self._credentials = credentials(tls)
        self._options = channel_options(options)
        # RequestStats of the last call that completed (a dict), for benchmarks. With
        # concurrent calls on one client it is whichever finished last.
        self.last_stats: dict[str, Any] | None = None

    @staticmethod
    def _prepare_attention(
        q: Any,
        k: Any,
        v: Any,
        cu_seqlens: Any,
        cu_seqlens_k: Any,
        causal: bool,
        softmax_scale: float | None,
        return_lse: bool,
    ) -> PreparedRequest:
        return prepare_prefill(
            q, k, v, cu_seqlens, cu_seqlens_k,
            causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
        )

    @staticmethod
    def _prepare_decode(
        q: Any,
        k: Any,
        v: Any,
        cu_seqlens_k: Any,
        softmax_scale: float | None,
        num_splits: int,
        return_lse: bool,
    ) -> PreparedRequest:
        return prepare_decode(
            q, k, v, cu_seqlens_k,
            softmax_scale=softmax_scale, num_splits=num_splits, return_lse=return_lse,
        )

    @staticmethod
    def _assembler(prep: PreparedRequest) -> ResponseAssembler:
        return ResponseAssembler(prep.method, prep.out_shape, prep.out_dtype, prep.lse_shape)

    def _complete(self, prep: PreparedRequest, assembler: ResponseAssembler) -> Any:
        out, lse, stats = assembler.finish()
        self.last_stats = stats
        return prep.finish(out, lse)
