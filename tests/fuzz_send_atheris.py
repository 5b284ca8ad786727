"""A coverage-guided run of the native SendMessageRequest walker against the reference path.

Not a test (pytest does not collect it): a fuzzing session's tool. ``pip install atheris``,
then from the repository root::

    .venv/bin/python tests/fuzz_send_atheris.py -atheris_runs=200000

libFuzzer mutates a corpus seeded with plain, tagged and hostile requests; each input goes
through ``test_send_native.check``, which fails when the walker builds anything other than
what protobuf and ``to_store_messages`` build. Coverage is the Python code's (the reference
conversion) and libFuzzer's comparison tracing; build the extension with
``-fsanitize=address`` and run under ``LD_PRELOAD=libasan.so PYTHONMALLOC=malloc`` to catch a
read past the request's bytes (decision 430).
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

with atheris.instrument_imports(include=["broker.protocol"]):
    import broker.protocol  # noqa: F401
from test_send_native import TOPICS, check, plain, request

KINDS = sorted(TOPICS)


def one(data: bytes) -> None:
    if not data:
        return
    check(data[1:], TOPICS[KINDS[data[0] % len(KINDS)]], data[0] % 11)


def seeds(folder: Path) -> None:
    """Write a few requests the walker takes and a few it does not into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    examples = [
        request(*(plain(i) for i in range(4))),
        request(plain(0, tag="TagA"), plain(1, tag="TagB")),
        request(plain(0, keys=["k1", "k2"]), plain(1, user={"a": "b"})),
        request(plain(0, message_group="g"), plain(1, delivery_timestamp=(1_900_000_000, 0))),
        request(plain(0, topic="../x")),
    ]
    for i, raw in enumerate(examples):
        (folder / f"seed-{i}").write_bytes(b"\x00" + raw)


if __name__ == "__main__":
    corpus = Path(__file__).resolve().parent.parent / ".fuzz-corpus" / "send"
    seeds(corpus)
    atheris.Setup([sys.argv[0], str(corpus), *sys.argv[1:]], one)
    atheris.Fuzz()
