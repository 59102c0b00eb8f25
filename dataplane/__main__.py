"""Entry point: ``python -m kvblend.dataplane --shm-prefix P --chunk-size C --backend B``.

Attaches the existing store and fingerprint index of prefix ``P`` (the supervisor created them),
serves the channel on ``--socket`` (default ``dataplane.default_address(P)``), prints one line
``dataplane ready pid=<pid> backend=<backend> address=<path>`` on stdout when it accepts calls,
and exits 0 after SIGTERM or SIGINT once every queued call completed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pydantic

from kvblend.dataplane import default_address, kernels
from kvblend.dataplane.backends import Backend
from kvblend.dataplane.engines import make_engine
from kvblend.dataplane.server import DataPlane
from kvblend.dataplane.settings import DataPlaneSettings
from kvblend.dataplane.transfer import Shared
from kvblend.shm.errors import ForeignObject
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.remotes import wall_ms
from kvblend.shm.store import Store
from kvblend.shm.telemetry import Counter

if TYPE_CHECKING:
    from kvblend.dataplane.discovery import Discovery
    from kvblend.dataplane.promote import Promoter
    from kvblend.dataplane.remote import RemoteTier
    from kvblend.dataplane.writebehind import WriteBehind
    from kvblend.shm.remotes import RemoteChunks

log = logging.getLogger("kvblend.dataplane")


def parse_args(argv: list[str] | None = None) -> DataPlaneSettings:
    """The process's settings: flags win over ``KVBLEND_DP_*`` variables, which win over the
    defaults of ``DataPlaneSettings``. Exits 2 with the reason on a missing or bad value."""
    p = argparse.ArgumentParser(prog="python -m kvblend.dataplane",
                                description=__doc__.split("\n")[0],
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--shm-prefix", help="segment prefix of the store to attach")
    p.add_argument("--chunk-size", type=int, help="tokens per chunk")
    p.add_argument("--backend", choices=[b.value for b in Backend])
    p.add_argument("--socket", help="Unix socket path (default: under /dev/shm)")
    p.add_argument("--reclaim-interval", type=float,
                   help="seconds between reclaim passes over dead pids' reservations and pins")
    p.add_argument("--lease", type=float,
                   help="seconds an instance lives without a renewal by its owner")
    p.add_argument("--max-instances", type=int)
    p.add_argument("--max-instances-per-client", type=int)
    p.add_argument("--max-connections", type=int)
    p.add_argument("--first-mib", type=float, help="MiB of a call's first batch")
    p.add_argument("--group-mib", type=float, help="MiB of a store's chunks per completion mark")
    p.add_argument("--staging-mib", type=float,
                   help="GPU staging per paged CUDA instance, MiB (at least two chunks)")
    p.add_argument("--log-level")
    p.add_argument("--remote", help="the remote tier's URL (credentials from the environment)")
    p.add_argument("--remote-ttl-s", type=float, help="seconds a remote chunk lives")
    p.add_argument("--remote-timeout-s", type=float, help="seconds one remote call may take")
    p.add_argument("--remote-queue", type=int, help="chunks waiting to be written behind")
    p.add_argument("--remote-capacity", type=int, help="entries of the remote-known table")
    p.add_argument("--remote-streams", type=int, help="remote chunks fetched at once")
    p.add_argument("--remote-stream-len", type=int,
                   help="about how many records the remote's record stream keeps")
    args = p.parse_args(argv)
    try:
        return DataPlaneSettings(**vars(args))
    except pydantic.ValidationError as exc:
        p.error("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    prefix = settings.shm_prefix
    logging.basicConfig(level=settings.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("kernels ready in %.2f s", kernels.warm(prefix))  # before the first real call
    store = Store.open(prefix)
    fingerprints = FingerprintIndex.attach(prefix, settings.chunk_size)
    events = EventLog.open(prefix)
    remote = Remote.start(settings, store, fingerprints, events) if settings.remote else None
    # a data plane killed between an eviction and its fingerprint removal left entries behind;
    # a chunk the remote tier holds stays
    held = store.holds_hashes if remote is None else remote.holds(store)
    swept = fingerprints.sweep(held)
    if swept:
        log.info("dropped %d fingerprint entries of chunks no longer stored", swept)
        events.add(Counter.FINGERPRINT_EVICTED_ENTRIES, swept)
    engine = make_engine(settings.backend, store, settings.tuning().staging_bytes)
    shared = Shared(store, fingerprints, events, settings.chunk_size, settings.tuning(),
                    *(remote.parts() if remote is not None else ()))
    plane = DataPlane(prefix, shared, engine, settings.reclaim_interval, settings.limits(),
                      settings.max_connections)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    address = settings.socket or default_address(prefix)
    try:
        plane.start(address)
    except ForeignObject as exc:
        log.error("%s", exc)
        return 2
    events.add(Counter.DATAPLANE_STARTS)
    print(f"dataplane ready pid={os.getpid()} backend={engine.backend.value} "
          f"address={address}", flush=True)
    while not stop.wait(1.0):  # wakes for signals on every Python version
        pass
    log.info("stopping: finishing queued calls")
    plane.shutdown()
    if remote is not None:
        remote.close(settings.remote_timeout_s * 4)  # bounded: what is still queued is dropped
    return 0


@dataclass
class Remote:
    """The remote tier's parts in this process: write-behind, discovery and promotion."""

    tier: "RemoteTier"
    remotes: "RemoteChunks"
    writebehind: "WriteBehind"
    promoter: "Promoter"
    discovery: "Discovery"

    @classmethod
    def start(cls, settings: DataPlaneSettings, store: Store, fingerprints: FingerprintIndex,
              events: EventLog) -> "Remote":
        """Connect to ``--remote`` (``dataplane.remote``; a remote that is down only costs
        misses until it answers) and start the write-behind and discovery threads."""
        from kvblend.dataplane.discovery import Discovery
        from kvblend.dataplane.promote import Promoter
        from kvblend.dataplane.remote import RemoteTier
        from kvblend.dataplane.writebehind import WriteBehind
        from kvblend.shm.remotes import RemoteChunks

        def secret(value: pydantic.SecretStr | None) -> str | None:
            return value.get_secret_value() if value is not None else None

        tier = RemoteTier(settings.remote, secret(settings.remote_username),
                          secret(settings.remote_password), settings.remote_timeout_s,
                          settings.remote_ttl_s, stream_len=settings.remote_stream_len)
        remotes = RemoteChunks.open(settings.shm_prefix, settings.remote_capacity)
        log.info("remote tier %s: writing stored chunks behind, finding other hosts' chunks",
                 settings.remote)
        writers = max(1, settings.remote_streams // 2)
        return cls(tier, remotes,
                   WriteBehind(store, tier, settings.remote_queue, events, writers),
                   Promoter(store, tier, remotes, events, settings.remote_streams),
                   Discovery(tier, store, fingerprints, remotes, events).start())

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
        self.tier.close()
        self.remotes.close()


if __name__ == "__main__":
    sys.exit(main())
