"""Spark's Python worker daemon, with the export's imports done once before it forks.

Spark starts one daemon per executor (``spark.python.daemon.module``) and forks a worker from
it for each Python task; a reused worker (``spark.python.worker.reuse``, on by default) serves
later tasks. Without this module every new worker imported pyarrow, numpy, pandas, deltalake's
neighbours and the tmq packages itself: on a loaded 2-core machine, seconds per task. Imported
here, the forked workers inherit them.

Spark runs it as ``python -m lakehouse.worker_daemon [worker module]``, exactly as it runs
``pyspark.daemon``.

Spark also puts ``pyspark.zip`` and py4j's zip first on every worker's path, for clusters
without pyspark installed. Here it is installed (the same version: it is what started the
JVM), and the zips cost on every task: pyspark's worker calls ``importlib.invalidate_caches()``
per task, which makes each zip importer re-read its whole directory. They are dropped from the
path before anything imports pyspark, so workers import the installed package.
"""

from __future__ import annotations

import importlib
import sys

# Loaded once here, inherited by every forked worker.
PRELOAD = (
    "numpy",
    "pandas",  # pyspark's Arrow paths import it
    "pyarrow",
    "pyarrow.compute",
    "pyarrow.parquet",
    "pyspark.sql.datasource",
    "pyspark.worker",
    # The S3 client stack (fsspec loads it on a task's first s3:// URL): s3fs, aiobotocore,
    # aiohttp and the TLS contexts aiohttp builds at import took more than a second per
    # worker, as much as the batch's reads.
    "s3fs",
    "botocore.session",  # the export's ranged GETs (lakehouse.source.RangeReader)
    "lakehouse.sink",
    "lakehouse.source",
    "tiered.columnar",
)


def main() -> None:
    sys.path[:] = [p for p in sys.path if not p.endswith(".zip")]
    for name in PRELOAD:
        importlib.import_module(name)
    from lakehouse.source import warm_clients

    warm_clients()  # botocore's S3 data parsed once, not per worker
    from pyspark import daemon

    daemon.manager()


if __name__ == "__main__":
    main()
