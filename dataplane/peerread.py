"""Peer reads: a host reads a chunk's KV straight out of the slab of the host that holds it,
one-sided, through Mooncake's transfer engine (TCP, or RDMA where the hosts have it), while the
remote store keeps only the small records: which host holds which chunk, where in its slab, with
the digest of its value.

This module owns the transfer engine of this data plane (its slab registered), this host's endpoint
record, where this host's chunks sit (what write-behind puts in their records), what the records
of other hosts' chunks said of their place, and the read of one chunk from its holder. It does not
own the records' format and checks (``dataplane.remoteformat``: ``PeerAt``, ``kv_digest_ok``), the
client of the remote store (``dataplane.remote``), tailing the records (``dataplane.discovery``) or
committing what was read (``dataplane.promote``). The transfer engine comes with the ``peer``
extra (``pip install 'kvblend[peer]'``); without it ``Peer.start`` logs why, and the tier reads
values only.

Records in the remote store::

    kvblend:1:peer:<holder>   a holder's endpoint, JSON ``Endpoint``: the engine's session
                              ("host:rpc port"), the slab's base address and size there, and a
                              generation drawn at each start; written with a TTL of
                              endpoint_ttl_s, renewed every third of it, deleted at a clean stop.
                              On a cluster, one copy per master: kvblend:1:peer:{N}:<holder>
                              beside each record stream {N}; a reader takes the first it reads
    a chunk's record, ``p``   ``PeerAt``: the holder, the KV's offset in its slab, and whether
                              the value was written too (``dataplane.remoteformat``)

Read of one chunk by host B from holder A::

    B knows no place of it (no record said one)  --> the value (RemoteTier.get_into), as before
    A's endpoint: cached for a third of its TTL, else read again; absent --> UNAVAILABLE
    offset + KV bytes past A's registered size                          --> OTHER_CHUNK
    A has a read of B's stuck (it timed out, below) and the same generation
                                                              --> UNAVAILABLE at once (timeouts)
    one-sided read of the KV into a staging buffer of B's (``dataplane.peerstaging``),
    waited for at most read_timeout_s (for a free buffer, then for the read):
        none came free, or every one waits on a stuck read    --> UNAVAILABLE (timeouts)
        not returned in time (A stopped: its sockets stay open) --> UNAVAILABLE (timeouts);
                                the buffer stays with the read, A is suspect until it returns
        the engine failed (A gone, killed, its port closed)   --> UNAVAILABLE, A's endpoint
                                                                  read again next time
    the staging buffer copied into B's buffer (a reserved slot of B's slab), then the HMAC of
    the value's head (rebuilt from the record) and that copy, against the record's digest; it
    differs (the slot was evicted, reused or rewritten, mid-read or before)
                                                              --> CORRUPT, the place forgotten
    --> Fetched: B commits the slot (``dataplane.promote``)
    a miss where the record says the value was written too    --> the value, as before

NOTE: the read is one-sided: A's data plane takes no part, holds no pin, and may evict and reuse
the slot at any moment, even while B reads it. That is safe because the digest is checked over
B's own copy in its slot, after the read completed: whatever A's slot holds by then, B commits
exactly the bytes that were digested, and a torn or reused slot fails the digest. The engine
never writes into a slot: a read B gave up on may still land (A resumed), and it lands in a
staging buffer that no slot takes bytes from until that read has returned. A's engine answers
reads of its whole registered slab to anyone who reaches its port (the TCP transport has no
authentication): the port belongs on the network between the tier's hosts only
(docs/security.md).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec
import numpy as np
from msgspec import Meta

from kvblend.dataplane.peerstaging import Outcome, StagingPool
from kvblend.dataplane.remote import ChunkId, Fetched, Miss, Record, RemoteTier
from kvblend.dataplane.remoteformat import KEY_PREFIX, PeerAt, kv_digest_ok
from kvblend.dataplane.settings import PeerSettings
from kvblend.shm.events import EventLog
from kvblend.shm.store import Store
from kvblend.shm.telemetry import Counter

log = logging.getLogger("kvblend.dataplane")

#: the transfer engine's way to find a peer: the handshake of the two engines, no metadata service
HANDSHAKE = "P2PHANDSHAKE"
#: places of other hosts' chunks kept at most (the oldest learnt are forgotten first)
KNOWN = 1 << 18


def unavailable() -> str | None:
    """Why peer reads cannot run in this process (the transfer engine does not load), or None."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as exc:  # the extra is missing, or a library it needs (libibverbs)
        return f"the transfer engine does not load ({exc}); pip install 'kvblend[peer]'"
    return None


class PeerUnavailable(RuntimeError):
    """The transfer engine did not start or did not register the slab."""


class Engine:
    """Mooncake's transfer engine, started for one host: ``read`` from a peer's registered memory.

    Args:
        host: the name or address the peers reach this engine at.
        protocol: ``tcp`` or ``rdma``.
        device: RDMA device(s), or empty.

    Raises:
        PeerUnavailable: it did not start.
    """

    def __init__(self, host: str, protocol: str = "tcp", device: str = "") -> None:
        from mooncake.engine import TransferEngine

        self._te = TransferEngine()
        if self._te.initialize(host, HANDSHAKE, protocol, device) != 0:
            raise PeerUnavailable(f"the transfer engine did not start on {host} ({protocol})")
        #: what a peer names this engine by
        self.session = f"{host}:{self._te.get_rpc_port()}"
        self._registered: list[int] = []

    def register(self, buf: np.ndarray) -> int:
        """Register ``buf`` (kept alive by the caller) for reads by peers and into it; its
        address."""
        addr = int(buf.ctypes.data)
        if self._te.register_memory(addr, buf.nbytes) != 0:
            raise PeerUnavailable(f"the transfer engine did not register {buf.nbytes} bytes")
        self._registered.append(addr)
        return addr

    def read(self, session: str, local: int, remote: int, nbytes: int) -> bool:
        """Copy ``nbytes`` at ``remote`` of peer ``session`` to ``local``; False when it failed."""
        return bool(self._te.transfer_sync_read(session, local, remote, nbytes) == 0)

    def close(self) -> None:
        for addr in self._registered:
            self._te.unregister_memory(addr)
        self._registered.clear()


class Endpoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A holder's endpoint record (module docstring), every field bounded: it is read off a shared
    store, as hostile as any input."""

    session: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:-]{1,300}$")]
    base: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
    size: Annotated[int, Meta(ge=1, lt=1 << 56)]
    gen: Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]


def endpoint_key(holder: str, tag: str = "") -> str:
    """The key of ``holder``'s endpoint record; ``tag`` (``{N}``) puts it beside the record
    stream of that tag, on that stream's master."""
    return f"{KEY_PREFIX}peer:{tag + ':' if tag else ''}{holder}"


def endpoint_keys(holder: str, streams: Sequence[str] | None) -> list[str]:
    """Where ``holder``'s endpoint record is written and looked for: beside each of the tier's
    record streams (one per master of a cluster, so that a dead master costs no host its
    readers), or the one key on a server."""
    tags = [s[s.index("{"):] for s in streams or () if "{" in s and s.endswith("}")]
    return [endpoint_key(holder, t) for t in tags] or [endpoint_key(holder)]


@dataclass(frozen=True)
class _Place:
    """What a record said of another host's chunk."""

    at: PeerAt
    digest: bytes
    pos0: int
    origin: int


class Peer:
    """This host's part in peer reads (module docstring).

    Args:
        tier: the remote tier (its key checks what is read; the endpoint records go there).
        store: this host's store, whose slab is registered.
        holder: this host's name in records (``<host>/<prefix>``).
        engine: the started transfer engine.
        values: whether this host's chunks are also written as values (``PeerAt.valued``).
        endpoint_ttl_s: the endpoint record's life; it is renewed every third of it.
        known: places of other hosts' chunks kept at most.
        events: where ``counts`` also go (``shm.telemetry``'s ``REMOTE_PEER_*`` counters), or
            None.
        staging: staging buffers, reads at once (``dataplane.peerstaging``).
        staging_bytes: bytes of each, the largest chunk read; None: the store's page, which
            holds any slot.
        read_timeout_s: the bound of one read, from asking for a buffer to its bytes.
    """

    def __init__(self, tier: RemoteTier, store: Store, holder: str, engine: Engine, *,
                 values: bool = True, endpoint_ttl_s: float = 30.0, known: int = KNOWN,
                 events: EventLog | None = None, staging: int = 4,
                 staging_bytes: int | None = None, read_timeout_s: float = 2.0) -> None:
        self._tier, self._store, self._engine, self._events = tier, store, engine, events
        self.holder, self.values, self._ttl_s = holder, values, endpoint_ttl_s
        self._base = engine.register(store.slab)
        #: the staging buffers (tests read how many are free)
        self.staging = StagingPool(engine, staging, staging_bytes or store.config.page_bytes)
        self._read_timeout_s = read_timeout_s
        #: holders with reads stuck: holder -> (its endpoint's generation, reads stuck)
        self._suspect: dict[str, tuple[int, int]] = {}
        self.endpoint = Endpoint(engine.session, self._base, store.slab.nbytes,
                                 secrets.randbits(62))
        self._lock = threading.Lock()
        self._known: OrderedDict[tuple[bytes, int], _Place] = OrderedDict()
        self._limit = known
        self._endpoints: dict[str, tuple[Endpoint, float]] = {}
        self.counts = {"read": 0, "missed": 0, "fell_back": 0, "timed_out": 0}
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="kvblend-peer", daemon=True)

    @classmethod
    def start(cls, settings: PeerSettings, tier: RemoteTier, store: Store,
              events: EventLog | None = None) -> "Peer | None":
        """A started ``Peer`` with its endpoint published, or None (logged) where the transfer
        engine does not load or start: the tier then writes and reads values, as without
        peer reads."""
        reason = unavailable()
        try:
            if reason is None:
                engine = Engine(settings.host, settings.protocol, settings.device)
                peer = cls(tier, store, f"{settings.host}/{store.name}", engine,
                           values=settings.values, endpoint_ttl_s=settings.endpoint_ttl_s,
                           events=events, staging=settings.staging,
                           read_timeout_s=settings.read_timeout_s)
                peer._renewer.start()
                log.info("peer reads: slab registered with the transfer engine at %s (%s)",
                         engine.session, settings.protocol)
                return peer
        except PeerUnavailable as exc:
            reason = str(exc)
        log.warning("peer reads unavailable: %s; the remote tier writes and reads values only",
                    reason)
        return None

    # -- this host's chunks -------------------------------------------------------------------

    def at(self, slot: int) -> PeerAt:
        """Where the KV of this store's ``slot`` sits, for its record."""
        offset = int(self._store.slot_kv(slot).ctypes.data) - self._base
        return PeerAt(self.holder, offset, self.values)

    def publish(self) -> bool:
        """Write this host's endpoint record (with its TTL) on every master; False when no
        write succeeded."""
        blob, ttl_ms = msgspec.json.encode(self.endpoint), int(self._ttl_s * 1000)
        done = [self._tier.run(key, lambda c, k=key: c.set(k, blob, px=ttl_ms)) is True
                for key in endpoint_keys(self.holder, self._tier.record_streams())]
        return any(done)

    def _renew(self) -> None:
        while True:
            if not self.publish():
                log.warning("peer reads: the endpoint record was not written; retrying")
            if self._stop.wait(self._ttl_s / 3):
                return

    # -- other hosts' chunks ------------------------------------------------------------------

    def learn(self, records: Sequence[Record]) -> None:
        """Keep the places the records name (discovery's batches); the oldest go past ``known``."""
        with self._lock:
            for r in records:
                if r.peer is not None and r.peer.holder != self.holder:
                    place = (r.chunk.chunk_hash, r.chunk.rank)
                    self._known[place] = _Place(r.peer, r.digest, r.pos0, r.origin)
                    self._known.move_to_end(place)
            while len(self._known) > self._limit:
                self._known.popitem(last=False)

    def fetch(self, chunk: ChunkId, tokens: np.ndarray, dest: np.ndarray,
              fallback: Callable[[], Fetched | Miss]) -> Fetched | Miss:
        """``chunk`` into ``dest`` from its holder's slab where a record named its place, else or
        after a miss through ``fallback`` (the value), unless the record said none was written.

        Args:
            dest: a writable C-contiguous uint8 array of ``chunk.kv_bytes`` (a reserved slot's
                KV); undefined after a miss.
        """
        with self._lock:
            place = self._known.get((chunk.chunk_hash, chunk.rank))
        if place is None:
            return fallback()
        got = self.read_into(chunk, tokens, dest, place)
        if isinstance(got, Fetched):
            self._count("read")
            return got
        self._count("missed")
        if got is not Miss.UNAVAILABLE:  # the slot holds something else now: not there again
            with self._lock:
                self._known.pop((chunk.chunk_hash, chunk.rank), None)
        if place.at.valued:
            self._count("fell_back")
            return fallback()
        return got

    def read_into(self, chunk: ChunkId, tokens: np.ndarray, dest: np.ndarray, place: _Place
                  ) -> Fetched | Miss:
        """One one-sided read of ``chunk`` from its holder's slab into ``dest``, checked, in at
        most ``read_timeout_s`` once the holder's endpoint is known (module docstring)."""
        if not (dest.dtype == np.uint8 and dest.nbytes == chunk.kv_bytes
                and dest.flags.c_contiguous and dest.flags.writeable
                and chunk.kv_bytes <= self.staging.size):
            raise ValueError(f"dest must be a writable C-contiguous uint8 array of "
                             f"{chunk.kv_bytes} bytes, at most {self.staging.size}")
        holder = place.at.holder
        endpoint = self._endpoint(holder)
        if endpoint is None:
            return Miss.UNAVAILABLE
        if place.at.offset + chunk.kv_bytes > endpoint.size:
            return Miss.OTHER_CHUNK
        if self._stuck(holder, endpoint.gen):
            self._count("timed_out")
            return Miss.UNAVAILABLE
        got = self.staging.read(endpoint.session, endpoint.base + place.at.offset,
                                chunk.kv_bytes, self._read_timeout_s,
                                lambda ok: self._returned(holder, endpoint.gen, ok))
        if not isinstance(got, Outcome):
            with got:  # the digest is taken over the slot's copy (peerstaging's NOTE)
                np.copyto(dest, got.data)
        elif got is Outcome.FAILED:
            with self._lock:  # gone or restarted: its endpoint is read again next time
                self._endpoints.pop(holder, None)
            return Miss.UNAVAILABLE
        else:
            if got is Outcome.TIMED_OUT:
                self._suspected(holder, endpoint.gen)
            self._count("timed_out")
            return Miss.UNAVAILABLE
        if not kv_digest_ok(chunk, tokens, place.pos0, place.origin, dest, place.digest,
                            key=self._tier.key):
            return Miss.CORRUPT
        return Fetched(memoryview(dest).cast("B").toreadonly(), place.pos0, place.origin)

    # -- holders with a read stuck ------------------------------------------------------------

    @property
    def suspects(self) -> frozenset[str]:
        """Holders with a read given up on and not returned yet: read again once it did."""
        with self._lock:
            return frozenset(h for h, (_, n) in self._suspect.items() if n > 0)

    def _stuck(self, holder: str, gen: int) -> bool:
        """Whether ``holder`` has a read stuck; a new generation (it restarted) is not
        suspect."""
        with self._lock:
            suspect = self._suspect.get(holder)
            if suspect is not None and suspect[0] != gen:
                del self._suspect[holder]
                return False
            return suspect is not None and suspect[1] > 0

    def _suspected(self, holder: str, gen: int) -> None:
        self._tally(holder, gen, 1)

    def _returned(self, holder: str, gen: int, ok: bool) -> None:
        """A read given up on returned (on a staging worker): once its holder's last stuck read
        did, the holder is read again."""
        self._tally(holder, gen, -1)
        if not ok:
            with self._lock:
                self._endpoints.pop(holder, None)

    def _tally(self, holder: str, gen: int, step: int) -> None:
        """Count ``holder``'s reads stuck up or down. NOTE: a read may return before its caller
        counted it stuck (it returned just past the bound), so the tally may stand at -1 for a
        moment; it is stuck only above 0."""
        with self._lock:
            was, n = self._suspect.get(holder, (gen, 0))
            if was != gen:
                if step < 0:
                    return  # a read of a generation gone: the new one owes it nothing
                n = 0
            if n + step:
                self._suspect[holder] = (gen, n + step)
            else:
                self._suspect.pop(holder, None)

    def place(self, chunk: ChunkId) -> _Place | None:
        """What the records said of ``chunk``'s place, or None."""
        with self._lock:
            return self._known.get((chunk.chunk_hash, chunk.rank))

    def _endpoint(self, holder: str) -> Endpoint | None:
        now = time.monotonic()
        with self._lock:
            cached = self._endpoints.get(holder)
        if cached is not None and now - cached[1] < self._ttl_s / 3:
            return cached[0]
        endpoint = None
        for key in endpoint_keys(holder, self._tier.record_streams()):  # the first one readable
            raw = self._tier.run(key, lambda c, k=key: c.get(k))
            try:
                endpoint = msgspec.json.decode(raw, type=Endpoint) if raw else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                endpoint = None
            if endpoint is not None:
                break
        with self._lock:
            if endpoint is None:
                self._endpoints.pop(holder, None)
            else:
                if len(self._endpoints) >= self._limit:
                    self._endpoints.clear()
                self._endpoints[holder] = (endpoint, now)
        return endpoint

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1
        if self._events is not None:
            self._events.add(_COUNTERS[what])

    def close(self) -> None:
        """Stop renewing, delete the endpoint record (readers miss at once), unregister the
        slab."""
        self._stop.set()
        if self._renewer.is_alive():
            self._renewer.join()
        for key in endpoint_keys(self.holder, self._tier.record_streams()):
            self._tier.run(key, lambda c, k=key: c.delete(k))
        self.staging.close()
        self._engine.close()


_COUNTERS = {"read": Counter.REMOTE_PEER_READS, "missed": Counter.REMOTE_PEER_MISSES,
             "fell_back": Counter.REMOTE_PEER_FALLBACKS,
             "timed_out": Counter.REMOTE_PEER_TIMEOUTS}


__all__ = ["Peer", "Engine", "Endpoint", "PeerUnavailable", "unavailable", "endpoint_key",
           "endpoint_keys",
           "HANDSHAKE", "KNOWN"]
