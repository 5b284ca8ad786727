"""The replica group's controller client: registration, election and failover through etcd
(decisions 130-133).

Keys, under ``/tmq/ha/{cluster}/{broker name}/``:

- ``members/{id}`` (on the member's lease): ``{"id", "ha", "endpoint", "role", "epoch",
  "last_epoch", "max_offset"}``, written at a tick when it changed (or the lease did); it
  vanishes when the member dies.
- ``master`` (on the master's lease): ``{"id", "epoch", "ha", "endpoint"}``; it vanishes when
  the master's lease expires, which is what starts an election.
- ``state`` (no lease): ``{"epoch", "master", "sync_state_set"}``, the group's current epoch and
  the members that hold everything acknowledged. Only the master changes the SyncStateSet, and
  only by a compare-and-swap on its mod revision.

Election (one thread per broker, ``tmq-ha-controller``, every ``_TICK_S``): when ``master`` is
absent, the live members named in ``state.sync_state_set`` are the candidates (any live member
when no state exists yet: a new group). Each waits a few ticks so that every candidate has
published its final CommitLog end, then the one with the highest (last epoch, end, lowest id)
tries one transaction: ``master`` absent and ``state`` unchanged -> put ``master`` on its lease
and ``state`` with epoch + 1 and a SyncStateSet of itself. The winner stops following, becomes
writable and starts its replication master in the new epoch; the others follow it.

A master fences itself (no sends, NOT_SERVING) as soon as it cannot prove its lease is alive
(no successful keepalive sent in the last 3/4 of the TTL), or it sees another master or a newer
epoch; a fenced master becomes a slave of whoever holds ``master``, truncating its divergent
tail. The lease is renewed every eighth of the TTL by a child process,
broker/ha/lease_keeper.py, which shares no GIL with this busy process (decision 910: renewals
from a thread here missed the deadline under load) and renews only while this process pulses;
the deadline is computed here from the time the keeper sent its last successful keepalive,
watched by ``tmq-ha-lease-watch`` (every ``_WATCH_S``, which also sends the pulse), and checked
by every send, so that an idle master whose etcd calls hang until they time out (etcd frozen
or unreachable: each endpoint is tried for up to 2 s) is fenced before etcd can expire its
lease and elect another (decision 222). A master fenced so gives its lease up at the next tick
that reaches etcd, so the group elects again rather than keep a fenced master.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from broker.ha.config import HaConfig
from broker.ha.etcd import Compare, EtcdClient, EtcdUnavailableError, KeyValue, put_op
from broker.ha.gate import NotMasterError, ReplicationStatus
from broker.ha.lease_keeper import LeaseKeeper
from broker.ha.master import ReplicationMaster
from broker.ha.role import RoleState
from broker.ha.slave import ReplicationSlave
from tiered.epoch_file import EpochFile
from tiered.store import MessageStore

log = logging.getLogger(__name__)

_TICK_S = 0.2
_WATCH_S = 0.05
# A tick longer than this says where its time went, in one line at most every _SLOW_TICK_LOG_S.
_SLOW_TICK_S = 1.0
_SLOW_TICK_LOG_S = 10.0
# A member that is not master asks the NameServers where the master is once no tick has read
# etcd for this long (decision 1151).
_FIND_AFTER_S = 3.0
# Ticks an election waits after the master vanished, for every candidate's final end.
_SETTLE_TICKS = 3
# A master fences itself this fraction of the TTL after its last successful keepalive was sent:
# etcd expires the lease no sooner than a full TTL after it, and another member can win only
# _SETTLE_TICKS ticks after that (decisions 132, 910).
_FENCE_AT = 3 / 4
# The keeper sends a keepalive every TTL/_RENEWALS_PER_TTL, without waiting for the last answer.
_RENEWALS_PER_TTL = 8
# A keeper that is alive but has renewed nothing for this many TTLs, while this process's own
# keepalive of the same lease was answered after its last renewal, is hung: killed and started
# again (decision 992).
_KEEPER_STALL_TTLS = 2


@dataclass(slots=True, frozen=True)
class Member:
    id: int
    ha: str
    endpoint: str
    role: str
    epoch: int
    last_epoch: int
    max_offset: int
    # Messages in this node's ConsumeQueues (their max offsets summed): lag in messages.
    messages: int = 0


@dataclass(slots=True)
class GroupView:
    """What etcd said at one tick."""

    members: dict[int, Member]
    master: dict[str, Any] | None
    master_kv: KeyValue | None
    state: dict[str, Any] | None
    state_kv: KeyValue | None


class ControllerMetrics:
    """Counters for /metrics."""

    def __init__(self) -> None:
        self.elections_won = 0
        self.elections_lost = 0
        self.fenced = 0
        self.role_changes = 0
        self.keeper_restarts = 0


class HaController:
    """Runs this broker's part of the group: which replication role it plays, and when."""

    def __init__(
        self,
        store: MessageStore,
        epochs: EpochFile,
        config: HaConfig,
        cluster: str,
        name: str,
        endpoint: Callable[[], str],
        role: RoleState,
        make_master: Callable[[], ReplicationMaster],
        make_slave: Callable[[HaConfig], ReplicationSlave],
        on_change: Callable[[ReplicationMaster | ReplicationSlave | None], None],
        find_master: Callable[[], str | None] | None = None,
    ) -> None:
        self.store = store
        self.epochs = epochs
        self.config = config
        self.node_id = config.broker_id
        self.endpoint = endpoint
        self.role = role
        self.etcd = EtcdClient(config.etcd)
        self.prefix = f"/tmq/ha/{cluster}/{name}/".encode()
        self._make_master = make_master
        self._make_slave = make_slave
        self._on_change = on_change
        # Where the group's master is registered elsewhere (the NameServers' broker id 0), for
        # forwarding while etcd cannot be reached (decision 1151).
        self._find_master = find_master
        self._finder: threading.Thread | None = None
        # When a tick last read etcd through: a tick cut from etcd waits out every endpoint's
        # timeout (and a fenced master's revoke and grant each do), 6-12 s at 2 s each.
        self._etcd_ok_at = time.monotonic()
        self.current: ReplicationMaster | ReplicationSlave | None = None
        self.following: str | None = None
        # The current master's gRPC endpoint as etcd names it (None: none, or this node).
        self.master_endpoint: str | None = None
        # The other live members' gRPC endpoints at the last tick that read etcd (a member's key
        # lives on its lease: a member that died drops out within its TTL, at once when its
        # keeper revokes the lease).
        self._peers: list[str] = []
        self.metrics = ControllerMetrics()
        self.last_error: str | None = None
        self._lease = 0
        # Set when this master fenced itself without etcd's word: revoke the lease at the next
        # tick (etcd still names this node master under it).
        self._abandon_lease = False
        self._lease_ok_at = 0.0
        # When this lease was taken: the election guard waits for the keeper's first renewal of
        # it only so long (a keeper that never renews must not keep a member from standing).
        self._lease_taken_at = 0.0
        self._keepalive_at = 0.0
        # When this process's own keepalive (the tick's fallback) was last answered.
        self._tick_keepalive_at = 0.0
        # The keeper's skipped-renewal count last seen, and when it last moved (a keeper that
        # skips for a stale pulse is alive and right not to renew).
        self._keeper_skipped = 0
        self._keeper_skipped_at = 0.0
        self._published_sss: list[int] | None = None
        self._absent_ticks = 0
        # The member document last written to etcd, and the lease it was written under.
        self._member_put: tuple[bytes, int] = (b"", 0)
        self._phases: list[tuple[str, float]] = [("start", time.monotonic())]
        self._tick_role = ""
        self._slow_ticks = 0
        self._slow_tick_logged_at = -_SLOW_TICK_LOG_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watch: threading.Thread | None = None
        self._keeper: LeaseKeeper | None = None
        self._lock = threading.Lock()

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start as a fenced member (no sends) until the first tick decides the role."""
        self.epochs.load()
        self.store.set_replica(True)
        self.role.set("slave", self.epochs.last_epoch if self.epochs.entries else 0)
        # The renewals run in a process of their own, which waits on no GIL (decision 910). It
        # exists before the tick's first lease: created after the tick started (as before
        # decision 990), a tick that granted its lease first told no keeper about it, no later
        # tick did (the lease did not change), and the keeper never renewed it: a member the
        # election guard never let stand (the CI runs of decision 911).
        self._keeper = LeaseKeeper(
            self.config.etcd,
            self._ttl_s(),
            interval_s=self._ttl_s() / _RENEWALS_PER_TTL,
            pulse_limit_s=self._ttl_s() / 2,
        )
        self._keeper.ensure_running()
        self._thread = threading.Thread(target=self._run, name="tmq-ha-controller", daemon=True)
        self._thread.start()
        self._watch = threading.Thread(
            target=self._watch_lease, name="tmq-ha-lease-watch", daemon=True
        )
        self._watch.start()
        if self._find_master is not None:
            self._finder = threading.Thread(
                target=self._find_loop, name="tmq-ha-master-finder", daemon=True
            )
            self._finder.start()

    def stop(self) -> None:
        self._stop.set()
        for thread in (self._thread, self._watch, self._finder):
            if thread is not None:
                thread.join(timeout=10)
        if self._keeper is not None:
            self._keeper.stop()
        with self._lock:
            if self.current is not None:
                self.current.stop()
        if self._lease:
            # Hand over at once rather than after the TTL: a clean stop is a fast failover.
            with contextlib.suppress(EtcdUnavailableError):
                self.etcd.revoke(self._lease)

    def status(self) -> ReplicationStatus | None:
        current = self.current
        return current.status() if current is not None else None

    # -- the loop ------------------------------------------------------------------------------

    def _key(self, suffix: str) -> bytes:
        return self.prefix + suffix.encode()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
                self.last_error = None
                self._etcd_ok_at = time.monotonic()
                self._report_slow_tick()
            except EtcdUnavailableError as e:
                # Logged as such; its time is the endpoints' timeouts.
                self.last_error = str(e)
                log.warning("controller: %s", e)
                self._check_lease_deadline()
            except Exception as e:  # never die: log and try again next tick
                self.last_error = str(e)
                log.exception("controller tick failed")
            self._stop.wait(_TICK_S)

    def _find_loop(self) -> None:
        """Every second: while no tick has read etcd for ``_FIND_AFTER_S`` and this member is
        not the writable master, take the master's endpoint from the NameServers for its
        forwarding (decision 1151). Its own thread: the tick is stuck in etcd's timeouts then,
        and the watchdog must pulse the keeper every 50 ms."""
        assert self._find_master is not None
        while not self._stop.wait(1.0):
            if self.role.is_master() or time.monotonic() - self._etcd_ok_at < _FIND_AFTER_S:
                continue
            try:
                found = self._find_master()
            except Exception as e:
                log.info("controller: the NameServers did not say where the master is: %s", e)
                continue
            if (
                found
                and found != self.endpoint()
                and found != self.master_endpoint
                and time.monotonic() - self._etcd_ok_at >= _FIND_AFTER_S
            ):
                # Without it a master cut from etcd, once fenced, knows no master and refuses
                # every send for as long as the cut lasts, and Apache's clients, which stay on
                # the first member of the route that answers, stay on it. Forwarding decides
                # nothing: the member reached acknowledges only while its own lease holds, and
                # answers NOT_MASTER otherwise (forwards go one hop).
                log.warning(
                    "controller: etcd has not answered for %.1f s; forwarding to %s, the master "
                    "the NameServers name",
                    time.monotonic() - self._etcd_ok_at,
                    found,
                )
                self.master_endpoint = found

    def _report_slow_tick(self) -> None:
        """Say where a tick longer than ``_SLOW_TICK_S`` spent its time, phase by phase (at
        most one line in ``_SLOW_TICK_LOG_S``, with how many more were slow since)."""
        phases = self._phases
        end = time.monotonic()
        took = end - phases[0][1]
        if took < _SLOW_TICK_S:
            return
        self._slow_ticks += 1
        if end - self._slow_tick_logged_at < _SLOW_TICK_LOG_S:
            return
        steps = [*phases, (self._tick_role, end)]
        log.warning(
            "controller: a tick took %.2f s (%s; %d slow tick(s) since the last such line)",
            took,
            ", ".join(f"{b[0]} {b[1] - a[1]:.2f}" for a, b in itertools.pairwise(steps)),
            self._slow_ticks,
        )
        self._slow_tick_logged_at, self._slow_ticks = end, 0

    def _ttl_s(self) -> int:
        return max(1, round(self.config.lease_ttl_ms / 1000))

    def _watch_lease(self) -> None:
        """The watchdog: every ``_WATCH_S`` it tells the keeper this process is alive (the
        pulse without which the keeper stops renewing) and checks the deadline."""
        while not self._stop.wait(_WATCH_S):
            keeper = self._keeper
            if keeper is not None:
                keeper.pulse()
            self._check_lease_deadline()

    def _set_lease(self, lease: int) -> None:
        if lease and lease != self._lease:
            self._lease_taken_at = time.monotonic()
        self._lease = lease
        if self._keeper is not None:
            self._keeper.set_lease(0 if self._abandon_lease else lease)

    def _keeper_renewals(self) -> None:
        """Take the keeper's last successful keepalive of the current lease as this process's
        own: the time it was sent, on the host's one monotonic clock."""
        keeper = self._keeper
        if keeper is None:
            return
        state = keeper.renewed()
        if state.lease and state.lease == self._lease and not self._abandon_lease:
            self._lease_ok_at = max(self._lease_ok_at, state.sent_at)
            self._keepalive_at = max(self._keepalive_at, state.sent_at)

    def _ensure_lease(self) -> None:
        if self._abandon_lease:
            self._abandon_lease = False
            if self._lease:
                with contextlib.suppress(EtcdUnavailableError):
                    self.etcd.revoke(self._lease)
                log.warning(
                    "controller: gave up lease %x after fencing; the group elects", self._lease
                )
                self._set_lease(0)
        if self._keeper is not None:
            self._keeper.ensure_running()
            # Every tick, not only when the lease changes: the keeper renews what the broker's
            # half names, and nothing else may leave that behind (decision 990).
            wanted = 0 if self._abandon_lease else self._lease
            if self._keeper.lease != wanted:
                self._keeper.set_lease(wanted)
        self._keeper_renewals()
        now = time.monotonic()
        if self._lease and now - self._keepalive_at < self._ttl_s() / 3:
            return
        if self._lease:
            if self.etcd.keepalive(self._lease) > 0:
                self._lease_ok_at = self._keepalive_at = self._tick_keepalive_at = now
                self._check_keeper(now)
                return
            log.warning("controller: lease %x expired; taking a new one", self._lease)
            self._set_lease(0)
            self._lose_mastership("its etcd lease expired")
        lease = self.etcd.grant(self._ttl_s())
        self._lease_ok_at = self._keepalive_at = now
        self._set_lease(lease)

    def _check_keeper(self, now: float) -> None:
        """Restart a keeper that is alive but not renewing (hung in a call, stopped, spinning):
        etcd answered this process's keepalive of the lease after the keeper's last renewal of
        it (or its start, or the lease's), and the keeper has renewed nothing for
        ``_KEEPER_STALL_TTLS`` TTLs. Fencing is untouched: the deadline counts only keepalives
        that were answered, the tick's own included, and the new keeper's half starts blank."""
        keeper = self._keeper
        if keeper is None or keeper.proc is None or keeper.proc.poll() is not None:
            return
        if not self._lease or self._abandon_lease:
            return
        state = keeper.renewed()
        if state.skipped != self._keeper_skipped:
            self._keeper_skipped, self._keeper_skipped_at = state.skipped, now
        since = max(
            state.sent_at if state.lease == self._lease else 0.0,
            keeper.started_at,
            self._lease_taken_at,
            self._keeper_skipped_at,
        )
        stalled = now - since
        if stalled <= _KEEPER_STALL_TTLS * self._ttl_s() or self._tick_keepalive_at <= since:
            return
        log.error(
            "controller: the lease keeper (pid %d) has not renewed lease %x for %.1f s while etcd "
            "answers this process (keeper: %d renewals, last keepalive %.2f s, longest %.2f s); "
            "restarting it",
            keeper.proc.pid,
            self._lease,
            stalled,
            state.renewals,
            state.last_latency_s,
            state.max_latency_s,
        )
        self.metrics.keeper_restarts += 1
        keeper.restart()
        self._keeper_skipped = 0

    def _check_lease_deadline(self) -> None:
        """No answer from etcd: a master that cannot prove its lease is alive fences itself
        before the lease can expire in etcd (3/4 of the TTL since the last renewal was sent)."""
        if not self.role.is_master():
            return
        self._keeper_renewals()
        if time.monotonic() - self._lease_ok_at > self._ttl_s() * _FENCE_AT:
            self._abandon_lease = True
            if self._keeper is not None:
                self._keeper.set_lease(0)
            keeper = self._keeper.renewed() if self._keeper is not None else None
            self._lose_mastership(
                f"its etcd lease was not renewed for {time.monotonic() - self._lease_ok_at:.1f} s "
                "(etcd unreachable or slow); the lease may have expired"
                + (
                    f" (keeper: {keeper.renewals} renewals, {keeper.skipped} skipped for a stale "
                    f"pulse, last keepalive {keeper.last_latency_s:.2f} s, longest "
                    f"{keeper.max_latency_s:.2f} s)"
                    if keeper is not None
                    else ""
                )
            )

    def _lose_mastership(self, why: str) -> None:
        if self.role.is_master():
            log.error("controller: fencing this master (epoch %d): %s", self.role.epoch, why)
            self.metrics.fenced += 1
            self.role.fence()

    def _member_doc(self) -> bytes:
        snap = self.role.get()
        return json.dumps(
            {
                "id": self.node_id,
                "ha": self.config.listen,
                "endpoint": self.endpoint(),
                "role": "master" if snap.is_writable_master else "slave",
                "epoch": snap.epoch,
                "last_epoch": self.epochs.last_epoch,
                "max_offset": self.store.max_physical_offset,
                "messages": sum(
                    self.store.max_offset(topic, q)
                    for topic in self.store.topics()
                    for q in self.store.queue_ids(topic)
                ),
            },
            sort_keys=True,
        ).encode()

    def _read(self) -> GroupView:
        members: dict[int, Member] = {}
        master = state = None
        master_kv = state_kv = None
        for kv in self.etcd.get_prefix(self.prefix):
            suffix = kv.key[len(self.prefix) :].decode()
            doc = json.loads(kv.value)
            if suffix.startswith("members/"):
                members[int(doc["id"])] = Member(**doc)
            elif suffix == "master":
                master, master_kv = doc, kv
            elif suffix == "state":
                state, state_kv = doc, kv
        return GroupView(members, master, master_kv, state, state_kv)

    def _tick(self) -> None:
        phases = self._phases = [("start", time.monotonic())]
        self._ensure_lease()
        phases.append(("lease", time.monotonic()))
        doc = self._member_doc()
        phases.append(("member doc", time.monotonic()))
        if (doc, self._lease) != self._member_put:
            # Only what changed (under sends its end changes at every tick): the key lives on
            # the lease, so an unchanged document under the same lease is still there. Written
            # every tick, an idle group cost etcd 5 raft writes a second per member (1152).
            self.etcd.put(self._key(f"members/{self.node_id}"), doc, self._lease)
            self._member_put = (doc, self._lease)
        phases.append(("put", time.monotonic()))
        view = self._read()
        phases.append(("read", time.monotonic()))
        self._peers = sorted(
            m.endpoint for i, m in view.members.items() if i != self.node_id and m.endpoint
        )
        master = view.master
        self.master_endpoint = (
            str(master["endpoint"])
            if master is not None and int(master["id"]) != self.node_id
            else None
        )
        snap = self.role.get()
        if snap.is_writable_master:
            self._tick_role = "master"
            self._as_master(view)
            return
        if view.master is not None and int(view.master["id"]) != self.node_id:
            self._tick_role = "follow"
            self._absent_ticks = 0
            self._follow(view.master)
            return
        self._tick_role = "elect"
        if view.master is not None:
            # etcd names this node master but it is not (a restart within the lease): let
            # that lease lapse; a fresh election follows.
            return
        self._absent_ticks += 1
        if self._absent_ticks > _SETTLE_TICKS:
            self._elect(view)

    # -- master --------------------------------------------------------------------------------

    def _as_master(self, view: GroupView) -> None:
        epoch = self.role.epoch
        master, state = view.master, view.state
        if (
            master is None
            or int(master["id"]) != self.node_id
            or state is None
            or int(state["epoch"]) != epoch
        ):
            self._lose_mastership(
                f"etcd names master {master and master['id']} in epoch {state and state['epoch']}"
            )
            return
        current = self.current
        if not isinstance(current, ReplicationMaster):
            return
        sss = sorted({self.node_id, *(i for i in current.sync_state_set() if i != 0)})
        if sss != state.get("sync_state_set") and view.state_kv is not None:
            doc = dict(state, sync_state_set=sss)
            ok = self.etcd.txn(
                [
                    Compare(self._key("state"), "MOD", view.state_kv.mod_revision),
                    Compare(self._key("master"), "MOD", view.master_kv.mod_revision)
                    if view.master_kv is not None
                    else Compare(self._key("master"), "VERSION", 1),
                ],
                [put_op(self._key("state"), json.dumps(doc, sort_keys=True).encode())],
            )
            if ok:
                log.info("controller: SyncStateSet of epoch %d is now %s", epoch, sss)
            else:
                log.info(
                    "controller: publishing SyncStateSet %s of epoch %d lost a race; next tick",
                    sss,
                    epoch,
                )

    # -- slave ---------------------------------------------------------------------------------

    def _follow(self, master: dict[str, Any]) -> None:
        address = str(master["ha"])
        epoch = int(master["epoch"])
        if self.following == address and isinstance(self.current, ReplicationSlave):
            if epoch > self.role.epoch:
                self.role.set("slave", epoch)
            return
        log.warning(
            "controller: following master %s at %s (epoch %d)", master["id"], address, epoch
        )
        with self._lock:
            self._switch(None)
            slave = self._make_slave(replace(self.config, master=address, peers=[]))
            self.role.set("slave", epoch)
            slave.start()
            self.following = address
            self._switch(slave)

    def _switch(self, new: ReplicationMaster | ReplicationSlave | None) -> None:
        old = self.current
        if old is not None and new is None:
            old.stop()
        self.current = new
        if new is not None or old is not None:
            self.metrics.role_changes += 1
            self._on_change(new)

    # -- election ------------------------------------------------------------------------------

    def _elect(self, view: GroupView) -> None:
        state = view.state
        live = view.members
        if state is None:
            candidates = list(live.values())
        else:
            sss = set(int(i) for i in state.get("sync_state_set", []))
            candidates = [m for m in live.values() if m.id in sss]
        if not any(m.id == self.node_id for m in candidates):
            if self._absent_ticks % 25 == 0:
                log.warning(
                    "controller: no master, and this member (%d) is not in the SyncStateSet %s; "
                    "waiting for one of them",
                    self.node_id,
                    state and state.get("sync_state_set"),
                )
            return
        best = max(candidates, key=lambda m: (m.last_epoch, m.max_offset, -m.id))
        if best.id != self.node_id:
            return
        keeper = self._keeper
        if (
            keeper is not None
            and keeper.proc is not None
            and keeper.proc.poll() is None
            and keeper.renewed().lease != self._lease
        ):
            # Its keeper (just started, after a restart) has not renewed this lease yet: a
            # master elected now would renew only through the tick, and fence (seen under load:
            # "0 renewals"). Stand at a later tick; but not for ever: past two TTLs the keeper
            # is not renewing (two CI runs saw a member never elected), and a member that
            # stands and renews through its tick is what the group had before decision 910.
            waited = time.monotonic() - self._lease_taken_at
            if waited < 2 * self._ttl_s():
                return
            log.warning(
                "controller: the lease keeper has not renewed lease %x in %.1f s; standing for "
                "election without it (renewals through the tick)",
                self._lease,
                waited,
            )
        # Stop following first: this node's end is final from here on.
        with self._lock:
            self._switch(None)
            self.following = None
        state_epoch = int(state["epoch"]) if state is not None else 0
        epoch = max(state_epoch, self.epochs.last_epoch) + 1
        master_doc = {
            "id": self.node_id,
            "epoch": epoch,
            "ha": self.config.listen,
            "endpoint": self.endpoint(),
        }
        state_doc = {"epoch": epoch, "master": self.node_id, "sync_state_set": [self.node_id]}
        state_cmp = (
            Compare(self._key("state"), "MOD", view.state_kv.mod_revision)
            if view.state_kv is not None
            else Compare(self._key("state"), "VERSION", 0)
        )
        won = self.etcd.txn(
            [Compare(self._key("master"), "VERSION", 0), state_cmp],
            [
                put_op(self._key("master"), json.dumps(master_doc).encode(), self._lease),
                put_op(self._key("state"), json.dumps(state_doc).encode()),
            ],
        )
        if not won:
            self.metrics.elections_lost += 1
            log.info("controller: another member won the election")
            return
        self.metrics.elections_won += 1
        log.warning(
            "controller: elected master of epoch %d (CommitLog end %d, candidates %s)",
            epoch,
            self.store.max_physical_offset,
            sorted(m.id for m in candidates),
        )
        self._promote(epoch)

    def _promote(self, epoch: int) -> None:
        with self._lock:
            store = self.store
            # Rebuild the next queue offsets from the ConsumeQueues (decision 111): wait for
            # this node's dispatcher to cover every replicated byte, then become writable.
            store.truncate_to(store.max_physical_offset)
            store.set_replica(False)
            master = self._make_master()
            try:
                master.start(epoch)
            except Exception:
                store.set_replica(True)
                raise
            self.role.set("master", epoch)
            self._switch(master)

    def peers(self) -> list[str]:
        """The gRPC endpoints of the group's other live members, as etcd last listed them:
        where the master relays the transaction check-backs it has no producer for (decision
        1250)."""
        return list(self._peers)

    def forward_target(self) -> str | None:
        """Where client requests that need the master go: None to answer them here (this node
        is the writable master, or no other master is known)."""
        if self.role.is_master():
            return None
        return self.master_endpoint

    def check_writable(self) -> None:
        self._check_lease_deadline()
        if not self.role.is_master():
            raise NotMasterError(
                f"member {self.node_id} is not the group's master (role {self.role.role}, "
                f"fenced {self.role.fenced})"
            )
        current = self.current
        if not isinstance(current, ReplicationMaster):
            raise NotMasterError(f"member {self.node_id} is still becoming master")
        current.check_writable()

    def wait_replicated(self, end_offset: int) -> None:
        current = self.current
        if not isinstance(current, ReplicationMaster):
            raise NotMasterError(f"member {self.node_id} stopped being master")
        current.wait_replicated(end_offset)
        self._check_lease_deadline()
        if not self.role.is_master():
            # Deposed while the send waited: the new master may lack it; do not acknowledge.
            raise NotMasterError(f"member {self.node_id} was fenced before acknowledging")
