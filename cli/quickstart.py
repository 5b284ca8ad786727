"""``tmq standalone --quickstart``: the whole mission on embedded defaults, shown step by step.

Beside the running NameServer and broker, it creates a tiered topic, produces with Apache's
client, offloads to the tier, replays the messages back from the tier, exports them to a Delta
table with Spark and queries it. Each operator step runs as the real ``tmq`` command and is
printed as such, so a newcomer sees what to type next time. The broker keeps serving afterwards.

The broker runs with ``read_from_tier = "force"`` here, so the replay is served from the object
store even though the local CommitLog still holds the same messages (the embedded default's
1 GiB CommitLog files would take a long time to roll and be released).
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

log = logging.getLogger(__name__)

TOPIC = "quickstart-orders"
MESSAGES = 1000
TAGS = ("created", "paid", "shipped")
STEPS = 5


class QuickstartError(RuntimeError):
    pass


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _tmq(*args: str, timeout: float = 300) -> str:
    """Run a ``tmq`` command as an operator would, echo it, and return its stdout."""
    _say(f"  $ tmq {shlex.join(args)}")
    done = subprocess.run(
        [sys.executable, "-m", "cli.app", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parent.parent,
        env=os.environ.copy(),
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise QuickstartError(f"tmq {args[0]} {args[1] if len(args) > 1 else ''}: {last}")
    return done.stdout


def run(namesrv: str, endpoint: str, data_dir: Path, tier_url: str) -> None:
    """The five steps; raises ``QuickstartError`` naming the step that failed."""
    started = time.monotonic()
    ns = ["-n", namesrv]
    lake = (data_dir / "lake").resolve()
    run_id = uuid.uuid4().hex[:6]

    _say(f"\n[1/{STEPS}] a broker is up: NameServer {namesrv}, broker {endpoint}")
    _say(f"      data in {data_dir}, cold tier {tier_url}")
    described = json.loads(_tmq("topic", "list", *ns, "--json"))
    if not any(t["topic"] == TOPIC for t in described):
        _tmq("topic", "create", TOPIC, *ns, "--queues", "4", "--tiered", "--ttl", "90d")

    _say(f"\n[2/{STEPS}] producing {MESSAGES} messages with Apache's RocketMQ 5 client")
    sent = _produce(endpoint, run_id)
    _say(f"      sent {len(sent)} messages, keys order-{run_id}-0 … order-{run_id}-{MESSAGES - 1}")

    _say(f"\n[3/{STEPS}] offloading them to the object store")
    rows = json.loads(_tmq("offload", TOPIC, *ns, "--json"))
    uploaded = sum(r["bytes"] for r in rows)
    _say(
        f"      {sum(r['segments'] for r in rows)} segment object(s), {uploaded:,} bytes; tier "
        f"watermarks {[r['watermark'] for r in rows]}"
    )

    _say(f"\n[4/{STEPS}] replaying from offset 0, served from the cold tier")
    replayed = [
        json.loads(line)
        for line in _tmq("replay", TOPIC, *ns, "--from-offset", "0", "--json").splitlines()
    ]
    mine = {
        r["message_id"]: r
        for r in replayed
        if any(k.startswith(f"order-{run_id}-") for k in r["keys"])
    }
    if len(mine) != len(sent) or any(_body(mine[i]["body"]) != body for i, body in sent.items()):
        raise QuickstartError(f"replay returned {len(mine)} of this run's {len(sent)} messages")
    _say(f"      {len(replayed)} message(s) replayed; all {len(sent)} of this run byte-identical")
    key = f"order-{run_id}-42"
    [hit] = [
        json.loads(line)
        for line in _tmq("query", "--topic", TOPIC, "--key", key, *ns, "--json").splitlines()
    ]
    _say(f"      key {key} found at {TOPIC}/{hit['queue']}@{hit['offset']}")

    _say(f"\n[5/{STEPS}] exporting the archive to Delta with Spark, then querying it")
    _tmq(
        "lakehouse",
        "export",
        TOPIC,
        "--tier-url",
        tier_url,
        "--lake-root",
        str(lake),
        "--once",
        timeout=600,
    )
    sql = f'select tags, count(*) as messages from "{TOPIC}" group by tags order by tags'
    result = _tmq("lakehouse", "query", sql, "--lake-root", str(lake), "--json")
    counts = {r["tags"]: r["messages"] for r in map(json.loads, result.splitlines())}
    for tag, n in counts.items():
        _say(f"      {tag:10s} {n}")
    expected = Counter(TAGS[i % len(TAGS)] for i in range(MESSAGES))
    if any(counts.get(t, 0) < n for t, n in expected.items()):
        raise QuickstartError(f"the Delta table holds {counts}, fewer than were sent")

    _say(
        f"\nquickstart done in {time.monotonic() - started:.0f} s. tmq standalone keeps serving; "
        "try:\n"
        f"  tmq topic describe {TOPIC} -n {namesrv}\n"
        f"  tmq replay {TOPIC} -n {namesrv} --from-offset 0 --queue 0\n"
        f"  tmq lakehouse query 'select count(*) from \"{TOPIC}\"' --lake-root {lake}\n"
        f"  tmq lakehouse status --lake-root {lake}\n"
        "Ctrl-C stops it."
    )


def _body(text: str) -> bytes:
    return base64.b64decode(text[7:]) if text.startswith("base64:") else text.encode()


def _produce(endpoint: str, run_id: str) -> dict[str, bytes]:
    from rocketmq import ClientConfiguration, Credentials, Message, Producer

    producer = Producer(ClientConfiguration(endpoint, Credentials(), request_timeout=10), [TOPIC])
    producer.startup()
    sent: dict[str, bytes] = {}
    try:
        for i in range(MESSAGES):
            m = Message()
            m.topic = TOPIC
            m.body = json.dumps({"order": i, "run": run_id, "amount": i % 97}).encode()
            m.keys = f"order-{run_id}-{i}"
            m.tag = TAGS[i % len(TAGS)]
            sent[producer.send(m).message_id] = m.body
    finally:
        producer.shutdown()
    return sent
