"""The native SendMessageRequest walker (decision 310) against the reference path (protobuf's
parse, then ``to_store_messages``): on random and hostile requests it either hands the batch
back to the reference path or builds exactly the reference's Messages (so the same records),
and it never takes bytes protobuf refuses or a batch the reference refuses."""

from __future__ import annotations

import random
import time
import zlib
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s

from broker.metadata import Limits, TopicConfig
from broker.protocol import (
    SEND_ENGINE,
    ProtocolError,
    scan_send_request,
    scanned_batch,
    to_store_messages,
)
from tiered.record import NATIVE_ENGINE, EncodedBatch, Message, RecordEncoder, RecordSpans

pytestmark = pytest.mark.skipif(SEND_ENGINE is None, reason="the native walker is not built")

LIMITS = Limits(max_body_bytes=4096)
TOPICS = {
    "NORMAL": TopicConfig(name="orders", queues=4),
    "FIFO": TopicConfig(name="orders", queues=4, message_type="FIFO"),
    "DELAY": TopicConfig(name="orders", queues=3, message_type="DELAY"),
    "TRANSACTION": TopicConfig(name="orders", queues=3, message_type="TRANSACTION"),
}
PEER = "127.0.0.9"


def reference(raw: bytes, topic: TopicConfig, first_queue: int) -> Any:
    """What the reference path makes of ``raw``: "undecodable", a ProtocolError's code, or
    (messages, ids, body bytes)."""
    try:
        request = s.SendMessageRequest.FromString(raw)
    except DecodeError:
        return "undecodable"
    names = {m.topic.name for m in request.messages}
    if not request.messages or len(names) != 1 or names.pop() != topic.name:
        return "not one topic"
    ids = [pm.system_properties.message_id for pm in request.messages]
    try:
        batch = to_store_messages(
            request.messages, topic, first_queue, LIMITS, PEER, request.ByteSize(), ids
        )
    except ProtocolError as e:
        return e.code
    return batch, ids, sum(len(m.body) for m in batch)


def native(raw: bytes, topic: TopicConfig, first_queue: int) -> Any:
    scanned = scan_send_request(raw)
    if scanned is None:
        return None
    return scanned, scanned_batch(scanned.messages, topic, first_queue, LIMITS, PEER, len(raw))


def records(batch: list[Message]) -> list[tuple[bytes, ...]]:
    encoder = RecordEncoder(("10.1.1.1", 10911))
    return [encoder.encode(m, 0, 0, 1_700_000_000_000) for m in batch]


def encoded(
    batch: list[Message] | RecordSpans,
    engine: str,
    space: int = 1 << 30,
    store_host: tuple[str, int] = ("10.1.1.1", 10911),
) -> tuple[Any, ...]:
    """A CommitLog append's encoding of ``batch`` by the native engine or the reference, in
    as many calls as ``space`` (the room left in a file, a fresh file after each) takes: the
    record bytes of each call and every column dispatch reads."""
    encoder = RecordEncoder(store_host)
    base = {("orders", 1): 7, ("orders", 2): 1 << 40}
    nexts: dict[tuple[str, int], int] = {}
    calls, i, offset = [], 0, 4096
    while i < len(batch):
        out = EncodedBatch(store_timestamp=1_700_000_000_123)
        if engine == "native":
            got = NATIVE_ENGINE.encode_batch(encoder, batch, i, offset, space, nexts, base, out)
        else:
            got = encoder.encode_batch_py(batch, i, offset, space, nexts, base, out)
        assert got[0] > i, "a record did not fit in an empty file"
        i, used = got
        offset += space
        calls.append(
            (
                b"".join(out.parts),
                used,
                list(out.offsets),
                list(out.sizes),
                list(out.queue_offsets),
                out.queues,
                out.tags,
                out.keys,
                out.uniq_keys,
            )
        )
    return tuple(calls), sorted(nexts.items())


def check_spans(
    scanned: Any, topic: TopicConfig, first_queue: int, raw: bytes, made: Any, ref: Any
) -> None:
    """The walker's ``RecordSpans`` of ``raw`` (decision 700): refused exactly when its
    ``Message`` objects are, else the same ids and body bytes, and byte-identical CommitLog
    records and dispatch columns, from the native encoder reading the spans in place and from
    the reference encoding the reference path's ``Message`` objects."""
    spans = scanned_batch(scanned.spans, topic, first_queue, LIMITS, PEER, len(raw))
    assert (spans is None) == (made is None)
    if spans is None:
        return
    record_spans, ids, body_bytes = spans
    assert isinstance(record_spans, RecordSpans)
    assert (ids, body_bytes) == (made[1], made[2])
    ref_batch = ref[0]
    assert record_spans.messages() == ref_batch
    want = encoded(ref_batch, "python")
    assert encoded(record_spans, "native") == want
    assert encoded(made[0], "native") == want
    assert encoded(record_spans, "python") == want
    # a file that takes two records at a time: the spans continue where a call stopped
    space = max(want[0][0][3]) * 2 + 8
    assert encoded(record_spans, "native", space) == encoded(ref_batch, "python", space)


def check(raw: bytes, topic: TopicConfig, first_queue: int = 6) -> bool:
    """Native and reference agree on ``raw``; True when the native path took the batch."""
    ref = reference(raw, topic, first_queue)
    got = native(raw, topic, first_queue)
    if got is None:
        return False
    scanned, made = got
    # Whatever the walker accepts, protobuf decodes, to one topic and this many messages.
    assert ref != "undecodable", raw
    request = s.SendMessageRequest.FromString(raw)
    assert scanned.count == len(request.messages)
    assert {m.topic.name for m in request.messages} == {scanned.topic}
    if scanned.topic != topic.name:
        # the broker looks up (and checks) the topic the walker read, as the reference does
        assert ref == "not one topic"
        return False
    if made is None:
        check_spans(scanned, topic, first_queue, raw, made, ref)
        return False
    assert isinstance(ref, tuple), f"native built a batch the reference refuses ({ref})"
    batch, ids, body_bytes = made
    ref_batch, ref_ids, ref_bytes = ref
    assert batch == ref_batch
    # property order too: it is the stored record's byte order
    assert [list(m.properties.items()) for m in batch] == [
        list(m.properties.items()) for m in ref_batch
    ]
    assert [type(m.queue_id) for m in batch] == [int] * len(batch)
    assert records(batch) == records(ref_batch)
    assert (ids, body_bytes) == (ref_ids, ref_bytes)
    check_spans(scanned, topic, first_queue, raw, made, ref)
    return True


def plain(i: int, topic: str = "orders", **system: Any) -> d.Message:
    pm = d.Message(topic=d.Resource(name=topic), body=b"body-%d" % i)
    sp = pm.system_properties
    sp.message_id = f"01{i:030X}"
    sp.message_type = d.NORMAL
    sp.body_encoding = d.IDENTITY
    sp.born_timestamp.seconds, sp.born_timestamp.nanos = 1_700_000_000 + i, 123_456_789
    sp.born_host = "10.0.0.7"
    sp.body_digest.type = d.MD5
    sp.body_digest.checksum = "0123456789abcdef"
    for name, value in system.items():
        if name == "body":
            pm.body = value
        elif name == "user":
            pm.user_properties.update(value)
        elif name == "keys":
            sp.keys.extend(value)
        elif isinstance(value, tuple):
            getattr(sp, name).seconds, getattr(sp, name).nanos = value
        else:
            setattr(sp, name, value)
    return pm


def request(*pms: d.Message) -> bytes:
    raw: bytes = s.SendMessageRequest(messages=list(pms)).SerializeToString()
    return raw


def test_a_plain_batch_is_built_natively_as_the_reference_builds_it() -> None:
    raw = request(*(plain(i) for i in range(128)))
    assert check(raw, TOPICS["NORMAL"])
    # what Apache's client leaves out: no digest, no born time, no host (the peer is used)
    bare = s.SendMessageRequest()
    for i in range(3):
        m = bare.messages.add(topic=d.Resource(name="orders"), body=b"x")
        m.system_properties.message_id = f"id-{i}"
        m.system_properties.message_type = d.NORMAL
    assert check(bare.SerializeToString(), TOPICS["NORMAL"])


@pytest.mark.parametrize(
    "system",
    [
        {"tag": "TagA"},
        {"keys": ["k1"]},
        {"keys": ["k1", "k 2"]},
        {"keys": ["k1", ""]},
        {"keys": ["k\u00e9"]},
        {"keys": ["k\x7f"]},
        {"keys": ["k" * (16 * 1024 + 1)]},
        {"user": {"a": "b"}},
        {"user": {"": "b"}},
        {"user": {"TAGS": "b"}},
        {"user": {"__SHARDINGKEY": "b"}},
        {"user": {"a": "b\x85c"}},  # a C1 control character (U+0085)
        {"user": {"a\x9f": "b"}},
        {"user": {"a": "b\x00"}},
        {"user": {"\u00e9": "\u00a0"}},  # not control characters
        {"user": {f"p{i}": "v" for i in range(129)}},
        {"user": {"a": "v" * (16 * 1024)}},
        {"message_group": "g"},
        {"message_group": ""},
        {"message_group": " "},
        {"message_group": "g" * 63},
        {"message_group": "g" * 64},
        {"message_group": "gr\u00fcppe"},
        {"message_group": "g\tg"},
        {"delivery_timestamp": (1_900_000_000, 0)},
        {"delivery_timestamp": (1_900_000_000_000, 5)},  # the Python client's milliseconds
        {"delivery_timestamp": (-3, -7)},
        {"delivery_timestamp": (2**62, 0)},
        {"delivery_timestamp": (-(2**62), 0)},
        {"body_encoding": d.GZIP},
        {"message_type": d.FIFO},
        {"message_type": d.TRANSACTION},
        {"message_id": ""},
        {"message_id": "   "},
        {"message_id": "a\x00b"},
        {"message_id": "x" * 129},
        {"message_id": "ünïcode"},
        {"body": b""},
        {"body": b"x" * 4097},
        {"born_host": "not-an-ip"},
        {"born_host": "::1"},
        {"born_timestamp": (-5, -1)},
        {"born_timestamp": (2**62, 999_999_999)},
        {"queue_id": 3},
        {"trace_context": "t"},
        {"store_host": "h"},
    ],
)
def test_each_message_off_the_plain_path_gets_the_references_answer(
    system: dict[str, Any],
) -> None:
    raw = request(plain(0), plain(1, **system), plain(2))
    for topic in TOPICS.values():
        check(raw, topic)


def test_hostile_and_foreign_shapes_go_to_the_reference_path() -> None:
    one = plain(0).SerializeToString()
    cases = [
        b"",  # no message
        request(plain(0), plain(1, topic="other")),  # two topics
        request(plain(0, topic="")),
        request(plain(0, topic="bad/topic")),
        b"\x0a" + bytes([len(one) + 1]) + one,  # length past the end
        b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # varint too long
        b"\x12\x00",  # field 2 of the request
        request(plain(0)) + b"\x0a\x02\x0a\x00",  # a message without body or id
        # the topic twice (protobuf merges them), a body twice (the last one wins)
        request(plain(0)) + b"\x0a\x06\x0a\x04\x12\x02ab",
        b"\x0a" + bytes([len(one) + 3]) + one + b"\x22\x01z",
        # a string that is not UTF-8, where protobuf refuses the request
        b"\x0a\x05\x0a\x03\x12\x01\xff",
        # a wire type protobuf does not expect for the field
        b"\x0a" + bytes([len(one) + 2]) + one + b"\x20\x01",
    ]
    for raw in cases:
        assert not check(raw, TOPICS["NORMAL"]), raw


def test_fields_in_another_order_decode_the_same() -> None:
    # fields in another order than protobuf writes them
    pm = plain(7)
    sp = pm.system_properties.SerializeToString()
    topic = pm.topic.SerializeToString()
    body = b"\x22\x03abc"
    msg = body + b"\x1a" + bytes([len(sp)]) + sp + b"\x0a" + bytes([len(topic)]) + topic
    raw = b"\x0a" + bytes([len(msg)]) + msg
    assert check(raw, TOPICS["NORMAL"])


def test_a_tagged_batch_is_built_natively_and_a_bad_tag_gets_the_references_answer() -> None:
    assert check(
        request(*(plain(i, tag="TagA" if i % 2 else "Tag B") for i in range(8))), TOPICS["NORMAL"]
    )
    too_long = "t" * (LIMITS.max_properties_bytes + 1)
    for tag in ("", " ", "a|b", "a\x7fb", "\u00e9t\u00e9", "a\tb", too_long):
        raw = request(plain(0, tag="ok"), plain(1, tag=tag))
        assert not check(raw, TOPICS["NORMAL"]), tag
        assert isinstance(reference(raw, TOPICS["NORMAL"], 0), int | tuple)


def test_keys_properties_groups_and_delivery_times_are_built_natively() -> None:
    """What Apache's clients send beside a plain body: keys, user properties (sorted by name
    on both paths, decision 390), a message group (its queue by CRC32) and a delivery time,
    each to the topic type that takes it, byte-identical to the reference."""

    def rich(i: int, **system: Any) -> d.Message:
        return plain(
            i,
            tag="TagA",
            keys=[f"order-{i}", "k\u0021"],
            user={"zeta": "1", "alpha": "\u00e9t\u00e9 \u00a0", "m": "", f"p{i}": "x"},
            **system,
        )

    assert check(request(*(rich(i) for i in range(16))), TOPICS["NORMAL"])
    fifo = request(*(rich(i, message_type=d.FIFO, message_group=f"g{i % 3}") for i in range(16)))
    assert check(fifo, TOPICS["FIFO"])
    delays = request(
        *(
            rich(i, message_type=d.DELAY, delivery_timestamp=(1_900_000_000 + i, 7))
            for i in range(4)
        ),
        rich(9, message_type=d.DELAY, delivery_timestamp=(1_900_000_000_123, 0)),
    )
    assert check(delays, TOPICS["DELAY"])
    scanned = scan_send_request(fifo)
    made = scanned_batch(scanned.messages, TOPICS["FIFO"], 0, LIMITS, PEER, len(fifo))
    assert made is not None
    # a group's queue is its own, not the round robin's
    assert [m.queue_id for m in made[0][:3]] == [zlib.crc32(b"g%d" % i) % 4 for i in range(3)]
    assert list(made[0][0].properties) == [
        "alpha",
        "m",
        "p0",
        "zeta",
        "TAGS",
        "KEYS",
        "UNIQ_KEY",
        "__MESSAGE_TYPE",
        "__SHARDINGKEY",
    ]


def test_a_transactional_batch_is_built_natively_unless_it_names_a_recovery_duration() -> None:
    """Half messages take the walker too (decision 470): the same Messages, properties and
    records as the reference; a message with an orphaned-transaction recovery duration (which
    the broker stores per half message) and a NORMAL message sent to a transactional topic go
    to the reference path."""
    tx = TOPICS["TRANSACTION"]
    rich = [
        plain(i, message_type=d.TRANSACTION, tag="t", keys=[f"k{i}"], user={"b": "2", "a": "1"})
        for i in range(5)
    ]
    assert check(request(*rich), tx)
    assert check(request(*(plain(i, message_type=d.TRANSACTION) for i in range(3))), tx)
    recovery = plain(9, message_type=d.TRANSACTION)
    recovery.system_properties.orphaned_transaction_recovery_duration.seconds = 30
    assert not check(request(*rich, recovery), tx)
    assert not check(request(plain(1)), tx)  # NORMAL to a transactional topic
    assert reference(request(plain(1)), tx, 0) == d.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE


def test_hand_made_property_entries_agree_with_protobuf() -> None:
    """Map entries protobuf reads in its own way: a missing key or value is empty, the value
    before the key, a name given twice (protobuf keeps the last: the reference path), a field
    repeated inside an entry."""
    base: bytes = plain(0).SerializeToString()

    def with_entry(entry: bytes) -> bytes:
        msg = base + b"\x12" + bytes([len(entry)]) + entry
        return b"\x0a" + bytes([len(msg)]) + msg

    def entry(*fields: tuple[int, bytes]) -> bytes:
        return b"".join(bytes([f << 3 | 2, len(v)]) + v for f, v in fields)

    taken = [
        with_entry(entry((1, b"k"))),  # no value: ""
        with_entry(entry((2, b"v"), (1, b"k"))),  # value first
    ]
    refused_or_reference = [
        with_entry(entry((2, b"v"))),  # no key: "" is refused
        with_entry(entry((1, b"k"), (1, b"j"), (2, b"v"))),
        with_entry(entry((1, b"k"), (2, b"\xff"))),  # not UTF-8
        with_entry(entry((1, b"k"), (3, b"v"))),  # unknown field
        with_entry(b"\x08\x01"),  # a varint key
    ]
    for raw in taken:
        assert check(raw, TOPICS["NORMAL"]), raw
    for raw in refused_or_reference:
        assert not check(raw, TOPICS["NORMAL"]), raw
    pm = plain(0, user={"k": "first"}).SerializeToString()
    again = (
        pm + b"\x12" + bytes([len(entry((1, b"k"), (2, b"last")))]) + entry((1, b"k"), (2, b"last"))
    )
    twice = b"\x0a" + bytes([len(again)]) + again
    assert not check(twice, TOPICS["NORMAL"])
    ref = reference(twice, TOPICS["NORMAL"], 0)
    assert isinstance(ref, tuple) and ref[0][0].properties["k"] == "last"


_text = st.one_of(
    st.sampled_from(["", " ", "orders", "01ABC", "10.0.0.1", "::1", "a|b", "a b", "\x7f", "é"]),
    st.text(max_size=12),
)


_name = st.sampled_from(["a", "b", "zz", "\u00e9", "TAGS", "UNIQ_KEY", "__SHARDINGKEY", "a\x85"])


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    out = s.SendMessageRequest()
    for i in range(draw(st.integers(0, 5))):
        pm = out.messages.add()
        if draw(st.booleans()) or i == 0:
            pm.topic.name = draw(st.sampled_from(["orders", "orders", "other", "", "a b"]))
        pm.body = draw(st.one_of(st.binary(max_size=40), st.just(b"y" * 4097)))
        sp = pm.system_properties
        sp.message_id = draw(st.one_of(st.just(f"id-{i}"), _text))
        sp.message_type = draw(
            st.sampled_from([d.NORMAL, d.NORMAL, d.FIFO, d.FIFO, d.DELAY, d.DELAY, 0, 9, -1])
        )
        sp.body_encoding = draw(st.sampled_from([d.IDENTITY, d.GZIP, 0, 7]))
        if draw(st.booleans()):
            sp.born_timestamp.seconds = draw(st.integers(-(2**63), 2**63 - 1))
            sp.born_timestamp.nanos = draw(st.integers(-(2**31), 2**31 - 1))
        if draw(st.booleans()):
            sp.born_host = draw(_text)
        if draw(st.integers(0, 5)) == 0:
            sp.tag = draw(_text)
        for _ in range(draw(st.integers(0, 3))):
            sp.keys.append(draw(st.one_of(st.just(f"key-{i}"), _text)))
        for _ in range(draw(st.integers(0, 3))):
            pm.user_properties[draw(st.one_of(_name, _text))] = draw(_text)
        if draw(st.integers(0, 3)) == 0:
            sp.message_group = draw(st.one_of(st.sampled_from(["g1", "g2"]), _text))
        if draw(st.integers(0, 4)) == 0:
            sp.delivery_timestamp.seconds = draw(
                st.one_of(st.integers(0, 2**40), st.integers(-(2**63), 2**63 - 1))
            )
            sp.delivery_timestamp.nanos = draw(st.integers(-(2**31), 2**31 - 1))
    raw: bytes = out.SerializeToString()
    # hostile bytes: a few flipped, cut short, or pasted in
    for _ in range(draw(st.integers(0, 2))):
        if not raw:
            break
        at = draw(st.integers(0, len(raw) - 1))
        how = draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip":
            raw = raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1 :]
        elif how == "cut":
            raw = raw[:at]
        else:
            raw = raw[:at] + draw(st.binary(min_size=1, max_size=4)) + raw[at:]
    return raw


@settings(max_examples=800, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=requests(), kind=st.sampled_from(sorted(TOPICS)), first=st.integers(0, 10))
def test_random_and_hostile_requests_agree_with_the_reference(
    raw: bytes, kind: str, first: int
) -> None:
    check(raw, TOPICS[kind], first)


def test_random_bytes_are_never_taken_when_protobuf_refuses_them() -> None:
    rng = random.Random(310)
    base = request(*(plain(i) for i in range(4)))
    taken = 0
    for _ in range(6_000):
        raw = bytearray(base)
        for _ in range(rng.randint(1, 3)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        taken += check(bytes(raw), TOPICS["NORMAL"], rng.randrange(8))
    assert taken > 0  # some mutations (of a body, say) keep the batch plain


def test_a_send_is_authorized_on_its_bytes_for_every_topic_it_names() -> None:
    from broker.acl import PUB
    from broker.authorization import send_resources as resources

    assert resources(request(plain(0), plain(1))) == [("topic", "orders", (PUB,))]
    # off the walker's path: protobuf reads the topics, every one of them
    two = request(plain(0, topic="zeta", tag="t"), plain(1, topic="alpha"))
    assert resources(two) == [
        ("topic", "alpha", (PUB,)),
        ("topic", "zeta", (PUB,)),
    ]
    assert resources(b"\x0a\x05garbage") is None  # the policy answers "malformed request"


def pulled_by_id(node: Any, count: int) -> dict[str, d.Message]:
    """Topic ``orders`` (2 queues) pulled by message id, until ``count`` are there (dispatch
    runs behind the answer) or 30 s have passed."""
    from broker_harness import pull_all

    pulled: dict[str, d.Message] = {}
    deadline = time.monotonic() + 30
    while len(pulled) < count and time.monotonic() < deadline:
        pulled = {m.system_properties.message_id: m for m in pull_all(node, "orders", 2)}
        time.sleep(0.2)
    return pulled


def test_a_broker_stores_the_same_records_from_either_path(tmp_path: Any) -> None:
    """Through a real broker: a batch the walker takes and the same batch sent down the
    reference path (a ``queue_offset`` the walker does not take and the broker ignores) are
    stored alike, answered alike, and pulled back alike."""
    import grpc
    from broker_harness import Standalone
    from rocketmq.grpc_protocol import service_pb2_grpc

    node = Standalone(tmp_path / "data").start()
    try:
        node.create_topic("orders", queues=2)
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        sent: dict[str, list[d.Message]] = {"native": [], "reference": []}
        paths: list[tuple[str, dict[str, Any]]] = [
            ("native", {}),
            ("reference", {"queue_offset": 1}),
        ]
        for path, extra in paths:
            pms = [
                plain(
                    i,
                    message_id=f"{path}-{i}",
                    tag="t",
                    keys=[f"k{i}", "shared"],
                    user={"z": str(i), "a": "\u00e9"},
                    **extra,
                )
                for i in range(6)
            ]
            pms[2].body = bytes(range(256)) * 3
            pms[3].system_properties.born_host = "not-an-ip"  # the peer's address is stored
            raw = request(*pms)
            assert (scan_send_request(raw) is None) == (path == "reference")
            reply = stub.SendMessage(s.SendMessageRequest.FromString(raw), timeout=30)
            assert reply.status.code == d.OK, reply.status
            assert [e.message_id for e in reply.entries] == [f"{path}-{i}" for i in range(6)]
            assert [e.status.code for e in reply.entries] == [d.OK] * 6
            sent[path] = pms
        pulled = pulled_by_id(node, 12)
    finally:
        node.stop()
    assert len(pulled) == 12
    for i in range(6):
        native_m, reference_m = pulled[f"native-{i}"], pulled[f"reference-{i}"]
        assert native_m.body == reference_m.body == sent["native"][i].body
        assert native_m.user_properties == reference_m.user_properties == {"z": str(i), "a": "é"}
        a, b = native_m.system_properties, reference_m.system_properties
        assert (a.tag, list(a.keys)) == (b.tag, list(b.keys)) == ("t", [f"k{i}", "shared"])
        assert (a.born_timestamp, a.born_host, a.message_type, a.queue_id) == (
            b.born_timestamp,
            b.born_host,
            b.message_type,
            b.queue_id,
        )
        assert a.born_timestamp.ToMilliseconds() == (1_700_000_000 + i) * 1000 + 123
    assert pulled["native-3"].system_properties.born_host == "127.0.0.1"


def test_a_broker_commits_half_messages_from_either_path_alike(tmp_path: Any) -> None:
    """Transactional batches through a real broker (decision 471): one the walker takes and the
    same one sent down the reference path are answered with transaction ids, and once
    committed are delivered with the same bodies, tags, keys, properties and type."""
    import grpc
    from broker_harness import Standalone
    from rocketmq.grpc_protocol import service_pb2_grpc

    node = Standalone(tmp_path / "data").start()
    try:
        node.create_topic("orders", queues=2, message_type="TRANSACTION")
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        paths: list[tuple[str, dict[str, Any]]] = [
            ("native", {}),
            ("reference", {"queue_offset": 1}),  # a field the walker does not take
        ]
        for path, extra in paths:
            pms = [
                plain(
                    i,
                    message_id=f"{path}-{i}",
                    message_type=d.TRANSACTION,
                    tag="t",
                    keys=[f"k{i}"],
                    user={"z": str(i), "a": "\u00e9"},
                    **extra,
                )
                for i in range(4)
            ]
            raw = request(*pms)
            assert (scan_send_request(raw) is None) == (path == "reference")
            reply = stub.SendMessage(s.SendMessageRequest.FromString(raw), timeout=30)
            assert reply.status.code == d.OK, reply.status
            assert [e.message_id for e in reply.entries] == [f"{path}-{i}" for i in range(4)]
            for e in reply.entries:
                assert e.transaction_id
                end = stub.EndTransaction(
                    s.EndTransactionRequest(
                        topic=d.Resource(name="orders"),
                        message_id=e.message_id,
                        transaction_id=e.transaction_id,
                        resolution=d.COMMIT,
                        source=d.SOURCE_CLIENT,
                    ),
                    timeout=30,
                )
                assert end.status.code == d.OK, end.status
        pulled = pulled_by_id(node, 8)  # once committed and dispatched
    finally:
        node.stop()
    assert len(pulled) == 8
    for i in range(4):
        a, b = pulled[f"native-{i}"], pulled[f"reference-{i}"]
        assert a.body == b.body == b"body-%d" % i
        assert a.user_properties == b.user_properties == {"z": str(i), "a": "é"}
        sa, sb = a.system_properties, b.system_properties
        assert (sa.tag, list(sa.keys), sa.message_type) == (sb.tag, list(sb.keys), sb.message_type)
        assert (sa.tag, list(sa.keys), sa.message_type) == ("t", [f"k{i}"], d.TRANSACTION)
        assert (sa.born_timestamp, sa.born_host) == (sb.born_timestamp, sb.born_host)


def test_spans_of_ipv6_hosts_and_many_queues_encode_as_their_messages() -> None:
    """IPv6 born and store hosts widen the record header, and a batch over more queues than
    the encoder tracks without its dict (32) takes the dict for the rest; FIFO messages go to
    their group's queue: the spans' records are still the reference's, byte for byte
    (decision 700)."""
    normal = [plain(i, born_host="::1" if i % 3 else "10.0.0.8", tag="t") for i in range(90)]
    fifo = [
        plain(i, born_host="::1", message_type=d.FIFO, message_group=f"g{i % 7}") for i in range(50)
    ]
    for kind, pms in (("NORMAL", normal), ("FIFO", fifo)):
        topic = TopicConfig(name="orders", queues=40, message_type=kind)
        raw = request(*pms)
        scanned = scan_send_request(raw)
        assert scanned is not None
        made = scanned_batch(scanned.messages, topic, 3, LIMITS, PEER, len(raw))
        spans = scanned_batch(scanned.spans, topic, 3, LIMITS, PEER, len(raw))
        assert made is not None and spans is not None
        assert spans[0].messages() == made[0]
        for host in (("10.1.1.1", 10911), ("fe80::2", 10911)):
            want = encoded(made[0], "python", store_host=host)
            assert encoded(spans[0], "native", store_host=host) == want
            want = encoded(made[0], "python", 5000, host)
            assert encoded(spans[0], "native", 5000, host) == want
        queues = {m.queue_id for m in made[0]}
        assert len(queues) == (40 if kind == "NORMAL" else 7)


def test_the_store_checks_spans_as_it_checks_messages(tmp_path: Any) -> None:
    """``put_messages`` refuses a ``RecordSpans`` batch with a bad topic, queue id or body size
    with the error it gives the same ``Message`` objects, and stores nothing (decision 700)."""
    import struct

    from tiered.config import StoreConfig
    from tiered.store import InvalidMessageError, MessageStore

    store = MessageStore(StoreConfig(data_dir=tmp_path, max_message_size=64))
    store.start()
    try:

        def spans(topic: str, queue_id: int, body: bytes) -> RecordSpans:
            props = b"UNIQ_KEY\x01x\x02"
            fields = struct.pack("=7q", 0, len(body), 0, len(props), 5, queue_id, 0)
            return RecordSpans(
                topic, body, fields * 2, props, ["10.0.0.1"], [None] * 2, [None] * 2, ["x", "x"]
            )

        for bad in (
            spans("a b", 0, b"x"),
            spans("t", -1, b"x"),
            spans("t", 1 << 20, b"x"),
            spans("t", 0, b"y" * 65),
        ):
            with pytest.raises(InvalidMessageError) as by_spans:
                store.put_messages(bad)
            with pytest.raises(InvalidMessageError) as by_messages:
                store.put_messages(bad.messages())
            assert str(by_spans.value) == str(by_messages.value)
        assert store.max_physical_offset == 0
        good = spans("t", 1, b"z" * 64)
        offsets = store.put_messages(good).queue_offsets
        assert list(offsets) == [0, 1]
    finally:
        store.shutdown()
