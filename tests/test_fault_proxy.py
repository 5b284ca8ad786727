"""The object-store fault proxy (localstack/fault_proxy.py) does what the fault tests rely on:
a clean pass-through by default, and each fault at the HTTP level, switched from this process
or another one."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    EndpointConnectionError,
    ReadTimeoutError,
)
from conftest import S3Endpoint, load_fault_proxy

from tiered.cold.storage import RetryPolicy, StorageError, open_store

SCRIPT = Path(__file__).resolve().parent.parent / "localstack" / "fault_proxy.py"


def _client(proxy: Any, read_timeout: float = 2.0) -> Any:
    return S3Endpoint(proxy.url, "proxy").client(
        Config(connect_timeout=2, read_timeout=read_timeout, retries={"total_max_attempts": 1})
    )


def test_pass_through_serves_s3_clients_unchanged(fault_proxy: Any, bucket: str) -> None:
    client = _client(fault_proxy)
    client.put_object(Bucket=bucket, Key="a/b", Body=b"x" * 70_000)
    assert client.get_object(Bucket=bucket, Key="a/b")["Body"].read() == b"x" * 70_000
    assert client.head_object(Bucket=bucket, Key="a/b")["ContentLength"] == 70_000
    assert [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]] == ["a/b"]
    # s3fs (aiohttp underneath), which tmq's ObjectStore uses, goes through it as well.
    store = open_store(
        f"s3://{bucket}/tier", S3Endpoint(fault_proxy.url, "proxy").storage_options()
    )
    assert store.put_if_absent("q/1", b"one") is True
    assert store.put_if_absent("q/1", b"two") is False
    assert store.get_range("q/1", 1, 2) == b"ne"
    assert [o.key for o in store.list("q/")] == ["q/1"]
    assert fault_proxy.snapshot()["counters"]["forwarded"] >= 8


def test_blackhole_hangs_requests_until_healed(fault_proxy: Any, bucket: str) -> None:
    client = _client(fault_proxy, read_timeout=1.0)
    client.put_object(Bucket=bucket, Key="k", Body=b"v")
    fault_proxy.set(blackhole=True)
    started = time.monotonic()
    with pytest.raises(ReadTimeoutError):
        client.get_object(Bucket=bucket, Key="k")
    assert time.monotonic() - started >= 0.9
    assert fault_proxy.snapshot()["counters"]["blackholed"] == 1
    fault_proxy.heal()
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"


def test_delay_reset_and_error_faults(fault_proxy: Any, bucket: str) -> None:
    client = _client(fault_proxy)
    client.put_object(Bucket=bucket, Key="k", Body=b"v")
    fault_proxy.set(delay_ms=400)
    started = time.monotonic()
    client.head_object(Bucket=bucket, Key="k")
    assert time.monotonic() - started >= 0.4
    fault_proxy.set(reset=True)
    with pytest.raises((ConnectionClosedError, EndpointConnectionError)):
        client.get_object(Bucket=bucket, Key="k")
    assert fault_proxy.snapshot()["counters"]["reset"] >= 1
    fault_proxy.set(error_rate=1.0, error_status=503)
    with pytest.raises(ClientError) as slow:
        client.get_object(Bucket=bucket, Key="k")
    assert slow.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    # Only the methods named are hit: reads pass while writes fail.
    fault_proxy.set(error_rate=1.0, methods=["PUT"])
    assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"v"
    with pytest.raises(ClientError):
        client.put_object(Bucket=bucket, Key="k2", Body=b"w")
    fault_proxy.heal()
    assert client.list_objects_v2(Bucket=bucket)["KeyCount"] == 1  # k2 was never written


def test_error_after_forward_means_the_write_happened(
    fault_proxy: Any, bucket: str, s3: S3Endpoint
) -> None:
    fault_proxy.set(error_rate=1.0, error_status=500, after_forward=True, methods=["PUT"])
    store = open_store(
        f"s3://{bucket}/tier",
        S3Endpoint(fault_proxy.url, "proxy").storage_options(),
        RetryPolicy(attempts=1),  # tmq's one retry layer, off: the first failure surfaces
    )
    with pytest.raises(StorageError):
        store.put("seg/0", b"payload")
    # The client saw a failure, yet the object is there: the case idempotent writes must survive.
    assert s3.client().get_object(Bucket=bucket, Key="tier/seg/0")["Body"].read() == b"payload"
    counters = fault_proxy.snapshot()["counters"]
    assert counters["error_500_after_forward"] >= 1


def test_another_process_drives_the_proxy_through_its_control_path(
    fault_proxy: Any, bucket: str
) -> None:
    def cli(*args: str) -> str:
        return subprocess.run(
            [sys.executable, str(SCRIPT), *args, fault_proxy.url],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout

    cli("set", "--error-rate", "1", "--error-status", "500")
    assert fault_proxy.settings.error_rate == 1.0 and fault_proxy.settings.error_status == 500
    with pytest.raises(ClientError):
        _client(fault_proxy).head_bucket(Bucket=bucket)
    assert '"error_500": 1' in cli("show")
    cli("heal")
    _client(fault_proxy).head_bucket(Bucket=bucket)
    control = load_fault_proxy().FaultControl(fault_proxy.url)
    with pytest.raises(Exception, match="400"):
        control.set(nonsense=True)


def test_a_served_proxy_process_reports_its_port(tmp_path: Path, s3: S3Endpoint) -> None:
    port_file = tmp_path / "port"
    child = subprocess.Popen(
        [sys.executable, str(SCRIPT), "serve", "--upstream", s3.url, "--port-file", str(port_file)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists() or not port_file.read_text():
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
        control = load_fault_proxy().FaultControl(f"http://127.0.0.1:{port_file.read_text()}")
        assert control.set(delay_ms=5)["settings"]["delay_ms"] == 5
    finally:
        child.terminate()
        child.wait(timeout=10)
