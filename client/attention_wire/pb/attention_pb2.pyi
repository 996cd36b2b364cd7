from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT8_E4M3: _ClassVar[DType]

class InputField(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INPUT_FIELD_UNSPECIFIED: _ClassVar[InputField]
    Q: _ClassVar[InputField]
    K: _ClassVar[InputField]
    V: _ClassVar[InputField]

class OutputField(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_FIELD_UNSPECIFIED: _ClassVar[OutputField]
    OUT: _ClassVar[OutputField]
    LSE: _ClassVar[OutputField]
DTYPE_UNSPECIFIED: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT32: DType
FLOAT8_E4M3: DType
INPUT_FIELD_UNSPECIFIED: InputField
Q: InputField
K: InputField
V: InputField
OUTPUT_FIELD_UNSPECIFIED: OutputField
OUT: OutputField
LSE: OutputField

class KvScales(_message.Message):
    __slots__ = ("k", "v", "q")
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    k: _containers.RepeatedScalarFieldContainer[float]
    v: _containers.RepeatedScalarFieldContainer[float]
    q: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, k: _Optional[_Iterable[float]] = ..., v: _Optional[_Iterable[float]] = ..., q: _Optional[_Iterable[float]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("field", "offset", "data", "padding")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    field: InputField
    offset: int
    data: bytes
    padding: bytes
    def __init__(self, field: _Optional[_Union[InputField, str]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., padding: _Optional[bytes] = ...) -> None: ...

class RegionSpan(_message.Message):
    __slots__ = ("region", "offset", "byte_size")
    REGION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    region: str
    offset: int
    byte_size: int
    def __init__(self, region: _Optional[str] = ..., offset: _Optional[int] = ..., byte_size: _Optional[int] = ...) -> None: ...

class TensorRegions(_message.Message):
    __slots__ = ("q", "k", "v", "out", "lse")
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    q: RegionSpan
    k: RegionSpan
    v: RegionSpan
    out: RegionSpan
    lse: RegionSpan
    def __init__(self, q: _Optional[_Union[RegionSpan, _Mapping]] = ..., k: _Optional[_Union[RegionSpan, _Mapping]] = ..., v: _Optional[_Union[RegionSpan, _Mapping]] = ..., out: _Optional[_Union[RegionSpan, _Mapping]] = ..., lse: _Optional[_Union[RegionSpan, _Mapping]] = ...) -> None: ...

class CacheTarget(_message.Message):
    __slots__ = ("cache_ids", "store")
    CACHE_IDS_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    cache_ids: _containers.RepeatedScalarFieldContainer[str]
    store: bool
    def __init__(self, cache_ids: _Optional[_Iterable[str]] = ..., store: _Optional[bool] = ...) -> None: ...

class ScoreOptions(_message.Message):
    __slots__ = ("window_left", "window_right", "softcap", "alibi_slopes")
    WINDOW_LEFT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_RIGHT_FIELD_NUMBER: _ClassVar[int]
    SOFTCAP_FIELD_NUMBER: _ClassVar[int]
    ALIBI_SLOPES_FIELD_NUMBER: _ClassVar[int]
    window_left: int
    window_right: int
    softcap: float
    alibi_slopes: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, window_left: _Optional[int] = ..., window_right: _Optional[int] = ..., softcap: _Optional[float] = ..., alibi_slopes: _Optional[_Iterable[float]] = ...) -> None: ...

class PrefillHeader(_message.Message):
    __slots__ = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "causal", "softmax_scale", "return_lse", "regions", "cache", "score", "kv_scales")
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    CU_SEQLENS_Q_FIELD_NUMBER: _ClassVar[int]
    CU_SEQLENS_K_FIELD_NUMBER: _ClassVar[int]
    CAUSAL_FIELD_NUMBER: _ClassVar[int]
    SOFTMAX_SCALE_FIELD_NUMBER: _ClassVar[int]
    RETURN_LSE_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    cu_seqlens_q: _containers.RepeatedScalarFieldContainer[int]
    cu_seqlens_k: _containers.RepeatedScalarFieldContainer[int]
    causal: bool
    softmax_scale: float
    return_lse: bool
    regions: TensorRegions
    cache: CacheTarget
    score: ScoreOptions
    kv_scales: KvScales
    def __init__(self, q: _Optional[_Union[TensorSpec, _Mapping]] = ..., k: _Optional[_Union[TensorSpec, _Mapping]] = ..., v: _Optional[_Union[TensorSpec, _Mapping]] = ..., cu_seqlens_q: _Optional[_Iterable[int]] = ..., cu_seqlens_k: _Optional[_Iterable[int]] = ..., causal: _Optional[bool] = ..., softmax_scale: _Optional[float] = ..., return_lse: _Optional[bool] = ..., regions: _Optional[_Union[TensorRegions, _Mapping]] = ..., cache: _Optional[_Union[CacheTarget, _Mapping]] = ..., score: _Optional[_Union[ScoreOptions, _Mapping]] = ..., kv_scales: _Optional[_Union[KvScales, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("header", "chunks", "step_timeout_ms")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    header: PrefillHeader
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    step_timeout_ms: int
    def __init__(self, header: _Optional[_Union[PrefillHeader, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., step_timeout_ms: _Optional[int] = ...) -> None: ...

class DecodeHeader(_message.Message):
    __slots__ = ("q", "k", "v", "cu_seqlens_k", "softmax_scale", "num_splits", "return_lse", "regions", "cache", "score", "kv_scales")
    Q_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    CU_SEQLENS_K_FIELD_NUMBER: _ClassVar[int]
    SOFTMAX_SCALE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPLITS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LSE_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    cu_seqlens_k: _containers.RepeatedScalarFieldContainer[int]
    softmax_scale: float
    num_splits: int
    return_lse: bool
    regions: TensorRegions
    cache: CacheTarget
    score: ScoreOptions
    kv_scales: KvScales
    def __init__(self, q: _Optional[_Union[TensorSpec, _Mapping]] = ..., k: _Optional[_Union[TensorSpec, _Mapping]] = ..., v: _Optional[_Union[TensorSpec, _Mapping]] = ..., cu_seqlens_k: _Optional[_Iterable[int]] = ..., softmax_scale: _Optional[float] = ..., num_splits: _Optional[int] = ..., return_lse: _Optional[bool] = ..., regions: _Optional[_Union[TensorRegions, _Mapping]] = ..., cache: _Optional[_Union[CacheTarget, _Mapping]] = ..., score: _Optional[_Union[ScoreOptions, _Mapping]] = ..., kv_scales: _Optional[_Union[KvScales, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("header", "chunks", "step_timeout_ms")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    header: DecodeHeader
    chunks: _containers.RepeatedCompositeFieldContainer[TensorChunk]
    step_timeout_ms: int
    def __init__(self, header: _Optional[_Union[DecodeHeader, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[TensorChunk, _Mapping]]] = ..., step_timeout_ms: _Optional[int] = ...) -> None: ...

class OutputChunk(_message.Message):
    __slots__ = ("field", "spec", "row_start", "row_count", "data")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    field: OutputField
    spec: TensorSpec
    row_start: int
    row_count: int
    data: bytes
    def __init__(self, field: _Optional[_Union[OutputField, str]] = ..., spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., row_start: _Optional[int] = ..., row_count: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("queue_seconds", "h2d_seconds", "kernel_seconds", "d2h_seconds", "bytes_in", "bytes_out", "flops", "batch_requests", "batch_tokens", "region_bytes_in", "region_bytes_out", "cache_lengths")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    H2D_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    D2H_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    h2d_seconds: float
    kernel_seconds: float
    d2h_seconds: float
    bytes_in: int
    bytes_out: int
    flops: float
    batch_requests: int
    batch_tokens: int
    region_bytes_in: int
    region_bytes_out: int
    cache_lengths: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, queue_seconds: _Optional[float] = ..., h2d_seconds: _Optional[float] = ..., kernel_seconds: _Optional[float] = ..., d2h_seconds: _Optional[float] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., flops: _Optional[float] = ..., batch_requests: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., region_bytes_in: _Optional[int] = ..., region_bytes_out: _Optional[int] = ..., cache_lengths: _Optional[_Iterable[int]] = ...) -> None: ...

class AttentionResponse(_message.Message):
    __slots__ = ("chunk", "stats")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    chunk: OutputChunk
    stats: RequestStats
    def __init__(self, chunk: _Optional[_Union[OutputChunk, _Mapping]] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ...) -> None: ...

class AttentionResult(_message.Message):
    __slots__ = ("chunks", "stats", "error")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[OutputChunk]
    stats: RequestStats
    error: CallError
    def __init__(self, chunks: _Optional[_Iterable[_Union[OutputChunk, _Mapping]]] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ("connections",)
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    connections: bool
    def __init__(self, connections: _Optional[bool] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("device", "backend", "dtypes", "head_dims", "max_request_bytes", "chunk_bytes", "max_message_bytes", "server_version", "torch_version", "triton_version", "cuda_version", "batching", "regions", "frontends", "kv_cache_bytes", "kv_page_bytes", "max_regions_per_caller", "system_region_bytes_per_caller", "frontend", "frontend_connections", "fewest_frontend_connections", "nixl", "nixl_backend", "steps_in_flight", "gpu_region_bytes_per_caller", "step_socket", "instance_id", "nixl_transports")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIMS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TORCH_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRITON_VERSION_FIELD_NUMBER: _ClassVar[int]
    CUDA_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    FRONTENDS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REGIONS_PER_CALLER_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_REGION_BYTES_PER_CALLER_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_FIELD_NUMBER: _ClassVar[int]
    FRONTEND_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    FEWEST_FRONTEND_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    NIXL_BACKEND_FIELD_NUMBER: _ClassVar[int]
    STEPS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    GPU_REGION_BYTES_PER_CALLER_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NIXL_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    device: str
    backend: str
    dtypes: _containers.RepeatedScalarFieldContainer[DType]
    head_dims: _containers.RepeatedScalarFieldContainer[int]
    max_request_bytes: int
    chunk_bytes: int
    max_message_bytes: int
    server_version: str
    torch_version: str
    triton_version: str
    cuda_version: str
    batching: bool
    regions: bool
    frontends: int
    kv_cache_bytes: int
    kv_page_bytes: int
    max_regions_per_caller: int
    system_region_bytes_per_caller: int
    frontend: int
    frontend_connections: int
    fewest_frontend_connections: int
    nixl: bool
    nixl_backend: str
    steps_in_flight: int
    gpu_region_bytes_per_caller: int
    step_socket: str
    instance_id: str
    nixl_transports: _containers.RepeatedCompositeFieldContainer[NixlTransport]
    def __init__(self, device: _Optional[str] = ..., backend: _Optional[str] = ..., dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., head_dims: _Optional[_Iterable[int]] = ..., max_request_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., server_version: _Optional[str] = ..., torch_version: _Optional[str] = ..., triton_version: _Optional[str] = ..., cuda_version: _Optional[str] = ..., batching: _Optional[bool] = ..., regions: _Optional[bool] = ..., frontends: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., kv_page_bytes: _Optional[int] = ..., max_regions_per_caller: _Optional[int] = ..., system_region_bytes_per_caller: _Optional[int] = ..., frontend: _Optional[int] = ..., frontend_connections: _Optional[int] = ..., fewest_frontend_connections: _Optional[int] = ..., nixl: _Optional[bool] = ..., nixl_backend: _Optional[str] = ..., steps_in_flight: _Optional[int] = ..., gpu_region_bytes_per_caller: _Optional[int] = ..., step_socket: _Optional[str] = ..., instance_id: _Optional[str] = ..., nixl_transports: _Optional[_Iterable[_Union[NixlTransport, _Mapping]]] = ...) -> None: ...

class NixlTransport(_message.Message):
    __slots__ = ("peer", "op", "local_memory", "remote_memory", "transport")
    PEER_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_MEMORY_FIELD_NUMBER: _ClassVar[int]
    REMOTE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    peer: str
    op: str
    local_memory: str
    remote_memory: str
    transport: str
    def __init__(self, peer: _Optional[str] = ..., op: _Optional[str] = ..., local_memory: _Optional[str] = ..., remote_memory: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class SystemRegion(_message.Message):
    __slots__ = ("key", "offset")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class CudaRegion(_message.Message):
    __slots__ = ("ipc_handle", "device_uuid", "offset")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    device_uuid: bytes
    offset: int
    def __init__(self, ipc_handle: _Optional[bytes] = ..., device_uuid: _Optional[bytes] = ..., offset: _Optional[int] = ...) -> None: ...

class ConnectNixlRequest(_message.Message):
    __slots__ = ("agent_name", "agent_metadata")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ...) -> None: ...

class ConnectNixlResponse(_message.Message):
    __slots__ = ("server_agent", "backend")
    SERVER_AGENT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    server_agent: str
    backend: str
    def __init__(self, server_agent: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class NixlRegion(_message.Message):
    __slots__ = ("agent_metadata", "address", "memory", "device_id", "agent_name")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    address: int
    memory: str
    device_id: int
    agent_name: str
    def __init__(self, agent_metadata: _Optional[bytes] = ..., address: _Optional[int] = ..., memory: _Optional[str] = ..., device_id: _Optional[int] = ..., agent_name: _Optional[str] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("name", "byte_size", "system", "cuda", "nixl")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    name: str
    byte_size: int
    system: SystemRegion
    cuda: CudaRegion
    nixl: NixlRegion
    def __init__(self, name: _Optional[str] = ..., byte_size: _Optional[int] = ..., system: _Optional[_Union[SystemRegion, _Mapping]] = ..., cuda: _Optional[_Union[CudaRegion, _Mapping]] = ..., nixl: _Optional[_Union[NixlRegion, _Mapping]] = ...) -> None: ...

class RegionInfo(_message.Message):
    __slots__ = ("name", "kind", "byte_size", "inflight")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    byte_size: int
    inflight: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., byte_size: _Optional[int] = ..., inflight: _Optional[int] = ...) -> None: ...

class UnregisterRegionRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnregisterRegionResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class ListRegionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRegionsResponse(_message.Message):
    __slots__ = ("regions",)
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    regions: _containers.RepeatedCompositeFieldContainer[RegionInfo]
    def __init__(self, regions: _Optional[_Iterable[_Union[RegionInfo, _Mapping]]] = ...) -> None: ...

class CacheLayout(_message.Message):
    __slots__ = ("dtype", "num_kv_heads", "head_dim", "kv_dtype", "kv_scales")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_SCALES_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    num_kv_heads: int
    head_dim: int
    kv_dtype: DType
    kv_scales: KvScales
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_dtype: _Optional[_Union[DType, str]] = ..., kv_scales: _Optional[_Union[KvScales, _Mapping]] = ...) -> None: ...

class CreateCachesRequest(_message.Message):
    __slots__ = ("cache_ids", "layout")
    CACHE_IDS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    cache_ids: _containers.RepeatedScalarFieldContainer[str]
    layout: CacheLayout
    def __init__(self, cache_ids: _Optional[_Iterable[str]] = ..., layout: _Optional[_Union[CacheLayout, _Mapping]] = ...) -> None: ...

class CreateCachesResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: int
    def __init__(self, created: _Optional[int] = ...) -> None: ...

class ReleaseCachesRequest(_message.Message):
    __slots__ = ("cache_ids", "all")
    CACHE_IDS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    cache_ids: _containers.RepeatedScalarFieldContainer[str]
    all: bool
    def __init__(self, cache_ids: _Optional[_Iterable[str]] = ..., all: _Optional[bool] = ...) -> None: ...

class ReleaseCachesResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class ForkCacheRequest(_message.Message):
    __slots__ = ("source_id", "target_id", "length")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    source_id: str
    target_id: str
    length: int
    def __init__(self, source_id: _Optional[str] = ..., target_id: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("cache_id", "layout", "length", "pages", "shared_pages", "idle_seconds", "busy")
    CACHE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SHARED_PAGES_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    cache_id: str
    layout: CacheLayout
    length: int
    pages: int
    shared_pages: int
    idle_seconds: float
    busy: bool
    def __init__(self, cache_id: _Optional[str] = ..., layout: _Optional[_Union[CacheLayout, _Mapping]] = ..., length: _Optional[int] = ..., pages: _Optional[int] = ..., shared_pages: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., busy: _Optional[bool] = ...) -> None: ...

class KvPoolInfo(_message.Message):
    __slots__ = ("page_bytes", "pages_total", "pages_used", "pages_free", "caches_live", "ttl_seconds", "caller_pages_used", "caller_pages_limit", "caller_caches")
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREE_FIELD_NUMBER: _ClassVar[int]
    CACHES_LIVE_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CALLER_PAGES_USED_FIELD_NUMBER: _ClassVar[int]
    CALLER_PAGES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    CALLER_CACHES_FIELD_NUMBER: _ClassVar[int]
    page_bytes: int
    pages_total: int
    pages_used: int
    pages_free: int
    caches_live: int
    ttl_seconds: float
    caller_pages_used: int
    caller_pages_limit: int
    caller_caches: int
    def __init__(self, page_bytes: _Optional[int] = ..., pages_total: _Optional[int] = ..., pages_used: _Optional[int] = ..., pages_free: _Optional[int] = ..., caches_live: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., caller_pages_used: _Optional[int] = ..., caller_pages_limit: _Optional[int] = ..., caller_caches: _Optional[int] = ...) -> None: ...

class ListCachesRequest(_message.Message):
    __slots__ = ("cache_ids", "page_size", "page_token", "pool_only")
    CACHE_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    POOL_ONLY_FIELD_NUMBER: _ClassVar[int]
    cache_ids: _containers.RepeatedScalarFieldContainer[str]
    page_size: int
    page_token: str
    pool_only: bool
    def __init__(self, cache_ids: _Optional[_Iterable[str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., pool_only: _Optional[bool] = ...) -> None: ...

class ListCachesResponse(_message.Message):
    __slots__ = ("caches", "pool", "next_page_token")
    CACHES_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    caches: _containers.RepeatedCompositeFieldContainer[CacheInfo]
    pool: KvPoolInfo
    next_page_token: str
    def __init__(self, caches: _Optional[_Iterable[_Union[CacheInfo, _Mapping]]] = ..., pool: _Optional[_Union[KvPoolInfo, _Mapping]] = ..., next_page_token: _Optional[str] = ...) -> None: ...
