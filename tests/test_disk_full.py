"""A full disk, on a real tmpfs of a few MiB under a real broker process.

A refused batch is refused whole (nothing of it readable, now or after a restart), the refusal
says the disk is full, and a broker whose disk cannot hold one CommitLog file does not start.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from broker_harness import Standalone
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc

from tiered.config import StoreConfig
from tiered.store import GetStatus, MessageStore

GEOMETRY = {
    "commitlog_file_size": 1 << 20,
    "consumequeue_entries_per_file": 1000,
    "index_hash_slots": 1000,
    "index_max_entries": 4000,
}


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 12 MiB tmpfs (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mnt)])
    if done.returncode != 0:
        pytest.skip("mount -t tmpfs is refused here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


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


def test_a_broker_without_room_for_one_commitlog_file_does_not_start(small_disk: Path) -> None:
    node = Standalone(small_disk / "data", extra=["--commitlog-file-size", "64MiB"])
    with pytest.raises(RuntimeError) as e:
        node.start()
        node.stop()  # it should not have started
    assert "commitlog_file_size" in str(e.value)
    assert not (small_disk / "data" / "commitlog").exists()
