"""bench/all.py: one summary of every bench, each figure the median of its runs."""

from __future__ import annotations

from bench.all import BENCHES, SHORT, median_of


def test_every_figure_is_the_median_of_the_runs_field_by_field() -> None:
    runs = [
        {"bench": "x", "mb_per_s": 10.0, "ok": True, "p99": {"idle": 1, "busy": 9}, "n": [1]},
        {"bench": "x", "mb_per_s": 30.0, "ok": False, "p99": {"idle": 3, "busy": 1}, "n": [2]},
        {"bench": "x", "mb_per_s": 20.0, "ok": True, "p99": {"idle": 2, "busy": 5}, "n": [3]},
    ]
    assert median_of(runs) == {
        "bench": "x",
        "mb_per_s": 20.0,
        "ok": True,  # not a number: the first run's
        "p99": {"idle": 2, "busy": 5},
        "n": [1],
    }


def test_short_mode_names_only_benches_that_exist() -> None:
    assert set(SHORT) <= set(BENCHES)
    assert {"offload", "cold_read", "store_append"} <= set(BENCHES)
