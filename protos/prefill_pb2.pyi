from protos import common_pb2 as _common_pb2
from protos import transfer_pb2 as _transfer_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransportKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_KIND_UNSPECIFIED: _ClassVar[TransportKind]
    TRANSPORT_KIND_NIXL: _ClassVar[TransportKind]
    TRANSPORT_KIND_GRPC: _ClassVar[TransportKind]
    TRANSPORT_KIND_INPROC: _ClassVar[TransportKind]

class PrefillStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_STATUS_UNSPECIFIED: _ClassVar[PrefillStatus]
    PREFILL_STATUS_OK: _ClassVar[PrefillStatus]
    PREFILL_STATUS_ABORTED: _ClassVar[PrefillStatus]
    PREFILL_STATUS_TRANSFER_FAILED: _ClassVar[PrefillStatus]
    PREFILL_STATUS_LAYOUT_MISMATCH: _ClassVar[PrefillStatus]
    PREFILL_STATUS_TIMEOUT: _ClassVar[PrefillStatus]
    PREFILL_STATUS_ERROR: _ClassVar[PrefillStatus]
    PREFILL_STATUS_STALE_HANDSHAKE: _ClassVar[PrefillStatus]
TRANSPORT_KIND_UNSPECIFIED: TransportKind
TRANSPORT_KIND_NIXL: TransportKind
TRANSPORT_KIND_GRPC: TransportKind
TRANSPORT_KIND_INPROC: TransportKind
PREFILL_STATUS_UNSPECIFIED: PrefillStatus
PREFILL_STATUS_OK: PrefillStatus
PREFILL_STATUS_ABORTED: PrefillStatus
PREFILL_STATUS_TRANSFER_FAILED: PrefillStatus
PREFILL_STATUS_LAYOUT_MISMATCH: PrefillStatus
PREFILL_STATUS_TIMEOUT: PrefillStatus
PREFILL_STATUS_ERROR: PrefillStatus
PREFILL_STATUS_STALE_HANDSHAKE: PrefillStatus

class HandshakeRequest(_message.Message):
    __slots__ = ("kv_layout", "layout_hash", "worker_id", "transports")
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    kv_layout: _common_pb2.KVLayout
    layout_hash: int
    worker_id: str
    transports: _containers.RepeatedScalarFieldContainer[TransportKind]
    def __init__(self, kv_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., layout_hash: _Optional[int] = ..., worker_id: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[TransportKind, str]]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("compatible", "error", "kv_layout", "layout_hash", "worker_id", "transports", "kv_epoch")
    COMPATIBLE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    KV_EPOCH_FIELD_NUMBER: _ClassVar[int]
    compatible: bool
    error: str
    kv_layout: _common_pb2.KVLayout
    layout_hash: int
    worker_id: str
    transports: _containers.RepeatedScalarFieldContainer[TransportKind]
    kv_epoch: int
    def __init__(self, compatible: _Optional[bool] = ..., error: _Optional[str] = ..., kv_layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., layout_hash: _Optional[int] = ..., worker_id: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[TransportKind, str]]] = ..., kv_epoch: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "num_cached_on_decode", "dst_block_ids", "transfer_id", "endpoint", "lease_seconds", "timeout_seconds", "kv_epoch", "session_id", "session_ttl_seconds", "session_end", "src_block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_ON_DECODE_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_END_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    num_cached_on_decode: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    transfer_id: str
    endpoint: _transfer_pb2.TransferEndpoint
    lease_seconds: float
    timeout_seconds: float
    kv_epoch: int
    session_id: str
    session_ttl_seconds: float
    session_end: bool
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., num_cached_on_decode: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., transfer_id: _Optional[str] = ..., endpoint: _Optional[_Union[_transfer_pb2.TransferEndpoint, _Mapping]] = ..., lease_seconds: _Optional[float] = ..., timeout_seconds: _Optional[float] = ..., kv_epoch: _Optional[int] = ..., session_id: _Optional[str] = ..., session_ttl_seconds: _Optional[float] = ..., session_end: _Optional[bool] = ..., src_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "status", "error", "first_token_id", "first_token_logprobs", "num_computed_tokens", "num_cached_tokens", "num_transferred_blocks", "transferred_bytes", "queue_seconds", "compute_seconds", "transfer_seconds", "cached_spans", "num_pulled_tokens", "pulled_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERRED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHED_SPANS_FIELD_NUMBER: _ClassVar[int]
    NUM_PULLED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PULLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: PrefillStatus
    error: str
    first_token_id: int
    first_token_logprobs: _common_pb2.TokenLogprobs
    num_computed_tokens: int
    num_cached_tokens: int
    num_transferred_blocks: int
    transferred_bytes: int
    queue_seconds: float
    compute_seconds: float
    transfer_seconds: float
    cached_spans: _containers.RepeatedCompositeFieldContainer[_common_pb2.CachedTokens]
    num_pulled_tokens: int
    pulled_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[PrefillStatus, str]] = ..., error: _Optional[str] = ..., first_token_id: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[_common_pb2.TokenLogprobs, _Mapping]] = ..., num_computed_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_transferred_blocks: _Optional[int] = ..., transferred_bytes: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., cached_spans: _Optional[_Iterable[_Union[_common_pb2.CachedTokens, _Mapping]]] = ..., num_pulled_tokens: _Optional[int] = ..., pulled_bytes: _Optional[int] = ...) -> None: ...

class ReleaseBlocksRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseBlocksResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
