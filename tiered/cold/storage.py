"""The cold tier's one narrow interface to object storage, and its fsspec implementation.

Everything in ``tiered/cold`` and ``offload`` talks to storage through ``ObjectStore``. The URL
picks the backend (``file://`` for the embedded default, ``s3://`` through s3fs); a
fault-injecting wrapper (``tiered/cold/faults.py``) is just another implementation.

Keys are ``/``-separated paths relative to the tier root. A key never starts with ``/`` and never
has an empty, ``.`` or ``..`` component: no key can address anything outside the root.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import fsspec
from fsspec.implementations.local import LocalFileSystem

log = logging.getLogger(__name__)

# Deadlines for every S3 call: a blackholed endpoint must fail a call, not hang it
# (Redpanda's lesson: a connect timeout alone leaves in-flight PUTs hanging for minutes).
DEFAULT_S3_OPTIONS: dict[str, Any] = {
    # Other processes write the same prefixes (a restarted broker, the exporter reading
    # manifests): a cached listing would hide their objects, and s3fs answers GET and HEAD
    # "not found" from a cached listing without asking the store.
    "use_listings_cache": False,
    "config_kwargs": {
        "connect_timeout": 5,
        "read_timeout": 30,
        "retries": {"max_attempts": 3, "mode": "standard"},
    },
}
# s3fs sends a conditional (If-None-Match) PUT only below its multipart threshold (2 x 50 MiB).
MAX_CONDITIONAL_PUT_BYTES = 100 * 1024 * 1024


class StorageError(Exception):
    """A storage call failed in a way worth retrying (unavailable, timed out, throttled)."""


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

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` unless it exists. True: written; False: it existed
        (whatever it holds; the caller decides whether that is its own earlier write). Atomic:
        nobody ever sees part of the object. Safe to retry."""
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
            options = {**DEFAULT_S3_OPTIONS, **options}
        self.fs, root = fsspec.core.url_to_fs(self.url, **options)
        self.root = root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            Path(self.root).mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> str:
        return f"{self.root}/{check_key(key)}"

    def _translate(self, key: str, e: Exception) -> Exception:
        if isinstance(e, FileNotFoundError):
            return ObjectNotFoundError(key)
        if isinstance(e, ValueError | ObjectNotFoundError):
            return e
        # Everything else from the network or the service is transient by assumption; the
        # caller retries with backoff. Credentials never appear in these messages.
        return StorageError(f"{self.url}: {key}: {type(e).__name__}: {e}")

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if self.local:
            return _local_create(Path(path), data)
        if len(data) > MAX_CONDITIONAL_PUT_BYTES:
            raise ValueError(f"{key}: {len(data)} bytes is too large for a conditional put")
        try:
            self.fs.pipe_file(path, data, mode="create")
            return True
        except FileExistsError:
            return False
        except Exception as e:
            if "PreconditionFailed" in str(e) or "412" in str(e):
                return False
            raise self._translate(key, e) from e

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        if self.local:
            _local_replace(Path(path), data)
            return
        try:
            self.fs.pipe_file(path, data)
        except Exception as e:
            raise self._translate(key, e) from e

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
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._translate(key, e) from e

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = f"{self.root}/{prefix}".rstrip("/")
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._translate(prefix, e) from e
        out = []
        for path, info in found.items():
            rel = path[len(self.root) :].lstrip("/")  # fsspec paths start with the root
            if info.get("type", "file") == "file" and not Path(rel).name.startswith("."):
                out.append(ObjectInfo(rel, int(info["size"])))  # (".tmp-*": a write under way)
        return sorted(out, key=lambda o: o.key)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            return
        except Exception as e:
            raise self._translate(key, e) from e

    def children(self, prefix: str) -> Sequence[str]:
        base = f"{self.root}/{prefix}".rstrip("/")
        try:
            # refresh: s3fs caches delimiter listings, and new queues must become visible.
            found = self.fs.ls(base, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise self._translate(prefix or "/", e) from e
        names = {str(info["name"]).rstrip("/").rsplit("/", 1)[-1] for info in found}
        return sorted(n for n in names if n and not n.startswith("."))


def _write_temp(directory: Path, data: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return Path(tmp)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _local_create(path: Path, data: bytes) -> bool:
    """Create-if-absent on a local filesystem: a fully written temporary file hard-linked into
    place, which fails atomically when the name exists."""
    tmp = _write_temp(path.parent, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink()
    _fsync_dir(path.parent)
    return True


def _local_replace(path: Path, data: bytes) -> None:
    tmp = _write_temp(path.parent, data)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def open_store(url: str, storage_options: dict[str, Any] | None = None) -> ObjectStore:
    return FsspecObjectStore(url, storage_options)
