from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Topic(_message.Message):
    __slots__ = ("name", "queues", "perm", "message_type", "tiered", "retention_ms", "local_retention_ms", "retention_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    PERM_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_TYPE_FIELD_NUMBER: _ClassVar[int]
    TIERED_FIELD_NUMBER: _ClassVar[int]
    RETENTION_MS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RETENTION_MS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    queues: int
    perm: int
    message_type: str
    tiered: bool
    retention_ms: int
    local_retention_ms: int
    retention_bytes: int
    def __init__(self, name: _Optional[str] = ..., queues: _Optional[int] = ..., perm: _Optional[int] = ..., message_type: _Optional[str] = ..., tiered: _Optional[bool] = ..., retention_ms: _Optional[int] = ..., local_retention_ms: _Optional[int] = ..., retention_bytes: _Optional[int] = ...) -> None: ...

class QueueStats(_message.Message):
    __slots__ = ("queue", "min_offset", "max_offset", "hot_min_offset", "tier_watermark", "offload_held", "offload_held_offset", "offload_held_reason", "offload_held_since_ms", "tier_check_pending", "tier_diverged", "tier_unchecked_from", "tier_archive_end", "tier_resolve_copies_from", "tier_unknown")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    MIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    HOT_MIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TIER_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_HELD_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_HELD_OFFSET_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_HELD_REASON_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_HELD_SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    TIER_CHECK_PENDING_FIELD_NUMBER: _ClassVar[int]
    TIER_DIVERGED_FIELD_NUMBER: _ClassVar[int]
    TIER_UNCHECKED_FROM_FIELD_NUMBER: _ClassVar[int]
    TIER_ARCHIVE_END_FIELD_NUMBER: _ClassVar[int]
    TIER_RESOLVE_COPIES_FROM_FIELD_NUMBER: _ClassVar[int]
    TIER_UNKNOWN_FIELD_NUMBER: _ClassVar[int]
    queue: int
    min_offset: int
    max_offset: int
    hot_min_offset: int
    tier_watermark: int
    offload_held: bool
    offload_held_offset: int
    offload_held_reason: str
    offload_held_since_ms: int
    tier_check_pending: bool
    tier_diverged: bool
    tier_unchecked_from: int
    tier_archive_end: int
    tier_resolve_copies_from: int
    tier_unknown: bool
    def __init__(self, queue: _Optional[int] = ..., min_offset: _Optional[int] = ..., max_offset: _Optional[int] = ..., hot_min_offset: _Optional[int] = ..., tier_watermark: _Optional[int] = ..., offload_held: _Optional[bool] = ..., offload_held_offset: _Optional[int] = ..., offload_held_reason: _Optional[str] = ..., offload_held_since_ms: _Optional[int] = ..., tier_check_pending: _Optional[bool] = ..., tier_diverged: _Optional[bool] = ..., tier_unchecked_from: _Optional[int] = ..., tier_archive_end: _Optional[int] = ..., tier_resolve_copies_from: _Optional[int] = ..., tier_unknown: _Optional[bool] = ...) -> None: ...

class TopicDescription(_message.Message):
    __slots__ = ("topic", "queues", "timers_pending", "timer_delivery_lag_seconds", "transactions_pending")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    TIMERS_PENDING_FIELD_NUMBER: _ClassVar[int]
    TIMER_DELIVERY_LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSACTIONS_PENDING_FIELD_NUMBER: _ClassVar[int]
    topic: Topic
    queues: _containers.RepeatedCompositeFieldContainer[QueueStats]
    timers_pending: int
    timer_delivery_lag_seconds: float
    transactions_pending: int
    def __init__(self, topic: _Optional[_Union[Topic, _Mapping]] = ..., queues: _Optional[_Iterable[_Union[QueueStats, _Mapping]]] = ..., timers_pending: _Optional[int] = ..., timer_delivery_lag_seconds: _Optional[float] = ..., transactions_pending: _Optional[int] = ...) -> None: ...

class PutTopicRequest(_message.Message):
    __slots__ = ("topic", "update")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    topic: Topic
    update: bool
    def __init__(self, topic: _Optional[_Union[Topic, _Mapping]] = ..., update: _Optional[bool] = ...) -> None: ...

class PutTopicResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTopicRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListTopicsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTopicsResponse(_message.Message):
    __slots__ = ("topics",)
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedCompositeFieldContainer[TopicDescription]
    def __init__(self, topics: _Optional[_Iterable[_Union[TopicDescription, _Mapping]]] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("name", "max_delivery_attempts", "fifo")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_DELIVERY_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    FIFO_FIELD_NUMBER: _ClassVar[int]
    name: str
    max_delivery_attempts: int
    fifo: bool
    def __init__(self, name: _Optional[str] = ..., max_delivery_attempts: _Optional[int] = ..., fifo: _Optional[bool] = ...) -> None: ...

class PutGroupRequest(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: Group
    def __init__(self, group: _Optional[_Union[Group, _Mapping]] = ...) -> None: ...

class PutGroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListGroupsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListGroupsResponse(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[Group]
    def __init__(self, groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("broker_name", "commitlog_min_offset", "commitlog_max_offset", "dispatched_offset", "topics", "groups")
    BROKER_NAME_FIELD_NUMBER: _ClassVar[int]
    COMMITLOG_MIN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    COMMITLOG_MAX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    broker_name: str
    commitlog_min_offset: int
    commitlog_max_offset: int
    dispatched_offset: int
    topics: int
    groups: int
    def __init__(self, broker_name: _Optional[str] = ..., commitlog_min_offset: _Optional[int] = ..., commitlog_max_offset: _Optional[int] = ..., dispatched_offset: _Optional[int] = ..., topics: _Optional[int] = ..., groups: _Optional[int] = ...) -> None: ...

class TieredQueueStatus(_message.Message):
    __slots__ = ("topic", "queue", "max_offset", "known", "lag_messages", "lag_bytes", "lag_seconds", "archived_bytes", "hot_bytes")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_OFFSET_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    LAG_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    LAG_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ARCHIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue: int
    max_offset: int
    known: bool
    lag_messages: int
    lag_bytes: int
    lag_seconds: float
    archived_bytes: int
    hot_bytes: int
    def __init__(self, topic: _Optional[str] = ..., queue: _Optional[int] = ..., max_offset: _Optional[int] = ..., known: _Optional[bool] = ..., lag_messages: _Optional[int] = ..., lag_bytes: _Optional[int] = ..., lag_seconds: _Optional[float] = ..., archived_bytes: _Optional[int] = ..., hot_bytes: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("broker_name", "cluster", "topics", "dispatch_lag_bytes", "commitlog_files", "hot_store_bytes", "cold_store_bytes", "has_tier", "queues", "export_reported", "export_freshness_seconds")
    class ExportFreshnessSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    BROKER_NAME_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_LAG_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITLOG_FILES_FIELD_NUMBER: _ClassVar[int]
    HOT_STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLD_STORE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HAS_TIER_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    EXPORT_REPORTED_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FRESHNESS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    broker_name: str
    cluster: str
    topics: int
    dispatch_lag_bytes: int
    commitlog_files: int
    hot_store_bytes: int
    cold_store_bytes: int
    has_tier: bool
    queues: _containers.RepeatedCompositeFieldContainer[TieredQueueStatus]
    export_reported: bool
    export_freshness_seconds: _containers.ScalarMap[str, float]
    def __init__(self, broker_name: _Optional[str] = ..., cluster: _Optional[str] = ..., topics: _Optional[int] = ..., dispatch_lag_bytes: _Optional[int] = ..., commitlog_files: _Optional[int] = ..., hot_store_bytes: _Optional[int] = ..., cold_store_bytes: _Optional[int] = ..., has_tier: _Optional[bool] = ..., queues: _Optional[_Iterable[_Union[TieredQueueStatus, _Mapping]]] = ..., export_reported: _Optional[bool] = ..., export_freshness_seconds: _Optional[_Mapping[str, float]] = ...) -> None: ...

class RetentionOutcome(_message.Message):
    __slots__ = ("topic", "queue", "segments", "messages", "bytes", "new_start_offset", "deleted_keys")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NEW_START_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DELETED_KEYS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue: int
    segments: int
    messages: int
    bytes: int
    new_start_offset: int
    deleted_keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, topic: _Optional[str] = ..., queue: _Optional[int] = ..., segments: _Optional[int] = ..., messages: _Optional[int] = ..., bytes: _Optional[int] = ..., new_start_offset: _Optional[int] = ..., deleted_keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ApplyRetentionRequest(_message.Message):
    __slots__ = ("topic", "dry_run")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    DRY_RUN_FIELD_NUMBER: _ClassVar[int]
    topic: str
    dry_run: bool
    def __init__(self, topic: _Optional[str] = ..., dry_run: _Optional[bool] = ...) -> None: ...

class ApplyRetentionResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[RetentionOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[RetentionOutcome, _Mapping]]] = ...) -> None: ...

class OffloadRequest(_message.Message):
    __slots__ = ("topic", "queue", "keep_local_bytes", "before_ms")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    KEEP_LOCAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BEFORE_MS_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue: int
    keep_local_bytes: int
    before_ms: int
    def __init__(self, topic: _Optional[str] = ..., queue: _Optional[int] = ..., keep_local_bytes: _Optional[int] = ..., before_ms: _Optional[int] = ...) -> None: ...

class QueueOffload(_message.Message):
    __slots__ = ("queue", "segments", "messages", "bytes", "watermark")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WATERMARK_FIELD_NUMBER: _ClassVar[int]
    queue: int
    segments: int
    messages: int
    bytes: int
    watermark: int
    def __init__(self, queue: _Optional[int] = ..., segments: _Optional[int] = ..., messages: _Optional[int] = ..., bytes: _Optional[int] = ..., watermark: _Optional[int] = ...) -> None: ...

class OffloadResponse(_message.Message):
    __slots__ = ("queues",)
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    queues: _containers.RepeatedCompositeFieldContainer[QueueOffload]
    def __init__(self, queues: _Optional[_Iterable[_Union[QueueOffload, _Mapping]]] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("topic", "repair", "deep")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    REPAIR_FIELD_NUMBER: _ClassVar[int]
    DEEP_FIELD_NUMBER: _ClassVar[int]
    topic: str
    repair: bool
    deep: bool
    def __init__(self, topic: _Optional[str] = ..., repair: _Optional[bool] = ..., deep: _Optional[bool] = ...) -> None: ...

class QueueVerdict(_message.Message):
    __slots__ = ("topic", "queue", "status", "missing", "damaged", "anomalies", "orphans", "repaired")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    ANOMALIES_FIELD_NUMBER: _ClassVar[int]
    ORPHANS_FIELD_NUMBER: _ClassVar[int]
    REPAIRED_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue: int
    status: str
    missing: _containers.RepeatedScalarFieldContainer[str]
    damaged: _containers.RepeatedScalarFieldContainer[str]
    anomalies: _containers.RepeatedScalarFieldContainer[str]
    orphans: _containers.RepeatedScalarFieldContainer[str]
    repaired: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, topic: _Optional[str] = ..., queue: _Optional[int] = ..., status: _Optional[str] = ..., missing: _Optional[_Iterable[str]] = ..., damaged: _Optional[_Iterable[str]] = ..., anomalies: _Optional[_Iterable[str]] = ..., orphans: _Optional[_Iterable[str]] = ..., repaired: _Optional[_Iterable[str]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("status", "queues")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    status: str
    queues: _containers.RepeatedCompositeFieldContainer[QueueVerdict]
    def __init__(self, status: _Optional[str] = ..., queues: _Optional[_Iterable[_Union[QueueVerdict, _Mapping]]] = ...) -> None: ...

class ResolveDivergenceRequest(_message.Message):
    __slots__ = ("topic", "queue", "discard_local", "discard_count")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    DISCARD_LOCAL_FIELD_NUMBER: _ClassVar[int]
    DISCARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    topic: str
    queue: int
    discard_local: bool
    discard_count: int
    def __init__(self, topic: _Optional[str] = ..., queue: _Optional[int] = ..., discard_local: _Optional[bool] = ..., discard_count: _Optional[int] = ...) -> None: ...

class ResolvedQueue(_message.Message):
    __slots__ = ("queue", "base", "archive_end", "copied", "copies_from", "copies_end", "discarded")
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_END_FIELD_NUMBER: _ClassVar[int]
    COPIED_FIELD_NUMBER: _ClassVar[int]
    COPIES_FROM_FIELD_NUMBER: _ClassVar[int]
    COPIES_END_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    queue: int
    base: int
    archive_end: int
    copied: int
    copies_from: int
    copies_end: int
    discarded: bool
    def __init__(self, queue: _Optional[int] = ..., base: _Optional[int] = ..., archive_end: _Optional[int] = ..., copied: _Optional[int] = ..., copies_from: _Optional[int] = ..., copies_end: _Optional[int] = ..., discarded: _Optional[bool] = ...) -> None: ...

class ResolveDivergenceResponse(_message.Message):
    __slots__ = ("queues",)
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    queues: _containers.RepeatedCompositeFieldContainer[ResolvedQueue]
    def __init__(self, queues: _Optional[_Iterable[_Union[ResolvedQueue, _Mapping]]] = ...) -> None: ...

class QueryByKeyRequest(_message.Message):
    __slots__ = ("topic", "key", "begin_ms", "end_ms", "max")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    BEGIN_MS_FIELD_NUMBER: _ClassVar[int]
    END_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    topic: str
    key: str
    begin_ms: int
    end_ms: int
    max: int
    def __init__(self, topic: _Optional[str] = ..., key: _Optional[str] = ..., begin_ms: _Optional[int] = ..., end_ms: _Optional[int] = ..., max: _Optional[int] = ...) -> None: ...

class FoundMessage(_message.Message):
    __slots__ = ("queue", "queue_offset", "message_id", "tag", "keys", "properties", "store_time_ms", "body")
    class PropertiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    STORE_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    queue: int
    queue_offset: int
    message_id: str
    tag: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    properties: _containers.ScalarMap[str, str]
    store_time_ms: int
    body: bytes
    def __init__(self, queue: _Optional[int] = ..., queue_offset: _Optional[int] = ..., message_id: _Optional[str] = ..., tag: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., properties: _Optional[_Mapping[str, str]] = ..., store_time_ms: _Optional[int] = ..., body: _Optional[bytes] = ...) -> None: ...

class QueryByKeyResponse(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[FoundMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[FoundMessage, _Mapping]]] = ...) -> None: ...
