"""The dispatch's ConsumeQueue and IndexFile writes: the native engine's ``cq_blocks`` and
``index_put`` (decision 540) give the reference's bytes, down to every file of a store.

The file-level test appends adversarial batches to a real store with its dispatcher stopped, then
applies the very same appended chunks (and the same records read back from the CommitLog) to two
empty ConsumeQueue and IndexFile directories, one per engine, and compares every file.
"""

from __future__ import annotations

import itertools
from array import array
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_record_engine import SETTINGS
from tiered import record
from tiered.config import StoreConfig
from tiered.hot.consume_queue import ConsumeQueueTable
from tiered.hot.dispatcher import Dispatcher
from tiered.hot.index_file import IndexService
from tiered.record import NATIVE_ENGINE, PYTHON_ENGINE, EncodedBatch, Message
from tiered.store import MessageStore

pytestmark = pytest.mark.skipif(NATIVE_ENGINE is None, reason="native engine not built")
NATIVE: Any = NATIVE_ENGINE

KEYS = [("a", 0), ("a", 1), ("b", 0), ("topic with space", 3)]
TAGS = st.one_of(st.none(), st.sampled_from(["", "x", "pay ment", "ünï", "a" * 300]))


@st.composite
def passes(draw: Any) -> tuple[list[int], list[int], list[int], list[tuple[str, int]], list[Any]]:
    n = draw(st.integers(0, 70))
    sizes = draw(st.lists(st.integers(1, 1 << 22), min_size=n, max_size=n))
    offsets, at = [], draw(st.integers(0, 1 << 40))
    for s in sizes:
        offsets.append(at)
        at += s
    # Equal keys as the same object (the encoder's cache) and as new tuples (read from a file).
    queues = [
        k if draw(st.booleans()) else (k[0] + "", k[1])
        for k in draw(st.lists(st.sampled_from(KEYS), min_size=n, max_size=n))
    ]
    queues = [(str(t), int(q)) if draw(st.booleans()) else (t, q) for t, q in queues]
    # Queue offsets mostly consecutive per queue, with gaps and repeats (a re-dispatch).
    next_q: dict[tuple[str, int], int] = {}
    qoffs = []
    for key in queues:
        q = next_q.get(key, draw(st.integers(0, 1 << 33)))
        q += draw(st.sampled_from([0, 0, 0, 0, 1, -1, 5]))
        qoffs.append(max(q, 0))
        next_q[key] = max(q, 0) + 1
    tags = draw(st.lists(TAGS, min_size=n, max_size=n))
    return offsets, sizes, qoffs, queues, tags


@SETTINGS
@given(passes())
def test_cq_blocks_is_identical(fields: Any) -> None:
    py_codes: dict[str | None, int] = {None: 0, "x": 77}  # a cached code is used as it is
    native_codes = dict(py_codes)
    py = PYTHON_ENGINE.cq_blocks(*fields, py_codes)
    native = NATIVE.cq_blocks(*fields, native_codes)
    assert native == py
    assert native_codes == py_codes
    entries, runs = native
    assert len(entries) == 20 * len(fields[0])
    assert sum(r[2] for r in runs) == len(fields[0])
    # The native encoder's integer columns are int64 arrays, read in place (decision 600).
    packed = [array("q", column) for column in fields[:3]]
    assert NATIVE.cq_blocks(*packed, *fields[3:], dict(py_codes)) == py
    assert PYTHON_ENGINE.cq_blocks(*packed, *fields[3:], dict(py_codes)) == py


KEY_TEXT = st.one_of(
    st.none(),
    st.sampled_from(["", " ", "k1 k2", " lead", "trail ", "a  b", "ünï code", "x" * 300]),
    st.text(st.sampled_from(["a", " ", "é", "\u4e2d"]), max_size=12),
)


@SETTINGS
@given(st.lists(st.tuples(KEY_TEXT, KEY_TEXT), max_size=40))
def test_index_entry_count_is_what_index_keys_makes(records: list[tuple[Any, Any]]) -> None:
    """The append path's room check counts IndexFile entries without hashing (decision 680):
    exactly as many as dispatch's ``index_keys`` makes, with either engine."""
    keys = [k for k, _ in records]
    uniq = [u for _, u in records]
    made = len(PYTHON_ENGINE.index_keys([("t", 0)] * len(records), keys, uniq)[0])
    assert PYTHON_ENGINE.index_entry_count(keys, uniq) == made
    assert NATIVE.index_entry_count(keys, uniq) == made


def _expected_counts(
    records: list[tuple[Any, Any, int]], qoffs: list[int], per_file: int
) -> tuple[int, int]:
    keys = [k for k, _, _ in records]
    uniq = [u for _, u, _ in records]
    entries = len(PYTHON_ENGINE.index_keys([("t", 0)] * len(records), keys, uniq)[0])
    return entries, sum(1 for q in qoffs if q % per_file == 0)


@SETTINGS
@given(
    st.lists(st.tuples(KEY_TEXT, KEY_TEXT, st.integers(0, 3)), max_size=40),
    st.integers(1, 5),
    st.dictionaries(st.integers(0, 3), st.integers(0, 12), max_size=4),
    st.integers(200, 6000),
)
def test_the_encoder_counts_what_the_room_check_charges(
    records: list[tuple[Any, Any, int]], per_file: int, base: dict[int, int], space: int
) -> None:
    """The encoder counts each batch's IndexFile entries and ConsumeQueue file starts while it
    encodes (decision 735): both engines, from ``Message`` objects and from ``RecordSpans``,
    give what dispatch's ``index_keys`` makes and the queue offsets that are multiples of the
    file's entry count, for the records that fit (a roll stops the batch)."""
    import struct

    from tiered.record import RecordEncoder, RecordSpans

    messages = [
        Message(
            topic="t",
            queue_id=q,
            body=b"b",
            properties={n: v for n, v in (("KEYS", k), ("UNIQ_KEY", u)) if v is not None},
        )
        for k, u, q in records
    ]
    props = [record.encode_properties(m.properties) for m in messages]
    spans = RecordSpans(
        "t",
        b"b",
        b"".join(
            struct.pack("=7q", 0, 1, sum(map(len, props[:i])), len(p), 5, m.queue_id, 0)
            for i, (m, p) in enumerate(zip(messages, props, strict=True))
        ),
        b"".join(props),
        ["10.0.0.1"],
        [None] * len(messages),
        [m.properties.get("KEYS") for m in messages],
        [m.properties.get("UNIQ_KEY") for m in messages],
    )
    bases = {("t", q): o for q, o in base.items()}
    results = []
    for engine, batch in itertools.product((PYTHON_ENGINE, NATIVE), (messages, spans)):
        out = EncodedBatch()
        i, _ = engine.encode_batch(
            RecordEncoder(cq_entries_per_file=per_file), batch, 0, 0, space, {}, bases, out
        )
        want = _expected_counts(records[:i], list(out.queue_offsets), per_file)
        assert (out.index_entries, out.cq_starts) == want
        results.append((i, out.index_entries, out.cq_starts))
    assert len(set(results)) == 1, results


def _store(root: Path) -> MessageStore:
    config = StoreConfig(
        data_dir=root,
        flush="async",
        commitlog_file_size=1 << 20,  # batches roll the CommitLog
        consumequeue_entries_per_file=7,  # a pass's run of a queue crosses file ends
        index_hash_slots=13,
        index_max_entries=50,  # the IndexFile rolls inside a pass
        max_message_size=256 << 10,
        max_dispatch_lag_bytes=1 << 40,
    )
    store = MessageStore(config)
    store.start()
    return store


def _batches() -> list[list[Message]]:
    big = b"\xab" * (256 << 10)  # the largest body the store takes
    mixed = [
        Message(
            topic=["orders", "pay_ments", "t%|x"][i % 3],
            queue_id=(i * 5) % 4,
            body=bytes([i % 256]) * (i * 37 % 3000),
            properties={
                **({"TAGS": ["", "vip", "ünï code", "a b"][i % 4]} if i % 5 else {}),
                **(
                    {"KEYS": ["k1 k2", " lead", "trail ", "a  b", "", "one"][i % 6]}
                    if i % 2
                    else {}
                ),
                **({"UNIQ_KEY": f"ID{i:030d}"} if i % 3 else {}),
            },
        )
        for i in range(300)
    ]
    single_queue = [
        Message(topic="orders", queue_id=1, body=b"s" * 100, properties={"KEYS": f"k{i}"})
        for i in range(40)
    ]
    largest = [Message(topic="orders", queue_id=2, body=big, properties={"TAGS": "big"})] * 5
    return [mixed[:17], mixed[17:256], largest, single_queue, mixed[256:], mixed[:3]]


def _apply(
    root: Path,
    batches: list[EncodedBatch],
    store: MessageStore,
    engine: Any,
    mp: Any,
    merge: bool = False,
) -> dict[str, bytes]:
    mp.setattr(record, "_engine", engine)
    queues = ConsumeQueueTable(root / "cq", 7)
    index = IndexService(root / "index", 13, 50)
    d = Dispatcher(store.commitlog, queues, index, reput_offset=0, index_from=0)
    d.unindexed_topics = frozenset({"t%|x"})
    if merge:  # as the dispatcher's loop takes them: abutting chunks merged into one pass
        for batch in batches:
            d.submit(batch)
        while d._pending:
            merged = d._take_consecutive(store.commitlog.max_offset)
            assert len(merged.offsets) == len(merged.store_timestamps or ())
            d.apply(merged)
    else:
        for batch in batches:
            d.apply(batch)
    files = {
        str(p.relative_to(root / "cq")): p.read_bytes()
        for p in sorted((root / "cq").rglob("*"))
        if p.is_file()
    }
    index.close()
    queues.close()
    # IndexFile names start with the wall clock: compare them by their CommitLog begin offset.
    for n, f in enumerate(index.files):
        files[f"index {n} {f.path.name.split('-')[1]}"] = f.path.read_bytes()
    return files


def test_dispatch_writes_the_same_files_with_either_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _store(tmp_path / "store")
    try:
        assert store.dispatcher is not None
        store.dispatcher.stop()
        for batch in _batches():
            store.put_messages(batch)
        chunks = list(store.dispatcher._pending)
        end = store.commitlog.max_offset
        # The same records read back from the CommitLog (new key objects, per-record times).
        parsed = []
        offset = 0
        while True:
            got = store.dispatcher._parse(store.commitlog.skip_blank(offset), end)
            if got is None:
                break
            parsed.append(got)
            offset = got.end_offset
        assert len(store.commitlog.files.files) > 1  # a roll happened
        assert sum(len(c.offsets) for c in chunks) == sum(len(b) for b in _batches())
        # The native encoder's chunks carry int64 arrays (decision 600); TMQ_PURE_PYTHON=1's
        # reference, lists.
        assert all((type(c.offsets) is array) == (record.ENGINE_NAME == "native") for c in chunks)
        first: dict[str, bytes] | None = None
        for name, batches, merge in (
            ("chunks", chunks, False),
            ("parsed", parsed, False),
            ("merged", chunks, True),
            ("merged-parsed", parsed, True),
        ):
            py = _apply(tmp_path / f"{name}-py", batches, store, PYTHON_ENGINE, monkeypatch, merge)
            native = _apply(tmp_path / f"{name}-native", batches, store, NATIVE, monkeypatch, merge)
            assert py.keys() == native.keys()
            for key in py:
                assert native[key] == py[key], key
            first = first or native
            assert native == first, name  # however the records came, the same files
            assert sum(1 for k in py if k.startswith("index")) > 2  # the IndexFile rolled
            assert sum(1 for k in py if k.startswith("orders/2/")) >= 1
    finally:
        store.shutdown()


# -- a whole pass in one call (decision 695) ----------------------------------------------------

KEY_TEXT = st.one_of(st.none(), st.sampled_from(["", "k1", "k1 k2", " lead", "a  b", "ünï"]))


class PassRun(NamedTuple):
    """Records as consecutive passes (the columns of ``passes()`` and their keys, unique ids
    and per-record times; ``bounds`` cut them into passes) and the store's dispatch settings."""

    offsets: list[int]
    sizes: list[int]
    qoffs: list[int]
    queues: list[tuple[str, int]]
    tags: list[Any]
    keys: list[Any]
    uniq: list[Any]
    stamps: list[int] | None
    bounds: list[int]
    index_from: int
    entries_per_file: int
    max_entries: int
    packed: bool


@st.composite
def pass_runs(draw: Any) -> PassRun:
    """A run of records as consecutive passes: the fields of ``passes()`` with keys, unique ids
    and per-record times, cut into one to three passes, and the store's dispatch settings."""
    offsets, sizes, qoffs, queues, tags = draw(passes())
    n = len(offsets)
    # Directory names: a topic with a space is refused by the ConsumeQueue table.
    valid = {("topic with space", 3): ("c%|x", 3)}
    queues = [valid.get(k, k) if k[0] == "topic with space" else k for k in queues]
    keys = draw(st.lists(KEY_TEXT, min_size=n, max_size=n))
    uniq = draw(
        st.lists(st.one_of(st.none(), st.text("0123ABC", max_size=6)), min_size=n, max_size=n)
    )
    stamps = draw(st.one_of(st.none(), st.lists(st.integers(0, 1 << 42), min_size=n, max_size=n)))
    cuts = sorted(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=2, unique=True)))
    bounds = [b for b in [0, *cuts, n] if b <= n]
    index_from = draw(st.sampled_from([0, offsets[n // 2] if n else 0, 1 << 50]))
    entries_per_file = draw(st.sampled_from([3, 7, 1 << 20]))
    max_entries = draw(st.sampled_from([5, 50, 1000]))
    packed = draw(st.booleans())
    return PassRun(
        offsets,
        sizes,
        qoffs,
        queues,
        tags,
        keys,
        uniq,
        stamps,
        bounds,
        index_from,
        entries_per_file,
        max_entries,
        packed,
    )


def _state(queues: ConsumeQueueTable, index: IndexService) -> Any:
    return (
        sorted(
            (key, cq.min_offset, cq.max_offset, cq.max_physical_end, cq._tail and cq._tail.wrote)
            for key, cq in queues.queues.items()
        ),
        [(f.header, f.path.name.split("-")[1]) for f in index.files],
    )


def _run_passes(root: Path, engine: Any, run: PassRun, mp: Any) -> tuple[Any, Any]:
    mp.setattr(record, "_engine", engine)
    queues = ConsumeQueueTable(root / "cq", run.entries_per_file)
    index = IndexService(root / "index", 13, run.max_entries)
    d = Dispatcher(None, queues, index, reput_offset=0, index_from=run.index_from)  # type: ignore[arg-type]
    d.unindexed_topics = frozenset({"b"})
    column = (lambda v: array("q", v)) if run.packed else list
    stamps = run.stamps
    for a, b in itertools.pairwise(run.bounds):
        if a == b:
            continue
        batch = EncodedBatch(
            offsets=column(run.offsets[a:b]),
            sizes=column(run.sizes[a:b]),
            queue_offsets=column(run.qoffs[a:b]),
            queues=run.queues[a:b],
            tags=run.tags[a:b],
            keys=run.keys[a:b],
            uniq_keys=run.uniq[a:b],
            store_timestamp=max(stamps[a:b]) if stamps else 1_700_000_000_000,
            store_timestamps=column(stamps[a:b]) if stamps else None,
        )
        d.apply(batch)
    state = _state(queues, index)
    files = {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }
    index.close()
    queues.close()
    # IndexFile names start with the wall clock: named by their CommitLog begin offset.
    named = {}
    for name, data in files.items():
        if name.startswith("index"):
            name = "index " + name.split("-")[1]
        named[name] = data
    return state, named


# Each example creates and fsyncs real files: fewer examples than the codec tests.
@settings(SETTINGS, max_examples=25)
@given(pass_runs())
def test_a_dispatch_pass_writes_the_same_files_and_state_with_either_engine(
    run: PassRun,
) -> None:
    """``dispatch_pass``: every ConsumeQueue and IndexFile byte, each queue's bounds and its
    tail's ``wrote``, and every IndexFile header the same as the reference's, on passes with
    gaps, repeats (re-dispatch), rolls of both kinds, ``index_from`` and an unindexed topic."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        py = _run_passes(Path(tmp) / "py", PYTHON_ENGINE, run, mp)
        native = _run_passes(Path(tmp) / "native", NATIVE, run, mp)
    assert native[0] == py[0]
    assert native[1].keys() == py[1].keys()
    for name in py[1]:
        assert native[1][name] == py[1][name], name


def test_a_pass_that_continues_its_queues_takes_no_python_put(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native pass copies a queue's next entries into its tail file itself: after a queue's
    first pass (which creates its file through ``put_block``), passes that continue it call no
    ``put_block`` and no ``put_many``, and read back as the reference wrote them."""
    from tiered.hot.consume_queue import ConsumeQueue
    from tiered.hot.index_file import IndexFile

    calls: list[str] = []
    put_block, put_many = ConsumeQueue.put_block, IndexFile.put_many

    def counted_put_block(self: ConsumeQueue, *a: Any) -> bool:
        calls.append(f"put_block {self.topic}/{self.queue_id}")
        return put_block(self, *a)

    def counted_put_many(self: IndexFile, *a: Any) -> None:
        calls.append("put_many")
        put_many(self, *a)

    monkeypatch.setattr(ConsumeQueue, "put_block", counted_put_block)
    monkeypatch.setattr(IndexFile, "put_many", counted_put_many)
    n = 64
    queues_ = [("a", i % 4) for i in range(n)]
    offsets = [1000 * i for i in range(n)]
    run = PassRun(
        offsets=offsets,
        sizes=[900] * n,
        qoffs=[i // 4 for i in range(n)],
        queues=queues_,
        tags=["t"] * n,
        keys=["k"] * n,
        uniq=[f"u{i}" for i in range(n)],
        stamps=None,
        bounds=[0, 16, 40, n],
        index_from=0,
        entries_per_file=1000,
        max_entries=1000,
        packed=True,
    )
    state, files = _run_passes(tmp_path / "native", NATIVE, run, monkeypatch)
    # The first pass creates the four files and the IndexFile (the roll path in Python).
    assert calls == [f"put_block a/{q}" for q in range(4)]
    calls.clear()
    ref_state, ref_files = _run_passes(tmp_path / "py", PYTHON_ENGINE, run, monkeypatch)
    assert len(calls) == 3 * 4 + 3  # the reference: every run and every pass
    assert state == ref_state
    assert files == ref_files
    assert [s[2] for s in state[0]] == [16] * 4  # every queue holds its 16 entries
