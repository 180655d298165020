from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Array(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingRow(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "position", "forced_top_k", "banned_token_ids", "num_logprobs", "forced_token_id", "logit_bias_ids", "logit_bias_values")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOP_K_FIELD_NUMBER: _ClassVar[int]
    BANNED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    position: int
    forced_top_k: int
    banned_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_logprobs: int
    forced_token_id: int
    logit_bias_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., position: _Optional[int] = ..., forced_top_k: _Optional[int] = ..., banned_token_ids: _Optional[_Iterable[int]] = ..., num_logprobs: _Optional[int] = ..., forced_token_id: _Optional[int] = ..., logit_bias_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "kind", "request_ids", "arrays", "sampling_rows", "is_prefill", "is_placeholder", "block_table_width", "entry_ratios", "graph_size", "num_padding_rows")
    class ArraysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Array
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_ROWS_FIELD_NUMBER: _ClassVar[int]
    IS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    IS_PLACEHOLDER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_WIDTH_FIELD_NUMBER: _ClassVar[int]
    ENTRY_RATIOS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PADDING_ROWS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    kind: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    arrays: _containers.MessageMap[str, Array]
    sampling_rows: _containers.RepeatedCompositeFieldContainer[SamplingRow]
    is_prefill: bool
    is_placeholder: bool
    block_table_width: int
    entry_ratios: _containers.RepeatedScalarFieldContainer[int]
    graph_size: int
    num_padding_rows: int
    def __init__(self, step_id: _Optional[int] = ..., kind: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ..., arrays: _Optional[_Mapping[str, Array]] = ..., sampling_rows: _Optional[_Iterable[_Union[SamplingRow, _Mapping]]] = ..., is_prefill: _Optional[bool] = ..., is_placeholder: _Optional[bool] = ..., block_table_width: _Optional[int] = ..., entry_ratios: _Optional[_Iterable[int]] = ..., graph_size: _Optional[int] = ..., num_padding_rows: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("num_tokens", "token_ids", "errors", "logprobs", "top_token_ids", "top_logprobs", "expert_counts", "num_rows_computed", "sampled", "sampled_token_ids", "sampled_errors")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_ERRORS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    errors: _containers.RepeatedScalarFieldContainer[int]
    logprobs: Array
    top_token_ids: Array
    top_logprobs: Array
    expert_counts: Array
    num_rows_computed: int
    sampled: bool
    sampled_token_ids: Array
    sampled_errors: Array
    def __init__(self, num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., errors: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[Array, _Mapping]] = ..., top_token_ids: _Optional[_Union[Array, _Mapping]] = ..., top_logprobs: _Optional[_Union[Array, _Mapping]] = ..., expert_counts: _Optional[_Union[Array, _Mapping]] = ..., num_rows_computed: _Optional[int] = ..., sampled: _Optional[bool] = ..., sampled_token_ids: _Optional[_Union[Array, _Mapping]] = ..., sampled_errors: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "config_sha256", "weights_sha256", "vocab_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SHA256_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    config_sha256: str
    weights_sha256: str
    vocab_size: int
    def __init__(self, model: _Optional[str] = ..., config_sha256: _Optional[str] = ..., weights_sha256: _Optional[str] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class SetImagesRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "rows")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    rows: Array
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., rows: _Optional[_Union[Array, _Mapping]] = ...) -> None: ...

class SetImagesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
