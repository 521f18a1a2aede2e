from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StructuredOutputKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STRUCTURED_OUTPUT_KIND_UNSPECIFIED: _ClassVar[StructuredOutputKind]
    STRUCTURED_OUTPUT_KIND_JSON_OBJECT: _ClassVar[StructuredOutputKind]
    STRUCTURED_OUTPUT_KIND_JSON_SCHEMA: _ClassVar[StructuredOutputKind]

class KVDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KVDType]
    KV_DTYPE_FLOAT32: _ClassVar[KVDType]
    KV_DTYPE_FLOAT16: _ClassVar[KVDType]
    KV_DTYPE_BFLOAT16: _ClassVar[KVDType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class KVSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_SOURCE_UNSPECIFIED: _ClassVar[KVSource]
    KV_SOURCE_DECODE_POOL: _ClassVar[KVSource]
    KV_SOURCE_PREFILL_POOL: _ClassVar[KVSource]
    KV_SOURCE_HOST_TIER: _ClassVar[KVSource]
    KV_SOURCE_DISK_TIER: _ClassVar[KVSource]
    KV_SOURCE_STORE: _ClassVar[KVSource]

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
STRUCTURED_OUTPUT_KIND_UNSPECIFIED: StructuredOutputKind
STRUCTURED_OUTPUT_KIND_JSON_OBJECT: StructuredOutputKind
STRUCTURED_OUTPUT_KIND_JSON_SCHEMA: StructuredOutputKind
KV_DTYPE_UNSPECIFIED: KVDType
KV_DTYPE_FLOAT32: KVDType
KV_DTYPE_FLOAT16: KVDType
KV_DTYPE_BFLOAT16: KVDType
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
KV_SOURCE_UNSPECIFIED: KVSource
KV_SOURCE_DECODE_POOL: KVSource
KV_SOURCE_PREFILL_POOL: KVSource
KV_SOURCE_HOST_TIER: KVSource
KV_SOURCE_DISK_TIER: KVSource
KV_SOURCE_STORE: KVSource
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "include_stop_str_in_output", "skip_special_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "structured_output", "prompt_logprobs")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[TokenBias]
    structured_output: StructuredOutput
    prompt_logprobs: int
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[TokenBias, _Mapping]]] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "json_schema", "prefix", "suffix")
    KIND_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    kind: StructuredOutputKind
    json_schema: str
    prefix: str
    suffix: str
    def __init__(self, kind: _Optional[_Union[StructuredOutputKind, str]] = ..., json_schema: _Optional[str] = ..., prefix: _Optional[str] = ..., suffix: _Optional[str] = ...) -> None: ...

class TokenBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_size", "protocol_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: KVDType
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    protocol_version: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[_Union[KVDType, str]] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class CachedTokens(_message.Message):
    __slots__ = ("source", "num_tokens")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    source: KVSource
    num_tokens: int
    def __init__(self, source: _Optional[_Union[KVSource, str]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens", "cached_by", "recomputed_held_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BY_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_HELD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_by: _containers.RepeatedCompositeFieldContainer[CachedTokens]
    recomputed_held_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., cached_by: _Optional[_Iterable[_Union[CachedTokens, _Mapping]]] = ..., recomputed_held_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("include_block_hashes",)
    INCLUDE_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    include_block_hashes: bool
    def __init__(self, include_block_hashes: _Optional[bool] = ...) -> None: ...

class BlockHashSnapshot(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("role", "worker_id", "num_running", "num_waiting", "num_waiting_tokens", "num_free_blocks", "num_total_blocks", "num_cached_blocks", "load", "kv_layout", "kv_epoch", "snapshot", "num_steps", "metrics_port", "prefill_tokens_per_s", "prefill_target_tokens", "pd_policy")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TARGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PD_POLICY_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    worker_id: str
    num_running: int
    num_waiting: int
    num_waiting_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    num_cached_blocks: int
    load: float
    kv_layout: KVLayout
    kv_epoch: int
    snapshot: BlockHashSnapshot
    num_steps: int
    metrics_port: int
    prefill_tokens_per_s: float
    prefill_target_tokens: int
    pd_policy: PDPolicyInfo
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., worker_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_waiting_tokens: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., load: _Optional[float] = ..., kv_layout: _Optional[_Union[KVLayout, _Mapping]] = ..., kv_epoch: _Optional[int] = ..., snapshot: _Optional[_Union[BlockHashSnapshot, _Mapping]] = ..., num_steps: _Optional[int] = ..., metrics_port: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., prefill_target_tokens: _Optional[int] = ..., pd_policy: _Optional[_Union[PDPolicyInfo, _Mapping]] = ...) -> None: ...

class PDPolicyInfo(_message.Message):
    __slots__ = ("itl_budget_ms", "idle_budget_ms", "min_remote_tokens", "remote_stall_fraction")
    ITL_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    IDLE_BUDGET_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_REMOTE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_STALL_FRACTION_FIELD_NUMBER: _ClassVar[int]
    itl_budget_ms: float
    idle_budget_ms: float
    min_remote_tokens: int
    remote_stall_fraction: float
    def __init__(self, itl_budget_ms: _Optional[float] = ..., idle_budget_ms: _Optional[float] = ..., min_remote_tokens: _Optional[int] = ..., remote_stall_fraction: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found", "kv_epoch")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    KV_EPOCH_FIELD_NUMBER: _ClassVar[int]
    found: bool
    kv_epoch: int
    def __init__(self, found: _Optional[bool] = ..., kv_epoch: _Optional[int] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...
