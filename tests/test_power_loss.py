"""Acknowledged messages survive a power loss, not only ``kill -9``.

The store runs on ``powerloss_fs`` (a FUSE filesystem, tests/powerloss_fs.py) that keeps only
what was fsynced: file bytes on fsync/fdatasync/msync, names on an fsync of their directory. At a
random moment the test cuts the power (everything else is forgotten, and every later change
fails), kills the producer, and recovers the store from what a disk would hold. Under SYNC flush
no acknowledged message and no saved consumer group may be missing, across rolled CommitLog
files, renamed checkpoints and compacted metadata.

FUSE needs root and ``/dev/fuse``; where the kernel refuses the mount the tests skip and say so.
Nothing needs installing: the filesystem speaks the kernel's FUSE protocol itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SMALL, crash_after_writing, run_child
from store_child import body_for, message_for
from test_crash import Ack, collect, verify

from broker.metadata import BrokerMetadata
from broker.timer import TimerService
from tiered import store as store_module
from tiered.config import StoreConfig
from tiered.hot.commitlog import DurabilityLostError
from tiered.hot.index_file import IndexFile
from tiered.record import Message
from tiered.store import GetStatus, MessageStore

FS = Path(__file__).with_name("powerloss_fs.py")
TIMER_CHILD = Path(__file__).with_name("timer_child.py")


class PowerLossMount:
    """One mount of the power-loss filesystem over ``durable`` (loaded as all durable)."""

    def __init__(self, mountpoint: Path, durable: Path) -> None:
        self.mountpoint = mountpoint
        self.proc = subprocess.Popen(
            [sys.executable, str(FS), str(mountpoint), str(durable)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            err = self.proc.stderr.read() if self.proc.stderr else ""
            self.proc.wait()
            if "Operation not permitted" in err or "No such device" in err:
                pytest.skip(f"the kernel refuses a FUSE mount here: {err.strip()[-200:]}")
            raise AssertionError(f"powerloss_fs did not start: {err}")

    def command(self, text: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def crash(self, seed: str | None = None) -> int:
        """Cut the power; with ``seed``, a random part of the unsynced pages lands (whole or
        torn at a sector). Returns the number of pages that landed."""
        reply = self.command("crash" if seed is None else f"crash {seed}")
        assert reply.startswith("crashed"), reply
        return int(reply.split()[3]) if seed is not None else 0

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("exit\n")
            self.proc.stdin.close()
            self.proc.wait(30)


def _need_fuse() -> None:
    if os.geteuid() != 0:
        pytest.skip("FUSE mounts need root")
    if not Path("/dev/fuse").exists():
        pytest.skip("no /dev/fuse on this kernel")


class Producer:
    """A store_child in produce-meta mode and what it acknowledged."""

    def __init__(self, data_dir: Path, seed: int) -> None:
        self.child = run_child(data_dir, "produce-meta", "sync", 0, seed)
        self.acks: dict[str, Ack] = {}
        self.groups: set[str] = set()
        self.refused = 0
        self.refusals: set[str] = set()
        self.lines: list[str] = []
        self.first_ack = threading.Event()
        self.stderr = ""
        self.reader = threading.Thread(target=self._collect)
        self.reader.start()

    def _collect(self) -> None:
        assert self.child.stdout is not None
        for line in self.child.stdout:
            if not line.endswith("\n"):
                break  # cut off by the kill: never acknowledged as a whole
            parts = line.split()
            self.lines.append(parts[0])
            if parts[0] == "ack":
                self.acks[parts[1]] = (parts[2], int(parts[3]), int(parts[4]), int(parts[5]))
                self.first_ack.set()
            elif parts[0] == "group":
                self.groups.add(parts[1])
            elif parts[0] == "refused":
                self.refused += 1
                self.refusals.add(parts[1])

    def kill(self) -> None:
        self.child.kill()
        self.child.wait()
        self.reader.join()
        if self.child.stderr is not None:
            self.stderr = self.child.stderr.read()
            self.child.stderr.close()


def power_loss_rounds(tmp_path: Path, rounds: int, seed: str) -> dict[str, int]:
    """``rounds`` crash points; returns the figures. Fails on any acknowledged loss.

    At each crash a random part of the pages written since the last fsync lands, whole or torn
    at a sector: a disk's cache writes back in any order (decision 211)."""
    _need_fuse()
    durable = tmp_path / "durable"
    mountpoint = tmp_path / "mnt"
    rng = random.Random(seed)
    acked: dict[str, Ack] = {}
    groups: set[str] = set()
    recovered_on_fuse = 0
    landed = 0
    for round_no in range(rounds):
        fs = PowerLossMount(mountpoint, durable)
        try:
            producer = Producer(mountpoint / "store", 7000 + round_no)
            if rng.random() < 0.2:
                time.sleep(rng.uniform(0.05, 1.0))  # likely during start-up and recovery
                recovered_on_fuse += 1
            else:
                if not producer.first_ack.wait(60):
                    producer.kill()
                    raise AssertionError(f"no acknowledgement in 60 s: {producer.stderr[-3000:]}")
                time.sleep(rng.uniform(0.0, 0.8))
            landed += fs.crash(f"{seed}-{round_no}")
            producer.kill()
        finally:
            fs.close()
        acked.update(producer.acks)
        groups |= producer.groups
        if rng.random() < 0.25 and round_no < rounds - 1:
            continue  # the next round recovers on the power-loss filesystem itself
        verify(durable / "store", "sync", acked)
        meta = BrokerMetadata(durable / "store" / "config")
        meta.load()
        missing = groups - set(meta.groups)
        assert not missing, f"{len(missing)} saved groups lost, e.g. {sorted(missing)[:3]}"
    commitlog_files = len(list((durable / "store" / "commitlog").iterdir()))
    figures = {
        "crash_points": rounds,
        "acknowledged": len(acked),
        "lost": 0,
        "groups_saved": len(groups),
        "groups_lost": 0,
        "commitlog_files": commitlog_files,
        "unsynced_pages_landed": landed,
    }
    print(json.dumps({"power_loss": figures}))
    assert commitlog_files >= 3, "the run should roll several CommitLog files"
    assert len(acked) > 200
    assert landed > 0, "some unsynced pages should have reached the disk"
    return figures


def test_acknowledged_messages_survive_power_loss(tmp_path: Path) -> None:
    power_loss_rounds(tmp_path, 6, "power-loss-short")


@pytest.mark.slow
def test_acknowledged_messages_survive_power_loss_at_60_crash_points(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if "slow" not in (request.config.option.markexpr or ""):
        pytest.skip("the long power-loss loop runs with -m slow")
    figures = power_loss_rounds(tmp_path, 60, "power-loss-long")
    assert figures["groups_saved"] > 1024, "metadata compaction should have run"


def produce_through_a_fault(tmp_path: Path, fault: str, seed: int) -> tuple[Producer, list[str]]:
    """A SYNC producer on the power-loss filesystem; ``fault`` (a command aimed at CommitLog
    files) is armed once it has been acknowledged, then the power goes out after 5 refusals
    (or 20 s). Returns the producer and the filesystem's ``stats`` before the crash; asserts
    that nothing was acknowledged after the first refusal."""
    _need_fuse()
    fs = PowerLossMount(tmp_path / "mnt", tmp_path / "durable")
    try:
        producer = Producer(tmp_path / "mnt" / "store", seed)
        assert producer.first_ack.wait(60)
        time.sleep(0.3)
        size = json.loads(Path(__file__).with_name("store_sizes.json").read_text())
        assert fs.command(f"{fault} {size['commitlog_file_size']}") == "armed"
        deadline = time.monotonic() + 20
        while producer.refused < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = fs.command("stats").split()
        fs.crash()
        producer.kill()
    finally:
        fs.close()
    assert producer.refused >= 5, f"the store should refuse writes after the {fault}"
    first_refusal = producer.lines.index("refused")
    assert "ack" not in producer.lines[first_refusal:], f"acknowledged after the {fault}"
    return producer, stats


def test_after_a_failed_fsync_nothing_more_is_acknowledged(tmp_path: Path) -> None:
    """fsyncgate: Linux may drop the pages of a failed writeback and report success on the
    next fsync. A store that retries would acknowledge messages behind a hole."""
    producer, _stats = produce_through_a_fault(tmp_path, "fail-fsync", 99)
    verify(tmp_path / "durable" / "store", "sync", producer.acks)


@pytest.mark.parametrize("engine", ["native", "python"])
def test_after_a_failed_write_nothing_more_is_acknowledged(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CommitLog write that failed with EIO (decision 361), on the record engine's native
    ``pwritev`` and on the reference ``pwrite``, with native or Python group commit: the batch
    it carried is refused, and so is every later one although the device writes again, until a
    restart recovers from what the disk holds (decision 500)."""
    _need_fuse()
    if engine == "native":
        from tiered.record import ENGINE_NAME

        assert ENGINE_NAME == "native", "the native record engine is not built"
    monkeypatch.setenv("TMQ_PURE_PYTHON", "1" if engine == "python" else "0")
    producer, stats = produce_through_a_fault(tmp_path, "fail-write", 98)
    assert stats[3] == "1", f"the write fault did not fire: {stats}"
    assert producer.refusals == {"DurabilityLostError"}, producer.refusals
    durable = tmp_path / "durable"
    verify(durable / "store", "sync", producer.acks)
    # The restart (verify's) recovered from the disk: the store takes writes again.
    store = MessageStore(StoreConfig(data_dir=durable / "store", flush="sync", **SMALL))
    store.start()
    try:
        store.put_message(message_for("after-restart", random.Random(1)))
    finally:
        store.shutdown()


# -- pages that reach the disk in any order -------------------------------------------------------

PAGE = 4096


def snapshot(data_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(data_dir)): p.read_bytes() for p in data_dir.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize("pages_after", ["lost", "kept"])
@pytest.mark.parametrize("lost_page", ["zeros", "garbage"])
def test_a_record_torn_by_a_power_loss_ends_the_log(
    tmp_path: Path, lost_page: str, pages_after: str
) -> None:
    """After a power loss the disk holds the last fsync's bytes plus any subset of the pages
    written after it. Keep the page with a record's size field and the start of its
    properties, lose a later page of the same record (zeros, or garbage), and lose or keep the
    pages after it. Its body CRC still matches, so before the record CRC (decision 210)
    recovery kept the record and served torn properties (a damaged message id among them), or,
    with whole records after it, refused to start. Now the log ends there: every acknowledged
    message is intact, nothing from the torn record on is served, the queues have no gap, and
    the ConsumeQueue and the index point at nothing past the cut."""
    live = tmp_path / "live"
    rng = random.Random(lost_page + pages_after)
    store = MessageStore(StoreConfig(data_dir=live, flush="sync", **SMALL))
    store.start()
    try:
        acked = [message_for(f"acked-{i}", rng) for i in range(40)]
        acked_at = list(store.put_messages(acked))  # SYNC: fsynced when this returns
        assert store.wait_dispatched()
        durable = snapshot(live)
        # Never acknowledged: written, then the power goes out before their fsync completes.
        # Long properties (the message id last, as a producer's map may order it) span pages.
        later = [
            Message(
                topic=acked[i].topic,
                queue_id=acked[i].queue_id,
                body=b"later-body-%d" % i,
                properties={
                    "x-trace": "t" * 3000,
                    "KEYS": f"key-later-{i}",
                    "UNIQ_KEY": f"later-{i}",
                },
            )
            for i in range(8)
        ]
        later_at = list(store.put_messages(later))
        assert store.wait_dispatched()
        written = snapshot(live)
    finally:
        store.shutdown()

    files = sorted(name for name in written if name.startswith("commitlog/"))
    bases = {name: int(Path(name).name) for name in files}

    def place(offset: int, size: int) -> tuple[str, int, int]:
        """(file, page of the record's last byte, page 3000 bytes before its end)."""
        name = max((n for n in files if bases[n] <= offset), key=bases.__getitem__)
        end = offset - bases[name] + size
        return name, (end - 1) // PAGE, (end - 3000) // PAGE

    # The first later record whose properties run onto a page after its size field's page.
    torn = next(
        i for i, a in enumerate(later_at) if len(set(place(a.commitlog_offset, a.size)[1:])) == 2
    )
    name, last_page, _ = place(later_at[torn].commitlog_offset, later_at[torn].size)
    image = tmp_path / "image"
    for rel, data in written.items():
        keep = durable.get(rel, b"") if rel in ("checkpoint",) else data
        if rel == name:
            old = durable.get(rel, b"").ljust(len(data), b"\0")
            lost = old[last_page * PAGE : (last_page + 1) * PAGE]
            if lost_page == "garbage":
                lost = rng.randbytes(len(lost))
            rest = data[(last_page + 1) * PAGE :]
            if pages_after == "lost":
                rest = old[(last_page + 1) * PAGE :]
                if lost_page == "garbage":
                    rest = rng.randbytes(len(rest))
            keep = data[: last_page * PAGE] + lost + rest
        (image / rel).parent.mkdir(parents=True, exist_ok=True)
        (image / rel).write_bytes(keep)
    if "abort" not in written:
        (image / "abort").write_bytes(b"")  # the store was running when the power went out

    cut = later_at[torn].commitlog_offset
    whole = [(m, a) for m, a in zip(acked + later, acked_at + later_at, strict=True)]
    expected = [(m, a) for m, a in whole if a.commitlog_offset < cut]
    gone = [(m, a) for m, a in whole if a.commitlog_offset >= cut]
    assert all(a.commitlog_offset < cut for a in acked_at)
    store = MessageStore(StoreConfig(data_dir=image, flush="sync", **SMALL))
    report = store.start()
    try:
        assert not report.clean_exit
        assert store.max_physical_offset == cut
        served: dict[str, tuple[int, int]] = {}
        for topic, qid in {(m.topic, m.queue_id) for m, _ in whole}:
            count = sum(1 for m, _ in expected if (m.topic, m.queue_id) == (topic, qid))
            assert store.max_offset(topic, qid) == count, "the ConsumeQueue ends at the cut"
            offset = 0
            while True:
                result = store.get_messages(topic, qid, offset, 16)
                if result.status is not GetStatus.FOUND:
                    break
                for got in result.messages:
                    assert got.queue_offset == offset, "no reader sees a gap"
                    served[got.msg_id or ""] = (got.queue_offset, got.commitlog_offset)
                    offset += 1
            assert offset == count
        for m, a in expected:
            uniq = m.properties["UNIQ_KEY"]
            assert served.pop(uniq) == (a.queue_offset, a.commitlog_offset)
            got = store.get_messages(m.topic, m.queue_id, a.queue_offset, 1).messages[0]
            assert (got.body, got.properties) == (m.body, m.properties), "stored as sent"
        assert not served, f"served records that were never written whole: {sorted(served)}"
        for m, _ in gone:
            key = m.properties["KEYS"]
            assert store.query_by_key(m.topic, key) == [], f"the index still finds {key}"
        first = acked[0].properties["KEYS"]
        assert [g.msg_id for g in store.query_by_key(acked[0].topic, first)] == ["acked-0"]
    finally:
        store.shutdown()


def test_a_group_line_torn_by_a_power_loss_is_dropped_and_a_damaged_one_is_not(
    tmp_path: Path,
) -> None:
    """Each group is one fdatasynced line of ``groups.log``, so only the last line can be
    unsynced; a power loss may land its newline but not a sector before it. That line was never
    acknowledged and is dropped. A damaged line with lines after it is still refused."""
    from broker.metadata import GroupConfig

    meta = BrokerMetadata(tmp_path)
    for name in ("g1", "g2", "g3"):
        meta.put_group(GroupConfig(name))
    meta.close()
    log_path = tmp_path / "groups.log"
    lines = log_path.read_bytes().split(b"\n")
    torn_last = bytearray(lines[2])
    torn_last[5:9] = bytes(4)  # a lost sector inside the line; its newline landed
    log_path.write_bytes(b"\n".join([lines[0], lines[1], bytes(torn_last), b""]))
    meta = BrokerMetadata(tmp_path)
    meta.load()
    assert sorted(meta.groups) == ["g1", "g2"]
    meta.close()
    log_path.write_bytes(b"\n".join([lines[0], bytes(torn_last), lines[2], b""]))
    with pytest.raises(RuntimeError, match="line 2 is damaged"):
        BrokerMetadata(tmp_path).load()


@pytest.mark.parametrize("newline_landed", [False, True])
def test_a_torn_group_line_is_cut_off_so_the_next_group_does_not_join_it(
    tmp_path: Path, newline_landed: bool
) -> None:
    """The 60-point power-loss loop found it: a torn last line was skipped at start but left in
    the file, the next group's line was appended to the fragment, and the start after the next
    power loss refused a damaged line in the middle of ``groups.log``."""
    from broker.metadata import GroupConfig

    meta = BrokerMetadata(tmp_path)
    for name in ("g1", "g2"):
        meta.put_group(GroupConfig(name))
    meta.close()
    log_path = tmp_path / "groups.log"
    whole = log_path.read_bytes()
    last = whole.rstrip(b"\n").rsplit(b"\n", 1)[1]
    torn = whole[: len(whole) - len(last) - 1] + last[:20] + (b"\n" if newline_landed else b"")
    log_path.write_bytes(torn)

    meta = BrokerMetadata(tmp_path)
    meta.load()
    assert sorted(meta.groups) == ["g1"]
    meta.put_group(GroupConfig("g3"))
    meta.close()
    again = BrokerMetadata(tmp_path)
    again.load()
    assert sorted(again.groups) == ["g1", "g3"]
    again.close()


# -- a power loss after a recovery whose fsync was deferred ----------------------------------------


@pytest.mark.parametrize("then", ["async", "sync"])
def test_a_power_loss_after_an_async_crash_and_recovery_serves_no_torn_record(
    tmp_path: Path, then: str
) -> None:
    """An ASYNC writer dies (``kill -9``): its last pages are in the page cache, not on disk.
    The store restarts (under ASYNC recovery leaves their fsync to the flusher's first flush,
    under SYNC it runs beside re-dispatch, decision 241) and the power fails at a random moment
    of that run, landing a random part of the unsynced pages. Twice over the same files: the
    store must start each time, serve no torn record (every body is checked), and keep every
    message acknowledged under SYNC; a checkpoint claiming bytes that were never fsynced
    makes recovery keep a torn record below it, or refuse to start."""
    _need_fuse()
    durable = tmp_path / "durable"
    mountpoint = tmp_path / "mnt"
    rng = random.Random(f"deferred-{then}")
    acked: dict[str, Ack] = {}
    for round_no in range(2):
        fs = PowerLossMount(mountpoint, durable)
        acks: dict[str, Ack] = {}
        try:
            crash_after_writing(mountpoint / "store", 400, "async", seed=300 + round_no)
            child = run_child(mountpoint / "store", "produce", then, 0, 400 + round_no)
            first_ack = threading.Event()
            reader = threading.Thread(target=collect, args=(child.stdout, acks, first_ack))
            reader.start()
            if round_no == 0:
                time.sleep(rng.uniform(0.05, 0.4))  # during recovery or its first flush
            else:
                assert first_ack.wait(60), "the restarted store acknowledged nothing"
                time.sleep(rng.uniform(0.0, 0.3))
            fs.crash(f"deferred-{then}-{round_no}")
            child.kill()
            child.wait()
            reader.join()
            if child.stderr is not None:
                child.stderr.close()
        finally:
            fs.close()
        if then == "sync":
            acked.update(acks)
        _verify_whole(durable / "store", acked)


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_consumequeue_entries_a_restart_kept_are_fsynced_before_a_checkpoint_claims_them(
    tmp_path: Path, flush: str
) -> None:
    """A store killed (``kill -9``) leaves ConsumeQueue entries written since its last flush
    in the page cache only. The next start keeps them (they are whole) and saves a checkpoint
    saying dispatch is done up to the end. A power loss then loses those entries; the next
    recovery trusts the checkpoint, re-dispatches nothing below it, and the messages, in the
    CommitLog and acknowledged under SYNC, are unreadable: a hole in their queues, or a tail
    the queue offsets of later sends overwrite. Recovery must fsync what it kept before a
    checkpoint counts it."""
    _need_fuse()
    durable = tmp_path / "durable"
    fs = PowerLossMount(tmp_path / "mnt", durable)
    try:
        # Under SYNC every put_message returned after its fsync: all 300 are acknowledged.
        crash_after_writing(tmp_path / "mnt" / "store", 300, "sync", seed=500)
        # The restarted store appends to one queue: its ConsumeQueue is fsynced past the
        # others' unflushed entries, so recovery's lowest queue end no longer covers them.
        child = run_child(tmp_path / "mnt" / "store", "hold", flush, 20, 501)
        assert child.stdout is not None
        try:
            assert child.stdout.readline().strip() == "ready"
            time.sleep(0.7)  # past a periodic flush and checkpoint of the restarted store
            fs.crash()
        finally:
            child.kill()
            child.wait()
            child.stdout.close()
            if child.stderr is not None:
                child.stderr.close()
    finally:
        fs.close()
    seen = _verify_whole(durable / "store", {})
    lost = 300 - sum(1 for msg_id in seen if msg_id.startswith("500-"))
    assert not lost, f"{lost} of 300 acknowledged messages unreadable"


def _verify_whole(data_dir: Path, acked: dict[str, Ack]) -> set[str]:
    """The store starts; every message it serves is whole and where its queue offset says;
    every acknowledged one is there. (``verify``'s, except that a queue whose every message
    was lost, unacknowledged, may stay empty.)"""
    store = MessageStore(StoreConfig(data_dir=data_dir, flush="sync", **SMALL))
    store.start()
    try:
        seen: set[str] = set()
        for topic in ("crash-a", "crash-b", "crash-c"):
            for qid in range(4):
                offset = store.min_offset(topic, qid)
                while (got := store.get_messages(topic, qid, offset, 64)).messages:
                    for m in got.messages:
                        assert m.queue_offset == offset and m.msg_id not in seen, m.msg_id
                        assert m.body == body_for(str(m.msg_id)), f"{m.msg_id} served torn"
                        seen.add(str(m.msg_id))
                        offset += 1
                assert got.status is not GetStatus.FOUND, got
        missing = sorted(set(acked) - seen)
        assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {missing[:3]}"
        return seen
    finally:
        store.shutdown()


def _run_timer_child(data_dir: Path, mode: str, clock: int, count: int, log: Path) -> str:
    """Start ``timer_child.py`` and return its first line (its stderr goes to ``log``)."""
    with log.open("ab") as err:
        child = subprocess.Popen(
            [sys.executable, str(TIMER_CHILD), str(data_dir), mode, str(clock), str(count)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    assert child.stdout is not None
    line = child.stdout.readline().strip()  # then it exits, or waits to be killed
    child.kill()
    child.wait(30)
    child.stdout.close()
    return line


def test_timers_a_restart_found_are_fsynced_before_its_checkpoint_claims_them(
    tmp_path: Path,
) -> None:
    """A broker killed right after its wheel enqueued 20 delay messages (acknowledged under
    SYNC: the timer records are fsynced in the CommitLog) leaves their bucket entries in the
    page cache only. The restarted wheel finds them in its current bucket and writes nothing
    again (a re-read entry is a duplicate), then saves a checkpoint past their timer records.
    A power loss then loses the entries, and the checkpoint says never to read the records
    again: the 20 messages are never delivered (decision 297). Until the wheel's checkpoint
    was made durable (its directory fsynced) this passed here by accident: on this filesystem
    the checkpoint's rename never survived a power loss, so the wheel re-read every record."""
    _need_fuse()
    durable = tmp_path / "durable"
    store_dir = tmp_path / "mnt" / "store"
    clock = (time.time_ns() // 1_000_000) // 60_000 * 60_000 + 1_000  # early in its minute
    log = tmp_path / "timer-child.log"
    fs = PowerLossMount(tmp_path / "mnt", durable)
    try:
        line = _run_timer_child(store_dir, "put-and-die", clock, 20, log)
        assert line == "enqueued", log.read_text()[-2000:]
        line = _run_timer_child(store_dir, "hold", clock, 20, log)
        assert line == "checkpointed", log.read_text()[-2000:]
        fs.crash()
    finally:
        fs.close()
    store = MessageStore(StoreConfig(data_dir=durable / "store", flush="sync", **SMALL))
    store.start()
    timers = TimerService(
        store, durable / "store" / "timer", lambda: ["later"], clock=lambda: clock + 120_000
    )
    timers.start()
    try:
        deadline = time.monotonic() + 20
        while timers.delivered < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.wait_dispatched()
        got = store.get_messages("later", 0, 0, 100)
        assert len(got.messages) == 20, f"{20 - len(got.messages)} of 20 delay messages lost"
    finally:
        timers.stop()
        store.shutdown()


@pytest.mark.parametrize("seed", ["cq-repair-1", "cq-repair-2", "cq-repair-3"])
def test_a_power_loss_during_the_consumequeue_repair_at_start_leaves_a_whole_queue(
    tmp_path: Path, seed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up repair of zeroed ConsumeQueue entries (decisions 363, 503) writes them in
    place; the power goes out before it is fsynced, and a random part of its pages lands whole,
    torn at a sector or not at all. The next start finds whatever is still zero and rebuilds
    it: every message of the queue is read back in order, none skipped, none early-ended."""
    _need_fuse()
    from test_consume_queue_repair import (
        PER_QUEUE,
        body,
        read_queue,
        write_two_queues,
        zero_entries,
    )

    durable = tmp_path / "durable"
    config = StoreConfig(data_dir=durable / "store", **SMALL)
    write_two_queues(config)
    for first, count in ((0, 3), (100, 2), (255, 3), (300, 40), (599, 1)):  # the last: torn tail
        zero_entries(config, 1, first, count)
    monkeypatch.setenv("TMQ_FAILPOINTS", "store.after_cq_repair=sleep:60")
    fs = PowerLossMount(tmp_path / "mnt", durable)
    log_path = tmp_path / "child.log"
    try:
        with log_path.open("w") as log_file:
            child = subprocess.Popen(
                [
                    sys.executable,
                    str(FS.with_name("store_child.py")),
                    str(tmp_path / "mnt" / "store"),
                    "hold",
                    "sync",
                    "0",
                ],
                stdout=log_file,
                stderr=log_file,
            )
        try:
            deadline = time.monotonic() + 60
            while "store.after_cq_repair" not in log_path.read_text():
                assert child.poll() is None, log_path.read_text()[-3000:]
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.05)
            # The repair's stores through the mapping reach the filesystem when the kernel
            # writes dirty pages back (as it does within 30 s by itself), not on an fsync: the
            # power then goes out with them written but not durable.
            mount_fd = os.open(tmp_path / "mnt", os.O_RDONLY)
            try:
                assert ctypes.CDLL(None, use_errno=True).syncfs(mount_fd) == 0
            finally:
                os.close(mount_fd)
            landed = fs.crash(seed)
        finally:
            child.kill()
            child.wait()
    finally:
        fs.close()
    text = log_path.read_text()
    assert "rebuilt 3 zeroed entries before queue offset 3" in text, text[-3000:]
    assert "rebuilt the damaged entries [300, 340)" in text, text[-3000:]
    assert landed > 0, "some of the repair's pages should have reached the disk"
    monkeypatch.delenv("TMQ_FAILPOINTS")
    store = MessageStore(config)
    report = store.start()
    try:
        print(f"landed {landed} pages; repaired again {report.cq_entries_repaired}")
        assert report.cq_entries_unrepaired == 0
        assert store.min_offset("t", 1) == 0
        assert read_queue(store, 1) == [body(1, n) for n in range(PER_QUEUE)]
        assert read_queue(store, 0) == [body(0, n) for n in range(PER_QUEUE)]
    finally:
        store.shutdown()


def assert_closed_all(store: MessageStore, index_files: list[IndexFile]) -> None:
    """A shutdown on a dead disk closed every file and released the lock (decisions 711, 781)."""
    assert all(f.mm.closed for f in index_files), "an IndexFile was left mapped"
    assert all(f.mm.closed for f in store.commitlog.files.files)
    assert store.data_dir._lock_fd is None, "the data directory's lock was left held"


def test_a_store_whose_disk_died_shuts_down_closing_every_file(tmp_path: Path) -> None:
    """The power goes out under a running store; its periodic flush meets the dead disk and
    fails the store (what raced `shutdown` in a loaded run of the group commit power-loss test).
    Shutdown then leaves the abort marker and closes every file: an IndexFile whose header
    cannot be written any more (EIO) is still unmapped and closed, and no raw `OSError` escapes
    from `shutdown` (it used to, leaving the rest of the store's files and its lock open)."""
    _need_fuse()
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    fs = PowerLossMount(mountpoint, durable)
    try:
        store = MessageStore(StoreConfig(data_dir=mountpoint / "store", flush="sync", **SMALL))
        store.start()
        for n in range(20):
            store.put_message(
                Message(topic="dead", queue_id=0, body=b"%d" % n, properties={"KEYS": "k"})
            )
        assert store.wait_dispatched()
        fs.crash()
        with pytest.raises(DurabilityLostError):
            store.flush()  # the periodic flush: ConsumeQueue and IndexFile fsyncs fail (EIO)
        assert store.commitlog.failed is not None
        index_files = list(store.index.files)
        assert index_files
        store.shutdown()
        assert_closed_all(store, index_files)
    finally:
        fs.close()


def test_a_start_that_fails_on_a_dying_disk_raises_its_own_error_not_the_cleanups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start refused for a reason of its own (here an unreadable queue-floors file, decision
    720) while the disk dies under it: closing what the start had opened then meets EIO (an
    IndexFile's header write). The operator must see why the start failed, not the cleanup's
    EIO, which used to replace it; the cleanup's error is kept as a note, every file is closed
    and the lock released."""
    _need_fuse()
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    fs = PowerLossMount(mountpoint, durable)
    try:
        config = StoreConfig(data_dir=mountpoint / "store", flush="sync", **SMALL)
        with MessageStore(config) as store:
            for n in range(20):
                store.put_message(
                    Message(topic="dead", queue_id=0, body=b"%d" % n, properties={"KEYS": "k"})
                )
        floors = config.data_dir / store_module.QUEUE_FLOORS_FILE
        floors.write_bytes(b"{not json")
        real_load = store_module.load_queue_floors

        def power_cut_then_load(data_dir: Path) -> dict[tuple[str, int], int]:
            fs.crash()  # the disk dies here, mid-start: every later write is EIO
            return real_load(data_dir)

        monkeypatch.setattr(store_module, "load_queue_floors", power_cut_then_load)
        store = MessageStore(config)
        with pytest.raises(store_module.StoreLoadError, match="queue-floors") as raised:
            store.start()
        assert any("Input/output error" in note for note in raised.value.__notes__)
        assert store.index.files, "the start had opened its IndexFiles"
        assert all(f.mm.closed for f in store.index.files), "an IndexFile was left mapped"
        assert all(f.mm.closed for f in store.commitlog.files.files)
        assert store.data_dir._lock_fd is None, "the data directory's lock was left held"
    finally:
        fs.close()


@pytest.mark.parametrize("first", ["flush", "shutdown"])
def test_a_dead_disk_met_by_a_flush_or_a_shutdown_fails_the_store_naming_the_file(
    tmp_path: Path, first: str
) -> None:
    """The power goes out under a healthy SYNC store (its CommitLog fsynced, its ConsumeQueue
    and IndexFile not): whichever meets the dead disk first, the periodic or an explicit
    ``flush`` or the ``shutdown``, raises ``DurabilityLostError`` naming the file whose fsync
    failed and fails the store, and the shutdown still closes every file and releases the
    lock. The flush's error used to name no file, and the shutdown raised the ConsumeQueue's
    raw ``OSError``, leaving the IndexFiles mapped and the data directory locked."""
    _need_fuse()
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    fs = PowerLossMount(mountpoint, durable)
    try:
        data_dir = mountpoint / "store"
        # The periodic flush must not meet the dead disk first (decision 711's race): this
        # test is the flush, or the shutdown, that does.
        config = StoreConfig(data_dir=data_dir, flush="sync", flush_interval_ms=600_000, **SMALL)
        store = MessageStore(config)
        store.start()
        for n in range(20):
            store.put_message(
                Message(topic="dead", queue_id=0, body=b"%d" % n, properties={"KEYS": "k"})
            )
        assert store.wait_dispatched()
        store.flush_commitlog()  # the CommitLog is on disk: the derived files' fsyncs fail
        fs.crash()
        with pytest.raises(DurabilityLostError) as raised:
            store.flush() if first == "flush" else store.shutdown()
        named = re.search(rf"'{re.escape(str(data_dir))}/(\w+)/", str(raised.value))
        assert named is not None and named[1] in ("consumequeue", "index"), raised.value
        assert store.commitlog.failed is not None
        with pytest.raises(DurabilityLostError):
            store.flush()
        index_files = list(store.index.files)
        store.shutdown()
        assert_closed_all(store, index_files)
    finally:
        fs.close()


def test_a_user_saved_before_a_power_loss_still_authenticates_after_it(tmp_path: Path) -> None:
    """The first user of a broker makes its secrets' key file (auth.key, in the data directory)
    and saves the user in config/acl.json, encrypted with that key. acl.json's save fsyncs its
    own directory; the key file's name was never made durable (its bytes were fsynced, its
    directory entry not). A power loss then kept acl.json and dropped the key: the next start
    made a new key, and no saved secret decrypted (every user lost, the broker's ACL unloadable)
    until someone restored a key nobody had any more."""
    _need_fuse()
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    durable.mkdir()
    (durable / "data" / "config").mkdir(parents=True)  # a broker's, there before the power loss
    fs = PowerLossMount(mountpoint, durable)
    try:
        meta = BrokerMetadata(mountpoint / "data" / "config")
        meta.load()
        secret = meta.acl.create_user("alice")  # returned: saved, the client is told its key
        fs.crash()
    finally:
        fs.close()
    again = BrokerMetadata(durable / "data" / "config")
    again.load()  # raised "the secret of user alice does not decrypt" on main
    assert again.acl.lookup("alice") == (secret, False)


def test_an_archive_on_a_file_tier_survives_a_power_loss_after_its_commit(tmp_path: Path) -> None:
    """A file:// tier on the power-loss filesystem: the first offload of a queue makes its
    directories (``{cluster}/{broker}/{topic}/{queue}/manifests``, ``segments``). Each object
    and its name were made durable, but the directories were made with ``mkdir -p`` and their
    parents never fsynced: a power loss after the commit, which lets release delete the local
    copy, took the new directories with everything in them, and the queue's archive was gone
    (its manifest loaded as an empty version 0). Every committed message must be in the
    archive after the power loss."""
    _need_fuse()
    from offload.offloader import Offloader, OffloadPolicy
    from tiered.cold.manifest import ManifestLog, queue_prefix
    from tiered.cold.segment import SegmentReader
    from tiered.cold.storage import open_store

    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    durable.mkdir()
    hot = MessageStore(StoreConfig(data_dir=tmp_path / "hot", **SMALL))
    hot.start()
    try:
        for n in range(300):
            hot.put_message(Message(topic="orders", queue_id=0, body=b"m%d" % n, properties={}))
        assert hot.wait_dispatched()
        fs = PowerLossMount(mountpoint, durable)
        try:
            tier = open_store(f"file://{mountpoint}/tier")
            offloader = Offloader(
                hot, tier, "c1", "broker-a", OffloadPolicy(segment_max_messages=100)
            )
            assert offloader.offload_queue("orders", 0).watermark == 300  # committed
            fs.crash()
        finally:
            fs.close()
    finally:
        hot.shutdown()
    after = open_store(f"file://{durable}/tier")
    manifest = ManifestLog(after, queue_prefix("c1", "broker-a", "orders", 0)).load()
    assert manifest.end_offset == 300, "the committed archive lost with its directories"
    bodies = [
        m.body
        for info in manifest.segments
        for m in SegmentReader(after, info).read(info.base_offset, info.count)
    ]
    assert bodies == [b"m%d" % n for n in range(300)]


def test_an_object_a_killed_writer_linked_is_durable_once_a_retry_finds_it(
    tmp_path: Path,
) -> None:
    """A file:// tier's create-if-absent links a fsynced temporary file into place, then fsyncs
    the directory. A writer killed between the two (a broker's kill -9 mid-offload) leaves the
    object's name in the page cache only. The retry after the restart finds the name taken and
    answers "exists" (offload then reads the footer, finds its own bytes and goes on to commit
    the manifest that names the object, and release deletes the local copy): that answer must
    be as durable as a fresh create, or a power loss after it takes the object from under a
    committed manifest."""
    _need_fuse()
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    durable.mkdir()
    data = os.urandom(10_000)
    fs = PowerLossMount(mountpoint, durable)
    try:
        url = f"file://{mountpoint}/tier"
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys\n"
                "from tiered.cold.storage import open_store\n"
                "open_store(sys.argv[1]).put_if_absent('q/seg-0', bytes.fromhex(sys.argv[2]))\n",
                url,
                data.hex(),
            ],
            env={**os.environ, "TMQ_FAILPOINTS": "tier.after_link"},
            cwd=Path(__file__).parent.parent,
            capture_output=True,
            timeout=60,
        )
        assert child.returncode == -9, child.stderr.decode()[-2000:]  # killed after the link
        from tiered.cold.storage import open_store

        assert open_store(url).put_if_absent("q/seg-0", data) is False  # the retry: it exists
        assert open_store(url).get("q/seg-0") == data
        fs.crash()
    finally:
        fs.close()
    assert (durable / "tier" / "q" / "seg-0").read_bytes() == data, "an answered object lost"


def test_a_key_file_a_killed_broker_left_unsynced_is_made_durable_before_use(
    tmp_path: Path,
) -> None:
    """The secrets' key file is made durable when it is made (decision 1141): written, renamed
    into place, the directory fsynced. A broker killed between the rename and that fsync left
    the key's name in the page cache only; the next start read it there, saved a user's secret
    encrypted with it (acl.json's save makes acl.json durable, not the key), and a power loss
    then kept the secret and dropped its key: no saved secret decrypted again."""
    _need_fuse()
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    durable.mkdir()
    (durable / "data" / "config").mkdir(parents=True)
    fs = PowerLossMount(mountpoint, durable)
    try:
        config = mountpoint / "data" / "config"
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys\n"
                "from pathlib import Path\n"
                "from broker.metadata import BrokerMetadata\n"
                "meta = BrokerMetadata(Path(sys.argv[1]))\n"
                "meta.load()\n"
                "meta.acl.create_user('bob')\n",
                str(config),
            ],
            env={**os.environ, "TMQ_FAILPOINTS": "durable.after_rename"},
            cwd=Path(__file__).parent.parent,
            capture_output=True,
            timeout=60,
        )
        assert child.returncode == -9, child.stderr.decode()[-2000:]  # killed after the rename
        assert (mountpoint / "data" / "auth.key").exists()  # in the page cache
        meta = BrokerMetadata(config)  # the restart
        meta.load()
        secret = meta.acl.create_user("alice")  # returned: saved, the client is told its key
        fs.crash()
    finally:
        fs.close()
    again = BrokerMetadata(durable / "data" / "config")
    again.load()
    assert again.acl.lookup("alice") == (secret, False)


_REWRITE_KILLED_AFTER_RENAME = {
    # loader name: (file, the content a killed writer left, the child's write)
    "queue floors": ("data/queue-floors.json", '{"queues": [["t", 0, 500]]}'),
    "epochs": ("data/epochs", "1 0\n2 4096\n"),
    "topics": ("data/config/topics.json", '[{"name": "orders"}, {"name": "refunds"}]'),
}


def _load_after_restart(kind: str, root: Path) -> object:
    from tiered.epoch_file import EpochFile

    if kind == "queue floors":
        return store_module.load_queue_floors(root / "data")
    if kind == "epochs":
        epochs = EpochFile(root / "data")
        epochs.load()
        return [(e.epoch, e.start_offset) for e in epochs.entries]
    meta = BrokerMetadata(root / "data" / "config")
    meta.load()
    return sorted(meta.topics)


@pytest.mark.parametrize("kind", sorted(_REWRITE_KILLED_AFTER_RENAME))
def test_what_a_start_read_from_a_killed_writers_rename_survives_a_power_loss(
    tmp_path: Path, kind: str
) -> None:
    """``write_file`` renames a fsynced temporary file into place, then fsyncs the directory. A
    process killed between the two leaves the new name in the page cache only. The next start
    read it and acted on it (a floor applied, an epoch taken, a topic served), and a power loss
    then brought the old file back under what it had done. A start now makes the directory
    durable before it reads from it (decision 1184)."""
    _need_fuse()
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    (durable / "data" / "config").mkdir(parents=True)
    name, new = _REWRITE_KILLED_AFTER_RENAME[kind]
    old = {"queue floors": '{"queues": []}', "epochs": "1 0\n", "topics": '[{"name": "orders"}]'}
    (durable / name).write_text(old[kind])
    fs = PowerLossMount(mountpoint, durable)
    try:
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys\n"
                "from pathlib import Path\n"
                "from tiered.durable import write_file\n"
                "write_file(Path(sys.argv[1]), sys.argv[2].encode())\n",
                str(mountpoint / name),
                new,
            ],
            env={**os.environ, "TMQ_FAILPOINTS": "durable.after_rename"},
            cwd=Path(__file__).parent.parent,
            capture_output=True,
            timeout=60,
        )
        assert child.returncode == -9, child.stderr.decode()[-2000:]  # killed after the rename
        read = _load_after_restart(kind, mountpoint)  # the restart reads the new file
        fs.crash()
    finally:
        fs.close()
    assert _load_after_restart(kind, durable) == read, "the power loss took back what was read"


def test_a_torn_tail_recovery_cut_is_still_in_quarantine_after_a_power_loss(
    tmp_path: Path,
) -> None:
    """Recovery copies a torn tail to ``quarantine/`` and then cuts it from the CommitLog: the
    copy is then the only place those bytes are. It must be durable before the cut is, or a
    power loss after the start keeps the cut and loses the copy."""
    _need_fuse()
    durable, mountpoint = tmp_path / "durable", tmp_path / "mnt"
    rng = random.Random("quarantine")
    store = MessageStore(StoreConfig(data_dir=durable / "store", flush="sync", **SMALL))
    store.start()
    try:
        store.put_messages([message_for(f"acked-{i}", rng) for i in range(20)])
        end = store.max_physical_offset
    finally:
        store.shutdown()
    files = sorted((durable / "store" / "commitlog").iterdir(), key=lambda p: int(p.name))
    last = max((p for p in files if int(p.name) <= end), key=lambda p: int(p.name))
    torn = rng.randbytes(3000)  # what a crash left past the valid records: never acknowledged
    with open(last, "r+b") as f:
        f.seek(end - int(last.name))
        f.write(torn)
    (durable / "store" / "abort").write_bytes(b"")  # the store was running at the crash

    with _power_lost_after(tmp_path, flush="sync") as store:
        report = store.start()
        assert store.max_physical_offset == end
        assert len(report.commitlog.quarantined) == 1
        copy = report.commitlog.quarantined[0].relative_to(mountpoint)
        assert (mountpoint / copy).read_bytes() == torn
    after = (durable / last.relative_to(durable)).read_bytes()
    cut_landed = after[end - int(last.name) :][: len(torn)] != torn
    saved = durable / copy
    assert saved.exists() and saved.read_bytes() == torn, (
        f"the torn tail's only copy is lost (the cut {'landed' if cut_landed else 'did not'})"
    )


def _queue_0_damaged_at_40(durable: Path) -> StoreConfig:
    """Queues 0 and 1 of topic t in ``durable/store`` (durable: the mount is not up yet),
    queue 0's entry 40 naming queue 1's record 40, which lies in CommitLog order: only a read
    finds it (decision 686). The store's config."""
    from test_consume_queue_repair import entries_of, write_entry, write_two_queues

    on_disk = StoreConfig(data_dir=durable / "store", **SMALL)
    write_two_queues(on_disk)
    write_entry(on_disk, 0, 40, entries_of(on_disk, 1)[40])
    return on_disk


@contextlib.contextmanager
def _power_lost_after(tmp_path: Path, flush: str = "async") -> Iterator[MessageStore]:
    """A store (not started) on the power-loss mount of ``tmp_path/durable``; the power goes
    out when the block ends."""
    _need_fuse()
    mountpoint = tmp_path / "mnt"
    fs = PowerLossMount(mountpoint, tmp_path / "durable")
    try:
        store = MessageStore(StoreConfig(data_dir=mountpoint / "store", flush=flush, **SMALL))
        try:
            yield store
            fs.crash()
        finally:
            with contextlib.suppress(Exception):
                store.shutdown()
    finally:
        fs.close()


def test_a_damaged_entry_a_read_noted_is_still_noted_after_a_power_loss(tmp_path: Path) -> None:
    """A read that meets a ConsumeQueue entry naming another queue's record fails, telling the
    operator to restart, and notes the entry in ``damaged_entries`` for the start to rebuild
    (no start check sees an entry that names a record in order, decision 686). The note must
    survive a power loss: the restart the error asks for must rebuild the entry, not meet the
    same error again."""
    from test_consume_queue_repair import read_stops_at_40, restart_repairs

    _need_fuse()
    on_disk = _queue_0_damaged_at_40(tmp_path / "durable")
    with _power_lost_after(tmp_path) as store:
        store.start()
        read_stops_at_40(store, r"t/0.*queue offset 40.*t/1.*restart")
        assert (store.config.data_dir / "damaged_entries").exists()
    restart_repairs(on_disk, 1, 0)


def test_damage_notes_are_kept_until_the_entries_they_name_are_rebuilt_durably(
    tmp_path: Path,
) -> None:
    """The start rebuilds the entries ``damaged_entries`` names, then removes the file. An
    ASYNC start's checkpoint fsyncs the data dir at once, which makes the removal durable,
    while the rebuilt entries reach the disk with the flusher, later: a power loss between the
    two must not keep the wrong entry and lose the note that names it."""
    from test_consume_queue_repair import read_queue, read_stops_at_40, restart_repairs, whole

    _need_fuse()
    on_disk = _queue_0_damaged_at_40(tmp_path / "durable")
    assert on_disk.flush == "async"
    store = MessageStore(on_disk)
    store.start()
    try:
        read_stops_at_40(store, r"t/0.*queue offset 40.*t/1.*restart")
    finally:
        store.shutdown()
    assert (on_disk.data_dir / "damaged_entries").exists()
    with _power_lost_after(tmp_path) as store:
        assert store.start().cq_entries_repaired == 1
        assert read_queue(store, 0) == whole(0)
    # The rebuilt entry is durable (a note that survived finds nothing left to rebuild).
    restart_repairs(on_disk, 0, 0)
