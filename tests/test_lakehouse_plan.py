"""The export's batch planning and row building, without Spark: how a batch's slices become one
pack per Spark task (``source.balanced_packs``), and the property lookup of ``schema.rows``."""

from __future__ import annotations

import random
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from lakehouse.schema import lookup
from lakehouse.source import MIN_PACK_BYTES, SegmentSlice, balanced_packs


def segment(key: str, base: int, count: int, size: int) -> dict[str, Any]:
    return {"key": key, "base_offset": base, "count": count, "size": size}


def slices_of(sizes_mb: list[float], per_offset: int = 4096) -> list[SegmentSlice]:
    out = []
    next_offset = [0, 0, 0]  # per queue: segments follow each other
    for i, mb in enumerate(sizes_mb):
        count = max(1, int(mb * (1 << 20)) // per_offset)
        base = next_offset[i % 3]
        next_offset[i % 3] += count
        info = segment(f"c1/broker-a/t/{i % 3}/segments/{i}", base, count, count * per_offset)
        out.append(SegmentSlice(f"c1/broker-a/t/{i % 3}", info, base, base + count))
    return out


def covered(packs: list[Any]) -> list[tuple[str, int, int]]:
    """The (queue, first, end) ranges the packs cover, adjacent pieces of a slice merged."""
    pieces = sorted((s.queue_key, s.first, s.end) for p in packs for s in p.slices)
    merged: list[tuple[str, int, int]] = []
    for queue, first, end in pieces:
        if merged and merged[-1][0] == queue and merged[-1][2] == first:
            merged[-1] = (queue, merged[-1][1], end)
        else:
            merged.append((queue, first, end))
    return merged


@pytest.mark.parametrize("cores", [1, 2, 4])
def test_a_batch_becomes_one_equal_pack_per_core(cores: int) -> None:
    """Eight segments of 8.7 MB over two cores were three packs of 32 MiB on two tasks: one
    core wrote twice what the other did, and waited seconds for Spark to hand it its second
    task. Now every core gets one task of the same share."""
    slices = slices_of([8.7] * 8 + [3.1])
    total = sum(s.bytes for s in slices)
    packs = balanced_packs(slices, cores)
    sizes = [sum(s.bytes for s in p.slices) for p in packs]
    assert len(packs) == cores
    assert max(sizes) - min(sizes) <= 2 * 4096 * 2, sizes  # a message or two apart
    assert sum(sizes) == pytest.approx(total, abs=4096 * len(packs))
    assert covered(packs) == covered([type(packs[0])(slices)]), "every offset once, no more"


def test_a_small_batch_is_one_pack_and_random_batches_cover_every_offset() -> None:
    small = slices_of([0.5, 0.7])
    assert len(balanced_packs(small, 2)) == 1, "below MIN_PACK_BYTES: one task"
    assert sum(s.bytes for s in small) < MIN_PACK_BYTES
    rng = random.Random(3)
    for _ in range(50):
        slices = slices_of([rng.uniform(0.01, 40) for _ in range(rng.randint(1, 12))])
        cores = rng.randint(1, 4)
        packs = balanced_packs(slices, cores)
        assert len(packs) <= cores
        assert all(p.slices for p in packs), "no empty pack"
        assert all(s.end > s.first for p in packs for s in p.slices)
        assert covered(packs) == covered([type(packs[0])(slices)])


def test_lookup_equals_map_lookup_for_names_unique_per_row() -> None:
    maps = pa.array(
        [
            [("KEYS", "a b"), ("TAGS", "red")],
            [],
            [("UNIQ_KEY", "id-1"), ("KEYS", "")],
            [("TAGS", "blue"), ("OTHER", "KEYS")],
            [("KEYS", "c")],
        ],
        pa.map_(pa.string(), pa.string()),
    )
    for name in ("KEYS", "TAGS", "UNIQ_KEY", "MISSING"):
        for part in (maps, maps.slice(1), maps.slice(1, 3), maps.slice(5)):
            assert lookup(part, name).equals(pc.map_lookup(part, name, "first")), (name, part)


# -- a manifest that replaced its archive (decision 1080) -----------------------------------


def archive_of(prefix: str, counts: list[int]) -> Any:
    """A queue's manifest as the offloader builds it: ``with_segments`` per upload, each
    segment under a fresh key (``segment_key``)."""
    from tiered.cold.manifest import QueueManifest, segment_key
    from tiered.formats import SegmentInfo

    manifest = QueueManifest(prefix)
    for count in counts:
        base = manifest.end_offset
        info = SegmentInfo(segment_key(prefix, base), base, count, count * 100, 0, 0, 0, 0,
                           base, base + count, 0)  # fmt: skip
        manifest = manifest.with_segments([info])
    return manifest


def test_appends_and_retention_continue_an_archive_a_re_created_one_does_not() -> None:
    from lakehouse.tier import replaced_by

    prefix = "c1/broker-a/t/0/"
    old = archive_of(prefix, [50, 50, 50, 50])  # 0..200, version 4
    appended = archive_of(prefix, [])
    appended.segments, appended.version = list(old.segments), old.version
    for count in (50, 30):
        appended = appended.with_segments([archive_of(prefix, [appended.end_offset, count])
                                           .segments[1]])  # fmt: skip
    retained = appended.without_segments_before(120)  # 100.. kept
    assert replaced_by(old, appended) is None
    assert replaced_by(old, retained) is None
    assert replaced_by(old, old.next_version()) is None  # a new master's claim
    assert replaced_by(appended, retained.without_segments_before(10**9)) is None  # all expired

    # The topic deleted and re-created, archived again from 0 under fresh keys.
    shorter = archive_of(prefix, [50, 50])  # version 2 < 4
    assert "went back from version 4 to 2" in str(replaced_by(old, shorter))
    longer = archive_of(prefix, [50] * 6)  # version 6, to 300
    why = str(replaced_by(old, longer))
    assert why.startswith(f"the tier holds {longer.segments[0].key} for offset 0, where it held")
    assert old.segments[0].key in why
    # Re-created and retained past the old start: an offset that had expired is held again.
    assert replaced_by(retained, longer) is not None


def test_an_archive_id_tells_a_re_created_archive_whose_retention_passed_the_old_end() -> None:
    """Decision 1240: a new archive whose retention expired everything below the old end has
    no offset or key left to compare (decision 1186); its id differs, or it has one where the
    old archive had none (ids are made only at a first commit). An archive whose id was
    dropped by a broker that predates ids tells nothing, and continues."""
    import dataclasses

    from lakehouse.tier import replaced_by

    prefix = "c1/broker-a/t/0/"
    old = archive_of(prefix, [50] * 4)  # 0..200, version 4
    assert old.archive and old.with_segments([]).archive == old.archive
    new = archive_of(prefix, [50] * 8).without_segments_before(200)  # 200..400, version 9
    assert (new.start_offset, new.end_offset) == (200, 400)
    unnamed = dataclasses.replace(new, archive="")
    assert replaced_by(dataclasses.replace(old, archive=""), unnamed) is None  # as before ids
    assert replaced_by(old, unnamed) is None  # its id dropped by an older broker
    assert replaced_by(old, new) == (
        f"the tier's archive has the id {new.archive}, the one exported had {old.archive}"
    )
    assert "the one exported had none" in str(
        replaced_by(dataclasses.replace(old, archive=""), new)
    )
    assert replaced_by(archive_of(prefix, []), archive_of(prefix, [50])) is None  # first commit
