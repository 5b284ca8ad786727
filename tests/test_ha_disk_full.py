"""A slave whose disk fills up during SYNC replication: the master acknowledges nothing the
slave could not store, the slave says why in one line, and once space is freed it catches up
and ends byte-identical to the master, without a gap."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import mounted_tmpfs
from rocketmq.grpc_protocol import definition_pb2 as d

from tests.broker_harness import free_port
from tests.test_ha import GroupMember, assert_same_replica, caught_up, send, wait_until

# Small ConsumeQueue files: a CommitLog roll reserves room for 16 of them (and an IndexFile),
# which must not be what fills the tmpfs.
STORE_TOML = "consumequeue_entries_per_file = 1000"


@pytest.fixture
def slave_disk(tmp_path: Path) -> Iterator[Path]:
    """A 6 MiB tmpfs for the slave's data dir (root only); grown by remounting."""
    with mounted_tmpfs(tmp_path / "slave-disk", "6m") as mnt:
        yield mnt


def test_a_slave_whose_disk_fills_blocks_sync_acks_and_catches_up_after_space_is_freed(
    tmp_path: Path, slave_disk: Path
) -> None:
    master = GroupMember(tmp_path, "master", free_port())
    slave = GroupMember(tmp_path, "slave", free_port())
    slave.data_dir = slave_disk / "slave"
    try:
        master.start(
            "master",
            0,
            mode="sync",
            min_in_sync_replicas=2,
            sync_timeout_ms=1500,
            store_toml=STORE_TOML,
        )
        master.create_topic()
        slave.start("slave", 1, master=master, store_toml=STORE_TOML)
        wait_until(
            "the slave joins the SyncStateSet",
            lambda: master.metric("tmq_replication_sync_state_set_size") == 2,
        )
        sent = 0
        acked_end = 0.0
        codes: list[int] = []
        while sent < 40_000:
            codes = [st.code for st in send(master.endpoint, sent, 100, batch=100)]
            sent += 100
            if codes != [d.OK]:
                break
            acked_end = master.metric("tmq_replication_max_offset") or 0.0
        # Refused, never acknowledged: the slave could not store those bytes.
        assert codes in ([d.SLAVE_PERSISTENCE_TIMEOUT], [d.HA_NOT_AVAILABLE]), codes
        # Every byte acknowledged so far is on the slave, full as it is.
        assert (slave.metric("tmq_replication_max_offset") or 0) >= acked_end > 0
        wait_until("the slave says why", lambda: "disk is full" in slave.log_path.read_text())
        wait_until(
            "the full slave leaves the SyncStateSet",
            lambda: master.metric("tmq_replication_sync_state_set_size") == 1,
        )
        before = master.metric("tmq_replication_max_offset")
        assert [st.code for st in send(master.endpoint, sent, 100, batch=100)] == [
            d.HA_NOT_AVAILABLE
        ]
        assert master.metric("tmq_replication_max_offset") == before, "refused: nothing stored"
        # Space is freed: the slave catches up from where it stopped and rejoins.
        subprocess.run(["mount", "-o", "remount,size=64m", str(slave_disk)], check=True)
        wait_until("the slave catches up", lambda: caught_up(master, slave), timeout=60)
        wait_until(
            "the slave rejoins the SyncStateSet",
            lambda: master.metric("tmq_replication_sync_state_set_size") == 2,
        )
        assert [st.code for st in send(master.endpoint, sent, 100, batch=100)] == [d.OK]
        sent += 100
        master.stop()
        slave.stop()
        # Byte-identical CommitLogs, identical ConsumeQueues: no gap where the disk was full.
        # Messages of refused sends: the one that timed out is stored (never acknowledged).
        assert assert_same_replica(master.data_dir, slave.data_dir) == sent
    finally:
        for m in (master, slave):
            if m.proc is not None and m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait()
