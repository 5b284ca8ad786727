"""A timer-wheel process for power-loss tests, on a SYNC store whose clock stands still.

Run as ``python tests/timer_child.py DATA_DIR MODE CLOCK_MS COUNT``. The clock stays at
CLOCK_MS, so the wheel's current bucket never moves and nothing comes due.

- ``put-and-die``: put COUNT delay messages for topic ``later`` due 30 s after CLOCK_MS (in
  the clock's minute bucket), wait until the wheel has enqueued them, print ``enqueued`` and
  ``os._exit`` at once: before the wheel's first checkpoint (1 s after its start).
- ``hold``: open the store and the wheel, wait until the wheel's checkpoint is past COUNT timer
  records, print ``checkpointed`` and wait to be killed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from broker.timer import PROPERTY_DELIVER_TIME, TimerService, as_timer_message
from tiered.config import StoreConfig
from tiered.record import Message
from tiered.store import MessageStore

SIZES = json.loads((Path(__file__).with_name("store_sizes.json")).read_text())


def main() -> None:
    data_dir, mode, clock, count = (
        Path(sys.argv[1]),
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    store = MessageStore(StoreConfig(data_dir=data_dir, flush="sync", **SIZES))
    store.start()
    timers = TimerService(store, data_dir / "timer", lambda: ["later"], clock=lambda: clock)
    timers.start()
    if mode == "put-and-die":
        due = str(clock + 30_000)
        store.put_messages(
            [
                as_timer_message(
                    Message(
                        topic="later",
                        queue_id=0,
                        body=f"timer-{i}".encode(),
                        properties={PROPERTY_DELIVER_TIME: due, "UNIQ_KEY": f"timer-{i}"},
                    )
                )
                for i in range(count)
            ]
        )
        timers.wakeup()
        while timers.enqueue_offset < count:
            time.sleep(0.005)
        print("enqueued", flush=True)
        os._exit(0)
    checkpoint = data_dir / "timer" / "checkpoint.json"
    while not checkpoint.exists() or json.loads(checkpoint.read_text())["enqueue"] < count:
        time.sleep(0.05)
    print("checkpointed", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main()
