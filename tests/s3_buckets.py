"""Buckets the test suite creates in the shared LocalStack, and their removal (decision 532).

LocalStack keeps every object in memory until it stops, and other engineers use the same
instance at the same time: a run names each bucket it creates with the run's own prefix
(``tmq-t{run}-``), deletes each one (objects, versions, delete markers and unfinished
multipart uploads, then the bucket) when the fixture or script that made it ends, and checks at
the end of the session that none with its prefix is left. Buckets of other runs and people
are never listed as ours, so never touched.

The run id comes from ``TMQ_TEST_RUN``: the controlling pytest process sets it before it
starts its xdist workers, which inherit it; a script started by a test (bench/torture.py)
is handed a bucket name instead.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

RUN_ENV = "TMQ_TEST_RUN"


def run_id() -> str:
    """This test run's id (8 hex digits), shared by the controller and its workers."""
    run = os.environ.get(RUN_ENV)
    if not run:
        run = os.environ[RUN_ENV] = uuid.uuid4().hex[:8]
    return run


def run_prefix() -> str:
    return f"tmq-t{run_id()}-"


def bucket_name(kind: str) -> str:
    """A fresh bucket name of this run: ``tmq-t{run}-{kind}-{8 hex}`` (at most 63 chars)."""
    return f"{run_prefix()}{kind}-{uuid.uuid4().hex[:8]}"


def delete_bucket(client: Any, name: str) -> None:
    """Empty ``name`` (every object version, delete marker and unfinished multipart upload)
    and delete it; a bucket already gone is fine."""
    try:
        for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=name):
            for upload in page.get("Uploads", []):
                client.abort_multipart_upload(
                    Bucket=name, Key=upload["Key"], UploadId=upload["UploadId"]
                )
        for page in client.get_paginator("list_object_versions").paginate(Bucket=name):
            doomed = [
                {"Key": v["Key"], "VersionId": v["VersionId"]}
                for v in page.get("Versions", []) + page.get("DeleteMarkers", [])
            ]
            if doomed:
                client.delete_objects(Bucket=name, Delete={"Objects": doomed, "Quiet": True})
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=name):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=name, Delete={"Objects": keys, "Quiet": True})
        client.delete_bucket(Bucket=name)
    except client.exceptions.NoSuchBucket:
        return


def leftover_buckets(client: Any) -> list[str]:
    """The buckets of this run that still exist."""
    prefix = run_prefix()
    return sorted(
        b["Name"] for b in client.list_buckets()["Buckets"] if b["Name"].startswith(prefix)
    )
