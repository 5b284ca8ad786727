"""The cold tier's one narrow interface to object storage, and its fsspec implementation.

Everything in ``tiered/cold`` and ``offload`` talks to storage through ``ObjectStore``. The URL
picks the backend (``file://`` for the embedded default, ``s3://`` through s3fs); a
fault-injecting wrapper (``tiered/cold/faults.py``) is just another implementation.

Keys are ``/``-separated paths relative to the tier root. A key never starts with ``/`` and never
has an empty, ``.`` or ``..`` component: no key can address anything outside the root.
"""

from __future__ import annotations

import base64
import logging
import os
import random
import re
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import urlparse

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tiered import failpoints
from tiered.durable import fill_new_file, make_dirs

log = logging.getLogger(__name__)

# Deadlines for every S3 call: a blackholed endpoint must fail a call, not hang it
# (Redpanda's lesson: a connect timeout alone leaves in-flight PUTs hanging for minutes).
DEFAULT_S3_OPTIONS: dict[str, Any] = {
    # Other processes write the same prefixes (a restarted broker, the exporter reading
    # manifests): a cached listing would hide their objects, and s3fs answers GET and HEAD
    # "not found" from a cached listing without asking the store.
    "use_listings_cache": False,
    # One retry policy (``RetryPolicy``), so botocore's own is off (one attempt; s3fs's too, see
    # ``FsspecObjectStore``). Stacked, the three multiplied: 8 x 5 x 3 attempts for one dead PUT.
    "config_kwargs": {
        "connect_timeout": 5,
        "read_timeout": 30,
        "retries": {"total_max_attempts": 1, "mode": "standard"},
    },
}

# S3 error codes (botocore's ``ClientError``) that no retry can fix, with what to do about them.
PERMANENT_CODES = {
    "NoSuchBucket": "the bucket does not exist: create it, or fix tier_url",
    "InvalidBucketName": "that is not a valid bucket name: fix tier_url",
    "AccessDenied": "access denied: grant these credentials s3:GetObject, s3:PutObject, "
    "s3:DeleteObject and s3:ListBucket on the bucket",
    "AllAccessDisabled": "all access to the bucket is disabled: ask its owner",
    "AccountProblem": "the account cannot use the bucket: ask its owner",
    "InvalidAccessKeyId": "the store does not know this access key: check AWS_ACCESS_KEY_ID "
    "or AWS_PROFILE (or tier_options.key)",
    "SignatureDoesNotMatch": "the secret key does not match the access key: check "
    "AWS_SECRET_ACCESS_KEY (or tier_options.secret)",
    "ExpiredToken": "the session token has expired: refresh the credentials",
    "InvalidToken": "the session token is not valid: refresh the credentials",
    "PermanentRedirect": "the bucket is in another region: set AWS_REGION to the bucket's",
    "AuthorizationHeaderMalformed": "the bucket is in another region: set AWS_REGION to the "
    "bucket's",
}
# Codes worth another attempt although their HTTP status is below 500.
TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "ConditionalRequestConflict",  # a rival conditional PUT in flight: the retry decides
    # The body the store received is not the one sent (its checksum or length differs): damaged
    # or cut off on the way. Nothing was stored, and the same bytes sent again arrive whole.
    "BadDigest",
    "IncompleteBody",
    "XAmzContentSHA256Mismatch",
}
# s3fs sends a conditional (If-None-Match) PUT only below its multipart threshold (2 x 50 MiB).
MAX_CONDITIONAL_PUT_BYTES = 100 * 1024 * 1024


class StorageError(Exception):
    """A storage call failed in a way worth retrying (unavailable, timed out, throttled)."""


class PermanentStorageError(StorageError):
    """A storage call failed in a way no retry can fix (no such bucket, access denied, bad
    credentials): the message names the bucket and what the operator must do. Never retried."""


class ObjectNotFoundError(KeyError):
    """The object does not exist."""


@dataclass(slots=True, frozen=True)
class ObjectInfo:
    key: str
    size: int


def check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"illegal object key {key!r}")
    return key


class ObjectStore(Protocol):
    url: str

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int | None = None) -> bool:
        """Create ``key`` with ``data`` unless it exists. True: written; False: it existed
        (whatever it holds; the caller decides whether that is its own earlier write). Atomic:
        nobody ever sees part of the object. Safe to retry. ``crc32c``: the CRC32C of ``data``
        when the caller has it already (a sealed segment): an S3 store sends it as the body's
        checksum instead of computing one (decision 490)."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Create or replace ``key`` atomically (readers see the old or the new bytes)."""
        ...

    def get(self, key: str) -> bytes:
        """The whole object; ``ObjectNotFoundError`` if missing."""
        ...

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from ``start`` (fewer at the end); ``ObjectNotFoundError`` if
        missing."""
        ...

    def size(self, key: str) -> int | None:
        """The object's size, or None if it does not exist."""
        ...

    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object under ``prefix`` (a key prefix ending in ``/``), sorted by key."""
        ...

    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing object succeeds (idempotent)."""
        ...

    def children(self, prefix: str) -> Sequence[str]:
        """The names one level below ``prefix`` ("" for the root), like an S3 LIST with a
        ``/`` delimiter: one request however many objects lie deeper. Sorted; never cached, so
        a long-running reader sees prefixes created after it started; [] if there are none."""
        ...


class FsspecObjectStore:
    """``ObjectStore`` over any fsspec filesystem, chosen by the URL's scheme."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        options = dict(storage_options or {})
        if self.url.startswith(("s3://", "s3a://")):
            config = {**DEFAULT_S3_OPTIONS["config_kwargs"], **options.get("config_kwargs", {})}
            options = {**DEFAULT_S3_OPTIONS, **options, "config_kwargs": config}
        self.fs, root = fsspec.core.url_to_fs(self.url, **options)
        if hasattr(self.fs, "retries"):  # s3fs's retry loop (a class attribute, not an option)
            self.fs.retries = 1
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        self.s3 = self.url.startswith(("s3://", "s3a://"))
        if self.local:
            make_dirs(Path(self.root))  # durable, as every directory under it (decision 1142)

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _translate(self, key: str, e: Exception) -> Exception:
        return translate(self.url, self._bucket(), key, e)

    def _bucket(self) -> str:
        parsed = urlparse(self.url)
        return f"{parsed.scheme}://{parsed.netloc}" if parsed.netloc else self.url

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int | None = None) -> bool:
        path = self._path(key)
        if self.local:
            return _local_create(Path(path), data)
        if len(data) > MAX_CONDITIONAL_PUT_BYTES:
            raise ValueError(f"{key}: {len(data)} bytes is too large for a conditional put")
        try:
            self.fs.pipe_file(path, data, mode="create", **self._checksum(data, crc32c))
            return True
        except FileExistsError:
            return False
        except Exception as e:
            if exists_refusal(e):
                return False
            raise self._translate(key, e) from e

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if self.local:
            _local_replace(Path(path), data)
            return
        try:
            self.fs.pipe_file(path, data, **self._checksum(data))
        except Exception as e:
            raise self._translate(key, e) from e

    def _checksum(self, data: bytes, crc32c: int | None = None) -> dict[str, str]:
        return put_checksum(data, crc32c) if self.s3 else {}

    def get(self, key: str) -> bytes:
        try:
            data: bytes = self.fs.cat_file(self._path(key))
            return data
        except Exception as e:
            raise self._translate(key, e) from e

    def get_range(self, key: str, start: int, length: int) -> bytes:
        try:
            data: bytes = self.fs.cat_file(self._path(key), start=start, end=start + length)
            return data
        except Exception as e:
            raise self._translate(key, e) from e

    def size(self, key: str) -> int | None:
        try:
            return int(self.fs.info(self._path(key))["size"])
        except Exception as e:
            error = self._translate(key, e)
            if isinstance(error, ObjectNotFoundError):
                return None
            raise error from e

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = f"{self.root}/{prefix}".rstrip("/")
        try:
            found = self.fs.find(base, detail=True)
        except Exception as e:
            error = self._translate(prefix, e)
            if isinstance(error, ObjectNotFoundError):
                return []
            raise error from e
        out = []
        for path, info in found.items():
            rel = path[len(self.root) :].lstrip("/")  # fsspec paths start with the root
            if info.get("type", "file") == "file" and not Path(rel).name.startswith("."):
                out.append(ObjectInfo(rel, int(info["size"])))  # (".tmp-*": a write under way)
        return sorted(out, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except Exception as e:
            error = self._translate(key, e)
            if not isinstance(error, ObjectNotFoundError):
                raise error from e

    def children(self, prefix: str) -> Sequence[str]:
        base = f"{self.root}/{prefix}".rstrip("/")
        try:
            # refresh: s3fs caches delimiter listings, and new queues must become visible.
            found = self.fs.ls(base, detail=True, refresh=True)
        except Exception as e:
            error = self._translate(prefix or "/", e)
            if isinstance(error, ObjectNotFoundError):
                return []
            raise error from e
        names = {str(info["name"]).rstrip("/").rsplit("/", 1)[-1] for info in found}
        return sorted(n for n in names if n and not n.startswith("."))


T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class RetryPolicy:
    """The one retry policy for object-store calls (the ``[retry]`` section of tmq.toml).

    A call that fails with a transient ``StorageError`` is tried again after an exponential,
    jittered backoff (``base_delay_s``, doubling up to ``max_delay_s``), ``attempts`` times in
    all; a ``PermanentStorageError`` and "not found" are never retried. s3fs's and botocore's
    own retries are off (``DEFAULT_S3_OPTIONS``), so this is the only layer that retries."""

    attempts: int = 6
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"[retry] attempts must be at least 1, not {self.attempts}")

    def call(
        self,
        what: str,
        fn: Callable[[], T],
        sleep: Callable[[float], None] = time.sleep,
        deadline: float | None = None,
    ) -> T:
        """``fn()``, retried. ``deadline`` (``time.monotonic()``): no attempt starts after it,
        nor a backoff that would end past it (an attempt under way is bounded by the client's
        own connect and read timeouts)."""
        delay = self.base_delay_s
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except PermanentStorageError:
                raise
            except StorageError as e:
                if attempt == self.attempts:
                    raise StorageError(f"{e} (failed {attempt} attempts)") from e
                pause = delay * (0.5 + random.random())
                if deadline is not None and time.monotonic() + pause >= deadline:
                    raise StorageError(
                        f"{e} (failed {attempt} attempt(s); no more before the caller's deadline)"
                    ) from e
                log.warning("%s: attempt %d failed (%s); retrying", what, attempt, e)
                sleep(pause)
                delay = min(delay * 2, self.max_delay_s)
        raise AssertionError("unreachable")


class RetryingObjectStore:
    """``ObjectStore`` that retries every call of another by a ``RetryPolicy``. Every method of
    the interface is safe to retry (``put_if_absent`` answers False when an earlier attempt
    landed; the caller tells its own bytes from a rival's)."""

    def __init__(
        self,
        inner: ObjectStore,
        policy: RetryPolicy,
        sleep: Callable[[float], None] = time.sleep,
        deadline: float | None = None,
    ) -> None:
        self.inner = inner
        self.url = inner.url
        self.policy = policy
        self._sleep = sleep
        self.deadline = deadline

    def until(self, deadline: float | None) -> RetryingObjectStore:
        """This store, but no call retried past ``deadline`` (``time.monotonic()``; None: as
        this one): what a caller that gives up then uses, so that the calls it leaves behind
        end soon after instead of running out the policy's attempts (decision 920)."""
        return RetryingObjectStore(self.inner, self.policy, self._sleep, deadline)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return self.policy.call(what, fn, self._sleep, self.deadline)

    def put_if_absent(self, key: str, data: bytes, *, crc32c: int | None = None) -> bool:
        return self._call(f"put {key}", lambda: self.inner.put_if_absent(key, data, crc32c=crc32c))

    def put(self, key: str, data: bytes) -> None:
        self._call(f"put {key}", lambda: self.inner.put(key, data))

    def get(self, key: str) -> bytes:
        return self._call(f"get {key}", lambda: self.inner.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._call(f"get {key}", lambda: self.inner.get_range(key, start, length))

    def size(self, key: str) -> int | None:
        return self._call(f"head {key}", lambda: self.inner.size(key))

    def list(self, prefix: str) -> list[ObjectInfo]:
        return self._call(f"list {prefix}", lambda: self.inner.list(prefix))

    def delete(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self.inner.delete(key))

    def children(self, prefix: str) -> Sequence[str]:
        return self._call(f"list {prefix}", lambda: self.inner.children(prefix))


def check_writable(store: ObjectStore, prefix: str) -> None:
    """Write, read back and delete a probe object under ``prefix``: what a broker does before it
    serves, so a missing bucket or missing permissions stop it at start (one line naming the
    bucket and the fix) instead of at its first upload. Raises ``PermanentStorageError`` for
    those; a ``StorageError`` when the store is unreachable."""
    key = f"{prefix.rstrip('/')}/.write-check-{os.getpid()}-{random.getrandbits(32):08x}"
    store.put(key, b"tmq")
    try:
        if store.get(key) != b"tmq":
            raise PermanentStorageError(f"{store.url}: {key}: read back other bytes than written")
    finally:
        store.delete(key)


def translate(url: str, bucket: str, key: str, e: Exception) -> Exception:
    """The error as ``ObjectStore`` states it, classified by the service's error code (never
    by matching text): not found, permanent, or transient. ``bucket`` names the bucket in a
    permanent error's message. Credentials never appear in these messages."""
    code, status = error_code(e)
    if code in PERMANENT_CODES:
        return PermanentStorageError(f"{bucket}: {code}: {PERMANENT_CODES[code]}")
    if code == "NoSuchKey" or status == 404 or (code is None and _not_found(e)):
        return ObjectNotFoundError(key)
    if isinstance(e, ValueError | ObjectNotFoundError):
        return e
    if isinstance(e, TypeError | AttributeError | NameError | AssertionError):
        # A bug or a bad option (an unknown tier_options key): no retry helps.
        return PermanentStorageError(f"{url}: {key}: {type(e).__name__}: {e}")
    if status is not None and 400 <= status < 500 and code not in TRANSIENT_CODES:
        # A request the service refuses as such (400, 403, 405…): the same again fails the
        # same way.
        return PermanentStorageError(f"{url}: {key}: {code} (HTTP {status}): {e}")
    if code is None and isinstance(e, PermissionError):
        return PermanentStorageError(
            f"{url}: {key}: permission denied: let tmq's user write the directory"
        )
    # 5xx, throttling, timeouts, refused connections: worth another attempt.
    return StorageError(f"{url}: {key}: {code or type(e).__name__}: {e}")


def exists_refusal(e: BaseException) -> bool:
    """Whether ``e`` is a conditional PUT's refusal because the key exists (If-None-Match:
    412 Precondition Failed)."""
    code, status = error_code(e)
    return code == "PreconditionFailed" or status == 412


def error_code(e: BaseException) -> tuple[str | None, int | None]:
    """The S3 error code and HTTP status of ``e`` or of what caused it (s3fs turns botocore's
    ``ClientError`` into an ``OSError`` and keeps the original as its cause); (None, None) for
    an error that never got an answer from the service (a refused connection, a timeout)."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = response["Error"].get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return (str(code) if code else None), (int(status) if status else None)
        cur = cur.__cause__ or cur.__context__
    return None, None


def _not_found(e: BaseException) -> bool:
    return isinstance(e, FileNotFoundError) or (
        isinstance(e, OSError) and e.errno == 2  # ENOENT from a backend's OSError
    )


# A file:// tier's temporary files are named for the process writing them (decision 1205):
# ".tmp-<boot>_<pid>_<start>-<random>", <boot> the CRC32 of the kernel's boot id and <start> the
# process's start time in clock ticks since boot (/proc/<pid>/stat). A writer killed between
# writing one and linking or deleting it leaves it behind, hidden from listings; a sweep
# deletes it once that process is gone. Pid and start time together name one process of one
# boot, so a reused pid (a restarted broker in a container is often pid 1 again) is no
# longer the writer's. A temporary file of another boot id (a previous boot, or another host
# sharing the directory) or of the old unnamed form is deleted only once untouched for
# TEMP_ABANDONED_S: a live writer writes its file, fsyncs it and links it within moments.
_TEMP = re.compile(r"\.tmp-([0-9a-f]{8})_(\d+)_(\d+)-")
TEMP_ABANDONED_S = 3600.0


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """``pid``'s start time (clock ticks since boot), None when no such process runs (or
    /proc cannot tell)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields follow its last ")".
    return int(stat.rsplit(")", 1)[1].split()[19])


_BOOT = f"{zlib.crc32(_boot_id().encode()):08x}" if _boot_id() else ""  # "": no /proc


_PREFIXES: dict[int, str] = {}


def _temp_prefix() -> str:
    """This process's temporary-file prefix (per pid: a forked child is another writer)."""
    pid = os.getpid()
    prefix = _PREFIXES.get(pid)
    if prefix is None:
        start = _start_ticks(pid) if _BOOT else None
        prefix = ".tmp-" if start is None else f".tmp-{_BOOT}_{pid}_{start}-"
        _PREFIXES[pid] = prefix
    return prefix


def _temp_abandoned(path: Path, now: float) -> bool:
    """Whether the temporary file at ``path`` belongs to no writer still at work."""
    match = _TEMP.match(path.name)
    if match is not None and _BOOT and match.group(1) == _BOOT:
        pid, start = int(match.group(2)), int(match.group(3))
        if pid == os.getpid():
            return False  # this process's own: its writer deletes or links it itself
        return _start_ticks(pid) != start
    try:
        return now - path.stat().st_mtime > TEMP_ABANDONED_S
    except FileNotFoundError:
        return False  # its writer linked or deleted it meanwhile


def sweep_temporaries(store: ObjectStore, prefix: str, *, delete: bool = True) -> list[str]:
    """The keys (under ``prefix``) of temporary files killed writers left in a file:// tier,
    deleted unless ``delete`` is False; [] for any other tier (an S3 PUT that never completed
    leaves no object). Safe while other writers work: a file whose writer may still be alive
    is kept (``_temp_abandoned``)."""
    inner: object = store
    while not isinstance(inner, FsspecObjectStore):
        inner = getattr(inner, "inner", None)
        if inner is None:
            return []
    if not inner.local:
        return []
    root = Path(inner.root)
    base = root / prefix
    if not base.is_dir():
        return []
    now = time.time()
    found = []
    for path in sorted(base.rglob(".tmp-*")):
        if not path.is_file() or not _temp_abandoned(path, now):
            continue
        if delete:
            try:
                path.unlink()
            except FileNotFoundError:
                continue
        found.append(path.relative_to(root).as_posix())
    return found


def _write_temp(directory: Path, data: bytes) -> Path:
    """A new temporary file in ``directory`` holding all of ``data``, fsynced; or an error and
    no file. A full disk can take part of a write without an error (``write`` returns less
    than asked, decision 1140): a single write linked into place a cut-off object. The
    directories made on the way are durable (decision 1142): ``mkdir -p`` left the first
    object of a queue, durable itself, in directories a power loss could take."""
    make_dirs(directory)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=_temp_prefix())
    fill_new_file(fd, Path(tmp), data)
    return Path(tmp)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _local_create(path: Path, data: bytes) -> bool:
    """Create-if-absent on a local filesystem: a fully written temporary file hard-linked into
    place, which fails atomically when the name exists. The directory is fsynced either way:
    a name found taken may be one a killed writer linked and never made durable, and the
    caller takes "exists" as "stored" (decision 1190)."""
    tmp = _write_temp(path.parent, data)
    try:
        os.link(tmp, path)
        failpoints.hit("tier.after_link")
    except FileExistsError:
        created = False
    else:
        created = True
    finally:
        tmp.unlink()
    _fsync_dir(path.parent)
    return created


def _local_replace(path: Path, data: bytes) -> None:
    tmp = _write_temp(path.parent, data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def put_checksum(data: bytes, crc32c: int | None = None) -> dict[str, str]:
    """The ``PutObject`` parameter with the body's checksum, for the store to check: a body
    damaged on the way is refused (BadDigest), never stored. Nothing reads a written object back
    (decision 251), so this is what guarantees it holds the bytes sent; given here, it does not
    depend on the SDK's own checksums, which AWS_REQUEST_CHECKSUM_CALCULATION=when_required
    turns off (decision 290). ``crc32c`` given (a segment, whose seal computed it): that, as
    ``ChecksumCRC32C``, at no cost here (decision 490); a whole-segment GET is checked against
    the footer's CRC32C by tmq itself. Otherwise (a manifest) the body's CRC32, the SDK's own
    default: botocore checks a whole-object GET against a stored CRC32C only with awscrt
    installed, and a manifest is read whole. Empty above one PUT's worth of bytes (a multipart
    upload checks its parts its own way)."""
    if len(data) > MAX_CONDITIONAL_PUT_BYTES:
        return {}
    if crc32c is not None:
        return {"ChecksumCRC32C": base64.b64encode(crc32c.to_bytes(4, "big")).decode()}
    crc = zlib.crc32(data).to_bytes(4, "big")
    return {"ChecksumCRC32": base64.b64encode(crc).decode()}


def within(store: ObjectStore, deadline: float | None) -> ObjectStore:
    """``store`` with no call retried past ``deadline`` when it retries (``RetryingObjectStore.
    until``); ``store`` itself otherwise."""
    return store.until(deadline) if isinstance(store, RetryingObjectStore) else store


def bounded_options(url: str, options: dict[str, Any] | None, seconds: float) -> dict[str, Any]:
    """``options`` for a client of the tier at ``url`` whose every attempt gives up after
    ``seconds`` of connecting or of silence (at most: the tier's own deadlines stay when they
    are shorter). For the broker's admin reads (decision 920): a manifest is a few KiB, and a
    load an operator waits ``admin_tier_wait_ms`` for must not hold one of the broker's load
    slots through a 30 s read timeout after the operator has had the answer. Only S3 has such
    deadlines; other schemes' options are returned as they are."""
    out = dict(options or {})
    if not url.startswith(("s3://", "s3a://")):
        return out
    config = {**DEFAULT_S3_OPTIONS["config_kwargs"], **out.get("config_kwargs", {})}
    for name in ("connect_timeout", "read_timeout"):
        config[name] = min(float(config[name]), seconds)
    out["config_kwargs"] = config
    return out


def open_store(
    url: str, storage_options: dict[str, Any] | None = None, retry: RetryPolicy | None = None
) -> RetryingObjectStore:
    """The object store at ``url``, every call retried by ``retry`` (the one policy; default
    ``RetryPolicy()``): transient failures with backoff, permanent ones never. ``s3://`` goes
    through a botocore client of its own (``tiered/cold/s3.py``, decision 330) unless the
    options name something only s3fs knows; every other scheme through fsspec."""
    from tiered.cold import s3  # imports this module

    inner: ObjectStore
    if s3.supports(url, storage_options or {}):
        inner = s3.S3ObjectStore(url, storage_options)
    else:
        inner = FsspecObjectStore(url, storage_options)
    return RetryingObjectStore(inner, retry or RetryPolicy())
