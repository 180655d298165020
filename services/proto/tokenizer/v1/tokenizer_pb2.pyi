from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("text", "add_bos", "max_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_bos: bool
    max_tokens: int
    def __init__(self, text: _Optional[str] = ..., add_bos: _Optional[bool] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RenderChatRequest(_message.Message):
    __slots__ = ("body_json", "max_tokens", "protocol")
    BODY_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    body_json: str
    max_tokens: int
    protocol: str
    def __init__(self, body_json: _Optional[str] = ..., max_tokens: _Optional[int] = ..., protocol: _Optional[str] = ...) -> None: ...

class RenderChatResponse(_message.Message):
    __slots__ = ("token_ids", "prompt", "image_urls")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_URLS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    image_urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., image_urls: _Optional[_Iterable[str]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens", "each")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EACH_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    each: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., each: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("text", "texts", "token_bytes")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    text: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    token_bytes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, text: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., token_bytes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "finish", "keep_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    KEEP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish: bool
    keep_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish: _Optional[bool] = ..., keep_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
