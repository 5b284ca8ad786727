"""``LogEvery``: the first line at once, then one a period with the count it kept quiet."""

from __future__ import annotations

from tiered.log_every import LogEvery


def test_first_at_once_then_once_a_period_with_the_quiet_count() -> None:
    now = [100.0]
    every = LogEvery(60.0, clock=lambda: now[0])
    assert every.due("disk") == 0
    assert [every.due("disk") for _ in range(5)] == [None] * 5
    assert every.due("fds") == 0  # another key has its own period
    now[0] += 59.9
    assert every.due("disk") is None
    now[0] += 0.1
    assert every.due("disk") == 6
    assert every.due("disk") is None
    now[0] += 60.0
    assert every.due("disk") == 1
