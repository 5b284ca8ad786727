"""The one rule for names that become directory names and object keys: topics, consumer groups,
clusters and brokers.

RocketMQ's TopicValidator charset, ``[%|a-zA-Z0-9_-]``, keeps every name one safe path component
and one object-key component. Two lengths apply: an operator creates topics of up to 127
characters (RocketMQ's ``TOPIC_MAX_LENGTH``); the store holds any name up to 255, because the
retry and dead-letter topics (``%RETRY%{group}``, ``%DLQ%{group}``) embed a group name of up to 120.
"""

from __future__ import annotations

import re

NAME_CHARS = "[%|a-zA-Z0-9_-]"
MAX_NAME_LENGTH = 255
MAX_TOPIC_LENGTH = 127
MAX_GROUP_LENGTH = 120

_NAME = re.compile(rf"^{NAME_CHARS}{{1,{MAX_NAME_LENGTH}}}$")


class InvalidNameError(ValueError):
    pass


def is_valid_name(name: object) -> bool:
    """Whether ``name`` may be a topic, group, cluster or broker name anywhere in the store."""
    return isinstance(name, str) and _NAME.match(name) is not None


def check_topic_name(topic: str, max_length: int = MAX_TOPIC_LENGTH) -> None:
    """A topic an operator or a producer names; ``InvalidNameError`` otherwise."""
    if not is_valid_name(topic) or len(topic) > max_length:
        raise InvalidNameError(
            f"invalid topic {topic!r}: 1-{max_length} characters from {NAME_CHARS}"
        )


def check_group_name(group: str) -> None:
    if not is_valid_name(group) or len(group) > MAX_GROUP_LENGTH:
        raise InvalidNameError(
            f"invalid consumer group {group!r}: 1-{MAX_GROUP_LENGTH} characters from {NAME_CHARS}"
        )
