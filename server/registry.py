"""The client registry: registered clients, their slabs and slots; lookups started and finished.

It knows nothing of ZeroMQ: the daemon hands it decoded requests (client/shared/messages.py) and a peer
identity, and gets back declared replies or a typed EngramError. A registration is made in two steps: `register`
(ZeroMQ) reserves a place, `attach` (the handle socket, with the peer's kernel credentials)
checks who the peer is and only then allocates its slab; the daemon keeps the attaching
connection as the registration's lease and is told through `on_retire` when a registration
ends. All methods run on the daemon's main thread; the backend's workers only call the
completion callback, which the daemon brings back to that thread before `finish_lookup`. Tests
drive the registry in-process. A registration request is checked in
server/registration_checks.py and a lookup request in server/lookup_checks.py; the totals,
errors and statistics are kept in server/accounting.py (`ClientRegistry.accounts`).
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engramd.client.errors import (
    BadRequestError,
    EngramError,
    InternalError,
    NotRegisteredError,
    PermissionDeniedError,
    ResourceError,
    TablesChangedError,
)
from engramd.client.geometry import ShardView, TableGeometry
from engramd.client.shared.handles import PeerCredentials
from engramd.client.shared.messages import (
    LookupReply,
    LookupRequest,
    RegisterReply,
    RegisterRequest,
)
from engramd.client.shared.slab import SlabLayout
from engramd.server.accounting import Accounting, checked_counts, printable
from engramd.server.backend import Backend, Completion, LookupJob, Slab
from engramd.server.config import DaemonConfig, from_setting, gib, id_set, listed, ms, options_from
from engramd.server.job_context import JobContext
from engramd.server.lookup_checks import check_ids_handed_over, check_lookup, refused_tokens
from engramd.server.procwatch import ProcessWatch
from engramd.server.registration_checks import (
    check_budget,
    check_device_name,
    check_pinned_tables,
    layout_for,
    mode_for,
    mps_report,
    shard_for,
)

log = logging.getLogger("engramd.registry")


# A client is alive as long as its lease (handle-socket connection) is open. Besides, one that
# sent nothing for this many heartbeat intervals, and at least HUNG_AFTER_S, is retired unless
# its process is visibly alive here (a hung client in another PID namespace). The floor keeps a
# live client whose heartbeat thread waits for the GIL a few seconds from being taken for hung.
HEARTBEAT_MISSES = 5
HUNG_AFTER_S = 30.0
# A registration not attached within this many seconds is retired. Not tied to the heartbeat:
# attaches queue behind each other's slab allocations (20 GPU clients starting at once take
# seconds), and an unattached registration holds nothing but its place and its budget.
ATTACH_TIMEOUT_S = 10.0
# Registrations one connection may hold unattached: a client makes one and attaches it at once,
# so this only stops a peer from taking every place with registrations it never uses.
MAX_PENDING_PER_CONNECTION = 4
# When every place is taken, a registration unattached for this long gives its place up.
PENDING_GRACE_S = 1.0
TABLES_ID = re.compile(r"[0-9a-f]{16}")  # a tables id (server/checkpoint.py fingerprint)


@dataclass(frozen=True)
class Limits:
    """What the registry enforces and tells its clients: each field one setting's value
    (server/config.py declares its type, bounds and doc), in the unit the registry uses.
    Built by `Limits.from_config`; defaults are the settings'."""

    max_clients: int = from_setting("max_clients")
    max_tokens: int = from_setting("max_tokens")
    max_slots: int = from_setting("max_slots")
    heartbeat_interval: float = from_setting("heartbeat_interval")
    modes: tuple[str, ...] = from_setting("client_modes", listed)  # of registration_checks.MODES, those allowed
    sort_min_tokens: int = from_setting("sort_min_tokens")  # told to mapped clients: the daemon's policy
    sm_fraction: float = from_setting("gather_sm_fraction")  # a mapped client's gather grid, as the daemon's
    mapped_cache_bytes: int = from_setting("mapped_hot_cache_gib", gib)  # a mapped GPU client's own cache
    cache_refresh_s: float = from_setting("hot_cache_refresh_ms", ms)  # and how often it refreshes
    # Who may attach, by the kernel's credentials of the handle-socket peer (None: whoever can
    # open the socket). A peer passes when its uid or its gid is listed.
    allowed_uids: frozenset[int] | None = from_setting("allowed_uids", id_set)
    allowed_gids: frozenset[int] | None = from_setting("allowed_gids", id_set)
    slab_budget: int = from_setting("slab_budget_gib", gib)  # all served clients' slabs together
    max_clients_per_uid: int = from_setting("max_clients_per_uid")  # attached clients one user may hold
    ids_wait_s: float = from_setting("ids_wait_s")  # a GPU lookup waiting longer for its IDs is reported
    pending_per_uid: int = from_setting("pending_registrations_per_uid")  # unattached ones of one user
    attach_timeout: float = ATTACH_TIMEOUT_S  # no setting's

    @classmethod
    def from_config(cls, config: DaemonConfig) -> Limits:
        return options_from(cls, config)

    def allows(self, peer: PeerCredentials) -> bool:
        if self.allowed_uids is None and self.allowed_gids is None:
            return True
        return peer.uid in (self.allowed_uids or ()) or peer.gid in (self.allowed_gids or ())

    @property
    def silence_s(self) -> float:
        """How long a client whose process is not visible here may send nothing."""
        return max(HEARTBEAT_MISSES * self.heartbeat_interval, HUNG_AFTER_S)


@dataclass
class ClientRecord:
    client_id: int
    identity: bytes
    name: str
    device: str
    tp_rank: int
    tp_size: int
    shard: ShardView
    layout: SlabLayout
    claimed_pid: int  # what the client said; its process as the kernel saw it is in `peer`
    token: str
    mode: str = "served"
    slab: Slab | None = None  # served, once attached; mapped clients gather from their own mapping
    peer: PeerCredentials | None = None  # set by attach
    watch: ProcessWatch | None = None  # the peer's process, when visible here (a diagnostic)
    mps_shared: bool | None = None  # GPU clients: do daemon and client share an MPS server there
    tables: str | None = None  # the tables it reads: served, the daemon's; mapped, as it reports
    pinned_tables: str | None = None  # its lookups are refused once the daemon serves others
    warm_file: bool = False  # mapped: it asked for the hot-row cache's warm-up trace at attach
    in_flight: Counter[int] = field(default_factory=Counter)  # slot -> jobs not yet completed
    last_seq: dict[int, int] = field(default_factory=dict)  # slot -> seq of its last job submitted
    releasing: bool = False
    lookups: int = 0
    rows: int = 0
    out_of_range: int = 0
    errors: int = 0
    last_seen: float = field(default_factory=lambda: time.monotonic())
    registered_at: float = field(default_factory=lambda: time.monotonic())
    registrant: PeerCredentials | None = None  # who held the connection it registered on, if known

    @property
    def attached(self) -> bool:
        return self.peer is not None

    def who(self) -> dict[str, Any]:
        """Who the client is: for admins only (engramd stats asks over the handle socket)."""
        pid = self.peer.pid if self.peer is not None and self.peer.pid else self.claimed_pid
        return {"client_id": self.client_id, "pid": pid, "name": self.name,
                "uid": self.peer.uid if self.peer is not None else None}

    def summary(self) -> dict[str, Any]:
        """What anyone who may connect sees: no pid, name or uid of another user's process."""
        return {"client_id": self.client_id, "attached": self.attached, "device": self.device,
                "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "lookups": self.lookups, "rows": self.rows, "out_of_range": self.out_of_range,
                "errors": self.errors, "in_flight": sum(self.in_flight.values()),
                "mps_shared": self.mps_shared, "mode": self.mode, "tables": self.tables,
                "pinned": self.pinned_tables is not None}


class ClientRegistry:
    def __init__(self, geometry: TableGeometry, backend: Backend, limits: Limits,
                 on_retire: Callable[[ClientRecord], None] = lambda record: None,
                 tables_id: str | None = None):
        self.geometry = geometry
        self.tables_id = tables_id  # told to clients, so they see a restart on other tables
        self.tables_seq = 0  # reloads that switched the tables (client/shared/messages.py: tables_seq)
        self.backend = backend
        self.limits = limits
        self._on_retire = on_retire  # the daemon lets go of the registration's lease
        self.clients: dict[int, ClientRecord] = {}
        self._next_id = 1
        self.accounts = Accounting(backend, limits.heartbeat_interval)  # totals, errors, stats

    # -- registration ---------------------------------------------------------------------------

    def register(self, identity: bytes, req: RegisterRequest,
                 peer: PeerCredentials | None = None) -> RegisterReply:
        """Reserve a place; `peer`: who holds the connection (the kernel's credentials, as
        libzmq read them at connect), which bounds its user's unattached registrations."""
        check_pinned_tables(req, self.tables_id)
        live = [c for c in self.clients.values() if not c.releasing]
        if peer is not None:
            live = self._bound_pending(live, peer)
        if len(live) >= self.limits.max_clients and not self._evict_unattached(live):
            raise ResourceError(f"client limit reached ({self.limits.max_clients} registered)")
        pending = sum(1 for c in live if c.identity == identity and not c.attached)
        if pending >= MAX_PENDING_PER_CONNECTION:
            raise ResourceError(f"{pending} registrations of this connection are not attached yet; "
                                "attach them (handle socket) before registering more")
        check_device_name(req.device)
        shard = shard_for(req, self.geometry)
        layout = layout_for(req, shard, self.geometry, self.limits)
        mps = mps_report(self.backend, req.device, req.mps)
        mode = mode_for(req.mode, req.device, self.limits.modes)
        if mode == "served":
            self.backend.check_device(req.device)
            check_budget(self.clients.values(), layout, self.limits.slab_budget)
        if mode == "served" and mps is not None and not mps["shared"]:
            log.warning("a client on %s is served without a shared MPS server (daemon: %s, client: %s): "
                        "the daemon's gathers time-slice with the client's kernels instead of "
                        "overlapping them; run nvidia-cuda-mps-control for both (README, 'MPS'), "
                        "or register it in mapped mode", req.device, mps["daemon"], mps["client"])
        client_id = self._next_id
        self._next_id += 1
        record = ClientRecord(client_id, identity, printable(req.name[:128]), req.device,
                              req.tp_rank, req.tp_size, shard, layout, req.pid,
                              secrets.token_hex(16), mps_shared=mps["shared"] if mps else None,
                              mode=mode, tables=self.tables_id,
                              pinned_tables=self.tables_id if req.pin_tables or req.tables else None,
                              warm_file=req.warm_file is True, registrant=peer)
        self.clients[client_id] = record
        self.accounts.totals["registrations"] += 1
        log.info("registered client %d (pid %d as it says, %s, tp %d/%d, %s, %d slots x %d tokens)",
                 client_id, req.pid, req.device, req.tp_rank, req.tp_size, mode,
                 layout.slots, layout.max_tokens)
        return RegisterReply(
            client_id=client_id, token=record.token, mode=mode, layout=layout.to_wire(),
            gather={"sort_min_tokens": self.limits.sort_min_tokens, "sm_fraction": self.limits.sm_fraction,
                    "cache_bytes": self.limits.mapped_cache_bytes,
                    "cache_refresh_s": self.limits.cache_refresh_s},
            heartbeat_interval=self.limits.heartbeat_interval, attach_within=self.limits.attach_timeout,
            geometry=self.geometry.to_config(),
            shard={"rank": shard.rank, "shards": shard.shards, "head_start": shard.head_start,
                   "head_end": shard.head_end, "local_heads": shard.local_heads,
                   "row_ranges": [list(r) for r in shard.row_ranges]},
            mps=mps, tables=self.tables_id, tables_seq=self.tables_seq)

    def _evict_unattached(self, live: list[ClientRecord]) -> bool:
        """Make room by retiring the oldest registration that was never attached although it
        had PENDING_GRACE_S to: a client attaches within milliseconds of registering, so such
        a registration is dead or hostile, and registrations over ZeroMQ carry no credentials
        to refuse them by. Without this, peers that register and never attach hold every place."""
        stale = [c for c in live if not c.attached
                 and c.registered_at < time.monotonic() - PENDING_GRACE_S]
        if not stale:
            return False
        self.accounts.totals["reaped"] += 1
        self._retire(min(stale, key=lambda c: c.registered_at), "evicted (never attached)")
        return True

    def _bound_pending(self, live: list[ClientRecord], peer: PeerCredentials) -> list[ClientRecord]:
        """Keep `peer`'s user under `pending_per_uid` unattached registrations, counting the one
        it makes now, by retiring the oldest of its process with the most: a client attaches
        within milliseconds, so a user's many unattached ones are dead or hostile, and without
        this 32 connections renewing theirs let a good client of any user in 0-1 times in 20.
        Returns the live registrations left."""
        mine = [c for c in live if not c.attached and c.registrant is not None
                and c.registrant.uid == peer.uid]
        if len(mine) < self.limits.pending_per_uid:
            return live
        pids = Counter(c.registrant.pid for c in mine)
        most = max(pids.values())
        victim = min((c for c in mine if pids[c.registrant.pid] == most), key=lambda c: c.registered_at)
        self.accounts.totals["reaped"] += 1
        self._retire(victim, f"evicted (uid {peer.uid} has {len(mine)} registrations not "
                             "attached; config: pending_registrations_per_uid)")
        return [c for c in live if c is not victim]

    def attach(self, client_id: int, token: str, peer: PeerCredentials) -> ClientRecord:
        """The second step of a registration, over the handle socket: the peer proves it made the
        registration (its token, good once) and passes the credentials check; then its slab is
        allocated (served). A refused peer's registration is retired with nothing allocated."""
        record = self.clients.get(client_id)
        if (record is None or record.releasing or not isinstance(token, str)
                or not secrets.compare_digest(token.encode(), record.token.encode())):
            raise NotRegisteredError(f"no live registration {client_id!r} with that token")
        if record.attached:
            raise BadRequestError(f"client {client_id} is attached already (a token attaches once)")
        if not self.limits.allows(peer):
            self._retire(record, f"refused (peer uid {peer.uid} gid {peer.gid} pid {peer.pid})")
            raise PermissionDeniedError(f"uid {peer.uid} / gid {peer.gid} may not use this daemon "
                                        "(config: allowed_uids, allowed_gids)")
        cap = self.limits.max_clients_per_uid
        held = sum(1 for c in self.clients.values()
                   if not c.releasing and c.peer is not None and c.peer.uid == peer.uid)
        if cap and held >= cap:
            self._retire(record, f"refused (uid {peer.uid} holds {held} clients)")
            raise ResourceError(f"uid {peer.uid} holds {held} clients, the most one user may "
                                "(config: max_clients_per_uid)")
        if record.pinned_tables not in (None, self.tables_id):  # a reload came between
            self._retire(record, "refused (its pinned tables were replaced)")
            raise TablesChangedError(f"client {client_id} pinned tables {record.pinned_tables}; "
                                     f"a reload replaced them with {self.tables_id}")
        if record.mode == "mapped":  # it maps the tables served now
            record.tables = self.tables_id
        if record.mode == "served":
            try:
                record.slab = self.backend.allocate_slab(record.device, record.layout, client_id,
                                                         record.shard)
            except BaseException as exc:  # nothing to attach to: the registration goes too
                self._retire(record, f"retired (no slab: {exc})")
                raise
        record.peer = peer
        record.watch = ProcessWatch(peer.pid) if peer.pid > 0 else None
        record.last_seen = time.monotonic()
        log.info("client %d attached: pid %d uid %d gid %d%s", client_id, peer.pid, peer.uid,
                 peer.gid, f", slab {record.layout.size} B" if record.slab else "")
        return record

    def client(self, identity: bytes, client_id: int) -> ClientRecord:
        record = self.clients.get(client_id)
        if record is None or record.releasing:
            raise NotRegisteredError(f"client {client_id} is not registered with this daemon "
                                     "(released, reaped, or registered with an earlier run)")
        if record.identity != identity:
            raise NotRegisteredError(f"client {client_id} belongs to another connection")
        record.last_seen = time.monotonic()
        return record

    def heartbeat(self, identity: bytes, client_id: int, token: str, counts: Any = None,
                  tables: str | None = None) -> None:
        """A sign of life from the client's own connection, or from another one with its token.
        Mapped clients report their cumulative lookup counts with it, and the tables they map."""
        record = self.clients.get(client_id)
        if (record is None or record.releasing or not token
                or not secrets.compare_digest(token.encode(), record.token.encode())):
            record = self.client(identity, client_id)  # NotRegisteredError unless it is that connection
        record.last_seen = time.monotonic()  # alive, whatever it reports
        if record.mode != "mapped":
            return
        checked = checked_counts(record, counts) if counts is not None else None
        if tables is not None and not TABLES_ID.fullmatch(tables):
            raise BadRequestError(f"tables {printable(tables[:40])!r}: expected a tables id "
                                  "(16 hex digits, as the daemon names them)")
        if checked is not None:
            self.accounts.take_counts(record, checked)
        if tables is not None:
            record.tables = tables

    def grant_tables(self, client_id: int, token: str, peer: PeerCredentials) -> ClientRecord:
        """A mapped client asks for the descriptors of the tables served now (after a reload):
        its token, attached, by the user that attached it."""
        record = self.clients.get(client_id)
        if (record is None or record.releasing or not isinstance(token, str)
                or not secrets.compare_digest(token.encode(), record.token.encode())):
            raise NotRegisteredError(f"no live registration {client_id!r} with that token")
        if not record.attached or record.peer.uid != peer.uid:
            raise PermissionDeniedError(f"client {client_id} is not attached by uid {peer.uid}")
        if record.mode != "mapped":
            raise BadRequestError(f"client {client_id} is served: it maps no tables")
        if record.pinned_tables is not None and record.pinned_tables != self.tables_id:
            raise TablesChangedError(f"client {client_id} pinned tables {record.pinned_tables}; "
                                     f"the daemon serves {self.tables_id} now")
        record.tables = self.tables_id
        return record

    def tables_changed(self, tables_id: str) -> None:
        """A reload switched the tables: served clients read the new ones from their next
        lookup on (those pinned to others are refused); mapped ones say when they re-map."""
        self.tables_id = tables_id
        self.tables_seq += 1
        for record in self.clients.values():
            if record.mode == "served" and record.pinned_tables is None:
                record.tables = tables_id

    def retire_client(self, client_id: int, why: str) -> None:
        """The registration's lease closed (the client's process is gone, or it let go)."""
        record = self.clients.get(client_id)
        if record is not None and not record.releasing:
            self.accounts.totals["reaped"] += 1
            self._retire(record, why)

    def retire_identity(self, identity: bytes, why: str) -> list[int]:
        """The connection is gone (the socket said so): retire its clients."""
        gone = [c for c in self.clients.values() if c.identity == identity and not c.releasing]
        for record in gone:
            self.accounts.totals["reaped"] += 1
            self._retire(record, why)
        return [c.client_id for c in gone]

    def release(self, identity: bytes, client_id: int, counts: Any = None) -> None:
        """The client is done; a mapped one reports its final counts with it."""
        record = self.client(identity, client_id)
        if record.mode == "mapped" and counts is not None:
            try:  # the release goes ahead whatever it reports: its counts are only not taken
                self.accounts.take_counts(record, checked_counts(record, counts))
            except BadRequestError as exc:
                log.info("client %d released with counts not taken: %s", client_id, exc.message)
        self._retire(record, "released")

    def _retire(self, record: ClientRecord, why: str) -> None:
        record.releasing = True
        log.info("client %d %s (%d lookups in flight)", record.client_id, why,
                 sum(record.in_flight.values()))
        self._on_retire(record)
        cut = self.backend.drop_queued(record.client_id)  # may finish lookups (and free) here
        if cut:
            log.info("client %d: %d of its lookups cut short (what no gather had begun, dropped)",
                     record.client_id, cut)
        if not record.in_flight:
            self._free(record)

    def _free(self, record: ClientRecord) -> None:
        if self.clients.pop(record.client_id, None) is None:
            return  # freed already (its last lookup finished while it was retired)
        if record.slab is not None:
            record.slab.close()

    def reap_dead(self) -> list[int]:
        """Retire what the leases cannot: registrations never attached within `attach_timeout`,
        and clients silent for `silence_s` whose process is not visibly alive here (hung, or in
        another PID namespace). A live client is never reaped: its library heartbeats from a background
        thread, and a frozen one (SIGSTOP) is visibly alive."""
        now = time.monotonic()
        dead = []
        for c in self.clients.values():
            if c.releasing:
                continue
            alive = c.watch.alive() if c.watch is not None else None
            if not c.attached and c.registered_at < now - self.limits.attach_timeout:
                dead.append((c, f"reaped (never attached within {self.limits.attach_timeout:.0f} s)"))
            elif alive is False:
                dead.append((c, f"reaped (process {c.watch.pid} is gone)"))
            elif c.attached and alive is None and c.last_seen < now - self.limits.silence_s:
                dead.append((c, f"reaped (no heartbeat for {HEARTBEAT_MISSES} intervals, "
                                "process not visible here)"))
        for record, why in dead:
            self.accounts.totals["reaped"] += 1
            self._retire(record, why)
        return [c.client_id for c, _ in dead]

    # -- lookups --------------------------------------------------------------------------------

    def start_lookup(self, identity: bytes, req: LookupRequest, payload: list[bytes],
                     done: Completion, context: JobContext) -> LookupJob:
        record = self.client(identity, req.client_id)
        if record.slab is None:
            record.errors += 1
            if record.mode == "served":
                raise NotRegisteredError(f"client {record.client_id} has not attached (handle socket)")
            raise BadRequestError(f"client {record.client_id} is registered in mapped mode: it "
                                  "gathers from its own mapping of the tables, not through the daemon")
        check_ids_handed_over(record, req)
        try:
            job = check_lookup(record, req, payload, self.geometry, self.tables_id,
                               self.backend.orders_slots)
        except EngramError:
            record.errors += 1
            self._release_refused(record, req, done)
            raise
        if context.received is None:  # a caller without a transport: the store's own time
            context.received = time.perf_counter()
        job.context = context
        self._submit(record, job, done)
        return job

    def _submit(self, record: ClientRecord, job: LookupJob, done: Completion) -> None:
        record.in_flight[job.slot] += 1
        record.last_seq[job.slot] = job.seq
        self.backend.submit(job, done)

    def overdue_lookups(self) -> list[str]:
        """What to say of each GPU lookup whose IDs its client's stream has not handed over
        within `ids_wait_s` of its enqueue (once per lookup): the daemon's stream waits for
        them, and so does every stream that shares its hardware queue, other clients' too."""
        said = []
        for job in self.backend.overdue_lookups(self.limits.ids_wait_s):
            record = self.clients.get(job.client_id)
            pid = record.peer.pid if record is not None and record.peer is not None else None
            said.append(f"client {job.client_id}{f' (pid {pid})' if pid else ''}: lookup {job.seq} "
                        f"(slot {job.slot}) has waited over {self.limits.ids_wait_s:g} s for its "
                        "IDs, which its stream has not copied; until they come the daemon's stream "
                        "for it waits, and so does every stream sharing that hardware queue")
        return said

    def _release_refused(self, record: ClientRecord, req: LookupRequest, done: Completion) -> None:
        """GPU clients wait on the slot's counter without awaiting the reply: release it in order."""
        slot = req.slot
        if not self.backend.orders_slots or not 0 <= slot < record.slab.layout.slots:
            return
        # Its rows become NaN, for a consumer whose wait() returned before the refusal reached its
        # client: the request's tokens, or the whole slot where its size is what was wrong.
        job = LookupJob(record.client_id, record.slab, record.shard, slot, req.seq,
                        refused_tokens(req, record.slab.layout.max_tokens), skip=True,
                        context=JobContext(silent=True))
        self._submit(record, job, done)

    def finish_lookup(self, job: LookupJob) -> LookupReply | None:
        """Book-keep a completed job; returns its reply (None for a skipped one, which is
        silent) or raises the job's error."""
        record = self.clients.get(job.client_id)
        if record is not None:
            record.in_flight[job.slot] -= 1
            if record.in_flight[job.slot] <= 0:
                del record.in_flight[job.slot]
            if record.releasing and not record.in_flight:
                self._free(record)
        if job.skip:
            return None
        if job.error is not None:
            if record is not None:
                record.errors += 1
            if isinstance(job.error, EngramError):
                raise job.error
            raise InternalError(f"gather failed: {type(job.error).__name__}: {job.error}")
        self.accounts.count_lookup(record, job, job.tokens * self.geometry.n_layers * job.shard.owned_heads)
        # A GPU's count stays on the device (stats reads it).
        return LookupReply(job.slot, job.seq, job.out_of_range if self.backend.counts_per_job else None)

    # -- introspection --------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return self.accounts.stats(self.clients.values())

    def who(self) -> list[dict[str, Any]]:
        """Who each live client is (pid, name, uid): the `clients` admin operation."""
        return [c.who() for c in self.clients.values() if not c.releasing]

    def close(self) -> None:
        """Free every slab. The backend must take no more jobs (backend.stop first)."""
        for record in list(self.clients.values()):
            self._free(record)

