"""The hot store's configuration: one typed object, passed down, never read from the environment."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tiered.record import Host

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

FlushMode = Literal["sync", "async"]

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1024 * GiB}
_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d|w)?\s*$", re.IGNORECASE)
_DURATION_MS = {
    "ms": 1,
    "s": 1000,
    "m": 60_000,
    "h": 3_600_000,
    "d": 86_400_000,
    "w": 7 * 86_400_000,
}


def parse_size(text: str | int) -> int:
    """``"64KiB"``, ``"1g"``, ``"512MB"`` or a plain byte count. Units are powers of 1024."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 65536, 64KiB, 1GiB)")
    unit = (m.group(2) or "").lower()[:1]
    return int(m.group(1)) * _SIZE_UNITS[unit]


def format_size(n: int) -> str:
    """Bytes as an operator writes them: ``50GiB``, ``64MiB``, ``1.5GiB``, ``512B``. Exact
    multiples print as ``parse_size`` reads them back."""
    for name, unit in (("TiB", 1024 * GiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= unit:
            return f"{n // unit}{name}" if n % unit == 0 else f"{n / unit:.1f}{name}"
    return f"{n}B"


def format_duration(ms: int) -> str:
    """Milliseconds in the largest unit that divides them (``90d``, ``12h``, ``1500ms``); 0 is
    ``forever`` (a TTL of 0 keeps everything)."""
    if ms == 0:
        return "forever"
    for unit in ("w", "d", "h", "m", "s"):
        if ms % _DURATION_MS[unit] == 0:
            return f"{ms // _DURATION_MS[unit]}{unit}"
    return f"{ms}ms"


def parse_duration_ms(text: str | int) -> int:
    """``"90d"``, ``"12h"``, ``"30s"``, ``"500ms"``; a bare number is seconds."""
    if isinstance(text, int):
        return text * 1000
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (examples: 30s, 15m, 12h, 90d)")
    return int(m.group(1)) * _DURATION_MS[(m.group(2) or "s").lower()]


@dataclass(slots=True)
class StoreConfig:
    """Settings of the local (hot) tier. Defaults are RocketMQ's ``MessageStoreConfig``'s."""

    data_dir: Path = field(default_factory=lambda: Path("tmq-data"))
    # 1 GiB like RocketMQ; tests go down to 64 KiB to exercise many rolls.
    commitlog_file_size: int = 1 * GiB
    # 300,000 entries of 20 bytes: 6 MB files, as RocketMQ.
    consumequeue_entries_per_file: int = 300_000
    # RocketMQ's IndexFile: 5M hash slots and 20M entries (about 420 MB, sparse until used).
    index_hash_slots: int = 5_000_000
    index_max_entries: int = 20_000_000
    flush: FlushMode = "async"
    flush_interval_ms: int = 500
    # Producers wait while dispatch (ConsumeQueue/IndexFile building) is this far behind the
    # CommitLog, so what is acknowledged becomes readable within a bounded delay.
    max_dispatch_lag_bytes: int = 32 * MiB
    # The largest body accepted (RocketMQ's maxMessageSize, 4 MiB).
    max_message_size: int = 4 * MiB
    # Verify body CRCs while scanning after a crash (RocketMQ's checkCRCOnRecover).
    check_crc_on_recover: bool = True
    # Verify the body CRC of every message read (cheap next to a network send; catches bit rot).
    check_crc_on_read: bool = True
    store_host: Host = ("127.0.0.1", 10911)
    # Like RocketMQ's tiered storage level: "auto" reads the tier only below the hot minimum;
    # "force" serves everything the tier holds from the tier (tests, and draining a disk).
    read_from_tier: Literal["auto", "force"] = "auto"

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if self.flush not in ("sync", "async"):
            raise ValueError(f"flush must be 'sync' or 'async', not {self.flush!r}")
        if self.commitlog_file_size < 64 * KiB:
            raise ValueError("commitlog_file_size must be at least 64 KiB")
        if self.read_from_tier not in ("auto", "force"):
            raise ValueError(
                f"read_from_tier must be 'auto' or 'force', not {self.read_from_tier!r}"
            )
        if self.max_message_size <= 0:
            raise ValueError("max_message_size must be positive")

    @property
    def commitlog_dir(self) -> Path:
        return self.data_dir / "commitlog"

    @property
    def consumequeue_dir(self) -> Path:
        return self.data_dir / "consumequeue"

    @property
    def index_dir(self) -> Path:
        return self.data_dir / "index"

    @property
    def quarantine_dir(self) -> Path:
        return self.data_dir / "quarantine"
