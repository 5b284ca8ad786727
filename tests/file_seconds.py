"""Writes ``tests/file_seconds.json``, the seconds each test file took, from a JUnit report of a
full run (``python -m pytest --junitxml=report.xml``); ``conftest.py`` starts the longest files
first. Refresh it when a file's time changes by more than a minute or so:

    python tests/file_seconds.py report.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def main() -> None:
    seconds: defaultdict[str, float] = defaultdict(float)
    for case in ET.parse(sys.argv[1]).iter("testcase"):
        # classname is the module's dotted path ("tests.test_ops", then a class's name if any);
        # time covers setup, call and teardown.
        parts = case.attrib["classname"].split(".")
        module = next(i for i, part in enumerate(parts) if part.startswith("test_"))
        seconds["/".join(parts[: module + 1]) + ".py"] += float(case.attrib.get("time", 0))
    table = {f: round(s) for f, s in sorted(seconds.items(), key=lambda kv: -kv[1])}
    (TESTS / "file_seconds.json").write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main()
