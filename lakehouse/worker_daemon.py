"""Spark's Python worker daemon, with the export's imports done once before it forks.

Spark starts one daemon per executor (``spark.python.daemon.module``) and forks a worker from
it for each Python task; a reused worker (``spark.python.worker.reuse``, on by default) serves
later tasks. Without this module every new worker imported pyarrow, numpy, pandas, deltalake's
neighbours and the tmq packages itself: on a loaded 2-core machine, seconds per task. Imported
here, the forked workers inherit them.

Spark runs it as ``python -m lakehouse.worker_daemon [worker module]``, exactly as it runs
``pyspark.daemon``.
"""

from __future__ import annotations

# The imports are the point: loaded once, inherited by every forked worker.
import numpy  # noqa: F401
import pandas  # noqa: F401  (pyspark's Arrow paths import it)
import pyarrow
import pyarrow.compute
import pyarrow.parquet  # noqa: F401
import pyspark.sql.datasource
import pyspark.worker  # noqa: F401

import lakehouse.sink
import lakehouse.source  # noqa: F401
import tiered.columnar  # noqa: F401


def main() -> None:
    from pyspark import daemon

    daemon.manager()


if __name__ == "__main__":
    main()
