"""A producer process for crash tests: it writes to a store and reports each acknowledgement.

Run as ``python tests/store_child.py DATA_DIR MODE FLUSH [COUNT] [SEED]``. Store geometry comes
from ``tests/store_sizes.json`` beside this file, so the test and the child agree.

Modes:
- ``produce``: append batches forever; after each ``put_messages`` returns, print one line per
  message: ``ack <id> <topic> <queue> <queue offset> <commitlog offset>`` and flush stdout.
  The parent ``kill -9``s it whenever it likes.
- ``write-and-crash``: append COUNT messages, print ``done``, then ``os._exit`` without a
  shutdown, leaving the abort marker behind exactly as a crash would.
- ``hold``: open the store, append COUNT messages to one queue (``crash-a`` 0), print
  ``ready`` and wait (a second process for lock tests).
- ``produce-meta``: like ``produce``, and after each batch also creates consumer groups in the
  broker's metadata store (``DATA_DIR/config``), printing ``group <name>`` once each is saved.
  A refused batch prints ``refused <reason>`` and production goes on, as a broker keeps serving.

Every body is derived from its id (``body_for``), so a verifier can check bytes without a log.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore

SIZES = json.loads((Path(__file__).with_name("store_sizes.json")).read_text())
TOPICS = ["crash-a", "crash-b", "crash-c"]


def body_for(msg_id: str) -> bytes:
    seed = hashlib.sha256(msg_id.encode()).digest()
    n = 1 + seed[0] * 7  # 1..1786 bytes
    return (seed * (n // 32 + 1))[:n]


def message_for(msg_id: str, rng: random.Random) -> Message:
    topic = rng.choice(TOPICS)
    return Message(
        topic=topic,
        queue_id=rng.randrange(4),
        body=body_for(msg_id),
        properties={"KEYS": f"key-{msg_id}", "TAGS": rng.choice(["a", "b"]), "UNIQ_KEY": msg_id},
        born_timestamp=int(time.time() * 1000),
    )


def config(data_dir: str, flush: str) -> StoreConfig:
    return StoreConfig(data_dir=Path(data_dir), flush=flush, **SIZES)  # type: ignore[arg-type]


def main() -> None:
    data_dir, mode, flush = sys.argv[1], sys.argv[2], sys.argv[3]
    count = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    seed = int(sys.argv[5]) if len(sys.argv) > 5 else os.getpid()
    rng = random.Random(seed)
    store = MessageStore(config(data_dir, flush))
    store.start()
    out = sys.stdout
    if mode == "hold":
        for i in range(count):  # to one queue only
            msg = message_for(f"{seed}-{i}", rng)
            msg.topic, msg.queue_id = TOPICS[0], 0
            store.put_message(msg)
        print("ready", flush=True)
        time.sleep(3600)
    elif mode == "write-and-crash":
        for i in range(count):
            store.put_message(message_for(f"{seed}-{i}", rng))
        store.wait_dispatched()
        if flush == "sync":
            store.commitlog.flush()
        print("done", flush=True)
        os._exit(0)
    elif mode in ("produce", "produce-meta"):
        meta = None
        if mode == "produce-meta":
            from broker.metadata import BrokerMetadata, GroupConfig

            meta = BrokerMetadata(Path(data_dir) / "config")
            meta.load()
        seq = 0
        while True:
            batch = []
            for _ in range(rng.randint(1, 16)):
                batch.append((f"{seed}-{seq}", message_for(f"{seed}-{seq}", rng)))
                seq += 1
            try:
                results = store.put_messages([m for _, m in batch])
            except Exception as e:
                if meta is None:
                    raise
                out.write(f"refused {type(e).__name__}\n")
                out.flush()
                time.sleep(0.01)
                continue
            out.write(
                "".join(
                    f"ack {mid} {m.topic} {m.queue_id} {r.queue_offset} {r.commitlog_offset}\n"
                    for (mid, m), r in zip(batch, results, strict=True)
                )
            )
            out.flush()
            if meta is not None:
                for k in range(8):
                    name = f"g-{seed}-{seq}-{k}"
                    meta.put_group(GroupConfig(name=name))
                    out.write(f"group {name}\n")
                out.flush()


if __name__ == "__main__":
    main()
