"""``ObjectStore`` for ``s3://`` through one botocore client: the cold tier's S3 backend.

s3fs (aiobotocore on an event loop thread, aiohttp) spends more CPU per byte than botocore's
own urllib3 for the same requests: measured in one process in the same minute, 4 concurrent
16 MiB conditional PUTs ran at 15-39 MB/s through s3fs and 33-57 MB/s through boto3, 1 MiB
ranged GETs 14-16 against 18-24 MB/s (decision 330). On a 2-core machine that CPU is taken from
the object store and the broker, so the cold tier's own calls go through this client; fsspec
stays for ``file://`` and every other scheme (``FsspecObjectStore``).

Behaviour is the interface's, call for call, as ``FsspecObjectStore`` gives it over s3fs: the
same options (``tier_options`` in s3fs's names, mapped here), the same deadlines and one
attempt per call (``RetryPolicy`` is the only retry layer), the same error classification
(``translate``). A conditional PUT is ``PutObject`` with ``If-None-Match: *``; a 412 is "it
exists". The client is thread-safe and keeps a pool of connections as large as the worker's
threads and the fetcher's read-ahead use at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

import botocore.config
import botocore.session
from botocore.exceptions import ClientError

from tiered.cold.storage import (
    DEFAULT_S3_OPTIONS,
    MAX_CONDITIONAL_PUT_BYTES,
    ObjectInfo,
    ObjectNotFoundError,
    check_key,
    error_code,
    exists_refusal,
    put_checksum,
    translate,
)

# s3fs option names this backend maps onto botocore; a tier with any other option is served
# by s3fs, which knows them all (``supports``).
_KNOWN = {"endpoint_url", "key", "secret", "token", "client_kwargs", "config_kwargs"}
_IGNORED = {"use_listings_cache"}  # nothing here caches listings
# Connections kept per client: the worker's threads and the fetcher's read-ahead (4 each) and
# a few commits and listings beside them.
_POOL = 16


def supports(url: str, options: dict[str, Any]) -> bool:
    """Whether this backend serves ``url`` with ``options`` exactly as s3fs would."""
    return url.startswith(("s3://", "s3a://")) and set(options) <= _KNOWN | _IGNORED


class S3ObjectStore:
    """``ObjectStore`` over S3 (or LocalStack, MinIO) through a botocore client."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        options = dict(storage_options or {})
        parsed = urlparse(self.url)
        self.bucket = parsed.netloc
        self.root = parsed.path.strip("/")
        config = {
            **DEFAULT_S3_OPTIONS["config_kwargs"],
            **options.get("config_kwargs", {}),
        }
        config.setdefault("max_pool_connections", _POOL)
        # No SHA-256 of the body for the signature (``UNSIGNED-PAYLOAD``, what botocore does by
        # itself over https when a checksum header is present): every PUT carries the body's
        # CRC32 or CRC32C, which the store checks, and the hash cost as much CPU as the rest of
        # a segment's PUT (decision 490). ``config_kwargs.s3.payload_signing_enabled = true``
        # signs the body again (over plain http, a body changed on purpose on the way, with
        # its checksum recomputed, is otherwise accepted).
        config["s3"] = {"payload_signing_enabled": False, **config.get("s3", {})}
        client_kwargs = dict(options.get("client_kwargs", {}))
        for ours, boto_name in (
            ("endpoint_url", "endpoint_url"),
            ("key", "aws_access_key_id"),
            ("secret", "aws_secret_access_key"),
            ("token", "aws_session_token"),
        ):
            if options.get(ours) is not None:
                client_kwargs.setdefault(boto_name, options[ours])
        self.client = botocore.session.get_session().create_client(
            "s3", config=botocore.config.Config(**config), **client_kwargs
        )

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.root}/{key}" if self.root else key

    def _translate(self, key: str, e: Exception) -> Exception:
        return translate(self.url, f"s3://{self.bucket}", key, e)

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int | None = None) -> bool:
        if len(data) > MAX_CONDITIONAL_PUT_BYTES:
            raise ValueError(f"{key}: {len(data)} bytes is too large for a conditional put")
        try:
            self.client.put_object(
                Bucket=self.bucket,
                Key=self._key(key),
                Body=data,
                IfNoneMatch="*",
                **put_checksum(data, crc32c),
            )
            return True
        except Exception as e:
            if exists_refusal(e):
                return False
            raise self._translate(key, e) from e

    def put(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, **put_checksum(data)
            )
        except Exception as e:
            raise self._translate(key, e) from e

    def get(self, key: str) -> bytes:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
            with body:
                data: bytes = body.read()
            return data
        except Exception as e:
            raise self._translate(key, e) from e

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            body = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{start + length - 1}"
            )["Body"]
            with body:
                data: bytes = body.read()
            return data
        except ClientError as e:
            code, _ = error_code(e)
            if code == "InvalidRange":  # ``start`` at or past the end: fewer bytes, none
                return b""
            raise self._translate(key, e) from e
        except Exception as e:
            raise self._translate(key, e) from e

    def size(self, key: str) -> int | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return int(head["ContentLength"])
        except Exception as e:
            error = self._translate(key, e)
            if isinstance(error, ObjectNotFoundError):
                return None
            raise error from e

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self._key(prefix.rstrip("/")) + "/" if prefix.strip("/") else self._prefix()
        out = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base
            )
            for page in pages:
                for item in page.get("Contents", ()):
                    rel = item["Key"][len(self._prefix()) :]
                    if rel and not rel.endswith("/") and not rel.rsplit("/", 1)[-1].startswith("."):
                        out.append(ObjectInfo(rel, int(item["Size"])))  # (".tmp-*": under way)
        except Exception as e:
            error = self._translate(prefix, e)
            if isinstance(error, ObjectNotFoundError):
                return []
            raise error from e
        return sorted(out, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as e:
            error = self._translate(key, e)
            if not isinstance(error, ObjectNotFoundError):
                raise error from e

    def children(self, prefix: str) -> Sequence[str]:
        base = self._key(prefix.rstrip("/")) + "/" if prefix.strip("/") else self._prefix()
        names: set[str] = set()
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/"
            )
            for page in pages:
                for common in page.get("CommonPrefixes", ()):
                    names.add(common["Prefix"][len(base) :].rstrip("/"))
                for item in page.get("Contents", ()):
                    names.add(item["Key"][len(base) :])
        except Exception as e:
            error = self._translate(prefix or "/", e)
            if isinstance(error, ObjectNotFoundError):
                return []
            raise error from e
        return sorted(n for n in names if n and not n.startswith("."))

    def _prefix(self) -> str:
        return f"{self.root}/" if self.root else ""
