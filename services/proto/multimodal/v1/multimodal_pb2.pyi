from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ImageRequest(_message.Message):
    __slots__ = ("image",)
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    def __init__(self, image: _Optional[bytes] = ...) -> None: ...

class PlanResponse(_message.Message):
    __slots__ = ("num_tokens", "rows", "cols", "width", "height")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    rows: int
    cols: int
    width: int
    height: int
    def __init__(self, num_tokens: _Optional[int] = ..., rows: _Optional[int] = ..., cols: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("plan", "hidden_size", "embeddings", "cached", "content_hash")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    plan: PlanResponse
    hidden_size: int
    embeddings: bytes
    cached: bool
    content_hash: str
    def __init__(self, plan: _Optional[_Union[PlanResponse, _Mapping]] = ..., hidden_size: _Optional[int] = ..., embeddings: _Optional[bytes] = ..., cached: _Optional[bool] = ..., content_hash: _Optional[str] = ...) -> None: ...
