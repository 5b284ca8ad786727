"""ConsumeQueue and IndexFile agree with a brute-force scan of the CommitLog files.

100,000 random messages in 50 topics x 8 queues, with files small enough that the CommitLog,
the ConsumeQueues and the IndexFiles all roll many times. The scan reads the files straight from
disk with the record codec, independently of the store's own readers.
"""

from __future__ import annotations

import bisect
import dataclasses
import random
import shutil
from collections import defaultdict

import pytest
from conftest import brute_force_scan

from tiered.config import StoreConfig
from tiered.record import Message, StoredMessage, tag_hash
from tiered.store import GetStatus, MessageStore

N_MESSAGES = 100_000
TOPICS = [f"topic-{i:02d}" for i in range(50)]
QUEUES = 8


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> tuple[StoreConfig, list[StoredMessage]]:
    config = StoreConfig(
        data_dir=tmp_path_factory.mktemp("consistency") / "store",
        commitlog_file_size=1 << 20,
        consumequeue_entries_per_file=64,
        index_hash_slots=1009,
        index_max_entries=5000,
    )
    rng = random.Random(20261120)
    store = MessageStore(config)
    store.start()
    i = 0
    while i < N_MESSAGES:
        batch = []
        for _ in range(min(rng.randint(1, 200), N_MESSAGES - i)):
            topic = rng.choice(TOPICS)
            props = {"UNIQ_KEY": f"id-{i}", "KEYS": f"shared-{i % 7000} own-{i}"}
            if rng.random() < 0.8:
                props["TAGS"] = rng.choice(["red", "green", "blue"])
            batch.append(
                Message(
                    topic=topic,
                    queue_id=rng.randrange(QUEUES),
                    body=rng.randbytes(rng.randint(0, 600)),
                    properties=props,
                )
            )
            i += 1
        store.put_messages(batch)
    assert store.wait_dispatched(120)
    store.shutdown()
    scanned = brute_force_scan(config.commitlog_dir)
    assert len(scanned) == N_MESSAGES
    assert len(list(config.commitlog_dir.iterdir())) > 30, "the CommitLog should roll many times"
    assert len(list(config.index_dir.iterdir())) > 30, "the IndexFile should roll many times"
    return config, scanned


def by_queue(scanned: list[StoredMessage]) -> dict[tuple[str, int], list[StoredMessage]]:
    queues: dict[tuple[str, int], list[StoredMessage]] = defaultdict(list)
    for m in scanned:
        queues[(m.topic, m.queue_id)].append(m)
    return queues


def assert_consume_queues_match(store: MessageStore, scanned: list[StoredMessage]) -> None:
    queues = by_queue(scanned)
    assert len(queues) == len(TOPICS) * QUEUES
    for (topic, qid), expected in queues.items():
        assert [m.queue_offset for m in expected] == list(range(len(expected)))
        assert store.min_offset(topic, qid) == 0
        assert store.max_offset(topic, qid) == len(expected)
        got: list[StoredMessage] = []
        offset = 0
        while True:
            result = store.get_messages(topic, qid, offset, max_count=32)
            if result.status is not GetStatus.FOUND:
                assert result.status is GetStatus.OFFSET_OVERFLOW_ONE
                break
            got.extend(result.messages)
            offset = result.next_offset
        assert got == expected, f"{topic}/{qid} differs from the CommitLog scan"


def assert_index_matches(store: MessageStore, scanned: list[StoredMessage], sample: int) -> None:
    rng = random.Random(5)
    by_key: dict[tuple[str, str], list[StoredMessage]] = defaultdict(list)
    for m in scanned:
        for k in [*m.keys, m.msg_id]:
            by_key[(m.topic, k)].append(m)
    keys = rng.sample(sorted(by_key), sample)
    for topic, key in keys:
        expected = {m.commitlog_offset for m in by_key[(topic, key)]}
        got = {m.commitlog_offset for m in store.query_by_key(topic, key, max_count=1000)}
        assert got == expected, f"query {topic}#{key}"
    # A time window selects exactly the messages stored within it.
    multi = [k for k in keys if len(by_key[k]) >= 3][:200]
    assert multi
    for topic, key in multi:
        msgs = sorted(by_key[(topic, key)], key=lambda m: m.store_timestamp)
        lo, hi = msgs[1].store_timestamp, msgs[-1].store_timestamp
        expected = {m.commitlog_offset for m in msgs if lo <= m.store_timestamp <= hi}
        got = {m.commitlog_offset for m in store.query_by_key(topic, key, lo, hi, 1000)}
        assert got == expected
    assert store.query_by_key(TOPICS[0], "no-such-key") == []


def test_consume_queues_match_a_commitlog_scan(loaded, start_store) -> None:
    config, scanned = loaded
    store = start_store(config)
    assert_consume_queues_match(store, scanned)


def test_index_matches_a_commitlog_scan(loaded, start_store) -> None:
    config, scanned = loaded
    store = start_store(config)
    assert_index_matches(store, scanned, sample=4000)


def test_offset_for_timestamp_matches_a_scan(loaded, start_store) -> None:
    config, scanned = loaded
    store = start_store(config)
    rng = random.Random(9)
    queues = by_queue(scanned)
    for topic, qid in rng.sample(sorted(queues), 60):
        stamps = [m.store_timestamp for m in queues[(topic, qid)]]
        for ts in [stamps[0] - 1, *rng.sample(stamps, 5), stamps[-1] + 1]:
            assert store.offset_for_timestamp(topic, qid, ts) == bisect.bisect_left(stamps, ts)


def test_tag_filter_matches_a_scan(loaded, start_store) -> None:
    config, scanned = loaded
    store = start_store(config)
    red = tag_hash("red")
    for (topic, qid), expected in list(by_queue(scanned).items())[:40]:
        want = [m.queue_offset for m in expected if m.tags == "red"]
        got, offset = [], 0
        while offset < len(expected):
            result = store.get_messages(topic, qid, offset, 16, tag_filter=lambda code: code == red)
            got += [m.queue_offset for m in result.messages]
            assert all(m.tags == "red" for m in result.messages)
            offset = result.next_offset
        assert got == want


def test_deleted_consumequeue_and_index_dirs_are_rebuilt_identically(
    loaded, start_store, tmp_path
) -> None:
    config, scanned = loaded
    copy = dataclasses.replace(config, data_dir=tmp_path / "c")
    shutil.copytree(config.data_dir, copy.data_dir)
    shutil.rmtree(copy.consumequeue_dir)
    shutil.rmtree(copy.index_dir)
    store = MessageStore(copy)
    report = store.start()
    try:
        assert report.consumequeue_rebuilt
        assert_consume_queues_match(store, scanned)
        assert_index_matches(store, scanned, sample=1500)
    finally:
        store.shutdown()
