from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import process_logs
import pytest
from hypothesis import settings
from s3_buckets import bucket_name, delete_bucket, leftover_buckets, run_id

from tiered.config import StoreConfig
from tiered.record import BLANK_MAGIC_CODE, StoredMessage, decode, read_total_and_magic
from tiered.store import MessageStore

# Property tests check what an engine returns, never how fast: hypothesis's default 200 ms
# deadline per example fails them on a shared 2-core machine at load 15 (seen in CI runs).
settings.register_profile("tmq", deadline=None)
settings.load_profile("tmq")

TESTS = Path(__file__).resolve().parent
SMALL = json.loads((TESTS / "store_sizes.json").read_text())
CHILD = TESTS / "store_child.py"


@pytest.fixture
def small_config(tmp_path: Path) -> StoreConfig:
    """A store with tiny files, so a few hundred messages roll many of them."""
    return StoreConfig(data_dir=tmp_path / "store", **SMALL)


@pytest.fixture
def start_store() -> Iterator[Callable[[StoreConfig], MessageStore]]:
    """Start MessageStores and shut every one down at the end of the test, whatever happens
    (not ``tiered.cold.storage.open_store``, which opens an object store)."""
    opened: list[MessageStore] = []

    def _open(config: StoreConfig) -> MessageStore:
        store = MessageStore(config)
        store.start()
        opened.append(store)
        return store

    yield _open
    for store in opened:
        store.shutdown()


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` (``mount -o size=``) mounted at the new directory ``mnt`` for
    the block; the test is skipped where that needs root or is refused."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mount -t tmpfs is refused here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def run_child(data_dir: Path, mode: str, flush: str, *args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(data_dir), mode, flush, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def crash_after_writing(data_dir: Path, count: int, flush: str = "async", seed: int = 7) -> None:
    """Write ``count`` messages in a child that then dies without shutting down."""
    child = run_child(data_dir, "write-and-crash", flush, count, seed)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0 and "done" in out, err


def brute_force_scan(commitlog_dir: Path) -> list[StoredMessage]:
    """Every record in the CommitLog files, read straight from disk with the codec alone."""
    out: list[StoredMessage] = []
    for path in sorted(commitlog_dir.iterdir()):
        data = path.read_bytes()
        pos = 0
        while pos + 8 <= len(data):
            total, magic = read_total_and_magic(data, pos)
            if magic == BLANK_MAGIC_CODE or total == 0:
                break
            msg = decode(data, pos)
            assert msg.commitlog_offset == int(path.name) + pos
            out.append(msg)
            pos += total
    return out


# -- the logs of the servers a test started ---------------------------------------------------


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A new test: the servers the harnesses track (tests/process_logs.py) are its own."""
    process_logs.clear()


_LOGS_SHOWN = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test's report ends with the last lines of every server log it tracked (its
    brokers', NameServers', etcd's), secrets scrubbed: what a failure seen once under load
    needs to be explained. Read before the fixtures' teardown stops the servers; once per test
    (a teardown that fails after the call did adds nothing new)."""
    report = yield
    if report.failed and not item.stash.get(_LOGS_SHOWN, False):
        item.stash[_LOGS_SHOWN] = True
        for title, text in process_logs.tails():
            report.sections.append((title, text))
    return report


# -- S3 ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    kind: str  # "localstack" or "moto"

    def client(self, config: Any = None) -> Any:
        """A boto3 S3 client; ``config``: a ``botocore.config.Config`` (timeouts, retries)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
            config=config,
        )

    def storage_options(self) -> dict[str, Any]:
        return {"endpoint_url": self.url, "key": "test", "secret": "test"}

    def env(self) -> dict[str, str]:
        """The standard AWS variables a child process (a broker) finds this endpoint by."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }


def _load_localstack_manager() -> Any:
    spec = importlib.util.spec_from_file_location(
        "tmq_localstack_manage", TESTS.parent / "localstack" / "manage.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Endpoint]:
    """S3 for the suite: LocalStack in host mode (localstack/manage.py). Where no Python 3.12+
    exists to run it, moto's server stands in and says so; with TMQ_REQUIRE_LOCALSTACK=1
    (as .ci/run sets) that is a failure instead."""
    manage = _load_localstack_manager()
    try:
        started = manage.start()
    except manage.LocalStackUnavailable as e:
        if os.environ.get("TMQ_REQUIRE_LOCALSTACK") == "1":
            pytest.fail(f"LocalStack is required (TMQ_REQUIRE_LOCALSTACK=1) but unavailable: {e}")
        warnings.warn(f"LocalStack unavailable ({e}); using moto's server instead", stacklevel=1)
        from moto.server import ThreadedMotoServer

        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        yield S3Endpoint(f"http://127.0.0.1:{port}", "moto")
        server.stop()
        return
    if started:
        # Other workers use it too, and the check for buckets left behind needs it: the
        # controlling process stops it when all are done.
        STARTED_BY_TESTS.touch()
    S3_USED.touch()
    yield S3Endpoint(manage.endpoint(), "localstack")


STARTED_BY_TESTS = TESTS.parent / "localstack" / ".run" / "started-by-tests"
# Touched by the first test of this run that uses LocalStack: the check for buckets left
# behind runs only then (a run without S3 does not even import boto3 for it).
S3_USED = Path(tempfile.gettempdir()) / f"tmq-s3-used-{run_id()}"


def pytest_configure(config: pytest.Config) -> None:
    """The run id every bucket of this run is named with (tests/s3_buckets.py), set in the
    controlling process before it starts the xdist workers that inherit it."""
    run_id()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In the controlling process (or a run without workers): fail the run if it left a
    bucket of its own in LocalStack (and delete it), then stop the LocalStack this run
    started."""
    if hasattr(session.config, "workerinput"):
        return
    if S3_USED.exists():
        S3_USED.unlink()
        client = S3Endpoint(_load_localstack_manager().endpoint(), "localstack").client()
        left = leftover_buckets(client)
        for name in left:
            delete_bucket(client, name)
        if left:
            reporter = session.config.pluginmanager.get_plugin("terminalreporter")
            line = f"FAILED: the suite left {len(left)} bucket(s) in LocalStack: {', '.join(left)}"
            if reporter is not None:
                reporter.ensure_newline()
                reporter.write_line(line, red=True)
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if STARTED_BY_TESTS.exists():
        STARTED_BY_TESTS.unlink()
        _load_localstack_manager().stop()


def load_fault_proxy() -> Any:
    """``localstack/fault_proxy.py`` (a script, not a package), loaded once."""
    module = sys.modules.get("tmq_fault_proxy")
    if module is None:
        spec = importlib.util.spec_from_file_location(
            "tmq_fault_proxy", TESTS.parent / "localstack" / "fault_proxy.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["tmq_fault_proxy"] = module  # dataclasses resolve their module by name
        spec.loader.exec_module(module)
    return module


@pytest.fixture
def fault_proxy(s3: S3Endpoint) -> Iterator[Any]:
    """A fault-injecting HTTP proxy (localstack/fault_proxy.py) in front of the test S3; use
    ``S3Endpoint(proxy.url, ...)`` to talk through it. Stopped (and healed) at the end."""
    proxy = load_fault_proxy().FaultProxy(s3.url, seed=1).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def bucket(s3: S3Endpoint) -> Iterator[str]:
    """A fresh bucket, emptied and deleted at the end: LocalStack keeps every object in memory
    until it stops, and a full run's buckets once grew it until the machine ran out of memory."""
    name = bucket_name("b")
    client = s3.client()
    client.create_bucket(Bucket=name)
    yield name
    try:
        delete_bucket(client, name)
    except Exception as e:  # the check at the session's end reports it and deletes it
        print(f"bucket {name} left behind: {e!r}")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- Spark ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One Spark session (local[2], UTC, UI off) for the whole suite: starting one takes ~9 s."""
    from lakehouse.spark import spark_session

    session = spark_session("local[2]", "tmq-tests")
    yield session
    session.stop()


# -- scheduling -------------------------------------------------------------------------------

# Seconds each test file took in a CI run (tests/file_seconds.py writes it from a JUnit report).
FILE_SECONDS: dict[str, float] = json.loads((TESTS / "file_seconds.json").read_text())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest test files first, each file's tests in their own order. xdist's
    ``--dist loadfile`` hands whole files to its workers in collection order (with
    ``--no-loadscope-reorder``; by default it orders them by their number of tests, which put
    the torture and the README's fresh clone, two or three long tests each, last): the long
    files then run side by side from the start, and the short ones fill the gaps, instead of
    one long file running alone at the end while the other worker waits. A file not in the
    table counts as short. The order decides only when a file runs, never what it asserts."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.nodeid.split("::")[0], 0.0))
