from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_DRAM: _ClassVar[MemoryKind]
    MEMORY_KIND_VRAM: _ClassVar[MemoryKind]
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_DRAM: MemoryKind
MEMORY_KIND_VRAM: MemoryKind

class NixlEndpoint(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "base_address", "memory_kind", "device_id")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    base_address: int
    memory_kind: MemoryKind
    device_id: int
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., base_address: _Optional[int] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., device_id: _Optional[int] = ...) -> None: ...

class GrpcEndpoint(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class InprocEndpoint(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class TransferEndpoint(_message.Message):
    __slots__ = ("layout_hash", "block_bytes", "num_blocks", "nixl", "grpc", "inproc")
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    GRPC_FIELD_NUMBER: _ClassVar[int]
    INPROC_FIELD_NUMBER: _ClassVar[int]
    layout_hash: int
    block_bytes: int
    num_blocks: int
    nixl: NixlEndpoint
    grpc: GrpcEndpoint
    inproc: InprocEndpoint
    def __init__(self, layout_hash: _Optional[int] = ..., block_bytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., nixl: _Optional[_Union[NixlEndpoint, _Mapping]] = ..., grpc: _Optional[_Union[GrpcEndpoint, _Mapping]] = ..., inproc: _Optional[_Union[InprocEndpoint, _Mapping]] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("request_id", "transfer_id", "layout_hash", "block_bytes", "dst_block_ids", "offset", "data")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    layout_hash: int
    block_bytes: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    data: bytes
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., layout_hash: _Optional[int] = ..., block_bytes: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushAck(_message.Message):
    __slots__ = ("transfer_id", "num_blocks", "num_bytes", "complete")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    num_blocks: int
    num_bytes: int
    complete: bool
    def __init__(self, transfer_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_bytes: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("request_id", "transfer_id", "layout_hash", "block_bytes", "src_block_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: str
    layout_hash: int
    block_bytes: int
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[str] = ..., layout_hash: _Optional[int] = ..., block_bytes: _Optional[int] = ..., src_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...
