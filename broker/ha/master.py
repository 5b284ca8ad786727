"""The master side of replication: stream the CommitLog to every slave, track what each holds
(the SyncStateSet), and hold SYNC sends until enough replicas have them.

Threads it owns:
- ``tmq-ha-accept``: accepts slave connections; every 200 ms it also re-evaluates the
  SyncStateSet (logging each change) and records the group's confirmed offset in the epoch file;
- per slave, ``tmq-ha-conn-{port}`` (handshake, then reads ACKs) and ``tmq-ha-push-{id}``
  (sends DATA frames: new bytes as soon as they are appended, a heartbeat each second otherwise
  and as soon as the confirmed offset moved while no bytes are due; and the metadata snapshot
  as soon as it changed, at most every ``_METADATA_MIN_S``).
Producers calling ``wait_replicated`` wait on one condition that ACKs notify.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from broker.ha import wire
from broker.ha.config import HaConfig, parse_address
from broker.ha.gate import (
    NotEnoughReplicasError,
    ReplicaLag,
    ReplicatedMetadata,
    ReplicationStatus,
    ReplicationTimeoutError,
)
from broker.ha.link import LinkRefusedError, LinkSecurity
from tiered.epoch_file import EpochFile
from tiered.store import MessageStore

log = logging.getLogger(__name__)

# Bytes per DATA frame, and how far the stream may run ahead of a slave's ACKs.
_CHUNK_BYTES = 1 << 20
_WINDOW_BYTES = 16 << 20
_HEARTBEAT_S = 1.0
# An idle master sends a moved confirmed offset this long after its last frame at the latest
# (under load the next DATA frame carries it sooner, and no heartbeat is added).
_CONFIRM_DELAY_S = 0.01
# Metadata changes (every consumer offset commit is one) are coalesced to one snapshot per this.
_METADATA_MIN_S = 0.05
_HOUSEKEEPING_S = 0.2


def now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclass(slots=True)
class SlaveState:
    """What the master knows of one slave."""

    broker_id: int
    address: str
    acked_offset: int = 0
    # When the slave last held everything the master had (None: never, since it connected).
    caught_up_ms: int | None = None
    connected: bool = True
    # (send time, master max offset then) of DATA frames not yet covered by an ACK.
    sent: deque[tuple[int, int]] = field(default_factory=deque)


class ReplicationMaster:
    def __init__(
        self,
        store: MessageStore,
        epochs: EpochFile,
        config: HaConfig,
        metadata: ReplicatedMetadata | None = None,
        link: LinkSecurity | None = None,
    ) -> None:
        self.store = store
        self.metadata = metadata
        # TLS and authentication of slave connections (broker/ha/link.py).
        self.link = link or LinkSecurity()
        self._tls: ssl.SSLContext | None = None
        self.epochs = epochs
        self.config = config
        self.epoch = 0
        self.port = 0
        self._cond = threading.Condition()
        self._slaves: dict[int, SlaveState] = {}
        self._sockets: dict[int, wire.Connection] = {}
        self._in_sync: frozenset[int] = frozenset()
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        # Bumped by every metadata change; each push thread sends a snapshot when it moved.
        self._metadata_version = 0

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, epoch: int | None = None) -> int:
        """Begin a new epoch at the CommitLog's end, listen for slaves; returns the port.
        ``epoch``: the one the controller handed out (it must exceed every epoch on file);
        None: this node's last epoch plus one (fixed roles, decision 113)."""
        host, port = parse_address(self.config.listen, "listen")
        try:
            listener = socket.create_server((host, port), reuse_port=False)
        except OSError as e:
            raise OSError(
                f"cannot listen for replication on {self.config.listen} ([ha] listen): "
                f"{e.strerror or e}"
            ) from None
        listener.settimeout(_HOUSEKEEPING_S)
        try:
            self._tls = self.link.server_context()
        except (OSError, ssl.SSLError) as e:
            listener.close()
            raise OSError(f"replication TLS ([tls]): {e}") from None
        self.epochs.load()
        end = self.store.max_physical_offset
        self.epochs.truncate_from(end + 1)  # entries past the log: a crash cut the tail
        if not self.epochs.entries and end > self.store.min_physical_offset:
            self.epochs.append(0, self.store.min_physical_offset)  # history from before HA
        self.epoch = max(self.epochs.last_epoch + 1, 1) if epoch is None else epoch
        if self.epoch <= self.epochs.last_epoch:
            listener.close()
            raise ValueError(f"epoch {self.epoch} is not past {self.epochs.last_epoch} on file")
        self.epochs.append(self.epoch, end)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self.store.add_append_listener(self._appended)
        if self.metadata is not None:
            self.metadata.add_change_listener(self._metadata_changed)
        self._spawn(self._accept_loop, "tmq-ha-accept")
        log.info(
            "replication master: epoch %d from offset %d, %s mode (min_in_sync_replicas %d), "
            "slaves connect to %s:%d",
            self.epoch,
            end,
            self.config.mode.upper(),
            self.config.min_in_sync_replicas,
            host,
            self.port,
        )
        return self.port

    def stop(self) -> None:
        self._stop.set()
        if self.metadata is not None:
            self.metadata.remove_change_listener(self._metadata_changed)
        if self._listener is not None:
            self._listener.close()
        with self._cond:
            for sock in self._sockets.values():
                _close(sock)
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=5)

    def _spawn(self, target: object, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    # -- the send path -------------------------------------------------------------------------

    def check_writable(self) -> None:
        """Before a message is stored: under SYNC, refuse when the SyncStateSet (the master
        included) is smaller than min_in_sync_replicas."""
        if self.config.mode != "sync":
            return
        members = len(self.sync_state_set())
        if members < self.config.min_in_sync_replicas:
            raise NotEnoughReplicasError(
                f"{members} of min_in_sync_replicas={self.config.min_in_sync_replicas} replicas "
                "are in sync; the message was not stored"
            )

    def wait_replicated(self, end_offset: int) -> None:
        """After a message is stored: under SYNC, return once min_in_sync_replicas members of the
        SyncStateSet hold every byte below ``end_offset``; raise on timeout."""
        if self.config.mode != "sync":
            return
        deadline = time.monotonic() + self.config.sync_timeout_ms / 1000
        with self._cond:
            while self._holders(end_offset) < self.config.min_in_sync_replicas:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    raise ReplicationTimeoutError(
                        f"only {self._holders(end_offset)} of min_in_sync_replicas="
                        f"{self.config.min_in_sync_replicas} replicas hold the message after "
                        f"{self.config.sync_timeout_ms} ms; it is not acknowledged"
                    )
                self._cond.wait(left)

    def _holders(self, end_offset: int) -> int:
        in_sync = self._evaluate(now_ms())
        return 1 + sum(
            1
            for s in self._slaves.values()
            if s.broker_id in in_sync and s.acked_offset >= end_offset
        )

    def _appended(self, end_offset: int) -> None:
        with self._cond:
            self._cond.notify_all()

    def _metadata_changed(self) -> None:
        with self._cond:
            self._metadata_version += 1
            self._cond.notify_all()

    def _idle_wait(
        self, last_send: float, sent_confirmed: int, metadata_version: int, metadata_at: float
    ) -> float:
        """How long a push thread with no bytes to send may sleep: until its heartbeat, or
        sooner when the confirmed offset or the metadata moved since it last sent them."""
        due = last_send + _HEARTBEAT_S
        if self.confirmed_offset() != sent_confirmed:
            due = min(due, last_send + _CONFIRM_DELAY_S)
        if self.metadata is not None and self._metadata_version != metadata_version:
            due = min(due, metadata_at + _METADATA_MIN_S)
        return max(0.0, due - time.monotonic())

    # -- the SyncStateSet ----------------------------------------------------------------------

    def _evaluate(self, now: int) -> frozenset[int]:
        """Slaves connected and caught up within max_lag_ms (call with the condition held)."""
        lag = self.config.max_lag_ms
        return frozenset(
            s.broker_id
            for s in self._slaves.values()
            if s.connected and s.caught_up_ms is not None and now - s.caught_up_ms <= lag
        )

    def sync_state_set(self) -> list[int]:
        """Broker ids in sync, the master (0) first."""
        with self._cond:
            return [0, *sorted(self._evaluate(now_ms()))]

    def confirmed_offset(self) -> int:
        """SYNC: the highest offset min_in_sync_replicas members hold (the master counts).
        ASYNC acknowledges nothing on the group's behalf: 0, so no replica refuses a cut."""
        if self.config.mode != "sync":
            return 0
        with self._cond:
            in_sync = self._evaluate(now_ms())
            held = sorted(
                [self.store.max_physical_offset]
                + [s.acked_offset for s in self._slaves.values() if s.broker_id in in_sync],
                reverse=True,
            )
        need = self.config.min_in_sync_replicas
        return held[need - 1] if len(held) >= need else 0

    def in_sync_offset(self) -> int:
        """The offset below which every member of the SyncStateSet (the master included) holds
        every byte: Kafka's high watermark. The tier archives only below it, so whichever
        member is elected next (only from the set) holds everything the tier does."""
        with self._cond:
            in_sync = self._evaluate(now_ms())
            return min(
                [self.store.max_physical_offset]
                + [s.acked_offset for s in self._slaves.values() if s.broker_id in in_sync]
            )

    def status(self) -> ReplicationStatus:
        top = self.store.max_physical_offset
        with self._cond:
            slaves = [
                ReplicaLag(
                    s.broker_id,
                    s.address,
                    s.connected,
                    s.acked_offset,
                    max(0, top - s.acked_offset),
                )
                for s in sorted(self._slaves.values(), key=lambda s: s.broker_id)
            ]
        return ReplicationStatus(
            role="master",
            broker_id=0,
            epoch=self.epoch,
            mode=self.config.mode,
            max_offset=top,
            confirmed_offset=self.confirmed_offset(),
            sync_state_set=self.sync_state_set(),
            slaves=slaves,
        )

    def _housekeeping(self) -> None:
        with self._cond:
            now_set = self._evaluate(now_ms())
            if now_set != self._in_sync:
                for joined in sorted(now_set - self._in_sync):
                    log.info("SyncStateSet: slave %d caught up and joined", joined)
                for left in sorted(self._in_sync - now_set):
                    log.warning(
                        "SyncStateSet: slave %d left (disconnected or behind for over %d ms)",
                        left,
                        self.config.max_lag_ms,
                    )
                self._in_sync = now_set
                self._cond.notify_all()
        if self.config.mode == "sync":
            self.epochs.set_confirmed(self.confirmed_offset())

    # -- connections ---------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                sock, peer = self._listener.accept()
            except TimeoutError:
                pass
            except OSError:
                if self._stop.is_set():
                    return
                log.exception("replication listener failed; retrying")
                time.sleep(1)
            else:
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._spawn(self._serve, f"tmq-ha-conn-{peer[1]}", sock, f"{peer[0]}:{peer[1]}")
            try:
                self._housekeeping()
            except Exception:
                log.exception("replication housekeeping failed")

    def _serve(self, raw: socket.socket, address: str) -> None:
        """Handshake with one slave, then read its ACKs while a second thread pushes bytes."""
        state: SlaveState | None = None
        sock: wire.Connection = raw
        try:
            sock = self.link.accept(raw, address, self._tls)
            hello = wire.decode_hello(wire.expect(sock, wire.FrameType.HELLO))
            file_size = self.store.config.commitlog_file_size
            if hello.broker_id <= 0:
                raise wire.ProtocolError(f"slave broker id {hello.broker_id}: slaves are 1 and up")
            if hello.file_size != file_size:
                raise wire.ProtocolError(
                    f"the slave's CommitLog files are {hello.file_size} bytes, the master's "
                    f"{file_size}: physical offsets could not match"
                )
            sock.sendall(
                wire.encode_welcome(
                    wire.Welcome(
                        epoch=self.epoch,
                        min_offset=self.store.min_physical_offset,
                        max_offset=self.store.max_physical_offset,
                        confirmed_offset=self.confirmed_offset(),
                        epochs=self.epochs.entries,
                    )
                )
            )
            start = wire.decode_ack(wire.expect(sock, wire.FrameType.ACK))
            if start < self.store.min_physical_offset or start > self.store.max_physical_offset:
                raise wire.ProtocolError(
                    f"the slave asks for offset {start}; this master holds "
                    f"[{self.store.min_physical_offset}, {self.store.max_physical_offset})"
                )
            state = SlaveState(hello.broker_id, address, acked_offset=start)
            with self._cond:
                old = self._sockets.pop(hello.broker_id, None)
                if old is not None:
                    _close(old)  # the same slave reconnected; its old connection is dead
                self._slaves[hello.broker_id] = state
                self._sockets[hello.broker_id] = sock
            log.info(
                "replication: slave %d at %s connected, streaming from offset %d",
                hello.broker_id,
                address,
                start,
            )
            self._spawn(self._push, f"tmq-ha-push-{hello.broker_id}", sock, state, start)
            while not self._stop.is_set():
                acked = wire.decode_ack(wire.expect(sock, wire.FrameType.ACK))
                self._on_ack(state, acked)
        except LinkRefusedError:
            pass  # logged and answered by the link
        except (OSError, wire.ProtocolError) as e:
            if not self._stop.is_set():
                log.warning("replication: connection from %s ended: %s", address, e)
                if isinstance(e, wire.ProtocolError) and "peer:" not in str(e):
                    with contextlib.suppress(OSError):
                        sock.sendall(wire.encode_error(str(e)))
        finally:
            _close(sock)
            if state is not None:
                with self._cond:
                    state.connected = False
                    if self._sockets.get(state.broker_id) is sock:
                        del self._sockets[state.broker_id]
                    self._cond.notify_all()

    def _on_ack(self, state: SlaveState, acked: int) -> None:
        with self._cond:
            state.acked_offset = max(state.acked_offset, acked)
            while state.sent and state.sent[0][1] <= state.acked_offset:
                state.caught_up_ms = state.sent.popleft()[0]
            self._cond.notify_all()

    def _push(self, sock: wire.Connection, state: SlaveState, offset: int) -> None:
        last_send = 0.0
        sent_metadata = b""
        metadata_at = 0.0
        metadata_version = -1  # of the last snapshot sent
        sent_confirmed = -1
        try:
            while not self._stop.is_set() and state.connected:
                if (
                    self.metadata is not None
                    and metadata_version != self._metadata_version
                    and time.monotonic() - metadata_at >= _METADATA_MIN_S
                ):
                    metadata_version = self._metadata_version
                    document = json.dumps(self.metadata.snapshot(), sort_keys=True).encode()
                    if document != sent_metadata:
                        sock.sendall(wire.encode_metadata(document))
                        sent_metadata = document
                    metadata_at = time.monotonic()
                top = self.store.max_physical_offset
                payload = b""
                if offset < top and offset - state.acked_offset < _WINDOW_BYTES:
                    epoch, boundary = self.epochs.epoch_at(offset)
                    limit = (
                        _CHUNK_BYTES if boundary is None else min(_CHUNK_BYTES, boundary - offset)
                    )
                    chunk = self.store.read_commitlog(offset, limit)
                    if chunk is None:
                        raise wire.ProtocolError(
                            f"offset {offset} is no longer on the master (released); "
                            "rebuild this slave from a copy of the master's data"
                        )
                    payload = chunk
                else:
                    epoch = self.epoch
                    with self._cond:
                        if self.store.max_physical_offset == top and not self._stop.is_set():
                            self._cond.wait(
                                self._idle_wait(
                                    last_send, sent_confirmed, metadata_version, metadata_at
                                )
                            )
                    since = time.monotonic() - last_send
                    if since < _HEARTBEAT_S and (
                        since < _CONFIRM_DELAY_S or self.confirmed_offset() == sent_confirmed
                    ):
                        continue
                sent_at = now_ms()
                sent_confirmed = self.confirmed_offset()
                frame = wire.Data(epoch, offset, top, sent_confirmed, payload)
                with self._cond:
                    state.sent.append((sent_at, top))
                    if len(state.sent) > 4096:
                        state.sent.popleft()
                sock.sendall(wire.encode_data_header(frame))
                if payload:
                    sock.sendall(payload)
                offset += len(payload)
                last_send = time.monotonic()
        except Exception as e:  # whatever stops the stream closes the connection; it reconnects
            if not self._stop.is_set():
                log.warning("replication: stream to slave %d stopped: %s", state.broker_id, e)
                if isinstance(e, wire.ProtocolError):
                    with contextlib.suppress(OSError):
                        sock.sendall(wire.encode_error(str(e)))
            _close(sock)


def _close(sock: wire.Connection) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
