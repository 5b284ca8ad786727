"""A queue started above its local end (``MessageStore.start_queue_at``, decision 720: a tiered
queue whose archive ends above it) stays there: its next messages take offsets from the floor,
and no later start brings its older records back under the floor, not the repair of a queue's
leading zeroed entries (decision 503) and not a rebuild of every ConsumeQueue."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest
from conftest import SMALL

from tiered.config import StoreConfig
from tiered.hot.commitlog import DurabilityLostError
from tiered.record import Message
from tiered.store import MessageStore, StoreLoadError

FLOOR = 100  # in the first ConsumeQueue file, beside the queue's first 20 entries


def body(tag: str, n: int) -> bytes:
    return f"{tag}-{n}-".encode() * 8


def hot_queue(store: MessageStore) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    offset = store.hot_min_offset("t", 0)
    while offset < store.max_offset("t", 0):
        result = store.get_messages("t", 0, offset, 32)
        assert result.next_offset > offset, (offset, result.status)
        out += [(m.queue_offset, m.body) for m in result.messages]
        offset = result.next_offset
    return out


@pytest.mark.parametrize("then", ["clean restart", "crash", "consumequeues lost"])
def test_a_queue_started_at_a_floor_stays_above_it(tmp_path: Path, then: str) -> None:
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    store = MessageStore(config)
    store.start()
    try:
        store.put_messages([Message("t", body("old", n), queue_id=0) for n in range(20)])
        store.put_messages([Message("t", body("other", n), queue_id=1) for n in range(5)])
        assert store.wait_dispatched()
        assert store.start_queue_at("t", 0, FLOOR)
        assert not store.start_queue_at("t", 0, FLOOR), "already there"
        store.put_messages([Message("t", body("new", n), queue_id=0) for n in range(10)])
        assert store.wait_dispatched()
        want = [(FLOOR + n, body("new", n)) for n in range(10)]
        assert hot_queue(store) == want
    finally:
        store.shutdown()
    if then == "crash":
        (config.data_dir / "abort").write_text("1\n")
    elif then == "consumequeues lost":
        shutil.rmtree(config.consumequeue_dir)
    store = MessageStore(config)
    report = store.start()
    try:
        assert report.cq_entries_repaired == 0 and report.cq_entries_unrepaired == 0
        assert store.hot_min_offset("t", 0) == FLOOR
        assert hot_queue(store) == want
        assert store.max_offset("t", 1) == 5
        store.put_messages([Message("t", body("next", 0), queue_id=0)])
        assert store.wait_dispatched()
        assert hot_queue(store) == [*want, (FLOOR + 10, body("next", 0))]
    finally:
        store.shutdown()


def test_an_unreadable_floor_record_refuses_the_start(tmp_path: Path) -> None:
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    store = MessageStore(config)
    store.start()
    store.shutdown()
    (config.data_dir / "queue-floors.json").write_text("{not json")
    with pytest.raises(StoreLoadError, match=r"queue-floors\.json is unreadable"):
        MessageStore(config).start()


class _PowerCut(Exception):
    """Raised where the test cut the power: the store's call stops there."""


@pytest.mark.parametrize("floor", [FLOOR, 600])  # 600: in a later ConsumeQueue file
@pytest.mark.parametrize(
    "step", ["floor saved", "consumequeue dropped", "messages at the floor", "next start"]
)
def test_a_power_loss_at_each_step_of_starting_a_queue_at_a_floor_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, floor: int
) -> None:
    """The power goes out (tests/powerloss_fs.py: only what was fsynced survives) after the
    floor is saved and before the queue's ConsumeQueue files are dropped; after they are
    dropped; after acknowledged (SYNC) messages at the floor; or in the next start, after it
    applied the floor again and before it re-dispatched or saved a checkpoint. The store
    recovered from what the disk holds keeps the floor: the queue's old entries never come
    back under it, no acknowledged message at the floor is lost, and the next message takes
    the next offset above them, not an offset below the floor."""
    from test_power_loss import PowerLossMount, _need_fuse

    _need_fuse()
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    armed: list[str] = []
    mounts: list[PowerLossMount] = []
    apply = MessageStore._apply_queue_floors

    def cut(where: str) -> None:
        if armed and armed[0] == where:
            armed.clear()
            mounts[-1].crash(f"floor-{step}-{floor}")
            raise _PowerCut(where)

    def applying(self: MessageStore) -> None:
        cut("before apply")
        apply(self)
        cut("after apply")

    monkeypatch.setattr(MessageStore, "_apply_queue_floors", applying)
    config = StoreConfig(data_dir=mountpoint / "store", flush="sync", **SMALL)
    mounts.append(PowerLossMount(mountpoint, durable))
    acked: list[tuple[int, bytes]] = []
    try:
        store = MessageStore(config)
        store.start()
        try:
            store.put_messages([Message("t", body("old", n), queue_id=0) for n in range(20)])
            store.put_messages([Message("t", body("other", n), queue_id=1) for n in range(5)])
            assert store.wait_dispatched()
            armed.append(
                {"floor saved": "before apply", "next start": "before apply"}.get(
                    step, "after apply" if step == "consumequeue dropped" else ""
                )
            )
            with contextlib.suppress(_PowerCut):
                assert store.start_queue_at("t", 0, floor)
            if step == "messages at the floor":
                result = store.put_messages(
                    [Message("t", body("new", n), queue_id=0) for n in range(10)]
                )
                acked = [(floor + n, body("new", n)) for n in range(10)]
                assert result is not None
                assert store.wait_dispatched()
                mounts[-1].crash(f"floor-{step}-{floor}")
        finally:
            with contextlib.suppress(OSError, DurabilityLostError):
                store.flush()  # on the dead disk: the store fails, and shuts down as failed
            store.shutdown()
    finally:
        mounts[-1].close()
    if step == "next start":
        mounts.append(PowerLossMount(mountpoint, durable))
        try:
            armed.append("after apply")
            with pytest.raises((_PowerCut, OSError)):  # its cleanup meets the dead disk
                MessageStore(config).start()
        finally:
            mounts[-1].close()
    store = MessageStore(StoreConfig(data_dir=durable / "store", flush="sync", **SMALL))
    store.start()
    try:
        assert store.queue_floors == {("t", 0): floor}, "the floor was saved before the cut"
        assert store.hot_min_offset("t", 0) == floor
        assert hot_queue(store) == acked, "old entries under the floor, or acknowledged lost"
        store.put_messages([Message("t", body("next", 0), queue_id=0)])
        assert store.wait_dispatched()
        assert hot_queue(store) == [*acked, (floor + len(acked), body("next", 0))]
        assert store.max_offset("t", 1) == 5
    finally:
        store.shutdown()


def test_a_lookup_by_key_finds_no_record_below_a_queue_floor(tmp_path: Path) -> None:
    """Decision 880: a resolved divergence (decision 801) raises a queue's floor over records
    still in the CommitLog, and re-appends them above it. Below the floor the archive's
    messages are the queue's: a lookup by key must not return the local record at its old
    offset (on main it did, beside its copy, until release took its file)."""
    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)

    def keyed(tag: str, n: int) -> Message:
        return Message("t", body(tag, n), queue_id=0, properties={"KEYS": f"k{n}"})

    store = MessageStore(config)
    store.start()
    try:
        store.put_messages([keyed("local", n) for n in range(10)])
        store.put_messages([keyed("copy", n) for n in range(10)])
        assert store.wait_dispatched()
        store.raise_queue_floor("t", 0, 10)
        found = [(m.queue_offset, m.body) for m in store.query_by_key("t", "k3")]
        assert found == [(13, body("copy", 3))]
    finally:
        store.shutdown()
    store = MessageStore(config)
    store.start()
    try:  # the floor is kept, and so is the answer
        found = [(m.queue_offset, m.body) for m in store.query_by_key("t", "k3")]
        assert found == [(13, body("copy", 3))]
    finally:
        store.shutdown()


def test_a_commitlog_file_of_records_below_a_resolved_floor_goes_whatever_the_local_ttl(
    tmp_path: Path,
) -> None:
    """Decision 903, a guard (passes on main): after a resolve (decision 801) raised a tiered
    queue's floor over its local originals, release's rule (offload/release.py, the broker's
    predicate on a real store) no longer sees them: a CommitLog file that holds only records
    below the floor has no queue span, so it goes at the next pass, whatever the topic's local
    TTL (here 1 day), while a file with the queue's records at or above the floor is still
    judged by them (kept: no tier watermark without an offloader). Nothing reads those records:
    reads by offset below the floor go to the archive, and so do lookups by key (decision 880),
    so the next reads of the queue are unchanged."""
    from broker.metadata import TopicConfig
    from offload.release import release_predicate

    config = StoreConfig(data_dir=tmp_path / "store", **SMALL)
    store = MessageStore(config)
    store.start()
    try:
        big = b"o" * 3000  # 40 of them fill most of the 128 KiB first file
        store.put_messages([Message("t", big, queue_id=0) for _ in range(40)])
        store.put_messages([Message("t", body("copy", n), queue_id=0) for n in range(80)])
        assert store.wait_dispatched()
        first, *rest = store.commitlog_files()
        assert rest, "the copies are in a later file"
        spans = store.queues_in_file(first)
        assert [(s.first, s.last) for s in spans] == [(0, spans[0].last)]
        floor = spans[0].last + 1  # the first file's records are the originals
        store.raise_queue_floor("t", 0, floor)
        can_release = release_predicate(
            store, None, {"t": TopicConfig("t", tiered=True, local_retention_ms=86_400_000)}
        )
        assert store.queues_in_file(first) == []
        assert can_release(first), "a file of originals only: released, TTL or not"
        assert not can_release(rest[0]), "the copies' file is judged by the copies"
        assert store.release_commitlog_files(can_release) == 1
        before = hot_queue(store)
        assert before[0][0] == floor and len(before) == 40 + 80 - floor
    finally:
        store.shutdown()
    store = MessageStore(config)
    store.start()
    try:
        assert store.hot_min_offset("t", 0) == floor
        assert hot_queue(store) == before
    finally:
        store.shutdown()


def test_a_floor_committed_above_what_a_power_loss_kept_does_not_stop_the_start(
    tmp_path: Path,
) -> None:
    """Decision 980: a resolve that discards (``offload resolve --discard-local``, decision
    801) commits the queue's floor, the archive's end, after checking that the queue reaches it,
    but under ASYNC flush the queue's last messages may not be on disk yet. The power goes out
    between the commit and the raised floor (tests/powerloss_fs.py: only what was fsynced
    survives): the queue comes back ending below the committed floor. The broker's start raises
    the floor again from the record (``apply_floors``); on main ``raise_queue_floor`` refused a
    queue ending below it (``ValueError``) at every start, so the broker could not start at all.
    The queue must start at the floor, as a queue floor above a queue's end always does (its
    offsets below are the archive's), and its next message take the floor's offset."""
    from test_power_loss import PowerLossMount, _need_fuse
    from test_tier_divergence import ending_at

    from offload.divergence import Conflict, Divergence
    from offload.resolve import apply_floors

    _need_fuse()
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    mount = PowerLossMount(mountpoint, durable)
    try:
        config = StoreConfig(
            data_dir=mountpoint / "store", flush="async", flush_interval_ms=600_000, **SMALL
        )
        store = MessageStore(config)
        store.start()
        try:
            store.put_messages([Message("t", body("kept", n), queue_id=0) for n in range(150)])
            store.flush()
            divergence = Divergence(config.data_dir)
            divergence.pend({("t", 0): 60})
            assert divergence.check("t", 0, ending_at(200), 150) == Conflict(60, 200)
            # Acknowledged under ASYNC flush, not yet flushed: the queue reaches the archive's
            # end, so the resolve's checks pass, and the commit records the floor 200.
            store.put_messages([Message("t", body("lost", n), queue_id=0) for n in range(70)])
            assert store.wait_dispatched() and store.max_offset("t", 0) == 220
            assert divergence.commit_resolve("t", 0) == 200
            mount.crash()  # at resolve.before_floor: nothing unsynced lands
        finally:
            with contextlib.suppress(OSError, DurabilityLostError):
                store.flush()
            store.shutdown()
    finally:
        mount.close()
    config = StoreConfig(data_dir=durable / "store", flush="async", **SMALL)
    want: list[tuple[int, bytes]] = []
    for n, start in enumerate(("the start after the power loss", "the next start")):
        store = MessageStore(config)
        store.start()
        try:
            divergence = Divergence(config.data_dir)
            if start == "the start after the power loss":
                assert divergence.floors == {("t", 0): 200}
                assert store.max_offset("t", 0) < 200, "the unflushed messages were lost"
            apply_floors(store, divergence)  # what the broker's start runs before serving
            assert divergence.floors == {}, start
            assert store.queue_floors == {("t", 0): 200}, start
            assert store.hot_min_offset("t", 0) == 200, start
            assert hot_queue(store) == want, start
            store.put_messages([Message("t", body("next", n), queue_id=0)])
            assert store.wait_dispatched()
            want.append((200 + n, body("next", n)))
            assert hot_queue(store) == want, start
            store.flush()
        finally:
            store.shutdown()
        if start == "the start after the power loss":
            shutil.rmtree(config.data_dir / "consumequeue")  # rebuilt: the floor still holds
