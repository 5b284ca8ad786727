"""The check for buckets a test run leaves in LocalStack (decision 532) fails the run, names the
bucket and deletes it; a bucket of another run is never touched."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from s3_buckets import delete_bucket

TESTS = Path(__file__).resolve().parent


@pytest.mark.skipif(not os.environ.get("TMQ_LEAK_PROBE"), reason="run by the test below")
def test_probe_leaves_a_bucket_behind(s3: Any) -> None:
    s3.client().create_bucket(Bucket=os.environ["TMQ_LEAK_PROBE"])


def test_a_bucket_left_behind_fails_the_run_and_is_deleted(s3: Any) -> None:
    if s3.kind != "localstack":
        pytest.skip("the check looks at LocalStack")
    run = uuid.uuid4().hex[:8]
    leaked = f"tmq-t{run}-probe-{uuid.uuid4().hex[:8]}"
    other = f"tmq-t{uuid.uuid4().hex[:8]}-probe-other"  # another run's, alive meanwhile
    client = s3.client()
    client.create_bucket(Bucket=other)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                f"{TESTS / 'test_s3_buckets.py'}::test_probe_leaves_a_bucket_behind",
                "-o",
                "addopts=",  # no xdist workers: one process, about 2 s of CPU
                "-q",
            ],
            env={**os.environ, "TMQ_TEST_RUN": run, "TMQ_LEAK_PROBE": leaked},
            cwd=TESTS.parent,
            capture_output=True,
            text=True,
            timeout=120,
        )
        names = {b["Name"] for b in client.list_buckets()["Buckets"]}
    finally:
        delete_bucket(client, other)
        delete_bucket(client, leaked)
    assert done.returncode == 1, done.stdout[-2000:]
    assert "1 passed" in done.stdout
    assert f"left 1 bucket(s) in LocalStack: {leaked}" in done.stdout
    assert leaked not in names and other in names
