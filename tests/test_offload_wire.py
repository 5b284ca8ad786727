"""What a segment PUT sends to S3 (decision 490): the body's CRC32C, which the seal computed
already, as the checksum the store checks, and no SHA-256 of the body for the signature."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import google_crc32c
import pytest
from conftest import S3Endpoint
from test_segment_upload import _planned_jobs

from offload.segment_upload import upload_segment
from tiered.cold.segment import verify
from tiered.cold.storage import (
    FsspecObjectStore,
    PermanentStorageError,
    RetryPolicy,
    StorageError,
    open_store,
)


def _b64(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def test_a_segment_put_sends_its_crc32c_and_no_payload_hash(
    tmp_path: Path, s3: S3Endpoint, bucket: str
) -> None:
    """The request carries ``x-amz-checksum-crc32c`` of the whole object (records, tables and
    footer) and ``UNSIGNED-PAYLOAD`` instead of the body's SHA-256; the store keeps that CRC32C
    as the object's checksum."""
    job = _planned_jobs(tmp_path, 400_000)[0]
    tier = open_store(f"s3://{bucket}/tier", s3.storage_options())
    sent: list[dict[str, str]] = []

    def capture(request: Any, **_: Any) -> None:
        sent.append(
            {
                k.lower(): v.decode() if isinstance(v, bytes) else v
                for k, v in request.headers.items()
            }
        )

    client = tier.inner.client  # type: ignore[attr-defined]
    client.meta.events.register("before-send.s3.PutObject", capture)
    info = upload_segment(tier, job)
    stored = tier.get(info.key)
    assert len(sent) == 1
    headers = sent[0]
    assert headers["x-amz-checksum-crc32c"] == _b64(google_crc32c.value(stored))
    assert "x-amz-checksum-crc32" not in headers
    assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
    head = s3.client().head_object(Bucket=bucket, Key=f"tier/{info.key}", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == _b64(google_crc32c.value(stored))


def test_a_put_whose_crc32c_does_not_match_its_body_is_refused_and_stores_nothing(
    s3: S3Endpoint, bucket: str
) -> None:
    """The store checks the CRC32C the PUT carries (nothing else guards the body now that it is
    not hashed for the signature): a body that does not match is refused as a transient
    failure (damaged on the way: the retry sends it again) and nothing is stored."""
    tier = open_store(f"s3://{bucket}/tier", s3.storage_options(), RetryPolicy(attempts=1))
    body = b"segment bytes " * 5000
    with pytest.raises(StorageError) as refused:
        tier.put_if_absent("seg/1", body, crc32c=google_crc32c.value(body) ^ 1)
    assert not isinstance(refused.value, PermanentStorageError), refused.value
    assert tier.list("") == []
    assert tier.put_if_absent("seg/1", body, crc32c=google_crc32c.value(body)) is True
    assert tier.get("seg/1") == body


def test_payload_signing_comes_back_when_the_operator_asks_for_it(
    s3: S3Endpoint, bucket: str
) -> None:
    """``tier_options.config_kwargs.s3.payload_signing_enabled = true`` signs the body again
    (over plain http, the one protection against a body changed on purpose on the way)."""
    options = {**s3.storage_options(), "config_kwargs": {"s3": {"payload_signing_enabled": True}}}
    tier = open_store(f"s3://{bucket}/tier", options)
    sent: list[str] = []
    tier.inner.client.meta.events.register(  # type: ignore[attr-defined]
        "before-send.s3.PutObject",
        lambda request, **_: sent.append(request.headers["x-amz-content-sha256"]),
    )
    tier.put_if_absent("seg/1", b"abc", crc32c=google_crc32c.value(b"abc"))
    assert sent and sent[0] not in ("UNSIGNED-PAYLOAD", b"UNSIGNED-PAYLOAD")


def test_the_s3fs_backend_puts_a_segment_with_its_crc32c_which_the_store_checks(
    tmp_path: Path, s3: S3Endpoint, bucket: str
) -> None:
    """A tier whose options name something only s3fs knows is served by s3fs
    (``FsspecObjectStore``): its segment PUT carries the seal's CRC32C too. The store keeps that
    checksum, the object reads back whole against its footer, and a CRC32C that does not match
    the body is refused (transient, as on the botocore path) and stores nothing."""
    options = {**s3.storage_options(), "default_block_size": 8 << 20}  # an s3fs-only option
    tier = open_store(f"s3://{bucket}/tier", options, RetryPolicy(attempts=1))
    assert isinstance(tier.inner, FsspecObjectStore)  # type: ignore[attr-defined]
    job = _planned_jobs(tmp_path, 400_000)[0]
    info = upload_segment(tier, job)
    verify(tier, info)
    stored = tier.get(info.key)
    head = s3.client().head_object(Bucket=bucket, Key=f"tier/{info.key}", ChecksumMode="ENABLED")
    assert head["ChecksumCRC32C"] == _b64(google_crc32c.value(stored)) == _b64(info.object_crc32c())
    with pytest.raises(StorageError) as refused:
        tier.put_if_absent("seg/bad", stored, crc32c=google_crc32c.value(stored) ^ 1)
    assert not isinstance(refused.value, PermanentStorageError), refused.value
    assert tier.size("seg/bad") is None
