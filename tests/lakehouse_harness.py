"""Archives for the lakehouse tests and benchmark: produce into a real store, offload to a tier."""

from __future__ import annotations

import random
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
            OffloadPolicy(segment_max_messages=self.segment_messages),
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
                "keys": m.properties.get("KEYS"),
                "tags": m.properties.get("TAGS"),
                "msg_id": m.properties.get("UNIQ_KEY"),
                "born_ms": m.born_timestamp,
                "store_ms": m.store_timestamp,
            }
            for m in messages
        ),
        key=lambda r: (r["queue_id"], r["queue_offset"]),
    )
