"""A tiered broker on a small disk while its object store is down (decisions 680, 735, 693).

The store answers every request with 503 at the HTTP level (localstack/fault_proxy.py), so
the offload stalls and release keeps every CommitLog file: the broker's own data fills a 12 MiB
tmpfs. It must refuse appends cleanly with the disk-full error, keep every acknowledged
message readable and never delete a file that holds records not yet uploaded. When the store
comes back, without a restart, the offload must catch up, release must free room and appends
must be taken again; every acknowledged message is then read back once, at its own offset, and
no refused one."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import grpc
from broker_harness import pull_all
from conftest import S3Endpoint
from rocketmq.grpc_protocol import definition_pb2 as d
from rocketmq.grpc_protocol import service_pb2 as s
from rocketmq.grpc_protocol import service_pb2_grpc
from test_disk_full import _Node, small_disk, write_config

from tiered.cold.manifest import ManifestLog, queue_prefix
from tiered.cold.storage import open_store

__all__ = ["small_disk"]  # the fixture, used by name

TOPIC = "full-tiered"
QUEUES = 2


def _request(first: int, count: int) -> tuple[s.SendMessageRequest, list[bytes]]:
    request = s.SendMessageRequest()
    bodies = []
    for n in range(first, first + count):
        body = f"m{n:07d}-".encode() + os.urandom(1500)
        m = request.messages.add(topic=d.Resource(name=TOPIC), body=body)
        m.system_properties.message_id = os.urandom(16).hex().upper()
        m.system_properties.message_type = d.NORMAL
        m.system_properties.body_encoding = d.IDENTITY
        m.system_properties.keys.append(f"k{n}")
        bodies.append(body)
    return request, bodies


def _send(stub: Any, n: int, acked: dict[bytes, int], refused: set[bytes]) -> Any:
    """One batch of 16 from message ``n``; returns the reply's status."""
    request, bodies = _request(n, 16)
    reply = stub.SendMessage(request, timeout=60)
    if reply.status.code == d.OK:
        by_id = {
            m.system_properties.message_id: b for m, b in zip(request.messages, bodies, strict=True)
        }
        for entry in reply.entries:
            acked[by_id[entry.message_id]] = entry.offset
    else:
        refused.update(bodies)
    return reply.status


def test_an_object_store_outage_fills_the_disk_refuses_cleanly_and_recovers_without_restart(
    small_disk: Path, tmp_path: Path, fault_proxy: Any, s3: S3Endpoint, bucket: str
) -> None:
    url = f"s3://{bucket}/full"
    proxied = S3Endpoint(fault_proxy.url, "proxy")
    node = _Node(
        small_disk / "data",
        extra=[
            "--config",
            str(write_config(tmp_path / "tmq.toml")),
            "--commitlog-file-size",
            "1MiB",
            "--offload-interval",
            "1",
            "--upload-after",
            "1s",
            "--tier-url",
            url,
        ],
        env=proxied.env(),
    )
    node.log_dir = tmp_path
    commitlog = small_disk / "data" / "commitlog"
    acked: dict[bytes, int] = {}
    refused: set[bytes] = set()
    node.start()
    try:
        node.create_topic(TOPIC, queues=QUEUES, tiered=True)
        node.create_group("g-replay")
        stub = service_pb2_grpc.MessagingServiceStub(grpc.insecure_channel(node.endpoint))
        fault_proxy.set(error_rate=1.0, error_status=503)
        n, refusals = 0, []
        while len(refusals) < 5 and n < 50_000:
            status = _send(stub, n, acked, refused)
            n += 16
            if status.code != d.OK:
                refusals.append(status)
        assert len(refusals) == 5, "a 12 MiB disk should fill up while nothing is uploaded"
        assert len(acked) > 2000, "the disk should take several CommitLog files first"
        for st in refusals:
            assert st.code == d.INTERNAL_SERVER_ERROR, st
            assert "disk is full" in st.message, st
        # Nothing was uploaded, so nothing may have been released.
        assert (commitlog / f"{0:020d}").exists(), "a file of unuploaded records was deleted"

        fault_proxy.heal()
        # Without a restart: the offload catches up, release frees room, appends resume.
        deadline = time.monotonic() + 180
        while True:
            status = _send(stub, n, acked, refused)
            n += 16
            if status.code == d.OK:
                break
            assert "disk is full" in status.message, status
            assert time.monotonic() < deadline, "appends never resumed after the store returned"
            time.sleep(1)
        assert not (commitlog / f"{0:020d}").exists(), "room came back without a release?"
        for _ in range(20):
            status = _send(stub, n, acked, refused)
            n += 16
            assert status.code == d.OK, status

        # Everything acknowledged is uploaded in the end.
        tier = open_store(url, s3.storage_options())
        deadline = time.monotonic() + 120
        while (archived := sum(_end(tier, q) for q in range(QUEUES))) < len(acked):
            assert time.monotonic() < deadline, f"{archived} of {len(acked)} uploaded"
            time.sleep(1)
        print(f"acknowledged {len(acked)}, refused {len(refused)}, archived {archived}")
        got = pull_all(node, TOPIC, QUEUES)
        bodies = [m.body for m in got]
        assert len(bodies) == len(set(bodies)), "a message served twice"
        served = set(bodies)
        assert not served & refused, f"{len(served & refused)} refused messages stored"
        lost = set(acked) - served
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged messages not served"
        for m in got:
            assert acked[m.body] == m.system_properties.queue_offset, "served at another offset"
    finally:
        if node.proc is not None and node.proc.poll() is None:
            node.kill9()


def _end(tier: Any, queue_id: int) -> int:
    return (
        ManifestLog(tier, queue_prefix("DefaultCluster", "broker-a", TOPIC, queue_id))
        .load()
        .end_offset
    )
