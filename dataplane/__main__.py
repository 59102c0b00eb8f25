"""Entry point: ``python -m dataplane --shm-prefix P --chunk-size C --backend cpu|cuda|auto``.

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

from dataplane import default_address
from dataplane.backend import make_engine
from dataplane.instances import Limits
from dataplane.server import DataPlane
from dataplane.transfer import Shared, open_fingerprints
from shm.errors import ForeignObject
from shm.events import EventLog
from shm.store import Store
from shm.telemetry import Counter
from shm.warm import warm

log = logging.getLogger("kvblend.dataplane")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dataplane", description=__doc__.split("\n")[0])
    p.add_argument("--shm-prefix", required=True, help="segment prefix of the store to attach")
    p.add_argument("--chunk-size", type=int, required=True, help="tokens per chunk")
    p.add_argument("--backend", choices=("cpu", "cuda", "auto"), default="auto")
    p.add_argument("--socket", default=None, help="Unix socket path (default: under /dev/shm)")
    p.add_argument("--reclaim-interval", type=float, default=1.0,
                   help="seconds between reclaim passes over dead pids' reservations and pins")
    p.add_argument("--lease", type=float, default=Limits.lease_s,
                   help="seconds an instance lives without a renewal by its owner")
    p.add_argument("--max-instances", type=int, default=Limits.max_instances)
    p.add_argument("--max-instances-per-client", type=int, default=Limits.max_per_client)
    p.add_argument("--max-connections", type=int, default=256)
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("kernels ready in %.2f s", warm(args.shm_prefix))  # before the first real call
    store = Store.open(args.shm_prefix)
    fingerprints = open_fingerprints(args.shm_prefix, args.chunk_size)
    events = EventLog.open(args.shm_prefix)
    # a data plane killed between an eviction and its fingerprint removal left entries behind
    swept = fingerprints.sweep(store.holds_hashes)
    if swept:
        log.info("dropped %d fingerprint entries of chunks no longer stored", swept)
        events.add(Counter.FINGERPRINT_EVICTED_ENTRIES, swept)
    engine = make_engine(args.backend, store)
    shared = Shared(store, fingerprints, events, args.chunk_size)
    limits = Limits(args.lease, args.max_instances, args.max_instances_per_client)
    plane = DataPlane(args.shm_prefix, shared, engine, args.reclaim_interval, limits,
                      args.max_connections)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    address = args.socket or default_address(args.shm_prefix)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
