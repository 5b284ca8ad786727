from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TransactionCheck(_message.Message):
    __slots__ = ("topic", "command", "client_ids")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    command: bytes
    client_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, topic: _Optional[str] = ..., command: _Optional[bytes] = ..., client_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RelayChecksRequest(_message.Message):
    __slots__ = ("checks",)
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    checks: _containers.RepeatedCompositeFieldContainer[TransactionCheck]
    def __init__(self, checks: _Optional[_Iterable[_Union[TransactionCheck, _Mapping]]] = ...) -> None: ...

class RelayChecksResponse(_message.Message):
    __slots__ = ("relayed",)
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    relayed: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, relayed: _Optional[_Iterable[bool]] = ...) -> None: ...
