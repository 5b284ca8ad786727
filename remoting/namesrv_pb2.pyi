from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Endpoint(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class TopicConfig(_message.Message):
    __slots__ = ("topic", "queues", "perm", "message_type")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    PERM_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_TYPE_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queues: int
    perm: int
    message_type: str
    def __init__(self, topic: _Optional[str] = ..., queues: _Optional[int] = ..., perm: _Optional[int] = ..., message_type: _Optional[str] = ...) -> None: ...

class BrokerRegistration(_message.Message):
    __slots__ = ("cluster", "broker_name", "broker_id", "endpoint", "topics")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    BROKER_NAME_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    broker_name: str
    broker_id: int
    endpoint: Endpoint
    topics: _containers.RepeatedCompositeFieldContainer[TopicConfig]
    def __init__(self, cluster: _Optional[str] = ..., broker_name: _Optional[str] = ..., broker_id: _Optional[int] = ..., endpoint: _Optional[_Union[Endpoint, _Mapping]] = ..., topics: _Optional[_Iterable[_Union[TopicConfig, _Mapping]]] = ...) -> None: ...

class RegisterBrokerRequest(_message.Message):
    __slots__ = ("broker",)
    BROKER_FIELD_NUMBER: _ClassVar[int]
    broker: BrokerRegistration
    def __init__(self, broker: _Optional[_Union[BrokerRegistration, _Mapping]] = ...) -> None: ...

class RegisterBrokerResponse(_message.Message):
    __slots__ = ("heartbeat_interval_ms", "expiry_ms")
    HEARTBEAT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_ms: int
    expiry_ms: int
    def __init__(self, heartbeat_interval_ms: _Optional[int] = ..., expiry_ms: _Optional[int] = ...) -> None: ...

class UnregisterBrokerRequest(_message.Message):
    __slots__ = ("cluster", "broker_name", "broker_id", "endpoint")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    BROKER_NAME_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    broker_name: str
    broker_id: int
    endpoint: Endpoint
    def __init__(self, cluster: _Optional[str] = ..., broker_name: _Optional[str] = ..., broker_id: _Optional[int] = ..., endpoint: _Optional[_Union[Endpoint, _Mapping]] = ...) -> None: ...

class UnregisterBrokerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRouteRequest(_message.Message):
    __slots__ = ("topic",)
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    topic: str
    def __init__(self, topic: _Optional[str] = ...) -> None: ...

class BrokerQueues(_message.Message):
    __slots__ = ("cluster", "broker_name", "broker_id", "endpoint", "queues", "perm", "message_type")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    BROKER_NAME_FIELD_NUMBER: _ClassVar[int]
    BROKER_ID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    PERM_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_TYPE_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    broker_name: str
    broker_id: int
    endpoint: Endpoint
    queues: int
    perm: int
    message_type: str
    def __init__(self, cluster: _Optional[str] = ..., broker_name: _Optional[str] = ..., broker_id: _Optional[int] = ..., endpoint: _Optional[_Union[Endpoint, _Mapping]] = ..., queues: _Optional[int] = ..., perm: _Optional[int] = ..., message_type: _Optional[str] = ...) -> None: ...

class TopicRoute(_message.Message):
    __slots__ = ("topic", "brokers")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    BROKERS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    brokers: _containers.RepeatedCompositeFieldContainer[BrokerQueues]
    def __init__(self, topic: _Optional[str] = ..., brokers: _Optional[_Iterable[_Union[BrokerQueues, _Mapping]]] = ...) -> None: ...

class GetClusterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BrokerInfo(_message.Message):
    __slots__ = ("broker", "last_heartbeat_ms")
    BROKER_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    broker: BrokerRegistration
    last_heartbeat_ms: int
    def __init__(self, broker: _Optional[_Union[BrokerRegistration, _Mapping]] = ..., last_heartbeat_ms: _Optional[int] = ...) -> None: ...

class ClusterInfo(_message.Message):
    __slots__ = ("brokers",)
    BROKERS_FIELD_NUMBER: _ClassVar[int]
    brokers: _containers.RepeatedCompositeFieldContainer[BrokerInfo]
    def __init__(self, brokers: _Optional[_Iterable[_Union[BrokerInfo, _Mapping]]] = ...) -> None: ...
