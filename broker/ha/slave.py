"""The slave side of replication: connect to the master, align the CommitLog with it (cutting a
tail the master never had), then append its bytes at the same physical offsets and ACK them.

Threads it owns: ``tmq-ha-slave``, which connects (to ``[ha] master``, or to each of ``peers``
until one answers as master), runs one session, and reconnects a second after any failure; and
``tmq-ha-confirm``, which records the confirmed offset the master sends (two fsyncs per write,
kept off the path every SYNC send waits for).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable

from broker.ha import wire
from broker.ha.config import HaConfig, parse_address
from broker.ha.gate import NotMasterError, ReplicatedMetadata, ReplicationStatus
from broker.ha.link import LinkSecurity
from tiered.epoch_file import EpochFile, TruncationRefusedError, consistent_point
from tiered.store import MessageStore

log = logging.getLogger(__name__)

_RETRY_S = 1.0
_CONFIRM_SAVE_S = 0.2


class ReplicationSlave:
    def __init__(
        self,
        store: MessageStore,
        epochs: EpochFile,
        config: HaConfig,
        metadata: ReplicatedMetadata | None = None,
        on_metadata: Callable[[], None] | None = None,
        link: LinkSecurity | None = None,
    ) -> None:
        self.store = store
        # TLS and authentication towards the master (broker/ha/link.py).
        self.link = link or LinkSecurity()
        # Replaced by the master's topics, groups and offsets whenever it sends them; then
        # ``on_metadata`` (the broker re-registers its topics).
        self.metadata = metadata
        self.on_metadata = on_metadata
        self.epochs = epochs
        self.config = config
        self.master_address: str | None = None
        self.master_epoch = 0
        self.master_max_offset = 0
        self.connected = False
        # Why the last session ended (for status and tests); None while none has failed.
        self.last_error: str | None = None
        self._master_epochs: dict[int, int] = {}
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        # The confirmed offset to record next, handed from the session to ``tmq-ha-confirm``.
        self._confirm_to = 0
        self._confirm_due = threading.Event()
        self._confirm_thread: threading.Thread | None = None

    def start(self) -> None:
        self.store.set_replica(True)
        self.epochs.load()
        self.epochs.truncate_from(self.store.max_physical_offset + 1)
        self._thread = threading.Thread(target=self._run, name="tmq-ha-slave", daemon=True)
        self._thread.start()
        self._confirm_thread = threading.Thread(
            target=self._save_confirmed, name="tmq-ha-confirm", daemon=True
        )
        self._confirm_thread.start()

    def stop(self) -> None:
        self._stop.set()
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._confirm_due.set()
        if self._confirm_thread is not None:
            self._confirm_thread.join(timeout=10)

    @property
    def confirmed_offset(self) -> int:
        """What the group acknowledged, as far as this slave knows: recorded, or on its way."""
        return max(self.epochs.confirmed_offset, self._confirm_to)

    def _save_confirmed(self) -> None:
        """Record each confirmed offset the session hands over (the latest, when several came
        during one write), and the last one at stop."""
        while True:
            self._confirm_due.wait()
            self._confirm_due.clear()
            try:
                self.epochs.set_confirmed(self._confirm_to)
            except OSError:
                log.exception("replication: cannot record the confirmed offset")
            if self._stop.is_set():
                return

    def check_writable(self) -> None:
        raise NotMasterError(
            f"broker id {self.config.broker_id} is a slave of "
            f"{self.master_address or 'its master'}; send to the master"
        )

    def wait_replicated(self, end_offset: int) -> None:
        raise NotMasterError("a slave acknowledges no sends")

    def status(self) -> ReplicationStatus:
        top = self.store.max_physical_offset
        return ReplicationStatus(
            role="slave",
            broker_id=self.config.broker_id,
            epoch=self.master_epoch,
            mode=self.config.mode,
            max_offset=top,
            confirmed_offset=self.confirmed_offset,
            sync_state_set=[],
            slaves=[],
            master=self.master_address,
            connected=self.connected,
            lag_bytes=max(0, self.master_max_offset - top),
            last_error=self.last_error,
        )

    def _candidates(self) -> list[str]:
        if self.config.master:
            return [self.config.master]
        return [p for p in self.config.peers if p != self.config.listen]

    def _run(self) -> None:
        while not self._stop.is_set():
            for address in self._candidates():
                if self._stop.is_set():
                    return
                host, port = parse_address(address, "master")
                try:
                    sock = socket.create_connection((host, port), timeout=5)
                except OSError as e:
                    log.debug("replication: %s does not answer: %s", address, e)
                    continue
                self._sock = sock
                try:
                    self._session(sock, address)
                except Exception as e:  # never die silently: log, and reconnect in a second
                    if not self._stop.is_set():
                        self.last_error = str(e)
                        log.warning("replication from %s stopped: %s", address, e)
                        if not isinstance(e, OSError | wire.ProtocolError):
                            with contextlib.suppress(OSError):
                                sock.sendall(wire.encode_error(str(e)))
                finally:
                    self.connected = False
                    self._sock = None
                    sock.close()
            self._stop.wait(_RETRY_S)

    def _session(self, raw: socket.socket, address: str) -> None:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = self.link.connect(raw, parse_address(address, "master")[0])
        store = self.store
        sock.sendall(
            wire.encode_hello(
                wire.Hello(
                    broker_id=self.config.broker_id,
                    file_size=store.config.commitlog_file_size,
                    max_offset=store.max_physical_offset,
                    confirmed_offset=self.confirmed_offset,
                    epochs=self.epochs.entries,
                )
            )
        )
        welcome = wire.decode_welcome(wire.expect(sock, wire.FrameType.WELCOME))
        self._master_epochs = {e.epoch: e.start_offset for e in welcome.epochs}
        raw.settimeout(None)
        start = self._align(welcome)
        sock.sendall(wire.encode_ack(start))
        self.master_address = address
        self.master_epoch = welcome.epoch
        self.connected = True
        self.last_error = None
        log.info(
            "replication: following master %s (epoch %d) from offset %d",
            address,
            welcome.epoch,
            start,
        )
        saved_at = 0.0
        frames = wire.FrameReader(sock)
        while not self._stop.is_set():
            kind, body = frames.read()
            if kind is wire.FrameType.METADATA:
                if self.metadata is not None:
                    self.metadata.replace(json.loads(bytes(body)))
                    if self.on_metadata is not None:
                        self.on_metadata()
                continue
            if kind is not wire.FrameType.DATA:
                raise wire.ProtocolError(f"expected DATA, got {kind.name}")
            data = wire.decode_data(body)
            self.master_max_offset = data.master_max_offset
            self.master_epoch = max(self.master_epoch, data.epoch)
            if data.payload:
                if data.epoch != self.epochs.last_epoch:
                    if data.epoch < self.epochs.last_epoch:
                        raise wire.ProtocolError(
                            f"bytes of epoch {data.epoch} after epoch {self.epochs.last_epoch}"
                        )
                    self.epochs.append(data.epoch, self._epoch_start(data.epoch, data.offset))
                store.append_replicated(data.offset, data.payload)
            top = store.max_physical_offset
            sock.sendall(wire.encode_ack(top))
            # A heartbeat (no bytes) is rare, and carries a confirmed offset that just moved.
            if not data.payload or time.monotonic() - saved_at >= _CONFIRM_SAVE_S:
                # What the group acknowledged and this slave holds: never to be truncated.
                # Recorded by tmq-ha-confirm: its fsyncs would hold up the next frame.
                self._confirm_to = max(self._confirm_to, min(data.confirmed_offset, top))
                self._confirm_due.set()
                saved_at = time.monotonic()

    def _epoch_start(self, epoch: int, offset: int) -> int:
        """Where ``epoch`` starts, for this slave's epoch file: the master's start of it, even
        when this slave's log begins later (an empty slave starts at the master's first file),
        so that both files name the epoch alike."""
        start = self._master_epochs.get(epoch, offset)
        entries = self.epochs.entries
        floor = entries[-1].start_offset if entries else 0
        return start if floor <= start <= offset else offset

    def _align(self, welcome: wire.Welcome) -> int:
        """Where this slave's CommitLog and the master's agree; cut what lies past it."""
        store = self.store
        mine, my_max = self.epochs.entries, store.max_physical_offset
        empty = my_max == store.min_physical_offset
        point = consistent_point(mine, my_max, welcome.epochs, welcome.max_offset)
        if point is None:
            if not empty:
                raise TruncationRefusedError(
                    f"this slave's CommitLog [{store.min_physical_offset}, {my_max}) shares no "
                    "epoch with the master's; refusing to discard it. Move the data dir aside "
                    "to start this slave empty."
                )
            start = welcome.min_offset
        else:
            start = point
        if start < my_max:
            confirmed = self.confirmed_offset
            if start < confirmed:
                raise TruncationRefusedError(
                    f"the master shares this slave's CommitLog only up to offset {start}, but "
                    f"the group acknowledged messages up to {confirmed} (SYNC); refusing to "
                    "truncate acknowledged messages"
                )
            log.warning(
                "replication: this slave's CommitLog diverged from the master's at offset %d "
                "(epoch entries %s vs the master's %s); cutting %d bytes",
                start,
                mine,
                welcome.epochs,
                my_max - start,
            )
            self.epochs.truncate_from(start)
            store.truncate_to(start)
        if start < welcome.min_offset or (point is None and not empty):
            raise wire.ProtocolError(
                f"this slave ends at {start}, but the master keeps only "
                f"[{welcome.min_offset}, {welcome.max_offset}): too far behind to catch up"
            )
        return start
