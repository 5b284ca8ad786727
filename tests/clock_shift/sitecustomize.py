"""A wall clock that steps, for one child process: imported at start when this directory is on
the child's PYTHONPATH and ``TMQ_CLOCK_SHIFT_FILE`` names a file holding a shift in
milliseconds. ``time.time`` and ``time.time_ns`` return the real time plus the shift, reread
when the file changes (checked at most every 20 ms), as a machine's clock does when NTP steps
it or an operator sets it. ``time.monotonic`` is left alone, as a step leaves it. Never the
system clock: the machine is shared."""

from __future__ import annotations

import os
import time

_path = os.environ.get("TMQ_CLOCK_SHIFT_FILE")

if _path:
    _real_time_ns = time.time_ns
    _state = {"checked": -1.0, "mtime": -1, "shift_ns": 0}

    def _shift_ns() -> int:
        now = time.monotonic()
        if now - _state["checked"] >= 0.02:
            _state["checked"] = now
            try:
                st = os.stat(_path)
                if st.st_mtime_ns != _state["mtime"]:
                    with open(_path) as f:
                        _state["shift_ns"] = int(f.read().strip() or 0) * 1_000_000
                    _state["mtime"] = st.st_mtime_ns
            except (OSError, ValueError):
                pass
        return int(_state["shift_ns"])

    def _time_ns() -> int:
        return _real_time_ns() + _shift_ns()

    def _time() -> float:
        return _time_ns() / 1e9

    time.time_ns = _time_ns
    time.time = _time
