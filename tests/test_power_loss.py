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

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import run_child
from test_crash import Ack, verify

from broker.metadata import BrokerMetadata

FS = Path(__file__).with_name("powerloss_fs.py")


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

    def crash(self) -> None:
        reply = self.command("crash")
        assert reply.startswith("crashed"), reply

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

    def kill(self) -> None:
        self.child.kill()
        self.child.wait()
        self.reader.join()
        if self.child.stderr is not None:
            self.stderr = self.child.stderr.read()
            self.child.stderr.close()


def power_loss_rounds(tmp_path: Path, rounds: int, seed: str) -> dict[str, int]:
    """``rounds`` crash points; returns the figures. Fails on any acknowledged loss."""
    _need_fuse()
    durable = tmp_path / "durable"
    mountpoint = tmp_path / "mnt"
    rng = random.Random(seed)
    acked: dict[str, Ack] = {}
    groups: set[str] = set()
    recovered_on_fuse = 0
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
            fs.crash()
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
    }
    print(json.dumps({"power_loss": figures}))
    assert commitlog_files >= 3, "the run should roll several CommitLog files"
    assert len(acked) > 200
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


def test_after_a_failed_fsync_nothing_more_is_acknowledged(tmp_path: Path) -> None:
    """fsyncgate: Linux may drop the pages of a failed writeback and report success on the
    next fsync. A store that retries would acknowledge messages behind a hole."""
    _need_fuse()
    durable = tmp_path / "durable"
    fs = PowerLossMount(tmp_path / "mnt", durable)
    try:
        producer = Producer(tmp_path / "mnt" / "store", 99)
        assert producer.first_ack.wait(60)
        time.sleep(0.3)
        size = json.loads(Path(__file__).with_name("store_sizes.json").read_text())
        assert fs.command(f"fail-fsync {size['commitlog_file_size']}") == "armed"
        deadline = time.monotonic() + 20
        while producer.refused < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        fs.crash()
        producer.kill()
    finally:
        fs.close()
    assert producer.refused >= 5, "the store should refuse writes after an fsync failed"
    first_refusal = producer.lines.index("refused")
    assert "ack" not in producer.lines[first_refusal:], "acknowledged after an fsync failed"
    verify(durable / "store", "sync", producer.acks)
