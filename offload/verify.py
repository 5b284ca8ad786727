"""``tmq verify``: a queue's manifest against what the bucket holds.

Per queue the verdict is:

- FAILURE: a segment the manifest names is missing or damaged, or the manifest's segments do not
  form one contiguous range (a read of those offsets would fail);
- WARNING: objects under the queue's ``segments/`` that no manifest names (orphans: an upload
  that crashed before its commit, or a retention pass that crashed before its deletes);
- OK otherwise.

``repair`` deletes orphans (never anything the manifest names). ``deep`` re-reads every segment
and checks its CRC instead of its size and footer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered.cold.manifest import ManifestError, ManifestLog, queue_prefix
from tiered.cold.segment import SegmentError, read_footer, verify
from tiered.cold.storage import ObjectStore

OK, WARNING, FAILURE = "OK", "WARNING", "FAILURE"
_RANK = {OK: 0, WARNING: 1, FAILURE: 2}


@dataclass(slots=True)
class QueueVerdict:
    topic: str
    queue_id: int
    status: str = OK
    missing: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)


def worst(statuses: list[str]) -> str:
    return max(statuses, key=_RANK.__getitem__, default=OK)


def verify_queue(
    tier: ObjectStore,
    cluster: str,
    broker: str,
    topic: str,
    queue_id: int,
    *,
    repair: bool = False,
    deep: bool = False,
) -> QueueVerdict:
    verdict = QueueVerdict(topic, queue_id)
    prefix = queue_prefix(cluster, broker, topic, queue_id)
    try:
        manifest = ManifestLog(tier, prefix).load()
    except ManifestError as e:
        verdict.anomalies.append(f"manifest: {e}")
        verdict.status = FAILURE
        return verdict
    listed = {o.key: o.size for o in tier.list(f"{prefix}segments/")}
    expected = manifest.start_offset
    for info in manifest.segments:
        if info.base_offset != expected:
            verdict.anomalies.append(
                f"{info.key}: starts at {info.base_offset}, expected {expected}"
            )
        expected = info.end_offset
        if info.key not in listed:
            verdict.missing.append(info.key)
            continue
        try:
            if deep:
                verify(tier, info)
            elif listed[info.key] != info.size or read_footer(tier, info.key) != info:
                raise SegmentError(f"{info.key}: size or footer differs from the manifest")
        except SegmentError as e:
            verdict.damaged.append(str(e))
    named = {s.key for s in manifest.segments}
    verdict.orphans = sorted(k for k in listed if k not in named)
    if repair:
        for key in verdict.orphans:
            tier.delete(key)
            verdict.repaired.append(key)
    if verdict.missing or verdict.damaged or verdict.anomalies:
        verdict.status = FAILURE
    elif verdict.orphans and not repair:
        verdict.status = WARNING
    return verdict
