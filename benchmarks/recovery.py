"""Kill-to-ready of ``kvblend serve``: SIGKILL one process kind many times, time each recovery.

One ``kvblend serve --backend cpu`` on a small store (64 MiB) of a private prefix, idle (the fault
trials, ``benchmarks/faults.py``, kill under load and check the cache; this one only times). For
each kind, ``--kills`` times:

| kind | killed | ready again when |
|---|---|---|
| dataplane | the data plane (the supervisor restarts it) | ``/readyz`` 200 and ``GET /v1/status`` names a new data-plane pid |
| api | the API process (the supervisor restarts it) | ``/readyz`` 200 from a new API process |
| supervisor | ``kvblend serve`` itself | a new ``kvblend serve``, started on the same prefix and port the moment the old one is reaped (a restart policy with no delay: systemd's ``Restart=always``, Docker's ``--restart``), answers ``/readyz`` 200 from an API other than the killed one's (the process listening on the port is not the old API: that one drains for a while and may answer meanwhile); a new serve that exits before it is ready is started again (counted as a retry) |

Each kind is run in two modes side by side: ``standby`` (the default: warm spares, ``--standby``)
and ``cold`` (``--no-standby``: every restart starts a process from nothing). Kill-to-ready is
polled every 10 ms. Before each kill the service is ready and has been for ``--settle`` seconds
(its children's start-up work is over), and in ``standby`` mode both spares wait. Prints one line a kill and a table
of median and max per kind; exits 1 when a kill did not recover within 60 s. The service's log
goes to ``--log`` (default: a temporary file); its supervisor's lines ``dataplane ready after``
and ``api ready after`` say how long each child's own start took.

Run from the repository root: ``python benchmarks/recovery.py [--kills 20]
[--kinds dataplane,api,supervisor]``
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package

from tests.faults import children_of, load_average, processes_of, _read  # noqa: E402
from tests.harness import (Service, listener_pid, poll, remove_prefix, spare_pid,  # noqa: E402
                           unique_prefix)

KINDS = ("dataplane", "api", "supervisor")
MODES = {"standby": "true", "cold": "false"}
FLAGS = ("--backend", "cpu", "--storage-mb", "64", "--fingerprint-capacity", "65536",
         "--log-level", "info")
POLL_S = 0.01
DEADLINE_S = 60.0


class Bench:
    """The service under test and the kills."""

    def __init__(self, prefix: str, log: Path, settle_s: float, mode: str) -> None:
        self.prefix, self.log, self.settle_s, self.mode = prefix, log, settle_s, mode
        self.svc = self._serve(port=None)
        self.svc.wait_ready()

    def _serve(self, port: int | None) -> Service:
        return Service(self.prefix, port=port, defaults=FLAGS, log=self.log, wait=False,
                       http_timeout_s=2.0, env={"KVBLEND_STANDBY": MODES[self.mode]})

    def api_pid(self) -> int | None:
        """The process listening on the service's port."""
        return listener_pid(self.svc.port)

    def settled(self) -> None:
        """Ready, and in standby mode both spares wait."""
        self.svc.wait_ready()
        if self.mode == "standby":
            poll(lambda: all(spare_pid(self.prefix, c) for c in ("dataplane", "api")),
                 DEADLINE_S, "both spares waiting")

    def target(self, kind: str) -> int:
        if kind == "supervisor":
            return self.svc.proc.pid
        which = self.svc.dataplane_pid if kind == "dataplane" else self.api_pid
        return poll(which, DEADLINE_S, f"the {kind}'s pid")

    def kill(self, kind: str) -> tuple[float, int]:
        """SIGKILL ``kind``; seconds to ready again and the retries of a new serve."""
        self.settled()
        time.sleep(self.settle_s)  # the service idles: not a wait for anything
        pid = self.target(kind)
        old_api = self.api_pid()
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        if kind == "supervisor":
            return self._new_serve(t0, old_api)
        which = self.svc.dataplane_pid if kind == "dataplane" else self.api_pid

        def back() -> bool:
            if self.svc.exited:
                raise RuntimeError(f"kvblend serve exited: {self.svc.log_tail()}")
            return self.svc.ready() and which() not in (None, pid)
        try:
            poll(back, DEADLINE_S, f"a new {kind}", every_s=POLL_S)
        except TimeoutError:
            for child in children_of(self.svc.proc.pid):  # the data plane's stacks to the log
                if b"kvblend.dataplane" in _read(f"/proc/{child}/cmdline"):
                    os.kill(child, signal.SIGUSR1)
            raise
        return time.monotonic() - t0, 0

    def _new_serve(self, t0: float, old_api: int | None) -> tuple[float, int]:
        self.svc.proc.wait()
        self.svc.http.close()
        retries = 0
        self.svc = self._serve(self.svc.port)

        def up() -> bool:
            nonlocal retries
            if self.svc.exited:  # a restart policy starts it again
                retries += 1
                self.svc = self._serve(self.svc.port)
                return False
            return self.svc.ready() and self.api_pid() not in (None, old_api)
        poll(up, DEADLINE_S, "a new kvblend serve", every_s=POLL_S)
        return time.monotonic() - t0, retries

    def close(self) -> None:
        self.svc.stop()
        for pid in processes_of(self.prefix):
            os.kill(pid, signal.SIGKILL)
        remove_prefix(self.prefix)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="kills of each kind")
    p.add_argument("--kinds", default=",".join(KINDS), help="which kinds, comma-separated")
    p.add_argument("--settle", type=float, default=0.5,
                   help="seconds the service idles before each kill")
    p.add_argument("--modes", default=",".join(MODES),
                   help="standby (warm spares), cold (none), or both, comma-separated")
    p.add_argument("--log", type=Path, default=None, help="the service's stderr")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    modes = [m for m in args.modes.split(",") if m]
    if set(kinds) - set(KINDS) or set(modes) - set(MODES) or not modes:
        raise SystemExit(f"kinds are {', '.join(KINDS)}; modes {', '.join(MODES)}")
    log = args.log or Path(tempfile.mkstemp(prefix="kvblend-recovery-", suffix=".log")[1])
    print(f"load average at start {load_average()}; log {log}")
    benches: dict[str, Bench] = {}
    times = {(k, m): [] for k in kinds for m in modes}  # type: dict[tuple[str, str], list[float]]
    retries = {(k, m): 0 for k in kinds for m in modes}
    try:
        for m in modes:
            benches[m] = Bench(unique_prefix("kvbrec"), log, args.settle, m)
        for kind in kinds:
            for i in range(args.kills):
                for m in modes:  # interleaved: both modes see the same load
                    took, again = benches[m].kill(kind)
                    times[kind, m].append(took)
                    retries[kind, m] += again
                    print(f"{kind:<10} {m:<7} {i + 1:>3}/{args.kills}  ready after {took:6.3f} s"
                          + (f"  ({again} retries)" if again else ""), flush=True)
    finally:
        for bench in benches.values():
            bench.close()
    print(f"load average at end {load_average()}")
    print(table(kinds, modes, times, retries))
    return 0


def table(kinds: list[str], modes: list[str], times: dict[tuple[str, str], list[float]],
          retries: dict[tuple[str, str], int]) -> str:
    """Median and max per kind and mode, and the medians' ratio cold / standby."""
    rows = ["", "| kind | mode | kills | kill-to-ready median | max | new-serve retries |",
            "|---|---|---:|---:|---:|---:|"]
    for kind in kinds:
        for m in modes:
            t = times[kind, m]
            rows.append(f"| {kind} | {m} | {len(t)} | {statistics.median(t):.2f} s | "
                        f"{max(t):.2f} s | {retries[kind, m]} |")
        if set(modes) == set(MODES):
            ratio = (statistics.median(times[kind, "cold"])
                     / statistics.median(times[kind, "standby"]))
            rows.append(f"| {kind} | cold / standby | | {ratio:.1f}x | | |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
