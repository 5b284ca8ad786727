"""SendMessage converts a whole batch in one pass: the same store Messages (and so the same
records) as checking each message alone, and the same refusal, for the same message first."""

from __future__ import annotations

import gzip
import zlib
from typing import Any

import pytest
from rocketmq.grpc_protocol import definition_pb2 as d

from broker.metadata import Limits, TopicConfig
from broker.protocol import ProtocolError, to_store_message, to_store_messages
from tiered.record import Message, RecordEncoder

NORMAL = TopicConfig(name="orders", queues=4)
FIFO = TopicConfig(name="fifo", queues=4, message_type="FIFO")
LIMITS = Limits()


def message(i: int, topic: TopicConfig = NORMAL, **system: Any) -> d.Message:
    pm = d.Message(topic=d.Resource(name=topic.name), body=b"body-%d" % i)
    sp = pm.system_properties
    sp.message_id = f"01{i:030X}"
    sp.message_type = d.FIFO if topic.message_type == "FIFO" else d.NORMAL
    sp.body_encoding = d.IDENTITY
    sp.born_timestamp.seconds, sp.born_timestamp.nanos = 1_700_000_000 + i, 123_000_000
    sp.born_host = "10.0.0.7"
    for name, value in system.items():
        if name == "user":
            pm.user_properties.update(value)
        elif name == "keys":
            sp.keys.extend(value)
        elif name == "body":
            pm.body = value
        else:
            setattr(sp, name, value)
    return pm


def one_by_one(pms: list[d.Message], topic: TopicConfig, first_queue: int) -> list[Message]:
    out = []
    for i, pm in enumerate(pms):
        sp = pm.system_properties
        group = sp.message_group if sp.HasField("message_group") else ""
        queue = zlib.crc32(group.encode()) % topic.queues if group else (first_queue + i) % 4
        out.append(to_store_message(pm, topic, queue, LIMITS, "127.0.0.1"))
    return out


def batch(pms: list[d.Message], topic: TopicConfig, first_queue: int = 5) -> list[Message]:
    size = sum(pm.ByteSize() for pm in pms)
    return list(to_store_messages(pms, topic, first_queue, LIMITS, "127.0.0.1", size))


def test_a_batch_converts_to_the_same_messages_and_records_as_one_by_one() -> None:
    pms = [
        message(0),
        message(1, tag="TagA"),
        message(2, keys=["k1", "k2"]),
        message(3, user={"region": "eu", "n": "1"}),
        message(4, body_encoding=d.GZIP, body=gzip.compress(b"zipped")),
        message(5, born_host="not-an-ip"),
        message(6, born_host=""),
        message(7),
    ]
    converted = batch(pms, NORMAL)
    assert converted == one_by_one(pms, NORMAL, 5)
    encoder = RecordEncoder(("10.0.0.1", 10911))
    for fast, slow in zip(converted, one_by_one(pms, NORMAL, 5), strict=True):
        assert encoder.encode(fast, 0, 0, 0) == encoder.encode(slow, 0, 0, 0)
    assert [m.queue_id for m in converted] == [(5 + i) % 4 for i in range(8)]


def test_messages_with_a_group_go_to_their_groups_queue() -> None:
    pms = [message(i, FIFO, message_group=f"g{i % 3}") for i in range(6)]
    assert batch(pms, FIFO) == one_by_one(pms, FIFO, 5)


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        ({"tag": "a|b"}, d.ILLEGAL_MESSAGE_TAG),
        ({"body": b""}, d.MESSAGE_BODY_EMPTY),
        ({"message_id": "id\x01"}, d.ILLEGAL_MESSAGE_ID),
        ({"message_id": " "}, d.ILLEGAL_MESSAGE_ID),
        ({"message_id": "x" * 129}, d.ILLEGAL_MESSAGE_ID),
        ({"message_type": d.FIFO}, d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
        ({"user": {"UNIQ_KEY": "x"}}, d.ILLEGAL_MESSAGE_PROPERTY_KEY),
        ({"user": {"__CRC32#": "0000000000"}}, d.ILLEGAL_MESSAGE_PROPERTY_KEY),
        ({"keys": ["a b"]}, d.ILLEGAL_MESSAGE_KEY),
    ],
)
def test_a_bad_message_is_refused_as_alone_and_before_later_ones(
    bad: dict[str, Any], code: int
) -> None:
    pms = [message(0), message(1, **bad), message(2, body=b"")]
    with pytest.raises(ProtocolError) as refused:
        batch(pms, NORMAL)
    assert refused.value.code == code


def test_a_message_too_large_to_deliver_is_refused() -> None:
    limits = Limits(max_body_bytes=8 << 20)
    pm = message(0, body=b"x" * (4 << 20))
    with pytest.raises(ProtocolError) as refused:
        to_store_messages([pm], NORMAL, 0, limits, "127.0.0.1", pm.ByteSize())
    assert refused.value.code == d.MESSAGE_BODY_TOO_LARGE


@pytest.mark.parametrize(
    ("ids", "offsets"),
    [
        ([], []),
        (["0A0000010000000000000000000000FF"], [0]),
        (["a", "é€𝄞", "x" * 200, ""], [1, 127, 128, (1 << 62) + 5]),
        ([f"{i:032X}" for i in range(1000)], list(range(0, 3_000_000, 3000))),
    ],
)
def test_the_send_answer_built_in_one_call_is_what_protobuf_builds(
    ids: list[str], offsets: list[int]
) -> None:
    """SendMessage's answer is built as bytes in one call (decision 261): the native engine's
    and the reference's parse to exactly the response protobuf's own ``add`` builds."""
    from rocketmq.grpc_protocol import service_pb2 as s

    from broker.protocol import send_response, send_results_py, status
    from tiered.record import NATIVE_ENGINE

    ok = status()
    expected = s.SendMessageResponse(status=ok)
    for i, o in zip(ids, offsets, strict=True):
        expected.entries.add(status=ok, message_id=i, transaction_id=i, offset=o)
    raw = ok.SerializeToString()
    assert s.SendMessageResponse.FromString(send_results_py(raw, ids, offsets)) == expected
    assert s.SendMessageResponse.FromString(NATIVE_ENGINE.send_results(raw, ids, offsets)) == (
        expected
    )
    assert send_response(ids, offsets) == expected
    with pytest.raises(ValueError):
        NATIVE_ENGINE.send_results(raw, ids, [*offsets, 1])
