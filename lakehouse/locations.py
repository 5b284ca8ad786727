"""Where the tier and the lake are, and the options each library needs to reach them.

Three libraries touch storage here and each spells its options differently: fsspec/s3fs (the
tier reader and the Parquet writers, ``endpoint_url``/``key``/``secret``), and delta-rs
(``AWS_ENDPOINT_URL``/``AWS_ACCESS_KEY_ID``/...). Callers give fsspec options, as the broker's
``tier_options`` are; this module translates. Credentials are never put into options by this
module: they come from the standard AWS chain on every process (driver and executors), so they
never appear in Spark plans, checkpoints or logs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec

_S3 = ("s3://", "s3a://")


def normalize_url(url: str) -> str:
    """A URL for every library: ``s3://…`` as given; a local path or ``file://…`` becomes
    ``file:///absolute/path`` (without a trailing slash)."""
    url = url.rstrip("/")
    if url.startswith(_S3):
        return "s3://" + url.split("://", 1)[1]
    if url.startswith("file://"):
        url = url[len("file://") :]
    elif "://" in url:
        raise ValueError(f"unsupported URL {url!r}: use file:// (or a path) or s3://bucket/prefix")
    return "file://" + str(Path(url).expanduser().resolve())


def is_local(url: str) -> bool:
    return normalize_url(url).startswith("file://")


def local_path(url: str) -> Path:
    return Path(urlparse(normalize_url(url)).path)


def options_from_env(url: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """fsspec options for ``url`` from the standard AWS environment: only the endpoint (for
    S3-compatible stores such as LocalStack or MinIO) and region; credentials stay in the chain."""
    env = os.environ if env is None else env
    if not normalize_url(url).startswith("s3://"):
        return {}
    options: dict[str, Any] = {}
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")
    if region:
        options["client_kwargs"] = {"region_name": region}
    return options


@dataclass(slots=True, frozen=True)
class Location:
    """A storage root (the tier, or the lake) and its fsspec options."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, url: str, options: Mapping[str, Any] | None = None) -> Location:
        merged = {**options_from_env(url), **(options or {})}
        return cls(normalize_url(url), merged)

    def child(self, name: str) -> Location:
        return Location(f"{self.url}/{name}", self.options)

    def filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """The fsspec filesystem and the root path within it."""
        fs, root = fsspec.core.url_to_fs(self.url, **self.options)
        return fs, str(root).rstrip("/")

    def delta_uri(self) -> str:
        """The URI delta-rs opens: a plain path for local tables."""
        return str(local_path(self.url)) if is_local(self.url) else self.url

    def delta_options(self) -> dict[str, str]:
        """delta-rs (object_store) storage options equivalent to the fsspec options."""
        if is_local(self.url):
            return {}
        out: dict[str, str] = {}
        endpoint = self.options.get("endpoint_url")
        if endpoint:
            out["AWS_ENDPOINT_URL"] = str(endpoint)
            if str(endpoint).startswith("http://"):
                out["AWS_ALLOW_HTTP"] = "true"
        if "key" in self.options:
            out["AWS_ACCESS_KEY_ID"] = str(self.options["key"])
        if "secret" in self.options:
            out["AWS_SECRET_ACCESS_KEY"] = str(self.options["secret"])
        region = (self.options.get("client_kwargs") or {}).get("region_name")
        out["AWS_REGION"] = str(region or os.environ.get("AWS_REGION", "us-east-1"))
        return out
