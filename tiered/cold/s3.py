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

import logging
import os
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, urlparse, urlsplit

import botocore.config
import botocore.credentials
import botocore.httpsession
import botocore.session
import urllib3
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
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

log = logging.getLogger(__name__)

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
        session = botocore.session.get_session()
        self.client = session.create_client(
            "s3", config=botocore.config.Config(**config), **client_kwargs
        )
        self._ranged = _RangedGetter.build(self, session, client_kwargs)

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
        if self._ranged is not None:
            try:
                return self._ranged.get(self._key(key), start, length)
            except _Delegate as refused:
                # A 4xx other than 416: botocore's own call answers it (see _RangedGetter). If
                # that call succeeds, the fast path sends something botocore does not (a region
                # or an address it would correct): it is switched off for this store, so that
                # every read does not pay two requests.
                data = self._botocore_range(key, start, length)
                log.warning(
                    "%s: a ranged GET was refused (HTTP %s) where botocore's call was not; "
                    "ranged GETs go through botocore from now on",
                    self.url,
                    refused.status,
                )
                self._ranged = None
                return data
            except Exception as e:
                raise self._translate(key, e) from e
        return self._botocore_range(key, start, length)

    def _botocore_range(self, key: str, start: int, length: int) -> bytes:
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


class _Delegate(Exception):
    """The ranged GET met an answer that botocore's own call handles (see ``_RangedGetter``)."""

    def __init__(self, status: int) -> None:
        super().__init__(status)
        self.status = status


class _RangedGetter:
    """Ranged ``GetObject`` through a urllib3 pool, signed by botocore's SigV4 signer, without
    botocore's per-request machinery (decision 770).

    A replay's segment reads are ranged GETs of a few MiB; botocore spends 1.1-1.5 ms of Python on
    each (endpoint resolution, parameter validation, event hooks, checksum context, response
    parsing) beyond the socket reads, 29 % of the cold worker's working samples (decision 706).
    This sends the same request: the URL botocore itself builds for the bucket (taken once from
    the client, so path or virtual-host addressing and a custom endpoint are botocore's), a
    ``Range`` header, a SigV4 signature from botocore's ``S3SigV4Auth`` with the client's own
    credentials (frozen per request, so refreshable credentials still refresh), and the client's
    connect and read deadlines, with no retry and no redirect (``RetryPolicy`` is the one retry
    layer, as for botocore's calls).

    Answers: 206 (or 200, sliced) is the bytes, a body shorter than its Content-Length is an error
    (urllib3 checks it), 416 is "nothing past the end" as in ``get_range``, a 5xx is a
    ``ClientError`` with the code of the error body (or the status when the body is not S3's
    XML), classified by ``translate`` like botocore's. Any other 4xx (not found, access denied, a
    bucket in another region that botocore would redirect to) is answered by botocore's own call
    instead: one more request on a path that fails anyway, and the error, its message and the
    region redirect are exactly botocore's; when botocore's call succeeds where this one was
    refused, the store leaves its ranged GETs to botocore from then on (logged). Credentials
    never appear in an error: the signature is a header, and neither the URL nor urllib3's
    messages carry headers."""

    def __init__(
        self,
        prefix: str,
        credentials: Any,
        region: str,
        pool: urllib3.connectionpool.HTTPConnectionPool,
    ) -> None:
        self.prefix = prefix  # scheme://host[:port]/path/ up to the object key
        self.path = urlsplit(prefix).path
        self.credentials = credentials
        self.region = region
        self.pool = pool
        self._frozen: Any = None
        self._signer: S3SigV4Auth | None = None

    @classmethod
    def build(
        cls,
        store: S3ObjectStore,
        session: botocore.session.Session,
        client_kwargs: dict[str, Any],
    ) -> _RangedGetter | None:
        """The getter for ``store``'s client, or None where botocore must stay on the path: an
        option this does not reproduce (a custom CA or none, proxies, client certificates, a
        signature version other than SigV4, an environment proxy) or no credentials."""
        client = store.client
        config = client.meta.config
        if os.environ.get("TMQ_S3_BOTOCORE_GETS") == "1":
            return None  # the A/B switch of decision 770: every GET through botocore
        if set(client_kwargs) - {
            "endpoint_url",
            "region_name",
            "aws_access_key_id",
            "aws_secret_access_key",
            "aws_session_token",
        }:
            return None
        if config.proxies or config.client_cert or config.signature_version not in (None, "s3v4"):
            return None
        if any(
            os.environ.get(v)
            for v in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY")
        ):
            return None
        if "aws_access_key_id" in client_kwargs or "aws_secret_access_key" in client_kwargs:
            if (
                "aws_access_key_id" not in client_kwargs
                or "aws_secret_access_key" not in client_kwargs
            ):
                return None  # half a pair: botocore's own call says what is wrong
            credentials: Any = botocore.credentials.Credentials(
                client_kwargs["aws_access_key_id"],
                client_kwargs["aws_secret_access_key"],
                client_kwargs.get("aws_session_token"),
            )
        else:
            credentials = session.get_credentials()  # the client's own (the session caches it)
        region = client.meta.region_name
        if credentials is None or not region:
            return None
        probe = f"{store.root}/tmq-probe" if store.root else "tmq-probe"
        try:
            url = client.generate_presigned_url(
                "get_object", Params={"Bucket": store.bucket, "Key": probe}, ExpiresIn=60
            )
        except Exception:
            return None
        parts = urlsplit(url)
        if not parts.path.endswith("/" + probe) or parts.scheme not in ("http", "https"):
            return None
        prefix = f"{parts.scheme}://{parts.netloc}{parts.path[: -len(probe)]}"
        timeout = urllib3.Timeout(connect=config.connect_timeout, read=config.read_timeout)
        size = config.max_pool_connections
        pool: urllib3.connectionpool.HTTPConnectionPool
        if parts.scheme == "https":
            pool = urllib3.HTTPSConnectionPool(
                parts.hostname,
                parts.port,
                maxsize=size,
                timeout=timeout,
                retries=False,
                cert_reqs="CERT_REQUIRED",
                # botocore's own choice: AWS_CA_BUNDLE or the profile's ca_bundle, else certifi's
                ca_certs=session.get_config_variable("ca_bundle")
                or botocore.httpsession.get_cert_path(True),
            )
        else:
            pool = urllib3.HTTPConnectionPool(
                parts.hostname, parts.port, maxsize=size, timeout=timeout, retries=False
            )
        return cls(prefix, credentials, region, pool)

    def _sign(self, url: str, headers: dict[str, str]) -> dict[str, str]:
        frozen = self.credentials.get_frozen_credentials()
        if self._signer is None or frozen != self._frozen:  # new keys: a new signer
            self._signer, self._frozen = S3SigV4Auth(frozen, "s3", self.region), frozen
        request = AWSRequest("GET", url, headers=headers)
        self._signer.add_auth(request)
        return dict(request.headers.items())

    def get(self, key: str, start: int, length: int) -> bytes:
        quoted = quote(key, safe="/~")
        headers = self._sign(self.prefix + quoted, {"Range": f"bytes={start}-{start + length - 1}"})
        response = self.pool.urlopen(
            "GET",
            self.path + quoted,
            headers=headers,
            retries=False,
            redirect=False,
            preload_content=False,
            enforce_content_length=True,
        )
        try:
            status = response.status
            # Every answer's body is read to its end, also a 416's or an error's: a connection
            # goes back to the pool only with nothing left of its answer on it.
            body: bytes = response.read(decode_content=False)
        except BaseException:
            response.close()  # cut off mid-body (or a timeout): never reused
            raise
        response.release_conn()
        if status in (200, 206):
            if status == 200:  # the whole object: a store that ignored the range
                body = body[start : start + length]
            return body
        if status == 416:  # ``start`` at or past the end: fewer bytes, none
            return b""
        if status < 500 and status != 429:
            raise _Delegate(status)
        raise ClientError(_error_response(status, body), "GetObject")


def _error_response(status: int, body: bytes) -> dict[str, Any]:
    """The error as botocore's parser states it: the S3 error body's ``Code`` and ``Message``,
    or the status and nothing else when the body is not S3's XML (a proxy's, a load balancer's)."""
    code, message = str(status), ""
    try:
        root = ElementTree.fromstring(body) if body else None
    except ElementTree.ParseError:
        root = None
    if root is not None and root.tag == "Error":
        code = root.findtext("Code") or code
        message = root.findtext("Message") or ""
    return {
        "Error": {"Code": code, "Message": message},
        # One attempt, as botocore's retry handler (total_max_attempts 1) records it for an
        # answer it would have retried: the same words in the error.
        "ResponseMetadata": {
            "HTTPStatusCode": status,
            "MaxAttemptsReached": True,
            "RetryAttempts": 0,
        },
    }
