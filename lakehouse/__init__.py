"""Archived topics as Delta tables: the ``tmq`` Spark data source over the cold tier, the Delta
sink, the export job, and the helpers analysts and operators use (status, query, maintain).

See docs/lakehouse.md. ``lakehouse.runner`` is what a broker imports; it does not import Spark.
"""

from pathlib import Path

# The checkout's root: Spark's Python workers and export child processes must import this
# checkout's packages (lakehouse, tiered) whatever directory they start in.
PROJECT_ROOT = Path(__file__).resolve().parent.parent
