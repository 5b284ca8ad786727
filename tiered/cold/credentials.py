"""Object-store credentials: which options are secret, and keeping them out of text we print.

Secrets reach tmq two ways: ``tier_options`` (s3fs's ``key``, ``secret``, ``token``, or
botocore's ``aws_secret_access_key`` inside ``client_kwargs``) and the standard AWS environment
variables. Neither may appear in a log line, an error message or ``--json`` output. ``redact``
is for showing options; ``scrub`` and ``ScrubSecrets`` remove known secret values from any text
(an exception message that quotes a URL or a request, say) before it is written.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

REDACTED = "***"
# Option names that hold a secret: key, secret, token, password, credentials, alone or as a
# word of a longer name (aws_secret_access_key, sse_customer_key, session_token).
_SECRET_NAME = re.compile(r"(^|_)(key|secret|token|password|credentials?)(_|$)", re.IGNORECASE)
# tmq's own admin secret (docs/security.md) is scrubbed the same way.
SECRET_ENV = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "TMQ_ADMIN_SECRET_KEY",
)
# Shorter values are not scrubbed from free text: they would match ordinary words (LocalStack's
# "test"), and no real credential is that short (AWS key ids are 20 characters, secrets 40).
_MIN_SCRUBBED = 8


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` with every secret value (at any depth) replaced by ``***``."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, Mapping):
            out[name] = redact(value)
        elif is_secret_name(str(name)) and value not in (None, ""):
            out[name] = REDACTED
        else:
            out[name] = value
    return out


def secret_values(
    options: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> set[str]:
    """The secret strings in ``options`` (at any depth) and in the AWS variables of ``env``."""
    found: set[str] = set()
    for name, value in (options or {}).items():
        if isinstance(value, Mapping):
            found |= secret_values(value)
        elif is_secret_name(str(name)) and isinstance(value, str):
            found.add(value)
    for name in SECRET_ENV:
        value = (env or {}).get(name)
        if value:
            found.add(value)
    return {s for s in found if len(s) >= _MIN_SCRUBBED}


def scrub(text: str, secrets: Iterable[str]) -> str:
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text


class ScrubSecrets(logging.Filter):
    """A handler filter that removes known secret values from each record, including its
    formatted traceback. Attach it to handlers (filters on a logger miss propagated records)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets: set[str] = set(secrets)
        self._formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        message = record.getMessage()
        clean = scrub(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = self._formatter.formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = scrub(record.exc_text, self.secrets)
        return True


_scrubber = ScrubSecrets()


def scrub_logs(secrets: Iterable[str]) -> ScrubSecrets:
    """Add ``secrets`` to the process's scrubber and attach it to every root handler."""
    _scrubber.secrets |= set(secrets)
    for handler in logging.getLogger().handlers:
        if _scrubber not in handler.filters:
            handler.addFilter(_scrubber)
    return _scrubber


def scrub_known(text: str) -> str:
    """``text`` without any secret the process's scrubber knows of."""
    return scrub(text, _scrubber.secrets)
