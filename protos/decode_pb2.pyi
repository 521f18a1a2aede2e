from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_MODE_UNSPECIFIED: _ClassVar[PrefillMode]
    PREFILL_MODE_AUTO: _ClassVar[PrefillMode]
    PREFILL_MODE_LOCAL: _ClassVar[PrefillMode]
    PREFILL_MODE_REMOTE: _ClassVar[PrefillMode]
PREFILL_MODE_UNSPECIFIED: PrefillMode
PREFILL_MODE_AUTO: PrefillMode
PREFILL_MODE_LOCAL: PrefillMode
PREFILL_MODE_REMOTE: PrefillMode

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "session_id", "prefill_address", "prefill_mode", "session_ttl_seconds", "session_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    session_id: str
    prefill_address: str
    prefill_mode: PrefillMode
    session_ttl_seconds: float
    session_end: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., prefill_address: _Optional[str] = ..., prefill_mode: _Optional[_Union[PrefillMode, str]] = ..., session_ttl_seconds: _Optional[float] = ..., session_end: _Optional[bool] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("index", "token_ids", "text_delta", "logprobs", "prompt_usage", "prompt_logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_DELTA_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text_delta: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_usage: _common_pb2.Usage
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text_delta: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class RequestTimings(_message.Message):
    __slots__ = ("ttft_seconds", "queue_seconds", "prefill_seconds", "transfer_seconds", "remote_prefill")
    TTFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    ttft_seconds: float
    queue_seconds: float
    prefill_seconds: float
    transfer_seconds: float
    remote_prefill: bool
    def __init__(self, ttft_seconds: _Optional[float] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., remote_prefill: _Optional[bool] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("index", "finish_reason", "stop_str", "stop_token_id", "usage", "error", "timings")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_STR_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    index: int
    finish_reason: _common_pb2.FinishReason
    stop_str: str
    stop_token_id: int
    usage: _common_pb2.Usage
    error: str
    timings: RequestTimings
    def __init__(self, index: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_str: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[str] = ..., timings: _Optional[_Union[RequestTimings, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "finished")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenChunk
    finished: Finished
    def __init__(self, tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ...) -> None: ...
