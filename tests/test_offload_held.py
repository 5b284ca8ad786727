"""A queue whose offload is held at a damaged ConsumeQueue entry (decision 730) says so: in the
admin protocol and `tmq offload status` (text, --json, exit code 3, `--wait` returns), with one
log line when the hold starts rather than one every pass; a restart rebuilds the entry and the
queue is archived whole. A real `tmq standalone` with its cold worker, LocalStack S3, decision
755."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from broker_harness import Standalone, send_batches, start_tiered, tmq

from broker import admin_pb2 as apb
from tiered.formats import CQ_DTYPE, CQ_ENTRY_SIZE

TOPIC = "held-orders"
OTHER = "held-audit"  # not tiered: its records lie beside the held topic's in the CommitLog
COUNT = 300
DAMAGED = 200


def entry_path(data: Path, topic: str) -> Path:
    return data / "consumequeue" / topic / "0" / f"{0:020d}"


def status(node: Standalone, *extra: str) -> Any:
    return tmq("offload", "status", TOPIC, "-n", node.namesrv, *extra, timeout=120)


def test_a_held_offload_is_shown_by_status_logged_once_and_ends_with_a_restart(
    tmp_path: Path, s3: Any, bucket: str
) -> None:
    # Segments of 50 messages: the entry at 200 starts the fifth, so the four before it land.
    url, env = f"s3://{bucket}/held", {**s3.env(), "TMQ_OFFLOAD_SEGMENT_MAX_MESSAGES": "50"}
    data = tmp_path / "node"
    node = start_tiered(data, url, env)
    try:
        for name in (TOPIC, OTHER):  # not tiered yet: nothing is uploaded before the damage
            made = tmq("topic", "create", name, "-n", node.namesrv, "-q", "1")
            assert made.returncode == 0, made.stderr
        for i in range(0, COUNT, 50):  # interleaved, so both queues have offsets 0..COUNT-1
            for name in (TOPIC, OTHER):
                send_batches(
                    node.endpoint,
                    name,
                    [(f"{name}-{n:04d}-".encode() * 20, f"k{n}", "t") for n in range(i, i + 50)],
                )
        ours, theirs = (
            entry_path(data, name).read_bytes()[DAMAGED * CQ_ENTRY_SIZE :][:CQ_ENTRY_SIZE]
            for name in (TOPIC, OTHER)
        )
        assert ours != theirs and len(theirs) == CQ_ENTRY_SIZE
        # Another topic's record at the same queue offset: only the segment build's topic check
        # sees it. The broker maps the file: it sees the write.
        with entry_path(data, TOPIC).open("r+b") as fh:
            fh.seek(DAMAGED * CQ_ENTRY_SIZE)
            fh.write(theirs)
        at = int(np.frombuffer(theirs, CQ_DTYPE)["offset"][0])
        tiered = tmq("topic", "update", TOPIC, "-n", node.namesrv, "--tiered")
        assert tiered.returncode == 0, tiered.stderr

        deadline = time.monotonic() + 60
        while True:
            shown = status(node, "--json")
            (row,) = json.loads(shown.stdout)
            if row["offload_held"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert row["offload_held"] is not None, (shown.returncode, shown.stdout, shown.stderr)
        assert shown.returncode == 3, shown.stderr
        held = row["offload_held"]
        assert held["offset"] == DAMAGED
        assert f"names CommitLog [{at}," in held["reason"], held
        assert row["tier_watermark"] == DAMAGED, "everything before the entry is archived"
        assert "held at a damaged ConsumeQueue entry" in shown.stderr
        assert f"{TOPIC}/0" in shown.stderr

        # The admin protocol carries it (what the CLI read), with no secret in any of it.
        reply = node.admin().GetTopic(apb.GetTopicRequest(name=TOPIC), timeout=10)
        (q,) = reply.queues
        assert (q.offload_held, q.offload_held_offset) == (True, DAMAGED)
        assert q.offload_held_since_ms > 0
        text = status(node)
        assert text.returncode == 3
        assert f"HELD at queue offset {DAMAGED}" in text.stdout, text.stdout
        assert "restart the broker" in text.stdout
        for secret in s3.env().values():
            if len(secret) >= 8:
                assert secret not in text.stdout + shown.stdout + text.stderr + str(reply)
        # --wait does not wait for a watermark a held queue never reaches.
        started = time.monotonic()
        waited = status(node, "--wait", "--json")
        assert waited.returncode == 3 and time.monotonic() - started < 60

        # Passes run every second and each meets the entry again: the hold is logged when it
        # starts, not on every pass.
        time.sleep(4)
        log = node.log_path.read_text()
        lines = [x for x in log.splitlines() if f"offload held at queue offset {DAMAGED}" in x]
        assert len(lines) == 1, lines
    finally:
        assert node.stop() == 0

    node = start_tiered(data, url, env)  # the start rebuilds the noted entry
    try:
        deadline = time.monotonic() + 60
        while True:
            shown = status(node, "--json")
            (row,) = json.loads(shown.stdout)
            if row["tier_watermark"] == COUNT or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert row["tier_watermark"] == COUNT, row
        assert row["offload_held"] is None
        assert shown.returncode == 0, shown.stderr
        assert "HELD" not in status(node).stdout
        assert (
            entry_path(data, TOPIC).read_bytes()[DAMAGED * CQ_ENTRY_SIZE :][:CQ_ENTRY_SIZE] == ours
        )
    finally:
        assert node.stop() == 0
