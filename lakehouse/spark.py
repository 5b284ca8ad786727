"""The Spark session the export runs in, with the ``tmq`` data source registered."""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

from lakehouse import PROJECT_ROOT
from lakehouse.source import TmqDataSource


def spark_session(
    master: str = "local[*]",
    app_name: str = "tmq-lakehouse",
    conf: dict[str, str] | None = None,
) -> SparkSession:
    """A session for the export (or reuse the active one, e.g. in a notebook or test suite).

    Python workers run the same interpreter as the driver, and see this checkout first on their
    path. The session time zone is UTC: store_date and every timestamp are UTC in the table."""
    active = SparkSession.getActiveSession()
    if active is not None:
        register(active)
        return active
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    path = os.environ.get("PYTHONPATH", "")
    if str(PROJECT_ROOT) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), path) if p)
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.shuffle.partitions", "4")
        # Python workers fork from a daemon that has imported the export's modules already,
        # and are reused across tasks: a task's fixed cost is then a fork, not imports.
        .config("spark.python.daemon.module", "lakehouse.worker_daemon")
        .config("spark.python.worker.reuse", "true")
        # Java's regex engine recurses deeply on long Python error messages; a small default
        # stack turned one failed batch into a StackOverflowError that hid the real error.
        .config("spark.driver.extraJavaOptions", "-Xss16m")
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    return session


def register(session: SparkSession) -> None:
    session.dataSource.register(TmqDataSource)
