"""Peer reads (``dataplane.peerread``) on a real ``redis-server`` and Mooncake's transfer engine
over TCP on loopback: two stores under two prefixes stand for two hosts. Host B reads a chunk
straight from host A's registered slab, byte for byte, with no value in Redis; once A evicted the
chunk and reused its slot for other bytes, B's read is a miss (and falls back to the value where
one was written), never wrong bytes; with A's process killed, B's read is a miss within a bounded
time; with A's process stopped (SIGSTOP: its sockets stay open, nothing answers), B's read is a
miss within its own bound, and its bytes, landing once A resumes, reach a staging buffer only.

Skipped when the transfer engine does not load (the ``peer`` extra); with
``KVBLEND_REQUIRE_PEER=1`` (set by ``.ci/run``) that fails instead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import redis

from kvblend.dataplane.peerread import Endpoint, Engine, Peer, endpoint_key, unavailable
from kvblend.dataplane.promote import Promoted, promote
from kvblend.dataplane.remote import Fetched, Miss, RemoteTier
from kvblend.dataplane.remoteformat import PeerAt
from kvblend.dataplane.writebehind import WriteBehind
from kvblend.shm.events import EventLog
from kvblend.shm.header import ORIGIN_STANDALONE
from kvblend.shm.store import ChunkKey, Store
from tests.harness import poll, remove_prefix, unique_prefix
from tests.remote.conftest import KEY, ClusterProcs
from tests.remote.peer_setup import HOST, POS0, Document, commit_chunks, document, open_store

REASON = unavailable()
if REASON is not None:
    if os.environ.get("KVBLEND_REQUIRE_PEER") == "1":
        pytest.fail(f"KVBLEND_REQUIRE_PEER=1 but {REASON}", pytrace=False)
    pytest.skip(REASON, allow_module_level=True)

pytestmark = pytest.mark.slow

DEADLINE = 30.0
#: a killed holder's reads must be misses within this (loopback: the connection is refused)
KILLED_MISS_S = 10.0
#: a stopped holder's read must be a miss within this (the read's own bound is 2 s; before the
#: bound, such a read waited until the holder resumed, or 61 s)
STOPPED_MISS_S = 20.0
#: a stopped holder is resumed after this whatever happens, so that a read with no bound fails
#: the test instead of hanging it
WATCHDOG_S = 60.0
ROOT = Path(__file__).resolve().parents[2]


class Host:
    """A store under its own prefix, its tier client, and its peer reads."""

    def __init__(self, url: str, values: bool = False) -> None:
        self.prefix = unique_prefix("kvbpeer")
        self.store = open_store(self.prefix)
        self.tier = RemoteTier(url, key=KEY, timeout_s=DEADLINE)
        self.events = EventLog.open(self.prefix)
        self.peer = Peer(self.tier, self.store, f"{HOST}/{self.prefix}", Engine(HOST),
                         values=values, events=self.events)
        assert self.peer.publish()

    def counted(self, read: int, missed: int, fell_back: int, timed_out: int = 0) -> bool:
        """The peer's counts are these, and the event log (``/metrics``) holds the same."""
        want = {"read": read, "missed": missed, "fell_back": fell_back, "timed_out": timed_out}
        logged = self.events.counters()
        return self.peer.counts == want and {
            "read": logged.get("remote_peer_reads", 0),
            "missed": logged.get("remote_peer_misses", 0),
            "fell_back": logged.get("remote_peer_fallbacks", 0),
            "timed_out": logged.get("remote_peer_timeouts", 0)} == want

    def write_behind(self, doc: Document) -> tuple[int, list[ChunkKey]]:
        """Commit ``doc`` here and write its records (and values, where on) behind."""
        class_id, keys = commit_chunks(self.store, doc)
        wb = WriteBehind(self.store, self.tier, peer=self.peer)
        wb.offer(class_id, doc.ns.root, keys, doc.rows)
        assert wb.flush(timeout=DEADLINE) and wb.counts["written"] == len(keys), wb.counts
        wb.close(timeout=DEADLINE)
        return class_id, keys

    def learn(self) -> int:
        """Every record in the stream, as discovery would hand them over; how many."""
        got = self.tier.records("0", 1000) or []
        records = [r for _, r in got if r is not None]
        self.peer.learn(records)
        return len(records)

    def close(self) -> None:
        self.peer.close()
        self.tier.close()
        self.events.close()
        self.store.close()
        remove_prefix(self.prefix)


@pytest.fixture
def hosts(redis_url: str) -> Iterator[list[Host]]:
    made: list[Host] = []
    yield made
    for h in made:
        h.close()


def promote_into(b: Host, doc: Document, i: int) -> Promoted | Miss:
    class_id = b.store.register_class(doc.cc)
    return promote(b.store, b.tier, class_id, doc.ns.id, doc.ids[i], doc.rows[i], peer=b.peer)


def kv_of(store: Store, doc: Document, i: int) -> np.ndarray:
    with store.pinned([_key(doc, i)]) as got:
        assert got[0] is not None, "not stored"
        return np.array(got[0].kv.view(np.uint16))


def test_a_host_reads_a_chunk_from_the_holders_slab(hosts: list[Host], redis_url: str) -> None:
    a, b = Host(redis_url), Host(redis_url)
    hosts += [a, b]
    doc = document(3, seed=1)
    a.write_behind(doc)
    with redis.Redis.from_url(redis_url) as raw:  # records only: no value was written
        assert raw.exists(*(cid.key for cid in doc.ids)) == 0
    assert b.learn() == 3
    for i in range(3):
        assert promote_into(b, doc, i) is Promoted.PROMOTED
        assert np.array_equal(kv_of(b.store, doc, i), doc.kvs[i])
    pos, origin = b.store.provenance(doc.ns.id, [cid.chunk_hash for cid in doc.ids])
    assert pos.tolist() == [POS0 + 16 * i for i in range(3)]
    assert origin.tolist() == [ORIGIN_STANDALONE] * 3
    assert b.counted(read=3, missed=0, fell_back=0)


def reuse_the_slot(a: Host, doc: Document) -> Document:
    """A evicts ``doc``'s first chunk and stores another one, with other bytes, in its slot."""
    slot = a.store.pin_slots([_key(doc, 0)])
    first = a.peer.at(int(slot[0]))
    a.store.unpin_slots(slot)
    a.store.clear()
    other = document(1, seed=99)
    commit_chunks(a.store, other)
    slot = a.store.pin_slots([_key(other, 0)])
    assert a.peer.at(int(slot[0])) == first, "the other chunk did not take the same slot"
    a.store.unpin_slots(slot)
    return other


def _key(doc: Document, i: int) -> ChunkKey:
    return ChunkKey(doc.ns.id, doc.ids[i].chunk_hash)


def test_a_reused_slot_is_a_miss_never_wrong_bytes(hosts: list[Host], redis_url: str) -> None:
    a, b = Host(redis_url), Host(redis_url)
    hosts += [a, b]
    doc = document(1, seed=2)
    a.write_behind(doc)
    assert b.learn() == 1
    place = b.peer.place(doc.ids[0])
    assert place is not None
    other = reuse_the_slot(a, doc)
    staging = np.zeros(doc.ids[0].kv_bytes, np.uint8)
    # the one-sided read happened (the other chunk's bytes came over) and its digest failed
    assert b.peer.read_into(doc.ids[0], doc.rows[0], staging, place) is Miss.CORRUPT
    assert np.array_equal(staging.view(np.uint16), other.kvs[0].reshape(-1))
    assert promote_into(b, doc, 0) is Miss.CORRUPT
    assert not b.store.contains_key(_key(doc, 0))  # nothing committed
    assert b.peer.place(doc.ids[0]) is None  # forgotten: not read there again
    assert b.counted(read=0, missed=1, fell_back=0)


def test_a_reused_slot_falls_back_to_the_value_where_one_was_written(
        hosts: list[Host], redis_url: str) -> None:
    a, b = Host(redis_url, values=True), Host(redis_url)
    hosts += [a, b]
    doc = document(1, seed=3)
    a.write_behind(doc)
    assert b.learn() == 1
    reuse_the_slot(a, doc)
    assert promote_into(b, doc, 0) is Promoted.PROMOTED
    assert np.array_equal(kv_of(b.store, doc, 0), doc.kvs[0])  # the value's bytes, not the slot's
    assert b.counted(read=0, missed=1, fell_back=1)


def test_a_hostile_place_or_endpoint_is_a_miss(hosts: list[Host], redis_url: str) -> None:
    a, b = Host(redis_url), Host(redis_url)
    hosts += [a, b]
    doc = document(1, seed=4)
    a.write_behind(doc)
    b.learn()
    place = b.peer.place(doc.ids[0])
    assert place is not None
    staging = np.zeros(doc.ids[0].kv_bytes, np.uint8)
    past = type(place)(PeerAt(place.at.holder, a.store.slab.nbytes - 16, False), place.digest,
                       place.pos0, place.origin)
    assert b.peer.read_into(doc.ids[0], doc.rows[0], staging, past) is Miss.OTHER_CHUNK
    nobody = type(place)(PeerAt("10.0.0.1/nobody", 0, False), place.digest, place.pos0,
                         place.origin)
    assert b.peer.read_into(doc.ids[0], doc.rows[0], staging, nobody) is Miss.UNAVAILABLE
    key = endpoint_key(place.at.holder)
    with redis.Redis.from_url(redis_url) as raw:
        raw.set(key, b'{"session": "x; rm -rf /", "base": 1, "size": 1, "gen": 0}')
    b2 = Host(redis_url)  # no cached endpoint
    hosts.append(b2)
    assert b2.peer.read_into(doc.ids[0], doc.rows[0], staging, place) is Miss.UNAVAILABLE
    assert PeerAt.parse(b"1:12:a holder\n") is None and PeerAt.parse(b"2:1:h") is None
    assert PeerAt.parse(b"0:1:h/p") == PeerAt("h/p", 1, False)
    assert Endpoint(session="h:1", base=1, size=1, gen=0).size == 1


@contextmanager
def holder_process(redis_url: str, chunks: int, seed: int) -> Iterator[subprocess.Popen]:
    """A holder host in a process of its own (``tests.remote.peer_holder``), ready; killed at
    the end whatever its state."""
    prefix = unique_prefix("kvbpeerA")
    with subprocess.Popen([sys.executable, "-m", "tests.remote.peer_holder", prefix, redis_url,
                           str(chunks), str(seed)], cwd=ROOT, stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            yield holder
        finally:
            if holder.poll() is None:
                holder.send_signal(signal.SIGCONT)
                holder.kill()
            remove_prefix(prefix)


def test_a_killed_holder_is_a_miss_within_a_bounded_time(hosts: list[Host],
                                                         redis_url: str) -> None:
    with holder_process(redis_url, 2, 5) as holder:
        b = Host(redis_url)
        hosts.append(b)
        doc = document(2, seed=5)
        assert b.learn() == 2
        assert promote_into(b, doc, 0) is Promoted.PROMOTED  # the holder answers
        assert np.array_equal(kv_of(b.store, doc, 0), doc.kvs[0])
        holder.send_signal(signal.SIGKILL)
        holder.wait(DEADLINE)
        start = time.monotonic()
        assert promote_into(b, doc, 1) is Miss.UNAVAILABLE
        assert promote_into(b, doc, 1) is Miss.UNAVAILABLE  # its endpoint read again
        assert time.monotonic() - start < KILLED_MISS_S
        assert not b.store.contains_key(_key(doc, 1))


@contextmanager
def stopped(holder: subprocess.Popen) -> Iterator[None]:
    """``holder`` SIGSTOPped (its sockets stay open, nothing answers) until the block ends, or
    ``WATCHDOG_S`` passed: a read with no bound then returns late and fails its assertion."""
    holder.send_signal(signal.SIGSTOP)
    watchdog = threading.Timer(WATCHDOG_S, holder.send_signal, (signal.SIGCONT,))
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
        holder.send_signal(signal.SIGCONT)


def meet(b: Host, doc: Document) -> None:
    """B reads ``doc``'s first chunk from the holder (their engines have met)."""
    assert b.learn() == len(doc.ids)
    assert promote_into(b, doc, 0) is Promoted.PROMOTED
    assert np.array_equal(kv_of(b.store, doc, 0), doc.kvs[0])


def test_a_stopped_holder_is_a_miss_within_a_bound_never_a_hang(hosts: list[Host],
                                                                redis_url: str) -> None:
    """The read waits at most its bound, then the holder is suspect: its next read misses at
    once, with no staging buffer and no thread spent, until the stuck read returned."""
    with holder_process(redis_url, 3, 12) as holder:
        b = Host(redis_url)
        hosts.append(b)
        doc = document(3, seed=12)
        meet(b, doc)
        staging = b.peer.staging
        with stopped(holder):
            start = time.monotonic()
            assert promote_into(b, doc, 1) is Miss.UNAVAILABLE
            assert time.monotonic() - start < STOPPED_MISS_S
            assert (staging.free, staging.abandoned) == (staging.count - 1, 1)
            assert b.peer.suspects == {holder_of(b, doc)}
            threads = threading.active_count()
            start = time.monotonic()
            assert promote_into(b, doc, 2) is Miss.UNAVAILABLE  # at once: nothing spent
            assert time.monotonic() - start < STOPPED_MISS_S
            assert (staging.free, threading.active_count()) == (staging.count - 1, threads)
            assert b.counted(read=1, missed=2, fell_back=0, timed_out=2)
        assert not b.store.contains_key(_key(doc, 1)) and not b.store.contains_key(_key(doc, 2))


def holder_of(b: Host, doc: Document) -> str:
    place = b.peer.place(doc.ids[0])
    assert place is not None
    return place.at.holder


def test_a_read_given_up_on_lands_in_its_staging_buffer_never_in_the_slot(
        hosts: list[Host], redis_url: str) -> None:
    """Once the stopped holder resumes, the abandoned read completes into its staging buffer,
    which then comes back; the buffer the read was for keeps what was put there after the
    miss, and the holder is read again, byte for byte."""
    with holder_process(redis_url, 2, 13) as holder:
        b = Host(redis_url)
        hosts.append(b)
        doc = document(2, seed=13)
        meet(b, doc)
        place = b.peer.place(doc.ids[1])
        assert place is not None
        dest = np.zeros(doc.ids[1].kv_bytes, np.uint8)
        staging = b.peer.staging
        with stopped(holder):
            assert b.peer.read_into(doc.ids[1], doc.rows[1], dest, place) is Miss.UNAVAILABLE
            dest.fill(0xA5)  # what the slot holds after the miss: no late byte may change it
        poll(lambda: staging.free == staging.count and not b.peer.suspects, DEADLINE,
             "the abandoned read to return once the holder resumed")
        assert (dest == 0xA5).all()
        assert promote_into(b, doc, 1) is Promoted.PROMOTED
        assert np.array_equal(kv_of(b.store, doc, 1), doc.kvs[1])
        assert b.counted(read=2, missed=0, fell_back=0, timed_out=1)


def test_without_values_a_chunk_is_written_as_its_record_only(hosts: list[Host],
                                                              redis_url: str) -> None:
    a = Host(redis_url)
    hosts.append(a)
    doc = document(2, seed=6)
    a.write_behind(doc)
    got = [r for _, r in a.tier.records("0", 10) or [] if r is not None]
    assert [r.peer.holder for r in got if r.peer] == [a.peer.holder] * 2
    assert all(r.peer is not None and not r.peer.valued for r in got)
    assert isinstance(a.tier.get(doc.ids[0], doc.rows[0]), Miss)
    assert not isinstance(a.tier.get(doc.ids[0], doc.rows[0]), Fetched)


def test_two_served_hosts_share_a_document_through_peer_reads(redis_url: str) -> None:
    """``kvblend serve --remote-peer --remote-peer-records-only`` twice: B finds, prefetches and
    retrieves A's document byte for byte, though Redis holds no value of it."""
    from tests.remote.test_hosts import Host as Served
    from tests.remote.test_hosts import share_and_retrieve

    flags = ("--remote-peer", "--remote-peer-records-only")
    served: list[Served] = []
    try:
        served += [Served(redis_url, *flags), Served(redis_url, *flags)]
        share_and_retrieve(*served)
        assert served[1].counter("remote_peer_reads") == 3  # in B's /metrics
        assert served[1].counter("remote_peer_misses") == 0
        with redis.Redis.from_url(redis_url) as raw:
            assert raw.keys("kvblend:1:*:0") == []  # no value: every byte came from A's slab
            assert len(raw.keys("kvblend:1:peer:*")) == 2  # both endpoints
    finally:
        for h in served:
            h.close()


def test_a_dead_master_leaves_every_holders_endpoint_readable(
        hosts: list[Host], redis_cluster: ClusterProcs) -> None:
    """On a cluster the endpoint record has a copy on every master: with the master that would
    hold a single copy killed, B still reads A's chunks (the namespace runs lost every chunk of
    such a holder before)."""
    a, b = Host(redis_cluster.cluster_url), Host(redis_cluster.cluster_url)
    hosts += [a, b]
    doc = document(3, seed=11)
    a.write_behind(doc)
    streams = b.tier.record_streams()
    assert streams is not None and len(streams) == len(redis_cluster.nodes)
    for stream in streams:  # discovery before the outage, as every host's tail does
        got = b.tier.records("0", 1000, stream=stream) or []
        b.peer.learn([r for _, r in got if r is not None])
    victim = redis_cluster.node_for_key(endpoint_key(a.peer.holder))
    victim.kill()
    try:
        for i in range(3):
            assert promote_into(b, doc, i) is Promoted.PROMOTED
            assert np.array_equal(kv_of(b.store, doc, i), kv_of(a.store, doc, i))
    finally:
        victim.restart()
        redis_cluster.wait_ok()
