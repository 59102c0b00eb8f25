"""Entry point: ``python -m kvblend.dataplane``, its settings in ``KVBLEND_DP_SETTINGS``.

It takes no arguments: ``kvblend serve`` hands it its whole ``DataPlaneSettings`` as JSON in that
one variable (``dataplane.settings``). It attaches the existing store and fingerprint index of
the settings' prefix (the supervisor created them) and takes the chunk size from the index's
header, serves the channel on ``socket`` (default ``dataplane.default_address(prefix)``), prints
one line ``dataplane ready pid=<pid> backend=<backend> address=<path>`` on stdout when it accepts
calls (the supervisor reads it and logs the readiness; it is the only line on stdout), and exits
0 once every queued call completed after SIGTERM or SIGINT, or after its parent (the supervisor)
is gone. Its log records go to stderr in the service's format (``log_format``:
``dataplane.logs``). Missing or bad settings exit 2 with one line naming the field, before
anything is attached.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvblend.dataplane import default_address, kernels, logs, standby
from kvblend.dataplane.calls import Tuning
from kvblend.dataplane.engines import make_engine
from kvblend.dataplane.instances import Limits
from kvblend.dataplane.server import DataPlane
from kvblend.dataplane.settings import ENV, MIB, DataPlaneSettings, RemoteSettings
from kvblend.dataplane.transfer import Shared
from kvblend.dataplane.wakeup import Wakeup
from kvblend.shm.errors import ForeignObject
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.orphans import sweep_orphans
from kvblend.shm.remotes import wall_ms
from kvblend.shm.store import Store
from kvblend.shm.telemetry import Counter

if TYPE_CHECKING:
    from kvblend.dataplane.discovery import Discovery
    from kvblend.dataplane.peerread import Peer
    from kvblend.dataplane.promote import Promoter
    from kvblend.dataplane.remote import RemoteTier
    from kvblend.dataplane.writebehind import WriteBehind
    from kvblend.shm.remotes import RemoteChunks

log = logging.getLogger("kvblend.dataplane")

PROG = "python -m kvblend.dataplane"


def load_settings(argv: list[str]) -> DataPlaneSettings:
    """The process's settings (``DataPlaneSettings.from_env``). Exits 2 with one line saying why
    when they are missing or bad, or when arguments are given (there are none)."""
    if argv:
        print(f"{PROG}: takes no arguments; its settings come as JSON in {ENV} (kvblend serve "
              "sets it)", file=sys.stderr)
        raise SystemExit(2)
    try:
        return DataPlaneSettings.from_env()
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def limits(settings: DataPlaneSettings) -> Limits:
    return Limits(settings.instance_lease_s, settings.max_instances,
                  settings.max_instances_per_client)


def tuning(settings: DataPlaneSettings) -> Tuning:
    return Tuning(int(settings.first_mib * MIB), int(settings.group_mib * MIB),
                  int(settings.staging_mib * MIB), int(settings.layer_dma_mib * MIB))


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(sys.argv[1:] if argv is None else argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a stuck start is: its stacks
    prefix = settings.shm_prefix
    logs.configure(settings.log_level, settings.log_format, "dataplane")
    kernels.warm(prefix)  # before the first real call; it logs before and after
    standby.wait_for_turn(prefix, "dataplane")  # a spare waits here for its supervisor
    parent = os.getppid()  # its supervisor (an adopted spare's: init, and a pidfd watches)
    store = Store.open(prefix)
    fingerprints = FingerprintIndex.attach(prefix)  # its header holds the chunk size
    events = EventLog.open(prefix)
    remote = (Remote.start(settings.remote, prefix, store, fingerprints, events)
              if settings.remote is not None else None)
    # a data plane killed between an eviction and its fingerprint removal left entries behind;
    # a chunk the remote tier holds stays
    held = store.holds_hashes if remote is None else remote.holds(store)
    swept = fingerprints.sweep(held)
    if swept:
        log.info("dropped %d fingerprint entries of chunks no longer stored", swept)
        events.add(Counter.FINGERPRINT_EVICTED_ENTRIES, swept)
    # a data plane killed between a store's commit and its registration left chunks no lookup
    # finds: indexed again, or freed when they cannot be
    orphans = sweep_orphans(store, fingerprints)
    if orphans.orphans:
        log.info("%s", orphans)
    engine = make_engine(settings.backend, store, tuning(settings))
    shared = Shared(store, fingerprints, events, fingerprints.chunk_size, tuning(settings),
                    *(remote.parts() if remote is not None else ()))
    plane = DataPlane(prefix, shared, engine, settings.reclaim_interval_s, limits(settings),
                      settings.max_connections)
    wakeup = Wakeup().catch()  # handlers that take no lock (dataplane.wakeup)
    address = settings.socket or default_address(prefix)
    try:
        plane.start(address)
    except ForeignObject as exc:
        log.error("%s", exc)
        return 2
    events.add(Counter.DATAPLANE_STARTS)
    print(f"dataplane ready pid={os.getpid()} backend={engine.backend.value} "
          f"address={address}", flush=True)
    while wakeup.stop_signal is None and os.getppid() == parent:
        wakeup.wait(1.0)
    if wakeup.stop_signal is None:  # the death signal is a backstop: the parent is gone
        log.warning("the supervisor (pid %d) is gone: stopping", parent)
    log.info("stopping: finishing queued calls")
    plane.shutdown()
    if remote is not None:
        remote.close(settings.remote.timeout_s * 4)  # bounded: what is still queued is dropped
    return 0


@dataclass
class Remote:
    """The remote tier's parts in this process: write-behind, discovery and promotion, and
    peer reads where they are on and the transfer engine loads."""

    tier: "RemoteTier"
    remotes: "RemoteChunks"
    writebehind: "WriteBehind"
    promoter: "Promoter"
    discovery: "Discovery"
    peer: "Peer | None"

    @classmethod
    def start(cls, settings: RemoteSettings, prefix: str, store: Store,
              fingerprints: FingerprintIndex, events: EventLog) -> "Remote":
        """Connect to the remote tier (``dataplane.remote``; a remote that is down only costs
        misses until it answers) and start the write-behind and discovery threads."""
        from kvblend.dataplane.discovery import Discovery
        from kvblend.dataplane.peerread import Peer
        from kvblend.dataplane.promote import Promoter
        from kvblend.dataplane.remote import RemoteKey, RemoteTier
        from kvblend.dataplane.writebehind import WriteBehind
        from kvblend.shm.remotes import RemoteChunks

        tier = RemoteTier(settings.url, settings.username, settings.password, settings.timeout_s,
                          settings.ttl_s, stream_len=settings.stream_len,
                          key=RemoteKey(settings.key))
        remotes = RemoteChunks.open(prefix, settings.capacity)
        log.info("remote tier %s: writing stored chunks behind, finding other hosts' chunks",
                 settings.url)
        writers = max(1, settings.streams // 2)
        peer = (Peer.start(settings.peer, tier, store, events) if settings.peer is not None
                else None)
        return cls(tier, remotes,
                   WriteBehind(store, tier, settings.queue, events, writers, peer=peer),
                   Promoter(store, tier, remotes, events, settings.streams, peer),
                   Discovery(tier, store, fingerprints, remotes, events, peer=peer).start(),
                   peer)

    def parts(self) -> tuple["WriteBehind", "Promoter", "RemoteChunks"]:
        """What ``Shared`` takes, in its order."""
        return self.writebehind, self.promoter, self.remotes

    def holds(self, store: Store) -> Callable[[np.ndarray], np.ndarray]:
        """The fingerprint sweep's question: is a chunk stored here or known remotely?"""
        return lambda words: store.holds_hashes(words) | self.remotes.knows(words, wall_ms())

    def close(self, timeout: float) -> None:
        self.discovery.close(timeout)
        self.writebehind.close(timeout)
        self.promoter.close()
        if self.peer is not None:
            self.peer.close()
        self.tier.close()
        self.remotes.close()


def leave(code: int) -> None:
    """End the process with ``code`` once ``main`` returned, without the interpreter's
    finalization: by then every call has ended and every part is closed, and finalization only
    risks aborting a clean stop (a stop in the suite once exited with SIGABRT, "terminate called
    without an active exception", after torch was loaded: a daemon thread or a static
    destructor of a C++ library torn down at exit; docs/faults.md, Findings 4)."""
    logging.shutdown()  # the log's last records out
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    leave(main())
