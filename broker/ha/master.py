"""The master side of replication: stream the CommitLog to every slave, track what each holds
(the SyncStateSet), and hold SYNC sends until enough replicas have them.

Threads it owns:
- ``tmq-ha-accept``: accepts slave connections; every 200 ms it also re-evaluates the
  SyncStateSet (logging each change) and records the group's confirmed offset in the epoch file;
- per slave, ``tmq-ha-conn-{port}`` (handshake, then reads ACKs) and ``tmq-ha-push-{id}``
  (sends DATA frames: new bytes as soon as they are appended, a heartbeat each second otherwise
  and as soon as the confirmed offset moved while no bytes are due; and the metadata snapshot
  as soon as it changed, at most every ``_METADATA_MIN_S``).
Producers calling ``wait_replicated`` wait each on its own lock, in a heap by offset; an ACK
computes the offset the group holds once and releases every waiter below it in one pass
(RocketMQ's GroupTransferService), instead of waking every waiter to count holders itself.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
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
# A SYNC producer ships new bytes itself only to a slave this close to the stream's end.
_INLINE_WINDOW_BYTES = 1 << 20
_HEARTBEAT_S = 1.0
# An idle master sends a moved confirmed offset this long after its last frame at the latest
# (under load the next DATA frame carries it sooner, and no heartbeat is added).
_CONFIRM_DELAY_S = 0.01
# Metadata changes (every consumer offset commit is one) are coalesced to one snapshot per this.
_METADATA_MIN_S = 0.05
_HOUSEKEEPING_S = 0.2
# Under SYNC a master's dispatcher lets appends gather this long before a pass (1 ms by default):
# a send already waits a replication round trip, and a pass's fixed cost, shared by four times
# the records, is CPU that round trip needs on a loaded machine (decision 370).
_SYNC_DISPATCH_COALESCE_S = 0.004
_DISPATCH_COALESCE_S = 0.001


def now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclass(slots=True)
class SlaveState:
    """What the master knows of one slave."""

    broker_id: int
    address: str
    sock: wire.Connection
    acked_offset: int = 0
    # When the slave last held everything the master had (None: never, since it connected).
    caught_up_ms: int | None = None
    connected: bool = True
    # (send time, master max offset then) of DATA frames not yet covered by an ACK.
    sent: deque[tuple[int, int]] = field(default_factory=deque)
    # The stream: every byte below ``next_offset`` was sent, but for ``pending`` (the tail of
    # a frame a producer could not send without waiting). Whoever writes to the socket (the
    # push thread, or a SYNC producer shipping its bytes at once) holds ``send_lock``.
    next_offset: int = 0
    pending: bytes = b""
    sent_at: float = 0.0  # monotonic time of the last DATA frame
    sent_confirmed: int = -1  # the confirmed offset the last DATA frame carried
    inline: bool = True
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    # The push thread sleeps for more than ``_CONFIRM_DELAY_S`` (an ACK must wake it).
    dozing: bool = False
    # Set by a SYNC producer that found ``send_lock`` taken: whoever holds it ships again after
    # releasing it, so the producer's bytes leave without waking the push thread.
    ship_due: bool = False


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
        # SYNC sends waiting for replicas: (end offset, sequence, a lock held until released);
        # and the offset below which min_in_sync_replicas members of the SyncStateSet held
        # every byte when last computed (it only grows within a term).
        self._waiters: list[tuple[int, int, threading.Lock]] = []
        self._waiter_seq = itertools.count()
        self._replicated = 0
        # Per producer thread, from ``check_writable`` to the end of ``wait_replicated``: the
        # end of what it appended (the store calls ``_appended`` in the appending thread), so
        # that a send waits for its own bytes, not for those appended after them by others.
        self._local = threading.local()
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
        if self._ships_inline():
            self.store.set_dispatch_coalescing(_SYNC_DISPATCH_COALESCE_S)
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
        self.store.set_dispatch_coalescing(_DISPATCH_COALESCE_S)
        if self.metadata is not None:
            self.metadata.remove_change_listener(self._metadata_changed)
        if self._listener is not None:
            self._listener.close()
        with self._cond:
            for sock in self._sockets.values():
                _close(sock)
            for _, _, waiter in self._waiters:
                waiter.release()  # they see the stop and fail
            self._waiters.clear()
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
        self._local.end = 0  # this thread's appends are recorded until it waits
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
        SyncStateSet hold every byte below ``end_offset``, or below the end of what this thread
        appended since its ``check_writable`` when that is known; raise on timeout."""
        own = getattr(self._local, "end", None)
        self._local.end = None
        if own:
            end_offset = own
        if self.config.mode != "sync" or self.config.min_in_sync_replicas <= 1:
            return
        # Ship first, even when enough replicas already hold the bytes: the append woke no push
        # thread (``_appended``), and a slave beyond min_in_sync_replicas may still lack them.
        self._ship_now()
        if self._replicated >= end_offset:  # only grows: no lock needed to see it is enough
            return
        waiter = threading.Lock()
        waiter.acquire()
        with self._cond:
            if self._replicated >= end_offset:
                return
            heapq.heappush(self._waiters, (end_offset, next(self._waiter_seq), waiter))
        if waiter.acquire(timeout=self.config.sync_timeout_ms / 1000) and not self._stop.is_set():
            return
        with self._cond:
            if self._replicated >= end_offset and not self._stop.is_set():
                return  # released just as the wait timed out
            if any(w[2] is waiter for w in self._waiters):  # not released: stop waiting
                self._waiters = [w for w in self._waiters if w[2] is not waiter]
                heapq.heapify(self._waiters)
            holders = self._holders(end_offset)
        raise ReplicationTimeoutError(
            f"only {holders} of min_in_sync_replicas={self.config.min_in_sync_replicas} "
            f"replicas hold the message after {self.config.sync_timeout_ms} ms; it is not "
            "acknowledged"
        )

    def _release(self) -> None:
        """Recompute the offset min_in_sync_replicas members hold and release every waiter
        below it (call with the condition held)."""
        in_sync = self._evaluate(now_ms())
        held = sorted(
            (s.acked_offset for s in self._slaves.values() if s.broker_id in in_sync),
            reverse=True,
        )
        need = self.config.min_in_sync_replicas - 1  # slaves besides the master
        if need < 1 or len(held) < need or held[need - 1] <= self._replicated:
            return
        self._replicated = offset = held[need - 1]
        waiters = self._waiters
        while waiters and waiters[0][0] <= offset:
            heapq.heappop(waiters)[2].release()

    def _holders(self, end_offset: int) -> int:
        in_sync = self._evaluate(now_ms())
        return 1 + sum(
            1
            for s in self._slaves.values()
            if s.broker_id in in_sync and s.acked_offset >= end_offset
        )

    def _appended(self, end_offset: int) -> None:
        own = getattr(self._local, "end", None)
        if own is not None:
            self._local.end = max(own, end_offset)
            if self._ships_inline():
                return  # the producer ships its bytes itself (``_ship_now``), waking no one
        with self._cond:
            self._cond.notify_all()

    def _ships_inline(self) -> bool:
        """Whether a producer's ``wait_replicated`` ships its own bytes (SYNC with replicas)."""
        return self.config.mode == "sync" and self.config.min_in_sync_replicas > 1

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
        with self._cond:
            return self._confirmed_locked()

    def _confirmed_locked(self) -> int:
        """``confirmed_offset``, with the condition held."""
        if self.config.mode != "sync":
            return 0
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
            self._release()
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
            state = SlaveState(
                hello.broker_id,
                address,
                sock,
                acked_offset=start,
                next_offset=start,
                # Sends without waiting need a plain socket (MSG_DONTWAIT).
                inline=type(sock) is socket.socket,
            )
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
            self._spawn(self._push, f"tmq-ha-push-{hello.broker_id}", sock, state)
            frames = wire.FrameReader(sock)
            while not self._stop.is_set():
                kind, body = frames.read()
                if kind is not wire.FrameType.ACK:
                    raise wire.ProtocolError(f"expected ACK, got {kind.name}")
                self._on_ack(state, wire.decode_ack(body))
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
            self._release()
            # The push thread wakes by itself within _CONFIRM_DELAY_S; an ACK wakes it only
            # from a longer sleep (to send the moved confirmed offset) or into a reopened window.
            if state.dozing or self._sendable(state, _WINDOW_BYTES):
                self._cond.notify_all()

    def _push(self, sock: wire.Connection, state: SlaveState) -> None:
        sent_metadata = b""
        metadata_at = 0.0
        metadata_version = -1  # of the last snapshot sent
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
                        with state.send_lock:
                            self._send_pending(state)
                            sock.sendall(wire.encode_metadata(document))
                        sent_metadata = document
                    metadata_at = time.monotonic()
                with state.send_lock:
                    shipped = self._ship(state, block=True)
                if shipped:
                    continue
                with self._cond:
                    # The first heartbeat goes at once: a slave that connects caught up joins the
                    # SyncStateSet with its ACK, not a second later (a failover waits for that).
                    idle = not state.pending and not self._sendable(state, _WINDOW_BYTES)
                    if idle and not self._stop.is_set():
                        wait = self._idle_wait(
                            state.sent_at, state.sent_confirmed, metadata_version, metadata_at
                        )
                        if wait > 0:
                            state.dozing = wait > _CONFIRM_DELAY_S
                            self._cond.wait(wait)
                            state.dozing = False
                since = time.monotonic() - state.sent_at
                if since < _HEARTBEAT_S and (
                    since < _CONFIRM_DELAY_S or self.confirmed_offset() == state.sent_confirmed
                ):
                    continue
                with state.send_lock:
                    self._send_pending(state)
                    top = self.store.max_physical_offset
                    self._send_frame(
                        state, wire.Data(self.epoch, state.next_offset, top, 0, b""), top, True
                    )
        except Exception as e:  # whatever stops the stream closes the connection; it reconnects
            if not self._stop.is_set():
                log.warning("replication: stream to slave %d stopped: %s", state.broker_id, e)
                if isinstance(e, wire.ProtocolError):
                    with contextlib.suppress(OSError):
                        sock.sendall(wire.encode_error(str(e)))
            _close(sock)

    def _sendable(self, state: SlaveState, window: int) -> bool:
        offset = state.next_offset
        return offset < self.store.max_physical_offset and offset - state.acked_offset < window

    def _ship(self, state: SlaveState, *, block: bool) -> bool:
        """Send the slave one DATA frame of the bytes it has not been sent, if any and if the
        window allows; False when there was nothing to send. With ``block`` False (a producer
        shipping at once) the frame goes out only as far as the socket takes it without
        waiting; the push thread sends the rest. Call with ``state.send_lock`` held."""
        if state.pending:
            if not block:
                return False
            self._send_pending(state)
        if not self._sendable(state, _WINDOW_BYTES if block else _INLINE_WINDOW_BYTES):
            return False
        offset = state.next_offset
        top = self.store.max_physical_offset
        epoch, boundary = self.epochs.epoch_at(offset)
        limit = _CHUNK_BYTES if boundary is None else min(_CHUNK_BYTES, boundary - offset)
        chunk = self.store.read_commitlog(offset, limit)
        if chunk is None:
            raise wire.ProtocolError(
                f"offset {offset} is no longer on the master (released); "
                "rebuild this slave from a copy of the master's data"
            )
        if not chunk:
            return False
        self._send_frame(state, wire.Data(epoch, offset, top, 0, chunk), top, block)
        return True

    def _send_frame(self, state: SlaveState, frame: wire.Data, top: int, block: bool) -> None:
        """Send one DATA frame (its confirmed offset filled in here) and advance the stream."""
        with self._cond:
            confirmed = self._confirmed_locked()
            state.sent.append((now_ms(), top))
            if len(state.sent) > 4096:
                state.sent.popleft()
        frame = wire.Data(
            frame.epoch, frame.offset, frame.master_max_offset, confirmed, frame.payload
        )
        state.sent_confirmed = confirmed
        header = wire.encode_data_header(frame)
        sock = state.sock
        if block:
            sock.sendall(header)
            if frame.payload:
                sock.sendall(frame.payload)
        else:
            assert isinstance(sock, socket.socket)  # ``inline`` is set for plain sockets only
            size = len(header) + len(frame.payload)
            try:  # header and records in one call, without joining them
                done = sock.sendmsg([header, frame.payload], [], socket.MSG_DONTWAIT)
            except BlockingIOError:
                done = 0
            if done < size:
                state.pending = (header + frame.payload)[done:]
                with self._cond:
                    self._cond.notify_all()  # the push thread sends the rest
        state.next_offset = frame.offset + len(frame.payload)
        state.sent_at = time.monotonic()

    def _send_pending(self, state: SlaveState) -> None:
        if state.pending:
            state.sock.sendall(state.pending)
            state.pending = b""

    def _ship_now(self) -> None:
        """SYNC, in the producer's thread right after its append: send the new bytes to every
        slave whose stream is idle and close to caught up, instead of waking its push thread
        (one thread hand-off less on the path every SYNC send waits for). A slave whose push
        thread is sending, or that lags, is left to that thread, woken here."""
        left = False
        for state in list(self._slaves.values()):
            if not state.connected:
                continue
            if not state.inline:
                left = True
                continue
            # Whoever holds the lock (another producer, the push thread) ships again after
            # releasing it when it sees the flag: set it before trying, check it after releasing.
            state.ship_due = True
            while state.ship_due and state.send_lock.acquire(False):
                state.ship_due = False
                try:
                    while self._ship(state, block=False):
                        pass
                    # Bytes within the inline window are their own producer's to ship; the push
                    # thread is woken only for a stream it must finish or catch up.
                    lagging = bool(state.pending) or (
                        self._sendable(state, _WINDOW_BYTES)
                        and not self._sendable(state, _INLINE_WINDOW_BYTES)
                    )
                except (OSError, wire.ProtocolError) as e:  # the push thread meets it and ends
                    log.debug("replication: shipping to slave %d failed: %s", state.broker_id, e)
                    lagging = True
                finally:
                    state.send_lock.release()
                left = left or lagging
        if left:
            with self._cond:
                self._cond.notify_all()


def _close(sock: wire.Connection) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
