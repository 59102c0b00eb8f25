"""The record streams of the remote tier: which stream a chunk's record goes to, and which streams
a reader tails.

A server keeps one stream, ``kvblend:1:fp``. A cluster keeps one per master, each named with a
hash tag that puts it on that master's slots: ``kvblend:1:fp:{N}``, where N is the smallest
integer whose stream lands on that master (tried N = 0, 1, 2, ...; a few tries for masters with
even shares of the slots). A chunk's record goes to the stream of the master that serves the
chunk's own key, so a value and its record are written to one master in one round trip: a dead
master loses the writes it would have taken and nothing else, and the other masters' streams
keep every record of the values they hold.

Every host sees the same slot map, so every host names the same streams. A new slot map (a
resharding, a master added) may name them anew: readers go on tailing the streams they knew
(``dataplane.discovery``), and the records in a stream whose slot moved move with it.

This module owns the names and the choice. It does not own the client (``dataplane.remote``
hands in its redis-py client) nor reading the streams (``dataplane.discovery``).
"""

from __future__ import annotations

import threading
from typing import Any

from kvblend.dataplane.remoteformat import STREAM

#: the most tags tried for one slot map; every slot is hit within it but with odds of about 1e-7
#: (a master serving a single slot needs 16,384 tries on average)
SCAN_LIMIT = 1 << 18


def stream_name(tag: int) -> str:
    """The stream of hash tag ``tag`` (a cluster's)."""
    return f"{STREAM}:{{{tag}}}"


class OneStream:
    """A server's streams: the one."""

    def of(self, key: str) -> str:
        return STREAM

    def all(self) -> list[str]:
        return [STREAM]


class MasterStreams:
    """A cluster's streams, one per master, from a redis-py ``RedisCluster``'s slot map (which
    it refreshes on its own, after a MOVED reply or a failed node).

    Args:
        client: the cluster client whose slot map names the masters.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._by_master: dict[str, str] = {}
        self._slotless: frozenset[str] = frozenset()  # masters no tag reached (no slots)

    def _owner(self, key: str) -> str | None:
        from redis.exceptions import SlotNotCoveredError
        try:
            return str(self._client.get_node_from_key(key).name)
        except SlotNotCoveredError:
            return None

    def of(self, key: str) -> str:
        """The stream of the master that serves ``key``."""
        master = self._owner(key)
        stream = self._by_master.get(master) if master is not None else None
        if stream is not None and self._owner(stream) == master:
            return stream
        stream = self._scan().get(master) if master is not None else None
        return stream if stream is not None else stream_name(0)  # a slot no master serves

    def all(self) -> list[str]:
        """One stream per master of the current slot map."""
        masters = {str(n.name) for n in self._client.get_primaries()}
        by_master = self._by_master
        if masters - self._slotless - by_master.keys() or any(
                self._owner(s) != m for m, s in by_master.items() if m in masters):
            by_master = self._scan()
        return sorted(s for m, s in by_master.items() if m in masters)

    def _scan(self) -> dict[str, str]:
        """Names every master's stream anew: the smallest tag that lands on it."""
        with self._lock:
            masters = {str(n.name) for n in self._client.get_primaries()}
            found: dict[str, str] = {}
            for tag in range(SCAN_LIMIT):
                if masters <= found.keys():
                    break
                name = stream_name(tag)
                owner = self._owner(name)
                if owner is not None and owner not in found:
                    found[owner] = name
            self._by_master, self._slotless = found, frozenset(masters - found.keys())
            return found


def streams_of(client: Any, cluster: bool) -> OneStream | MasterStreams:
    """The record streams of ``client`` (a cluster's when ``cluster``)."""
    return MasterStreams(client) if cluster else OneStream()


__all__ = ["OneStream", "MasterStreams", "streams_of", "stream_name", "SCAN_LIMIT"]
