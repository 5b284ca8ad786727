"""Numbers read back from the properties of stored records.

The broker writes these properties itself (delivery times, real queue ids, check counts, check
immunity), after checking what the producer sent. A record may still hold something else: one
written by an older version, or a store that was copied or edited by hand. Such a value is
logged and read as the caller's default, clamped to the caller's range. It is never raised: an
exception here would stop the timer wheel, the check-back loop or a recovery at start, for
every message and not only for this one (decision 530).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
# protobuf's Timestamp range (google/protobuf/timestamp.proto): 0001-01-01T00:00:00Z to
# 9999-12-31T23:59:59.999999999Z. protobuf refuses to build a Timestamp outside it, and a client
# that reads one as a date fails on it.
TIMESTAMP_MIN_MS = -62_135_596_800_000
TIMESTAMP_MAX_MS = 253_402_300_799_999


def int_property(
    properties: Mapping[str, str],
    name: str,
    default: int,
    low: int = INT64_MIN,
    high: int = INT64_MAX,
) -> int:
    """``properties[name]`` as an int within [low, high]; ``default`` when it is absent or not
    a decimal integer of at most 19 digits (the most an int64 holds)."""
    text = properties.get(name)
    if text is None or text == "":
        return default
    digits = text[1:] if text[:1] == "-" else text
    if not (0 < len(digits) <= 19 and digits.isascii() and digits.isdigit()):
        log.warning("stored property %s=%.40r is not a number; read as %d", name, text, default)
        return default
    return min(max(int(text), low), high)
