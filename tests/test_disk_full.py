"""A full disk, on a real tmpfs of a few MiB under a real broker process.

A refused batch is refused whole (nothing of it readable, now or after a restart), the refusal
says the disk is full, and a broker whose disk cannot hold one CommitLog file does not start.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from broker_harness import Standalone, pull_all
from conftest import SMALL, crash_after_writing, mounted_tmpfs
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from broker import admin_pb2 as apb
from broker.metadata import BrokerMetadata, GroupConfig
from broker.timer import ENTRY as TIMER_ENTRY
from broker.timer import PROPERTY_DELIVER_TIME, TimerLog, TimerService, as_timer_message
from tiered.config import StoreConfig
from tiered.record import PROPERTY_UNIQ_KEY, Message
from tiered.store import DiskFullError, GetStatus, MessageStore, StoreLoadError

GEOMETRY = {
    "commitlog_file_size": 1 << 20,
    "consumequeue_entries_per_file": 1000,
    "index_hash_slots": 1000,
    "index_max_entries": 4000,
}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 12 MiB tmpfs (root only)."""
    with mounted_tmpfs(tmp_path / "small", "12m") as mnt:
        yield mnt


def write_config(path: Path) -> Path:
    lines = ["[store]", *(f"{k} = {v}" for k, v in GEOMETRY.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_full_disk_refuses_whole_batches_clearly(small_disk: Path, tmp_path: Path) -> None:
    config = write_config(tmp_path / "tmq.toml")
    node = Standalone(
        small_disk / "data",
        flush="sync",
        extra=["--config", str(config), "--commitlog-file-size", "1MiB"],
    ).start()
    acked: set[str] = set()
    refused: set[str] = set()
    refusals: list[d.Status] = []
    try:
        node.create_topic("full", queues=2)
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        for n in range(200):
            request = s.SendMessageRequest()
            ids = []
            for i in range(24):
                m = request.messages.add(topic=d.Resource(name="full"), body=os.urandom(10_000))
                m.system_properties.message_id = f"{n:04d}-{i:02d}-{os.urandom(4).hex()}"
                m.system_properties.message_type = d.NORMAL
                ids.append(m.system_properties.message_id)
            reply = stub.SendMessage(request, timeout=60)
            if reply.status.code == d.OK:
                acked.update(ids)
            else:
                refused.update(ids)
                refusals.append(reply.status)
                if len(refusals) >= 3:
                    break
    finally:
        node.kill9()
    assert refusals, "a 12 MiB disk should fill up"
    assert acked, "the disk should take some batches first"
    for st in refusals:
        assert st.code == d.INTERNAL_SERVER_ERROR, st
        assert "disk is full" in st.message, st
    store = MessageStore(StoreConfig(data_dir=small_disk / "data", **GEOMETRY))  # type: ignore[arg-type]
    store.start()
    try:
        stored: set[str] = set()
        for queue in range(2):
            offset = 0
            while True:
                got = store.get_messages("full", queue, offset, 256)
                if got.status is not GetStatus.FOUND:
                    break
                stored.update(m.msg_id for m in got.messages)
                offset = got.next_offset
    finally:
        store.shutdown()
    assert not stored & refused, f"{len(stored & refused)} messages of refused batches stored"
    assert acked <= stored, f"{len(acked - stored)} acknowledged messages lost"


class _LogElsewhere(Standalone):
    """A broker whose log is not on its (full) data disk, so every line it writes is kept."""

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent.parent / "broker.log"


def test_a_producer_retrying_on_a_full_disk_gets_one_log_line_a_minute(
    small_disk: Path, tmp_path: Path
) -> None:
    """Every refusal is answered, but the log says so once a minute, not once a send: a
    producer retrying as fast as it is refused wrote one ERROR line a send (decision 1181)."""
    config = write_config(tmp_path / "tmq.toml")
    node = _LogElsewhere(
        small_disk / "data",
        flush="sync",
        extra=["--config", str(config), "--commitlog-file-size", "1MiB"],
    )
    assert not node.log_path.is_relative_to(small_disk)
    node.start()
    refusals: list[d.Status] = []
    try:
        node.create_topic("full", queues=1)
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        for n in range(400):
            request = s.SendMessageRequest()
            for i in range(24):
                m = request.messages.add(topic=d.Resource(name="full"), body=os.urandom(10_000))
                m.system_properties.message_id = f"{n:04d}-{i:02d}"
                m.system_properties.message_type = d.NORMAL
            reply = stub.SendMessage(request, timeout=60)
            if reply.status.code != d.OK:
                refusals.append(reply.status)
                if len(refusals) >= 50:
                    break
    finally:
        node.kill9()
    assert len(refusals) == 50, "a 12 MiB disk should fill up"
    for st in refusals:
        assert st.code == d.INTERNAL_SERVER_ERROR and "disk is full" in st.message, st
    lines = [ln for ln in node.log_path.read_text().splitlines() if "send refused" in ln]
    assert len(lines) == 1, f"{len(lines)} 'send refused' lines for 50 refusals: {lines[:3]}"
    assert "disk is full" in lines[0]


def test_a_broker_without_room_for_one_commitlog_file_does_not_start(small_disk: Path) -> None:
    node = Standalone(small_disk / "data", extra=["--commitlog-file-size", "64MiB"])
    with pytest.raises(RuntimeError) as e:
        node.start()
        node.stop()  # it should not have started
    assert "commitlog_file_size" in str(e.value)
    assert not (small_disk / "data" / "commitlog").exists()


def _fill_between_checkpoints(store: MessageStore, directory: Path) -> Path:
    """``_fill`` while no checkpoint save is under way. A save holds two pages for a moment
    (its ``.tmp`` and the checkpoint it replaces): a disk filled then has a page again once the
    rename frees the old one, every later save fits in it, and a shutdown meant to meet a full
    disk saved its checkpoint and exited cleanly (seen once under load)."""
    with store._checkpoint_lock:
        return _fill(directory)


def _fill(directory: Path) -> Path:
    """Take every free byte of ``directory``'s filesystem, as another writer on a shared disk
    does; returns the file to delete to give the space back."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        while True:
            os.write(fd, bytes(4096))  # page by page: not one page is left
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    return filler


def _stored_ids(store: MessageStore, topic: str) -> list[str]:
    got = store.get_messages(topic, 0, 0, 1000)
    assert got.status is GetStatus.FOUND, got.status
    return [str(m.msg_id) for m in got.messages]


@pytest.mark.parametrize(("flush", "single"), [("sync", False), ("async", False), ("sync", True)])
def test_a_disk_filled_by_another_writer_refuses_appends_only_while_it_is_full(
    small_disk: Path, flush: str, single: bool
) -> None:
    """A disk that another writer fills cannot take the checkpoint, which costs a longer
    recovery scan and nothing else: it is no failed fsync, and must not turn the store
    read-only until a restart (it did: every send was refused as "an fsync failed", even after
    the space came back; decision 295). Appends are refused while it is full, as the disk being
    full, since their IndexFile entries would have no room (decision 680; the preallocated
    CommitLog file took them before), and taken again once space is freed. ``single``: sent
    by ``put_message``, the native single send under SYNC (decision 820), which must refuse
    exactly as the Python path does."""
    config = StoreConfig(
        data_dir=small_disk / "data",
        flush=flush,  # type: ignore[arg-type]
        flush_interval_ms=20,
        **GEOMETRY,  # type: ignore[arg-type]
    )

    def put(n: int) -> str:
        msg_id = f"m{n:03d}"
        msg = Message(
            topic="full", queue_id=0, body=b"x" * 100, properties={PROPERTY_UNIQ_KEY: msg_id}
        )
        if single:
            store.put_message(msg)
        else:
            store.put_messages([msg])
        return msg_id

    def refused(n: int) -> None:
        with pytest.raises(DiskFullError) as e:
            put(n)
        assert "the disk is full" in str(e.value), e.value

    store = MessageStore(config)
    store.start()
    acked = [put(n) for n in range(5)]
    filler = _fill_between_checkpoints(store, small_disk)
    try:
        time.sleep(0.2)  # several flushes, each of which fails to write the checkpoint
        for n in range(5, 10):
            refused(n)
        time.sleep(0.2)
        store.flush()
        for n in range(10, 15):
            refused(n)
    finally:
        filler.unlink()
    time.sleep(0.1)
    acked += [put(n) for n in range(15, 20)]
    assert store.wait_dispatched()
    assert _stored_ids(store, "full") == acked
    # A shutdown while the disk is full again ends as a crash would (its checkpoint is stale),
    # and the next start finds every acknowledged message.
    filler = _fill_between_checkpoints(store, small_disk)
    try:
        store.shutdown()
    finally:
        filler.unlink()
    store = MessageStore(config)
    report = store.start()
    try:
        assert not report.clean_exit
        assert _stored_ids(store, "full") == acked
    finally:
        store.shutdown()


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_a_restart_on_a_full_disk_is_refused_clearly_and_loses_nothing(
    small_disk: Path, flush: str
) -> None:
    """Recovery after ``kill -9`` writes (IndexFile entries, the checkpoint): on a disk that
    another writer filled meanwhile it cannot. The start is refused with one line that says the
    disk is full (it raised ``BufferError: cannot close exported pointers exist``, the cleanup's
    error hiding the cause), and once space is freed the store starts with every message."""
    data_dir = small_disk / "store"
    crash_after_writing(data_dir, 200, flush)
    config = StoreConfig(data_dir=data_dir, flush=flush, **SMALL)  # type: ignore[arg-type]
    filler = _fill(small_disk)
    try:
        with pytest.raises(StoreLoadError) as e:
            MessageStore(config).start()
        assert "the disk is full" in str(e.value), e.value
    finally:
        filler.unlink()
    store = MessageStore(config)
    store.start()
    try:
        total = 0
        for topic in ("crash-a", "crash-b", "crash-c"):
            for queue in range(4):
                total += len(store.get_messages(topic, queue, 0, 1000).messages)
        assert total == 200
    finally:
        store.shutdown()


def test_a_group_line_a_full_disk_cuts_short_is_refused_and_the_log_stays_whole(
    small_disk: Path,
) -> None:
    """``groups.log`` takes one fdatasynced line per group. On a full disk the write can take
    only the part of a line that fits in the file's last page: that short write was ignored,
    so the group was reported saved, and the next line (written once space came back) was
    appended to the fragment: the reload dropped both as one torn line. The write must fail,
    leave no fragment, and every group saved before and after must come back."""
    meta = BrokerMetadata(small_disk / "config")
    meta.load()
    log = small_disk / "config" / "groups.log"
    saved: list[str] = []
    while not saved or log.stat().st_size % 4096 <= 4096 - 60:  # the next line crosses a page
        saved.append(f"group-{len(saved):05d}")
        meta.put_group(GroupConfig(name=saved[-1]))
    size = log.stat().st_size
    filler = _fill(small_disk)
    try:
        with pytest.raises(OSError) as e:
            meta.put_group(GroupConfig(name="refused-" + "x" * 60))
        assert e.value.errno == errno.ENOSPC
        assert log.stat().st_size == size, "a fragment of the refused line was left"
    finally:
        filler.unlink()
    meta.put_group(GroupConfig(name="after"))
    saved.append("after")
    reloaded = BrokerMetadata(small_disk / "config")
    reloaded.load()
    assert sorted(reloaded.groups) == sorted(saved)


def test_timer_entries_a_full_disk_cuts_short_are_refused_and_later_ones_stay_aligned(
    small_disk: Path,
) -> None:
    """A timer bucket file holds 24-byte entries back to back. A write that a full disk cut
    short left part of an entry, and every entry appended after it was read at the wrong
    place: due times and CommitLog offsets of garbage. The write must fail and leave none of
    it, so the entries appended once space is back read as written."""
    timer_log = TimerLog(small_disk / "timer")
    timer_log.dir.mkdir()
    bucket = 60_000
    path = small_disk / "timer" / f"{bucket:013d}.bucket"

    def entries(first: int, count: int) -> np.ndarray:
        rows = [(10**12 + i, 1000 * i, 100, 7) for i in range(first, first + count)]
        return np.array(rows, dtype=TIMER_ENTRY)

    written = 0
    while written == 0 or path.stat().st_size % 4096 <= 4096 - 100:
        timer_log.append(bucket, entries(written, 1))
        written += 1
    filler = _fill(small_disk)
    try:
        with pytest.raises(OSError) as e:
            timer_log.append(bucket, entries(written, 10))  # 240 bytes: across the page
        assert e.value.errno == errno.ENOSPC
    finally:
        filler.unlink()
    timer_log.append(bucket, entries(written, 10))
    timer_log.close()
    got = TimerLog(small_disk / "timer").entries(bucket)
    assert got["offset"].tolist() == [1000 * i for i in range(written + 10)]


def test_delay_messages_the_wheel_could_not_write_on_a_full_disk_are_delivered_after_a_restart(
    small_disk: Path, tmp_path: Path
) -> None:
    """The wheel enqueues delay messages into a bucket file; on a full disk that write fails
    and the wheel retries a second later. The retry must write them: it skipped the ones due
    in the current bucket as already scheduled (they were in memory only), then moved its
    checkpoint past them, so after a restart they were never delivered. (The store is on
    another disk: on the full one it refuses the messages, decision 680.)"""
    config = StoreConfig(data_dir=tmp_path / "store", flush="sync", **SMALL)
    clock = (time.time_ns() // 1_000_000) // 60_000 * 60_000 + 1_000
    due = str(clock + 30_000)  # in the clock's bucket: the current one

    def put(first: int, count: int) -> None:
        store.put_messages(
            [
                as_timer_message(
                    Message(
                        topic="later",
                        queue_id=0,
                        body=b"due",
                        properties={PROPERTY_DELIVER_TIME: due, PROPERTY_UNIQ_KEY: f"t{i}"},
                    )
                )
                for i in range(first, first + count)
            ]
        )

    store = MessageStore(config)
    store.start()
    try:
        timers = TimerService(store, small_disk / "timer", lambda: ["later"], clock=lambda: clock)
        timers.start()
        put(0, 165)  # 165 entries of 24 bytes: the bucket file's page has 136 bytes left
        deadline = time.monotonic() + 10
        while timers.enqueue_offset < 165 and time.monotonic() < deadline:
            time.sleep(0.02)
        filler = _fill(small_disk)
        try:
            put(165, 10)  # 240 bytes of entries: more than the page holds
            timers.wakeup()
            time.sleep(0.3)  # the wheel tries, and fails
            assert timers.enqueue_offset == 165
        finally:
            filler.unlink()
        deadline = time.monotonic() + 10
        while timers.enqueue_offset < 175 and time.monotonic() < deadline:
            time.sleep(0.05)  # its retry, a second later
        timers.stop()
        timers = TimerService(
            store, small_disk / "timer", lambda: ["later"], clock=lambda: clock + 120_000
        )
        timers.start()
        deadline = time.monotonic() + 10
        while timers.delivered < 175 and time.monotonic() < deadline:
            time.sleep(0.05)
        timers.stop()
        assert store.wait_dispatched()
        got = store.get_messages("later", 0, 0, 1000)
        assert len(got.messages) == 175, f"{175 - len(got.messages)} of 175 delay messages lost"
    finally:
        store.shutdown()


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_a_shutdown_while_the_disk_is_too_full_to_dispatch_ends_as_a_crash_and_loses_nothing(
    small_disk: Path, flush: str
) -> None:
    """Appends are acknowledged (the native group commit's fdatasync under SYNC) while the disk
    has room for the ConsumeQueue files and IndexFile entries of their new queues, and another
    writer takes that room before the dispatcher (held back here) writes them: the dispatcher
    retries, nothing is readable yet. (The store itself no longer acknowledges appends whose
    entries do not fit, decision 680.) A shutdown then must end as a crash would (no clean-exit
    marker, every file closed, the data dir unlocked), not raise the dispatch's ENOSPC out of
    ``shutdown`` (it did, leaving the store half shut and the broker's stop failing), and the
    next start, once there is room, recovers every acknowledged message (decision 662)."""
    config = StoreConfig(
        data_dir=small_disk / "data",
        flush=flush,  # type: ignore[arg-type]
        flush_interval_ms=20,
        **GEOMETRY,  # type: ignore[arg-type]
    )
    store = MessageStore(config)
    store.start()
    acked: dict[int, list[str]] = {}

    def put(queue: int, n: int) -> None:
        msg_id = f"q{queue:02d}-m{n}"
        store.put_messages(
            [
                Message(
                    topic="full",
                    queue_id=queue,
                    body=b"x" * 100,
                    properties={PROPERTY_UNIQ_KEY: msg_id, "KEYS": f"key-{queue}-{n}"},
                )
            ]
        )
        acked.setdefault(queue, []).append(msg_id)

    for n in range(5):
        put(0, n)
    assert store.wait_dispatched(10)
    assert store.dispatcher is not None
    store.dispatcher.stop()  # behind, as under load
    for queue in range(1, 41):  # each a new ConsumeQueue file
        put(queue, 0)
    filler = _fill(small_disk)  # no room left for one
    try:
        assert not store.wait_dispatched(0.5), "dispatched although the disk is full"
        store.shutdown()
    finally:
        filler.unlink()
    assert _unlocked(small_disk / "data")
    store = MessageStore(config)
    report = store.start()
    try:
        assert not report.clean_exit
        assert store.wait_dispatched(10)
        for queue, ids in acked.items():
            got = store.get_messages("full", queue, 0, 100)
            assert got.status is GetStatus.FOUND, (queue, got.status)
            assert [m.msg_id for m in got.messages] == ids
        assert [m.msg_id for m in store.query_by_key("full", "key-40-0")] == ["q40-m0"]
    finally:
        store.shutdown()


def _unlocked(data_dir: Path) -> bool:
    """Whether another process could take ``data_dir``'s lock now."""
    import fcntl

    fd = os.open(data_dir / "lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_an_indexfile_the_full_disk_cannot_size_leaves_no_file_behind(small_disk: Path) -> None:
    """The dispatcher retries a failed IndexFile roll every second while the disk is full: each
    attempt left a sparse file with a zero header, which the next start logged as unusable,
    removed and "rebuilt" a CommitLog range for (decision 662)."""
    from tiered.hot.index_file import IndexService

    index = IndexService(small_disk / "index", 100_000, 4000)
    index.load()
    filler = _fill(small_disk)
    try:
        for _ in range(3):
            with pytest.raises(OSError) as e:
                index.new_file(0)
            assert e.value.errno == errno.ENOSPC
        assert sorted(os.listdir(small_disk / "index")) == []
    finally:
        filler.unlink()
    index.new_file(0).close()
    assert len(os.listdir(small_disk / "index")) == 1


class _Node(Standalone):
    """A broker whose log is kept off the small disk: the test fills that disk with the
    store's own data alone."""

    log_dir: Path

    @property
    def log_path(self) -> Path:
        return self.log_dir / "standalone.log"


def _keyed_request(first: int, count: int) -> tuple[s.SendMessageRequest, dict[str, list[str]]]:
    """``count`` small records with 60 keys each (one of them the record's own, the rest short
    and shared): their ConsumeQueue and IndexFile entries take about twice the room of their
    CommitLog bytes."""
    request = s.SendMessageRequest()
    keys: dict[str, list[str]] = {}
    for n in range(first, first + count):
        m = request.messages.add(topic=d.Resource(name="keyed"), body=os.urandom(8))
        m.system_properties.message_id = f"{n:08X}{os.urandom(12).hex().upper()}"
        m.system_properties.message_type = d.NORMAL
        mine = [f"own-{n:x}", *(f"k{j}" for j in range(59))]
        m.system_properties.keys.extend(mine)
        keys[m.system_properties.message_id] = mine
    return request, keys


def _send_until_refused(
    node: Standalone, first: int, acked: dict[str, list[str]], refused: set[str]
) -> tuple[int, list[d.Status]]:
    """Send batches of 16 until five are refused; returns the next message number and the
    refusals."""
    stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
    refusals: list[d.Status] = []
    n = first
    while len(refusals) < 5 and n < first + 200_000:
        request, keys = _keyed_request(n, 16)
        n += 16
        reply = stub.SendMessage(request, timeout=60)
        if reply.status.code == d.OK:
            acked.update(keys)
        else:
            refused.update(keys)
            refusals.append(reply.status)
    return n, refusals


def _readable(node: Standalone, acked: dict[str, list[str]], seconds: float) -> set[str]:
    """The acknowledged messages the broker serves by PullMessage, waiting up to ``seconds``
    for them all (dispatch may be behind)."""
    deadline = time.monotonic() + seconds
    while True:
        got = {m.system_properties.message_id for m in pull_all(node, "keyed", 4)}
        if set(acked) <= got or time.monotonic() > deadline:
            return got
        time.sleep(1)


def _found_by_key(node: Standalone, key: str) -> list[str]:
    reply = node.admin().QueryByKey(apb.QueryByKeyRequest(topic="keyed", key=key), timeout=30)
    return [m.message_id for m in reply.messages]


def _all_served(
    node: Standalone,
    refusals: list[d.Status],
    acked: dict[str, list[str]],
    refused: set[str],
    when: str,
) -> None:
    """Every refusal says the disk is full; every acknowledged message is served (``when``:
    the state of the broker, for the error), and no refused one."""
    for st in refusals:
        assert st.code == d.INTERNAL_SERVER_ERROR, st
        assert "disk is full" in st.message, st
    served = _readable(node, acked, 60)
    assert set(acked) <= served, (
        f"{len(set(acked) - served)} of {len(acked)} acknowledged messages unreadable {when}"
    )
    assert not served & refused, f"{len(served & refused)} refused messages stored"


@pytest.mark.parametrize(
    ("flush", "engine"), [("sync", "native"), ("async", "native"), ("async", "python")]
)
def test_every_message_acknowledged_on_a_filling_disk_is_readable_without_freeing_space(
    small_disk: Path, tmp_path: Path, flush: str, engine: str
) -> None:
    """Small records with many keys, a dispatcher kept behind the appends, and a disk the
    store fills by itself: appends its open CommitLog file had room for were acknowledged
    while the disk had no room left for their ConsumeQueue files and IndexFile entries, and
    stayed unreadable until space was freed (decision 662's open lead; decision 680). Every
    acknowledged message must be served, and found by key and by id, without freeing space,
    live and after a ``kill -9`` and restart; every refusal must say the disk is full, and no
    refused message may be stored."""
    config = write_config(tmp_path / "tmq.toml")
    node = _Node(
        small_disk / "data",
        flush=flush,
        extra=["--config", str(config), "--commitlog-file-size", "1MiB"],
        env={
            "TMQ_FAILPOINTS": "dispatch.before_pass=sleep:0.05",
            "TMQ_PURE_PYTHON": "1" if engine == "python" else "0",
        },
    )
    node.log_dir = tmp_path
    acked: dict[str, list[str]] = {}
    refused: set[str] = set()
    node.start()
    try:
        node.create_topic("keyed", queues=4)
        node.create_group("g-replay")  # pull_all's, made while there is room for it
        n, refusals = _send_until_refused(node, 0, acked, refused)
        assert len(refusals) == 5, "a 12 MiB disk should fill up"
        assert len(acked) > 1000, "the disk should take a few CommitLog files first"
        _all_served(node, refusals, acked, refused, "while the disk is full")
        ids = list(acked)
        sample = ids[-20:] + ids[:: max(1, len(ids) // 30)]
        for msg_id in sample:
            assert _found_by_key(node, acked[msg_id][0]) == [msg_id]
            assert _found_by_key(node, msg_id) == [msg_id]
        node.kill9()
        node.start()  # on the same full disk
        n, refusals = _send_until_refused(node, n, acked, refused)
        _all_served(node, refusals, acked, refused, "after a restart on the full disk")
        for msg_id in ids[-20:] + list(acked)[-20:]:
            assert _found_by_key(node, acked[msg_id][0]) == [msg_id]
    finally:
        if node.proc is not None and node.proc.poll() is None:
            node.kill9()


def test_damage_notes_a_full_disk_refused_are_written_by_the_next_read_and_never_torn(
    small_disk: Path,
) -> None:
    """A read that meets a ConsumeQueue entry naming another record fails, asks for a restart,
    and notes the entry in ``damaged_entries`` for that start to rebuild. On a full disk the
    note cannot be written: a later read must write it once there is room (the note was
    counted as made, and the restart rebuilt nothing), and a note the disk cut short must
    not stay in the file, where the next note would join it and both be lost (decision 1263)."""
    from test_consume_queue_repair import (
        entries_of,
        read_stops_at_40,
        restart_repairs,
        write_entry,
        write_two_queues,
    )

    config = StoreConfig(data_dir=small_disk / "store", **SMALL)
    write_two_queues(config)
    write_entry(config, 0, 40, entries_of(config, 1)[40])
    notes = config.data_dir / "damaged_entries"
    store = MessageStore(config)
    store.start()
    try:
        filler = _fill_between_checkpoints(store, small_disk)
        read_stops_at_40(store, r"t/0.*queue offset 40.*t/1.*restart")  # not noted: no room
        assert not notes.exists() or notes.read_bytes() == b""
        filler.unlink()
        # Notes of entries that are whole (they name their own records), a page's worth and
        # more, the disk filled again while they are written: one of them crosses into a page
        # the disk has no room for, and the disk takes only its part in the page it has.
        filler = None
        for n in range(600):
            size = notes.stat().st_size if notes.exists() else 0
            if filler is None and size > 4096 - 64:
                filler = _fill_between_checkpoints(store, small_disk)
            store.note_damaged_entry("t", 1, n)
            if notes.stat().st_size < size + len(json.dumps(["t", 1, n])) + 1:
                break  # refused: the disk took none of it, or (the old code) a part
        else:
            raise AssertionError("the full disk never refused a note")
        assert filler is not None
        filler.unlink()
        read_stops_at_40(store, r"t/0.*queue offset 40.*t/1.*restart")  # room again: noted
        store.note_damaged_entry("t", 1, 599)
    finally:
        store.shutdown()
    lines = notes.read_bytes().split(b"\n")
    assert lines[-1] == b""
    noted = [json.loads(line) for line in lines[:-1]]  # every line whole
    assert ["t", 0, 40] in noted and ["t", 1, 599] in noted
    restart_repairs(config, 1, 0, 1)
