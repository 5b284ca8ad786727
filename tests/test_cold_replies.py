"""Cold reads answered with replies the cold worker wrote (decision 400): the bytes a PullMessage
client receives are exactly the reference path's, for every shape of message, across segments
and batches, through a real worker process; a damaged segment fails them as it fails a read."""

from __future__ import annotations

import hashlib
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from rocketmq.grpc_protocol import service_pb2 as s

from broker.reply import (
    encode_pull_replies,
    encode_pull_replies_decoded,
    encode_pull_replies_py,
    pull_reply,
)
from offload.offloader import Offloader, OffloadPolicy
from tiered.cold.fetcher import ColdFetcher
from tiered.cold.segment import SegmentError
from tiered.cold.storage import open_store
from tiered.cold.worker import ColdWorker, run_job, warm_up
from tiered.config import StoreConfig
from tiered.record import Message, RecordEncoder, RecordError, decode_many
from tiered.store import MessageStore

# Property sets of every shape the writer meets: none, system ones only, keys with empty parts,
# tags, a FIFO group, a delay (plain digits and not), UTF-8, empty names and values, and several
# user properties (whose order protobuf's map decides: the reference writes those).
PROPERTIES: list[dict[str, str]] = [
    {},
    {"UNIQ_KEY": "7F0000010001B4AAC00000000000001A"},
    {"UNIQ_KEY": "u", "TAGS": "TagA", "KEYS": "k1  k2 ", "__SHARDINGKEY": "group-1"},
    {"__MESSAGE_TYPE": "FIFO", "__SHARDINGKEY": "g"},
    {"__STARTDELIVERTIME": "1700000000123", "__MESSAGE_TYPE": "DELAY"},
    {"__STARTDELIVERTIME": "12x"},
    {"__STARTDELIVERTIME": "\u00b2"},
    {"TAGS": "étiquette 中", "KEYS": "ключ", "order": "ü"},
    {"u1": ""},
    {"": "v"},
    {"u1": "a", "u2": "b", "u3": ""},
    {"TRACE_ON": "true", "__MESSAGE_TYPE": "TRANSACTION", "app": "x"},
]


def records(n: int, seed: int) -> tuple[bytes, list[int]]:
    """``n`` records of every shape above, back to back, and where each starts."""
    rng = random.Random(seed)
    encoder = RecordEncoder(("10.1.2.3", 10911))
    parts, positions, at = [], [], 0
    for i in range(n):
        m = Message(
            topic=rng.choice(["cold", "%RETRY%g_cold", "t" * 120]),
            queue_id=rng.choice([0, 1, 7, 1023]),
            body=os.urandom(rng.choice([0, 1, 127, 128, 1024, 20_000])),
            properties=dict(PROPERTIES[i % len(PROPERTIES)]),
            born_timestamp=rng.choice([0, 1, 999, 1000, 1_700_000_000_123, -1, -1001]),
            born_host=rng.choice([("1.2.3.4", 5), ("::1", 60000)]),
            reconsume_times=rng.choice([0, 3, 16]),
        )
        record, _, _ = encoder.encode(m, rng.randrange(1 << 40), at, rng.choice([0, 1, 10**13]))
        parts.append(record)
        positions.append(at)
        at += len(record)
    return b"".join(parts), positions


def split(replies: tuple[bytes, list[int], list[int]]) -> list[bytes]:
    buffer, ends, _ = replies
    return [buffer[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def assert_same_replies(got: list[bytes], expected: list[bytes]) -> None:
    """Byte for byte, except that a message with several user properties may list them in
    another order: protobuf writes a map in its hash table's order, which changes from process
    to process, so there the parsed messages (properties included) must be equal."""
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a == b:
            continue
        parsed_a, parsed_b = (
            s.PullMessageResponse.FromString(a),
            s.PullMessageResponse.FromString(b),
        )
        assert parsed_a == parsed_b, i
        assert len(parsed_a.message.user_properties) > 1, i
        assert len(a) == len(b), i


def test_native_pull_replies_are_byte_identical_to_the_reference() -> None:
    data, positions = records(600, seed=1)
    native = encode_pull_replies(data, positions)
    reference = encode_pull_replies_py(data, positions)
    assert_same_replies(split(native), split(reference))
    assert native[2] == reference[2]  # body sizes
    several = [
        i
        for i, raw in enumerate(split(reference))
        if len(s.PullMessageResponse.FromString(raw).message.user_properties) > 1
    ]
    assert several  # the case the map order matters for is covered
    assert sum(split(native)[i] == split(reference)[i] for i in range(600)) >= 600 - len(several)
    # And the reference is what PullMessage sent before: the decoded message, as protobuf.
    messages = decode_many(data, positions, check_crc=True)
    for raw, m in zip(split(native), messages, strict=True):
        parsed = s.PullMessageResponse.FromString(raw)
        assert parsed.message.body == m.body
        assert parsed.message.system_properties.queue_offset == m.queue_offset
        assert parsed == s.PullMessageResponse.FromString(pull_reply(m))


def test_the_native_md5_is_hashlibs() -> None:
    """The writer's own MD5 (the body digest, decision 481) on every length around its block
    and padding boundaries, and on large bodies."""
    from broker import _reply_native  # type: ignore[attr-defined]

    for n in [*range(0, 200), 1024, 4095, 4096, 20_000, 1 << 20]:
        data = os.urandom(n)
        assert _reply_native.md5(data) == hashlib.md5(data).digest(), n


def test_the_many_buffer_md5_is_hashlibs() -> None:
    """The writer digests a run's bodies eight side by side (decision 640): every length around
    the block and padding boundaries, shuffled among long ones so lanes end at different blocks
    and take the next body mid-run, and every count from none to past two rounds of lanes."""
    from broker import _reply_native  # type: ignore[attr-defined]

    rng = random.Random(640)
    lengths = [*range(0, 200), *[rng.randrange(0, 5000) for _ in range(300)], 1024, 4096, 1 << 20]
    rng.shuffle(lengths)
    buffers = [rng.randbytes(n) for n in lengths]
    assert _reply_native.md5_many(buffers) == [hashlib.md5(b).digest() for b in buffers]
    for count in range(18):
        some = buffers[count * 7 : count * 8]
        assert _reply_native.md5_many(some) == [hashlib.md5(b).digest() for b in some], count
    with pytest.raises(TypeError, match="md5_many takes bytes"):
        _reply_native.md5_many([b"a", bytearray(b"b")])


def test_apaches_python_client_verifies_every_digest_the_writer_wrote() -> None:
    """Apache's Python client reads each reply the record writer wrote (bodies of every size,
    their digests from the eight-lane MD5) and finds no body corrupt; one body byte changed
    after the writing and it does."""
    from rocketmq.v5.model.message import Message as ClientMessage

    data, positions = records(600, seed=3)
    replies = split(encode_pull_replies(data, positions))
    for raw in replies:
        message = s.PullMessageResponse.FromString(raw).message
        assert not ClientMessage().fromProtobuf(message).corrupted
    damaged = s.PullMessageResponse.FromString(replies[1]).message
    damaged.body = bytes([damaged.body[0] ^ 1]) + damaged.body[1:] if damaged.body else b"x"
    assert ClientMessage().fromProtobuf(damaged).corrupted


def test_replies_from_record_bytes_are_those_from_decoded_messages() -> None:
    """The writer that reads records (decision 481) writes exactly the bytes of the one that
    reads decoded messages (decision 400), record order of user properties included, on the
    600 records of every shape above (IPv6 hosts, UTF-8, delays that are not digits: the
    records it hands to its fallback) and on the bench's plain ones."""
    data, positions = records(600, seed=2)
    assert encode_pull_replies(data, positions) == encode_pull_replies_decoded(data, positions)
    encoder = RecordEncoder(("10.200.3.4", 60000))
    parts, positions, at = [], [], 0
    for i in range(300):
        m = Message(
            topic="cold",
            queue_id=i % 3,
            body=os.urandom(1024),
            properties={"UNIQ_KEY": f"{i:032X}"} if i % 2 else {},
            born_host=("192.168.255.1", 1),
            reconsume_times=i % 2,
        )
        record, _, _ = encoder.encode(m, i * 2000, at, i)
        parts.append(record)
        positions.append(at)
        at += len(record)
    data = b"".join(parts)
    assert encode_pull_replies(data, positions) == encode_pull_replies_decoded(data, positions)
    assert encode_pull_replies(b"", []) == (b"", [], [])


# Property bytes a dict of str cannot produce, written over a value of the same length: pairs
# with one name twice, empty pairs, a name without a value, \x01 in a value, and UTF-8 of every
# kind, valid (2, 3 and 4 bytes) and not (a stray byte, an overlong form, a surrogate, past
# U+10FFFF, a truncated sequence).
RAW_VALUES = [
    b"a\x02b\x01c\x02a\x01d",
    b"\x02\x02x\x01y\x02\x02",
    b"\x02noval\x02",
    b"\x02z\x01p\x01q\x02",
    b"\xc3\xa9\xe4\xb8\xad\xf0\x9f\x98\x80",
    b"\x02TAGS\x01\xc3\xa9\x02",
    b"\xff",
    b"\xc0\xaf",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xe4\xb8",
    b"\x02__STARTDELIVERTIME\x01" + b"9" * 18,
    b"\x02__STARTDELIVERTIME\x01" + b"9" * 19,
    b"\x02__MESSAGE_TYPE\x01FIFO\x02",
    b"\x02__MESSAGE_TYPE\x01nope\x02",
    b"\x02__MESSAGE_TYPE\x01\x02",
]


@pytest.mark.parametrize("raw", RAW_VALUES)
def test_replies_from_record_bytes_on_adversarial_properties(raw: bytes) -> None:
    """Either both writers write the same bytes, or both refuse the record with the same
    error (properties that are not UTF-8). A delivery time past protobuf's Timestamp range is
    left out by both (decision 530)."""
    placeholder = "P" * len(raw)
    record, _, _ = RecordEncoder(("10.1.2.3", 10911)).encode(
        Message(topic="t", queue_id=0, body=b"b", properties={"UNIQ_KEY": "u", "v": placeholder}),
        7,
        0,
        0,
    )
    at = record.index(placeholder.encode())
    data = record[:at] + raw + record[at + len(raw) :]
    try:
        expected = encode_pull_replies_decoded(data, [0])
    except (RecordError, ValueError) as e:
        with pytest.raises(type(e), match=re.escape(str(e))):
            encode_pull_replies(data, [0])
        return
    assert encode_pull_replies(data, [0]) == expected


def test_the_writer_is_in_use() -> None:
    """The native twin is built (``pip install -e .``): otherwise the test above compared the
    reference with itself."""
    import broker.reply

    assert broker.reply._NATIVE is not None


@pytest.fixture(scope="module")
def archive(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[bytes]]]:
    """1,200 messages of every shape in one queue, offloaded as 5 segments of 240."""
    root = tmp_path_factory.mktemp("replies")
    store = MessageStore(StoreConfig(data_dir=root / "hot"))
    store.start()
    rng = random.Random(7)
    try:
        store.put_messages(
            [
                Message(
                    topic="t",
                    queue_id=0,
                    body=os.urandom(rng.choice([0, 10, 900, 5000])),
                    properties=dict(PROPERTIES[i % len(PROPERTIES)]),
                )
                for i in range(1200)
            ]
        )
        assert store.wait_dispatched()
        tier = open_store(f"file://{root}/tier")
        Offloader(store, tier, "c", "b", OffloadPolicy(segment_max_messages=240)).offload_queue(
            "t", 0
        )
        expected = [pull_reply(m) for m in store.get_messages("t", 0, 0, 1200, 1 << 30).messages]
    finally:
        store.shutdown()
    yield root, expected


@pytest.fixture(scope="module")
def worker(archive: tuple[Path, list[bytes]]) -> Iterator[ColdWorker]:
    root, _ = archive
    w = ColdWorker(f"file://{root}/tier")
    w.start()
    run_job(w, warm_up)
    yield w
    w.close()


def test_replies_through_the_worker_are_the_reference_across_segments_and_batches(
    archive: tuple[Path, list[bytes]], worker: ColdWorker
) -> None:
    root, expected = archive
    tier = open_store(f"file://{root}/tier")
    fetcher = ColdFetcher(
        tier, "c", "b", runner=worker, reply_encoder=encode_pull_replies, read_timeout_s=60
    )
    try:
        assert len(fetcher.manifest("t", 0).segments) == 5
        got: list[bytes] = []
        offset, rng = 0, random.Random(3)
        while offset < 1200:
            # Reads bounded by count and by bytes, starting anywhere in a batch or segment.
            replies, nxt, body_bytes = fetcher.get_replies(
                "t", 0, offset, rng.choice([1, 7, 100, 500]), rng.choice([1, 4000, 1 << 20])
            )
            assert replies and nxt == offset + len(replies)
            assert body_bytes == sum(
                len(s.PullMessageResponse.FromString(r).message.body) for r in replies
            )
            got += replies
            offset = nxt
        assert_same_replies(got, expected)
        # A read from the middle of the third segment, past its end: stops at the segment.
        replies, nxt, _ = fetcher.get_replies("t", 0, 500, 1000, 1 << 30)
        assert_same_replies(replies, expected[500:720])
        assert nxt == 720
    finally:
        fetcher.close()


def test_the_broker_store_answers_a_cold_pull_with_the_replies(
    archive: tuple[Path, list[bytes]], worker: ColdWorker, tmp_path: Path
) -> None:
    """``MessageStore.get_messages(replies=True)`` below the hot store: the replies, and the
    same offsets and status as the decoded read; with a filter, the decoded read."""
    root, expected = archive
    tier = open_store(f"file://{root}/tier")
    fetcher = ColdFetcher(
        tier, "c", "b", runner=worker, reply_encoder=encode_pull_replies, read_timeout_s=60
    )
    # "force": read the archive wherever it holds the offset (this hot store starts at 0).
    store = MessageStore(
        StoreConfig(data_dir=tmp_path / "hot", read_from_tier="force"), cold=fetcher
    )
    store.start()
    try:
        store.put_messages([Message(topic="t", queue_id=0, body=b"x")])  # the queue exists
        assert store.wait_dispatched()
        fetcher.manifest("t", 0)
        answered = store.get_messages("t", 0, 230, 32, replies=True)
        decoded = store.get_messages("t", 0, 230, 32)
        assert answered.replies is not None
        assert_same_replies(answered.replies, [pull_reply(m) for m in decoded.messages])
        assert_same_replies(answered.replies, expected[230:240])
        assert (answered.status, answered.next_offset) == (decoded.status, decoded.next_offset)
        filtered = store.get_messages("t", 0, 230, 32, tag_filter=lambda _: True, replies=True)
        assert filtered.replies is None and len(filtered.messages) == 10
    finally:
        store.shutdown()
        fetcher.close()


def test_a_damaged_segment_fails_replies_with_the_same_error_as_a_read(
    archive: tuple[Path, list[bytes]], worker: ColdWorker, tmp_path: Path
) -> None:
    root, _ = archive
    tier = open_store(f"file://{root}/tier")
    info = ColdFetcher(tier, "c", "b").manifest("t", 0).segments[1]
    path = root / "tier" / info.key
    original = path.read_bytes()
    damaged = bytearray(original)
    damaged[600] ^= 0xFF  # inside the segment's first records
    path.write_bytes(bytes(damaged))
    try:
        errors = []
        for encoder in (encode_pull_replies, None):
            fetcher = ColdFetcher(
                tier, "c", "b", runner=worker, reply_encoder=encoder, read_timeout_s=60
            )
            with pytest.raises(SegmentError) as caught:
                if encoder is None:
                    fetcher.get("t", 0, info.base_offset, 10)
                else:
                    fetcher.get_replies("t", 0, info.base_offset, 10)
            fetcher.close()
            errors.append(str(caught.value))
        assert errors[0] == errors[1]
        assert info.key in errors[0] and "record at" in errors[0]
    finally:
        path.write_bytes(original)


def test_a_replay_by_replies_carries_no_records_and_a_read_still_decodes(
    archive: tuple[Path, list[bytes]], worker: ColdWorker
) -> None:
    """Decision 705: the batches ``get_replies`` reads through the worker hold only replies
    (the records stay in the worker: half the bytes through the pipe), and those ``get``
    reads hold only records (no replies written for it); each read answers as before from
    the same cache."""
    root, expected = archive
    tier = open_store(f"file://{root}/tier")
    fetcher = ColdFetcher(
        tier, "c", "b", runner=worker, reply_encoder=encode_pull_replies, read_timeout_s=60
    )
    try:
        replies, nxt, _ = fetcher.get_replies("t", 0, 250, 100, 1 << 30)
        assert nxt == 350
        assert_same_replies(replies, expected[250:350])
        with fetcher._lock:
            cached = list(fetcher._cache.values())
        assert cached and all(s.data == b"" and s.replies is not None for s in cached)
        assert not any(s.has_records for s in cached)
        assert fetcher.bytes_fetched == sum(s.size for s in cached)
        decoded, nxt = fetcher.get("t", 0, 250, 100, max_bytes=1 << 30)
        assert nxt == 350
        assert_same_replies([pull_reply(m) for m in decoded], expected[250:350])
        with fetcher._lock:
            records = [s for k, s in fetcher._cache.items() if not k[-1]]
        assert records and all(s.data and s.replies is None for s in records)
    finally:
        fetcher.close()
