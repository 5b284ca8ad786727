"""Archives for the lakehouse tests and benchmark: produce into a real store, offload to a tier."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload.offloader import Offloader, OffloadPolicy
from tiered.cold.storage import ObjectStore
from tiered.config import StoreConfig
from tiered.record import Message, StoredMessage
from tiered.store import MessageStore

TAGS = ["red", "green", "blue", None]
BORN_BASE_MS = 1_700_000_000_000


@dataclass
class Archive:
    """A hot store whose tiered topics are offloaded to ``tier`` on demand."""

    store: MessageStore
    tier: ObjectStore
    queues: int
    segment_messages: int
    produced: int = 0
    upload_after_ms: int = 60_000  # the offload policy's age trigger (its default)

    @classmethod
    def open(
        cls, data_dir: Path, tier: ObjectStore, queues: int = 2, segment_messages: int = 1000
    ) -> Archive:
        store = MessageStore(StoreConfig(data_dir=data_dir, commitlog_file_size=8 << 20))
        store.start()
        return cls(store, tier, queues, segment_messages)

    @property
    def offloader(self) -> Offloader:
        return Offloader(
            self.store,
            self.tier,
            "c1",
            "broker-a",
            OffloadPolicy(
                segment_max_messages=self.segment_messages,
                upload_after_ms=self.upload_after_ms,
            ),
        )

    def produce(self, topic: str, n: int, seed: int = 1, body_size: int | None = None) -> None:
        rng = random.Random(f"{topic}-{seed}-{self.produced}")
        batch = []
        for _ in range(n):
            i = self.produced
            self.produced += 1
            tags = TAGS[i % len(TAGS)]
            props = {"KEYS": f"{topic}-k{i} alt{i % 7}", "UNIQ_KEY": f"{topic}-id-{i}"}
            if tags is not None:
                props["TAGS"] = tags
            batch.append(
                Message(
                    topic=topic,
                    queue_id=i % self.queues,
                    body=rng.randbytes(body_size or rng.randint(1, 300)),
                    properties=props,
                    born_timestamp=BORN_BASE_MS + i,
                    born_host=("10.1.2.3", 40_000 + i % 5),
                )
            )
            if len(batch) == 256:
                self.store.put_messages(batch)
                batch = []
        if batch:
            self.store.put_messages(batch)
        assert self.store.wait_dispatched(120)

    def offload(self, topic: str) -> None:
        offloader = self.offloader
        for q in range(self.queues):
            offloader.offload_queue(topic, q)

    def messages(self, topic: str) -> list[StoredMessage]:
        out: list[StoredMessage] = []
        for q in range(self.queues):
            out += self.store.get_messages(topic, q, 0, 10**7, max_bytes=1 << 30).messages
        return out

    def close(self) -> None:
        self.store.shutdown()


def expected_rows(messages: list[StoredMessage]) -> list[dict[str, Any]]:
    """What the Delta rows must hold, computed from the store's records without lakehouse code."""
    return sorted(
        (
            {
                "queue_id": m.queue_id,
                "queue_offset": m.queue_offset,
                "commitlog_offset": m.commitlog_offset,
                "body": m.body,
                "keys": m.keys,  # KEYS split at spaces: an array in the table
                "tags": m.properties.get("TAGS"),
                "msg_id": m.properties.get("UNIQ_KEY"),
                "born_ms": m.born_timestamp,
                "store_ms": m.store_timestamp,
            }
            for m in messages
        ),
        key=lambda r: (r["queue_id"], r["queue_offset"]),
    )


class LiveTopic:
    """A topic produced at a steady rate and offloaded the way a broker does (every
    ``offload_every_s``, each queue whose policy says it is due), recording when each
    produced batch was acknowledged: freshness is measured from there."""

    def __init__(self, archive: Archive, topic: str, rate_per_s: float, offload_every_s: float):
        self.archive = archive
        self.topic = topic
        self.rate = rate_per_s
        self.offload_every_s = offload_every_s
        self.produced: list[tuple[float, dict[int, int]]] = []  # (ack time, queue -> end offset)
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._quiet = threading.Event()  # producing stopped; offloading goes on
        self._threads = [
            threading.Thread(target=self._guard(self._produce), daemon=True),
            threading.Thread(target=self._guard(self._offload), daemon=True),
        ]

    def _guard(self, loop: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                loop()
            except BaseException as e:
                self.errors.append(e)

        return run

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop_producing(self) -> None:
        self._quiet.set()

    @property
    def producing(self) -> bool:
        """Until the producer thread has ended: after ``stop_producing`` it may still be storing
        its last batch, which ``produced`` shows only once that batch is acknowledged."""
        return self._threads[0].is_alive()

    def stop(self) -> None:
        self._quiet.set()
        self._stop.set()
        for t in self._threads:
            t.join(30)
        assert not self.errors, self.errors

    def _produce(self) -> None:
        store, queues = self.archive.store, self.archive.queues
        per_tick = max(1, round(self.rate / 5))
        n = 0
        while not self._quiet.wait(per_tick / self.rate):
            batch = [
                Message(
                    self.topic,
                    os.urandom(1024),
                    (n + i) % queues,
                    {"UNIQ_KEY": f"live-{n + i}"},
                    born_timestamp=int(time.time() * 1000),
                )
                for i in range(per_tick)
            ]
            stored = store.put_messages(batch)
            n += per_tick
            # The batch's own queue offsets: ``max_offset`` is what the dispatcher has reached,
            # which under ASYNC flush may not include this batch yet, and an end read from it
            # let the freshness loop stop before the batch's last messages were exported.
            ends: dict[int, int] = {}
            for msg, queue_offset in zip(batch, stored.queue_offsets, strict=True):
                ends[msg.queue_id] = max(ends.get(msg.queue_id, 0), queue_offset + 1)
            self.produced.append((time.monotonic(), ends))

    def _offload(self) -> None:
        offloader = self.archive.offloader
        while not self._stop.wait(self.offload_every_s):
            now_ms = int(time.time() * 1000)
            for q in range(self.archive.queues):
                if offloader.due(self.topic, q, now_ms):
                    offloader.offload_queue(self.topic, q)


def exported_to(table: Any, topic: str, ends: dict[int, int]) -> bool:
    """Whether ``table`` (a deltalake.DeltaTable, or None) has exported every queue to
    ``ends``: the rows are queryable."""
    if table is None:
        return False
    for q, end in ends.items():
        done = table.transaction_version(f"tmq-export:c1/broker-a/{topic}/{q}")
        if done is None or done < end:
            return False
    return True


def run_in_thread(job: Any) -> tuple[threading.Thread, list[BaseException]]:
    """Start ``job.run(once=False)`` (a continuous ``Export``) on a daemon thread; what it
    raises lands in the returned list. Stop it with ``job.stop()`` and join the thread."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            job.run(once=False)
        except BaseException as e:
            errors.append(e)

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    return runner, errors
