"""Users and grants (RocketMQ ACL 2.0's users and policies), and who may do what with them.

A user is an access key with a secret key; an admin user (RocketMQ's SUPER) may do everything,
the admin and ACL services included. Any other user may do exactly what its grants allow and
nothing else: ``topic:orders`` (literal), ``topic:orders-*`` (prefix) or ``topic:*`` (any), the
same for ``group:``, with the actions PUB and SUB (ALL: both), each ALLOW or DENY. For a request
the most specific matching grant decides (literal over prefix, a longer prefix over a shorter,
any last); on equally specific grants a DENY wins. No matching grant: refused.

Stored in ``{config_dir}/acl.json``, replaced atomically like ``topics.json``, and replicated
with the rest of the metadata (BrokerMetadata.snapshot). HMAC verification needs the secret
itself, so it cannot be stored hashed: each secret is encrypted with AES-256-GCM (its user name
as associated data) under a key kept in ``{data_dir}/auth.key`` (created 0600 on first use,
outside ``config/`` so that a copy of the metadata alone does not carry it). Whoever reads both
files, or the broker's memory, has the secrets: docs/security.md, "Threat model".

Every change is durable when the method returns, and visible to the next request: the
interceptor asks this store on every call, so a revoked grant stops working without a restart.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tiered.durable import fill_new_file, fsync_dir, make_dirs, settle_dir, write_file
from tiered.durable import replace as replace_durably

PUB = "PUB"
SUB = "SUB"
ACTIONS = (PUB, SUB)
RESOURCE_KINDS = ("topic", "group")
_KEY_BYTES = 32
_NONCE_BYTES = 12
_MAX_NAME = 255


class AclError(ValueError):
    """A request the store refuses (unknown user, bad resource or action); safe to show."""


def parse_actions(actions: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    out: set[str] = set()
    for a in actions:
        for part in a.upper().replace(",", " ").split():
            if part == "ALL":
                out.update(ACTIONS)
            elif part in ACTIONS:
                out.add(part)
            else:
                raise AclError(f"unknown action {part!r} (PUB, SUB or ALL)")
    if not out:
        raise AclError("a grant needs at least one action (PUB, SUB or ALL)")
    return tuple(sorted(out))


def parse_resource(resource: str) -> tuple[str, str]:
    """``topic:NAME`` into (kind, pattern); a pattern ending in ``*`` is a prefix."""
    kind, sep, pattern = resource.partition(":")
    if not sep or kind.lower() not in RESOURCE_KINDS or not pattern:
        raise AclError(
            f"resource {resource!r} must be topic:NAME, topic:PREFIX*, topic:*, "
            "group:NAME, group:PREFIX* or group:*"
        )
    if len(pattern) > _MAX_NAME or "*" in pattern[:-1]:
        raise AclError(f"resource {resource!r}: '*' may only end the name")
    return kind.lower(), pattern


def _specificity(pattern: str, name: str) -> int | None:
    """How specifically ``pattern`` matches ``name`` (higher: more); None if it does not."""
    if pattern.endswith("*"):
        prefix = pattern[:-1]
        return len(prefix) if name.startswith(prefix) else None
    return _MAX_NAME + 1 if pattern == name else None


@dataclass(frozen=True, slots=True)
class Grant:
    user: str
    resource: str  # kind:pattern, normalised
    actions: tuple[str, ...]
    deny: bool = False

    @classmethod
    def of(cls, user: str, resource: str, actions: list[str], deny: bool = False) -> Grant:
        kind, pattern = parse_resource(resource)
        return cls(user, f"{kind}:{pattern}", parse_actions(actions), deny)


# Serialises the making of a key file between the stores of one process (``_create_key``).
_KEY_LOCK = threading.Lock()


class AclStore:
    """Thread-safe. ``lookup`` is what remoting/auth.py's Authenticator asks."""

    def __init__(self, config_dir: Path, key_file: Path | None = None) -> None:
        self.path = config_dir / "acl.json"
        self.key_file = key_file or config_dir.parent / "auth.key"
        self._lock = threading.Lock()
        self._users: dict[str, tuple[str, bool]] = {}  # name -> (secret, admin)
        self._grants: dict[str, list[Grant]] = {}  # user -> grants
        self._key: bytes | None = None
        # Called after every saved change (BrokerMetadata: a master pushes it to its slaves).
        self.on_change: Callable[[], None] | None = None

    def __repr__(self) -> str:  # never the secrets
        return f"AclStore({self.path}, {len(self._users)} users)"

    # -- the key -------------------------------------------------------------------------------

    def _cipher(self) -> AESGCM:
        if self._key is None:
            try:
                key = self.key_file.read_bytes()
            except FileNotFoundError:
                key = self._create_key()
            else:
                # Found, its name may not be durable: a broker killed between the rename that
                # made it and the fsync after it left the name in the page cache only, and a
                # secret saved with it now would outlive it (decision 1191).
                fsync_dir(self.key_file.parent)
            if len(key) != _KEY_BYTES:
                raise RuntimeError(f"{self.key_file} is not a {_KEY_BYTES}-byte key")
            self._key = key
        return AESGCM(self._key)

    def _create_key(self) -> bytes:
        """A new key in ``key_file``, durable before any secret is saved with it (decision
        1141): written whole to a temporary file and fsynced, renamed into place, and the
        directory fsynced. The name used to be left undurable (acl.json's save fsyncs another
        directory), so a power loss kept the secrets and lost their key; and a full disk left
        an empty key file that no later start could use. Only the broker holding the data
        directory's lock makes its key; ``_KEY_LOCK`` keeps two stores of one process from
        both making one."""
        with _KEY_LOCK:
            with contextlib.suppress(FileNotFoundError):
                return self.key_file.read_bytes()  # made meanwhile
            key = secrets.token_bytes(_KEY_BYTES)
            make_dirs(self.key_file.parent)
            tmp = self.key_file.with_name(self.key_file.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            fill_new_file(fd, tmp, key)
            replace_durably(tmp, self.key_file)
            return key

    def _encrypt(self, name: str, secret: str) -> str:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        sealed = self._cipher().encrypt(nonce, secret.encode(), name.encode())
        return base64.b64encode(nonce + sealed).decode()

    def _decrypt(self, name: str, sealed: str) -> str:
        raw = base64.b64decode(sealed)
        try:
            return (
                self._cipher()
                .decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], name.encode())
                .decode()
            )
        except Exception:
            raise RuntimeError(
                f"{self.path}: the secret of user {name} does not decrypt with {self.key_file} "
                "(a different key file?); restore the key, or re-create the user"
            ) from None

    # -- persistence ---------------------------------------------------------------------------

    def load(self) -> None:
        settle_dir(self.path.parent)  # what is read below is durable before it is acted on
        try:
            document = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except json.JSONDecodeError as e:
            raise RuntimeError(f"{self.path} is damaged ({e}); restore it from a backup") from e
        users = {
            u["name"]: (self._decrypt(u["name"], u["secret"]), bool(u["admin"]))
            for u in document.get("users", [])
        }
        grants: dict[str, list[Grant]] = {}
        for g in document.get("grants", []):
            grants.setdefault(g["user"], []).append(
                Grant(g["user"], g["resource"], tuple(g["actions"]), bool(g["deny"]))
            )
        with self._lock:
            self._users, self._grants = users, grants

    def _save(self, users: dict[str, tuple[str, bool]], grants: dict[str, list[Grant]]) -> None:
        """Under the lock: ``users`` and ``grants`` saved, then served. A save that fails (a
        full disk) changes nothing, in memory either (decision 1141): a user whose creation
        was refused used to authenticate until the next restart, and then vanish."""
        document = {
            "users": [
                {"name": n, "admin": admin, "secret": self._encrypt(n, secret)}
                for n, (secret, admin) in sorted(users.items())
            ],
            "grants": [asdict(g) for gs in grants.values() for g in gs],
        }
        make_dirs(self.path.parent)
        write_file(self.path, json.dumps(document, indent=1, sort_keys=True).encode())
        self._users, self._grants = users, grants
        if self.on_change is not None:
            self.on_change()

    # -- users ---------------------------------------------------------------------------------

    def lookup(self, access_key: str) -> tuple[str, bool] | None:
        return self._users.get(access_key)

    def create_user(
        self, name: str, admin: bool = False, secret: str = "", replace: bool = False
    ) -> str:
        """Create ``name`` (or give it a new secret with ``replace``); returns its secret key,
        generated when none is given."""
        if not name or len(name) > _MAX_NAME or any(c in name for c in " ,=/:\t\r\n"):
            raise AclError(f"user name {name!r} must be 1..{_MAX_NAME} characters, no ' ,=/:'")
        secret = secret or secrets.token_urlsafe(24)
        with self._lock:
            if name in self._users and not replace:
                raise AclError(f"user {name} exists (--rotate gives it a new secret)")
            self._save({**self._users, name: (secret, admin)}, self._grants)
        return secret

    def ensure_admin(self, name: str, secret: str) -> None:
        """The bootstrap admin of the environment: created, or brought up to date."""
        if self._users.get(name) != (secret, True):
            self.create_user(name, admin=True, secret=secret, replace=True)

    def delete_user(self, name: str) -> int:
        """Remove ``name`` and its grants; returns how many grants went with it."""
        with self._lock:
            if name not in self._users:
                raise AclError(f"no user {name}")
            removed = len(self._grants.get(name, []))
            self._save(
                {n: u for n, u in self._users.items() if n != name},
                {u: gs for u, gs in self._grants.items() if u != name},
            )
        return removed

    def users(self) -> list[tuple[str, bool]]:
        return sorted((n, admin) for n, (_, admin) in list(self._users.items()))

    # -- grants --------------------------------------------------------------------------------

    def grant(self, grant: Grant) -> None:
        """Add ``grant``, replacing the user's grant on the same resource."""
        with self._lock:
            if grant.user not in self._users:
                raise AclError(f"no user {grant.user} (tmq user create {grant.user})")
            kept = [g for g in self._grants.get(grant.user, []) if g.resource != grant.resource]
            self._save(self._users, {**self._grants, grant.user: [*kept, grant]})

    def revoke(self, user: str, resource: str = "") -> int:
        """Remove ``user``'s grant on ``resource`` (empty: all its grants); returns how many."""
        target = "{}:{}".format(*parse_resource(resource)) if resource else ""
        with self._lock:
            before = self._grants.get(user, [])
            kept = [g for g in before if target and g.resource != target]
            if len(kept) != len(before):
                self._save(self._users, {**self._grants, user: kept})
        return len(before) - len(kept)

    def grants(self, user: str = "") -> list[Grant]:
        return [
            g for u, gs in sorted(self._grants.items()) if not user or u == user for g in list(gs)
        ]

    def allows(self, user: str, kind: str, name: str, actions: tuple[str, ...]) -> bool:
        """Whether ``user`` may do any of ``actions`` on the ``kind`` named ``name``."""
        return any(self._decide(user, kind, name, action) for action in actions)

    def _decide(self, user: str, kind: str, name: str, action: str) -> bool:
        best, allowed = -1, False
        for g in list(self._grants.get(user, ())):
            g_kind, _, pattern = g.resource.partition(":")
            if g_kind != kind or action not in g.actions:
                continue
            rank = _specificity(pattern, name)
            if rank is None or rank < best:
                continue
            if rank > best:
                best, allowed = rank, not g.deny
            elif g.deny:
                allowed = False
        return allowed

    # -- replication ---------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """Users (with their secrets, in the clear: a slave encrypts them under its own key)
        and grants, for the replication link (broker/ha)."""
        with self._lock:
            return {
                "users": [
                    {"name": n, "admin": admin, "secret": secret}
                    for n, (secret, admin) in sorted(self._users.items())
                ],
                "grants": [asdict(g) for gs in self._grants.values() for g in gs],
            }

    def replace(self, snapshot: dict[str, Any]) -> None:
        """Become ``snapshot`` (a master's), durably."""
        users = {u["name"]: (u["secret"], bool(u["admin"])) for u in snapshot["users"]}
        grants: dict[str, list[Grant]] = {}
        for g in snapshot["grants"]:
            grants.setdefault(g["user"], []).append(
                Grant(g["user"], g["resource"], tuple(g["actions"]), bool(g["deny"]))
            )
        with self._lock:
            if (users, grants) == (self._users, self._grants):
                return
            self._save(users, grants)
