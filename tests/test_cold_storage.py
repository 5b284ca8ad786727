"""The cold tier's storage interface, on the local filesystem and on S3 (LocalStack)."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from conftest import S3Endpoint

from tiered.cold.faults import FaultyObjectStore
from tiered.cold.storage import (
    FsspecObjectStore,
    ObjectInfo,
    ObjectNotFoundError,
    ObjectStore,
    PermanentStorageError,
    RetryingObjectStore,
    RetryPolicy,
    StorageError,
    check_writable,
    open_store,
)


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "file":
        return open_store(f"file://{tmp_path}/tier")
    s3 = request.getfixturevalue("s3")
    bucket = request.getfixturevalue("bucket")
    return open_store(f"s3://{bucket}/tier", s3.storage_options())


def test_put_if_absent_writes_once_and_never_overwrites(store: ObjectStore) -> None:
    assert store.put_if_absent("c/b/orders/0/seg", b"first") is True
    assert store.put_if_absent("c/b/orders/0/seg", b"second") is False
    assert store.get("c/b/orders/0/seg") == b"first"


def test_only_one_of_many_racing_writers_wins(store: ObjectStore) -> None:
    results: list[bool] = []
    writers = [
        threading.Thread(
            target=lambda i=i: results.append(
                store.put_if_absent("race/obj", f"writer-{i}".encode())
            )
        )
        for i in range(8)
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert sorted(results) == [False] * 7 + [True]
    assert store.get("race/obj").startswith(b"writer-")


def test_reads_ranges_sizes_lists_and_idempotent_deletes(store: ObjectStore) -> None:
    store.put_if_absent("t/0/a", bytes(range(200)))
    store.put("t/0/manifest", b"v1")
    store.put("t/0/manifest", b"v2")  # replace
    assert store.get_range("t/0/a", 10, 5) == bytes(range(10, 15))
    assert store.get_range("t/0/a", 195, 100) == bytes(range(195, 200))
    assert store.size("t/0/a") == 200 and store.size("t/0/none") is None
    assert store.get("t/0/manifest") == b"v2"
    assert store.list("t/0/") == [ObjectInfo("t/0/a", 200), ObjectInfo("t/0/manifest", 2)]
    assert store.list("nothing/") == []
    store.delete("t/0/a")
    store.delete("t/0/a")
    with pytest.raises(ObjectNotFoundError):
        store.get("t/0/a")
    with pytest.raises(ObjectNotFoundError):
        store.get_range("t/0/a", 0, 1)


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/./b", "a/../../etc", ""])
def test_keys_cannot_leave_the_tier_root(tmp_path: Path, key: str) -> None:
    store = open_store(f"file://{tmp_path}/tier")
    with pytest.raises(ValueError, match="illegal object key"):
        store.put(key, b"x")
    with pytest.raises(ValueError, match="illegal object key"):
        store.put_if_absent(key, b"x")
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


# -- errors by code, one retry policy ---------------------------------------------------------


@dataclass
class AuthS3:
    """An S3 endpoint that checks credentials (moto's server with IAM enforced: LocalStack's
    community edition accepts any key): a bucket, and a user with no permission on it."""

    url: str
    bucket: str
    powerless_key: str
    powerless_secret: str


@pytest.fixture(scope="module")
def auth_s3() -> Iterator[AuthS3]:
    import boto3

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # The first three requests are let through unchecked: they set the stage.
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"}
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "moto_server did not start"
                time.sleep(0.2)
        kw = {"endpoint_url": url, "region_name": "us-east-1"}
        creds = {"aws_access_key_id": "AKIASETUP00000000001", "aws_secret_access_key": "x"}
        boto3.client("s3", **kw, **creds).create_bucket(Bucket="tmq-guarded")
        iam = boto3.client("iam", **kw, **creds)
        iam.create_user(UserName="powerless")
        key = iam.create_access_key(UserName="powerless")["AccessKey"]
        yield AuthS3(url, "tmq-guarded", key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        server.terminate()
        server.wait(10)


def watched(url: str, options: dict[str, Any]) -> tuple[ObjectStore, list[float]]:
    """The store at ``url`` under a 5-attempt policy, and the backoffs it slept (one per
    retry)."""
    slept: list[float] = []
    policy = RetryPolicy(attempts=5, base_delay_s=0.01)
    return RetryingObjectStore(FsspecObjectStore(url, options), policy, slept.append), slept


def test_a_missing_bucket_fails_at_once_naming_the_bucket_and_the_fix(s3: Any) -> None:
    missing = f"tmq-missing-{uuid.uuid4().hex[:8]}"
    store, slept = watched(f"s3://{missing}/tier", s3.storage_options())
    with pytest.raises(PermanentStorageError) as raised:
        store.put("c/b/probe", b"x")
    assert slept == [], "a permanent error is never retried"
    message = str(raised.value)
    assert "\n" not in message
    assert f"s3://{missing}" in message and "NoSuchBucket" in message
    assert "create it, or fix tier_url" in message
    with pytest.raises(PermanentStorageError, match="NoSuchBucket"):
        check_writable(store, "c/b")
    # Never mistaken for "no such object" or "nothing listed" either.
    for call in (
        lambda: store.size("c/b/x"),
        lambda: store.get("c/b/x"),
        lambda: store.list("c/"),
        lambda: store.children(""),
        lambda: store.delete("c/b/x"),
    ):
        with pytest.raises(PermanentStorageError, match="NoSuchBucket"):
            call()


def test_unknown_credentials_and_denied_access_fail_at_once_with_their_fix(
    auth_s3: AuthS3,
) -> None:
    cases = [
        ("AKIANOSUCHKEY0000001", "whatever", "InvalidAccessKeyId", "check AWS_ACCESS_KEY_ID"),
        (auth_s3.powerless_key, auth_s3.powerless_secret, "AccessDenied", "s3:PutObject"),
    ]
    for key, secret, code, fix in cases:
        options = {"endpoint_url": auth_s3.url, "key": key, "secret": secret}
        store, slept = watched(f"s3://{auth_s3.bucket}/tier", options)
        with pytest.raises(PermanentStorageError) as raised:
            check_writable(store, "c/b")
        assert slept == [], f"{code} is never retried"
        message = str(raised.value)
        assert message.startswith(f"s3://{auth_s3.bucket}: {code}: "), message
        assert fix in message and "\n" not in message
        assert secret not in message


def test_a_refused_connection_is_transient_even_when_the_url_holds_412(tmp_path: Path) -> None:
    # The old classification matched "412" in the text and took this for "the key exists".
    store, slept = watched(
        "s3://tmq-412/tier", {"endpoint_url": "http://127.0.0.1:1/412", "key": "k", "secret": "s"}
    )
    with pytest.raises(StorageError) as raised:
        store.put_if_absent("c/b/412", b"x")
    assert not isinstance(raised.value, PermanentStorageError)
    assert "failed 5 attempts" in str(raised.value) and len(slept) == 4


def test_transient_failures_are_retried_by_the_one_policy_and_permanent_ones_never(
    tmp_path: Path,
) -> None:
    inner = open_store(f"file://{tmp_path}/tier", retry=RetryPolicy(attempts=1))
    faulty = FaultyObjectStore(inner, failure_rate=0.5, seed=3)
    store = RetryingObjectStore(faulty, RetryPolicy(attempts=20, base_delay_s=0.0))
    for i in range(20):
        assert store.put_if_absent(f"k/{i}", b"x") is True
    assert faulty.injected["503"] > 5, "failures were injected and every call still succeeded"

    calls = []

    class Refusing(FaultyObjectStore):
        def get(self, key: str) -> bytes:
            calls.append(key)
            raise PermanentStorageError("s3://b: AccessDenied: grant …")

    with pytest.raises(PermanentStorageError):
        RetryingObjectStore(Refusing(inner), RetryPolicy(attempts=20, base_delay_s=0.0)).get("k/0")
    assert calls == ["k/0"]


def test_s3_goes_through_botocore_and_answers_every_call_as_s3fs_does(s3: Any, bucket: str) -> None:
    """Decision 330: ``open_store`` serves ``s3://`` with its own botocore client (s3fs costs
    more CPU per byte); every answer of the interface is the one s3fs gives on the same bucket."""
    from tiered.cold.s3 import S3ObjectStore

    url = f"s3://{bucket}/parity"
    ours = open_store(url, s3.storage_options())
    assert isinstance(ours.inner, S3ObjectStore)  # type: ignore[attr-defined]
    theirs = FsspecObjectStore(url, s3.storage_options())
    keys = ["c/b/t/0/a.seg", "c/b/t/0/b.seg", "c/b/t/1/manifest/0001", "c/b/u/0/x", "c/.hidden"]
    for i, key in enumerate(keys):
        assert ours.put_if_absent(key, bytes(range(i + 10))) is True
        assert ours.put_if_absent(key, b"other") is False
    for store in (ours, theirs):
        assert store.list("c/b/") == [ObjectInfo(k, i + 10) for i, k in enumerate(keys[:4])]
        assert list(store.children("")) == ["c"]
        assert list(store.children("c/b/")) == ["t", "u"]
        assert list(store.children("c/b/t/0/")) == ["a.seg", "b.seg"]
        assert list(store.children("nothing/")) == [] and store.list("nothing/") == []
        assert store.size(keys[1]) == 11 and store.size("c/b/none") is None
        assert store.get(keys[2]) == bytes(range(12))
        assert store.get_range(keys[2], 3, 4) == bytes(range(3, 7))
        assert store.get_range(keys[2], 10, 10) == bytes(range(10, 12))  # fewer at the end
        with pytest.raises(ObjectNotFoundError):
            store.get_range("c/b/none", 0, 1)
        with pytest.raises(ObjectNotFoundError):
            store.get("c/b/none")
    ours.put(keys[0], b"replaced")
    assert theirs.get(keys[0]) == b"replaced"
    ours.delete(keys[0])
    ours.delete(keys[0])  # idempotent
    assert theirs.size(keys[0]) is None


# -- ranged GETs without botocore's per-request machinery (decision 770) -----------------------


def _botocore_gets(store: ObjectStore) -> list[str]:
    """The keys of the ``GetObject`` calls botocore's client of ``store`` makes from now on."""
    calls: list[str] = []
    client = store.inner.client  # type: ignore[attr-defined]
    client.meta.events.register(
        "before-call.s3.GetObject", lambda params, **_: calls.append(params["url_path"])
    )
    return calls


def test_ranged_gets_bypass_botocore_and_answer_every_fault_as_it_does(
    fault_proxy: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the fault proxy: the ranged GETs of a cold read go out through the urllib3 pool,
    signed once each, and read the right bytes (also of a key that needs quoting); every fault
    comes out as the same ``ObjectStore`` error botocore's call gave: a 503 and a cut-off body
    transient, a reset transient, a blackhole a timeout within the configured deadline, a
    missing key "not found" (answered by botocore's own call), past the end nothing."""
    options = {
        **S3Endpoint(fault_proxy.url, "proxy").storage_options(),
        "config_kwargs": {"read_timeout": 1, "connect_timeout": 1},
    }
    store = open_store(f"s3://{bucket}/tier", options, RetryPolicy(attempts=1))
    monkeypatch.setenv("TMQ_S3_BOTOCORE_GETS", "1")  # the same store on botocore's path
    reference = open_store(f"s3://{bucket}/tier", options, RetryPolicy(attempts=1))
    assert reference.inner._ranged is None  # type: ignore[attr-defined]
    botocore_gets = _botocore_gets(store)
    data = os.urandom(300_000)
    keys = ["c/b/t/0/00000000000000000000.seg", "c/b/odd key+~é=&.seg"]
    for key in keys:
        assert store.put_if_absent(key, data) is True
    for key in keys:
        assert store.get_range(key, 0, 100) == data[:100]
        assert store.get_range(key, 123_456, 65_536) == data[123_456 : 123_456 + 65_536]
        assert store.get_range(key, 299_990, 100) == data[299_990:]  # fewer at the end
        assert store.get_range(key, 300_000, 10) == b""  # nothing past the end
    assert botocore_gets == [], "ranged GETs went through botocore's client"
    assert store.get(keys[0]) == data  # a whole-object GET stays botocore's (its checksums)
    assert len(botocore_gets) == 1

    with pytest.raises(ObjectNotFoundError):
        store.get_range("c/b/none.seg", 0, 10)
    assert len(botocore_gets) == 2  # the 404, answered by botocore's own call
    assert store.inner._ranged is not None  # type: ignore[attr-defined]  # (a miss is a miss)

    def failure(of: ObjectStore, length: int = 100) -> StorageError:
        started = time.monotonic()
        with pytest.raises(StorageError) as raised:
            of.get_range(keys[0], 0, length)
        assert time.monotonic() - started < 10, "the read deadline (1 s) was not applied"
        assert not isinstance(raised.value, PermanentStorageError), raised.value
        for error in (raised.value, raised.value.__cause__):
            assert "Signature" not in str(error) and "Credential=" not in str(error)
        return raised.value

    fault_proxy.set(error_rate=1.0, error_status=503, methods=["GET"])
    assert "SlowDown" in str(failure(store))
    assert str(failure(store)) == str(failure(reference))  # botocore's words exactly
    fault_proxy.set(error_rate=1.0, error_status=500, methods=["GET"])
    assert str(failure(store)) == str(failure(reference))
    fault_proxy.set(truncate=True, methods=["GET"])
    failure(store, 200_000)
    failure(reference, 200_000)
    fault_proxy.set(reset=True)
    failure(store)
    fault_proxy.set(blackhole=True)
    failure(store)
    counters = fault_proxy.snapshot()["counters"]
    assert counters["truncated"] >= 1 and counters["reset"] >= 1
    fault_proxy.heal()
    assert store.get_range(keys[1], 5, 5) == data[5:10]
    assert len(botocore_gets) == 2


def test_a_ranged_get_refused_where_botocore_succeeds_hands_ranged_gets_to_botocore(
    s3: S3Endpoint, bucket: str
) -> None:
    """A fast path that sends something botocore would not (here: another address; in the field
    a region botocore corrects) answers with botocore's bytes, then leaves ranged GETs to
    botocore rather than pay two requests a read."""
    store = open_store(f"s3://{bucket}/tier", s3.storage_options(), RetryPolicy(attempts=1))
    data = os.urandom(10_000)
    store.put("c/b/k", data)
    botocore_gets = _botocore_gets(store)
    store.inner._ranged.path = f"/not-{bucket}/"  # type: ignore[attr-defined]
    assert store.get_range("c/b/k", 100, 50) == data[100:150]
    assert store.inner._ranged is None  # type: ignore[attr-defined]
    assert len(botocore_gets) == 1
    assert store.get_range("c/b/k", 0, 10) == data[:10]
    assert len(botocore_gets) == 2


def test_ranged_gets_refused_for_credentials_fail_at_once_naming_the_fix(auth_s3: AuthS3) -> None:
    """A ranged GET with an unknown key or without permission is the permanent error botocore's
    call gives (the 403 is handed to it), never retried, the secret nowhere in it."""
    cases = [
        ("AKIANOSUCHKEY0000001", "whatever", "InvalidAccessKeyId", "check AWS_ACCESS_KEY_ID"),
        (auth_s3.powerless_key, auth_s3.powerless_secret, "AccessDenied", "s3:GetObject"),
    ]
    for key, secret, code, fix in cases:
        options = {"endpoint_url": auth_s3.url, "key": key, "secret": secret}
        slept: list[float] = []
        inner = open_store(f"s3://{auth_s3.bucket}/tier", options, RetryPolicy(attempts=1))
        store = RetryingObjectStore(
            inner.inner,  # type: ignore[attr-defined]
            RetryPolicy(attempts=5, base_delay_s=0.01),
            slept.append,
        )
        assert inner.inner._ranged is not None  # type: ignore[attr-defined]
        with pytest.raises(PermanentStorageError) as raised:
            store.get_range("c/b/t/0/x.seg", 0, 100)
        assert slept == [], f"{code} is never retried"
        message = str(raised.value)
        assert message.startswith(f"s3://{auth_s3.bucket}: {code}: "), message
        assert fix in message and secret not in message and "\n" not in message


def test_ranged_gets_over_https_with_a_session_token_read_the_archived_bytes(
    s3: Any, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LocalStack answers HTTPS on its port, with a self-signed certificate for localhost. With
    that certificate as the CA bundle (``AWS_CA_BUNDLE``: the project has no CA setting of its
    own, botocore's decides) and a session token in the credentials, the ranged GETs of a cold
    read go through the urllib3 pool over HTTPS, verified, signed with the token, and read the
    bytes written; botocore's client makes none of them. Without the bundle the certificate is
    refused (the verification is on)."""
    plain = urlsplit(s3.url)
    assert plain.hostname is not None and plain.port is not None
    ca = tmp_path / "localstack.pem"
    ca.write_text(ssl.get_server_certificate((plain.hostname, plain.port)))
    options = {
        "endpoint_url": f"https://localhost:{plain.port}",
        "key": "test",
        "secret": "test",
        "token": "a-session-token",
    }
    monkeypatch.setenv("AWS_CA_BUNDLE", str(ca))
    store = open_store(f"s3://{bucket}/tier", options, RetryPolicy(attempts=1))
    ranged = store.inner._ranged  # type: ignore[attr-defined]
    assert ranged is not None and ranged.prefix.startswith("https://localhost:")
    sent: list[dict[str, str]] = []
    urlopen = ranged.pool.urlopen

    def recording(*args: Any, **kwargs: Any) -> Any:
        sent.append(dict(kwargs["headers"]))
        return urlopen(*args, **kwargs)

    monkeypatch.setattr(ranged.pool, "urlopen", recording)
    botocore_gets = _botocore_gets(store)
    data = os.urandom(3 << 20)
    key = "c/b/t/0/00000000000000000000.seg"
    assert store.put_if_absent(key, data) is True
    for start, length in ((0, 100), (12_345, 2 << 20), (len(data) - 10, 10)):
        assert store.get_range(key, start, length) == data[start : start + length]
    assert len(sent) == 3 and botocore_gets == []
    assert all(h["X-Amz-Security-Token"] == "a-session-token" for h in sent), sent
    assert all("Credential=test/" in h["Authorization"] for h in sent)

    monkeypatch.delenv("AWS_CA_BUNDLE")
    unverified = open_store(f"s3://{bucket}/tier", options, RetryPolicy(attempts=1))
    with pytest.raises(StorageError) as refused:
        unverified.get_range(key, 0, 100)
    assert "certificate" in str(refused.value).lower(), refused.value
