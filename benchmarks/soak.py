"""The churn soak for an hour: memory of every process of the service and of its shared memory.

The driver and the checkpoint are ``tests/churn.py``'s (``tests/test_soak.py`` runs them bounded,
in CI): one ``kvblend serve --backend cpu`` with 8 MiB of storage and a fingerprint index of 128
entries, distinct documents stored one after the other, with re-stores, new models, clears,
data-plane SIGKILLs and service restarts in between, and a checkpoint every few dozen documents
and after every disturbance. Here the disturbances are sparser than in CI, so that each process
lives long enough for its memory to tell.

Every ``--every`` seconds it samples the resident memory (VmRSS, and RssAnon: the process's own
heap, without the shared memory it maps) of the supervisor, the API and the data plane, and the
bytes that the prefix's names take in /dev/shm, and prints one line. At the end: what the run did,
and per process the first, last and largest sample and the growth, over the whole run and over the
processes of each role (a restart starts a new one); the samples go to ``samples.csv`` in
``--workdir``.

Exits 1 when a checkpoint or a store failed, the service logged an error, or it did not stop
cleanly; the message names what.

Run from the repository root: ``python -m benchmarks.soak [--minutes 60] [--seed 1]``.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from kvblend.shm.names import Names
from kvblend.shm.private import SHM_DIR
from tests.churn import Churn, Schedule, Sizes, SoakFailure
from tests.harness import PollTimeout, ServiceExited, remove_prefix, unique_prefix

# sparser than CI's (about 50 documents a second on 2 cores): a data plane lives for about 5
# minutes, the API and the supervisor for about 20, the store is cleared every minute or so
LONG = Schedule(new_model=40, clear=3000, kill=15000, restart=60000, checkpoint=100)
ROLES = ("supervisor", "api", "dataplane")
MIB = 1 << 20


@dataclass
class Sample:
    t: float
    pid: int
    rss: int   # bytes
    anon: int  # bytes


@dataclass
class Memory:
    """Samples of the service's processes (by role) and of its /dev/shm names."""

    prefix: str
    t0: float = field(default_factory=time.monotonic)
    procs: dict[str, list[Sample]] = field(default_factory=lambda: defaultdict(list))
    # (t, service bytes, service names, engine buffer bytes, engine buffers)
    shm: list[tuple[float, int, int, int, int]] = field(default_factory=list)

    def sample(self, supervisor: int) -> None:
        t = time.monotonic() - self.t0
        for role, pid in roles(supervisor).items():
            got = status_kib(pid)
            if got is not None:
                self.procs[role].append(Sample(t, pid, got[0] << 10, got[1] << 10))
        self.shm.append((t, *shm_usage(self.prefix)))

    def line(self) -> str:
        mem = " ".join(f"{role}={self.procs[role][-1].rss / MIB:.1f}/"
                       f"{self.procs[role][-1].anon / MIB:.1f}"
                       for role in ROLES if self.procs[role])
        _, own, names, bufs, nbufs = self.shm[-1]
        return (f"rss/anon MiB {mem} | /dev/shm {own / MIB:.2f} MiB in {names} names + "
                f"{bufs / MIB:.2f} MiB in {nbufs} engine buffers")


def roles(supervisor: int) -> dict[str, int]:
    """The supervisor and its children, by role (from their command lines)."""
    found = {"supervisor": supervisor}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != supervisor:
                continue
            pid = int(stat.split("/")[2])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if b"kvblend.dataplane" in argv:
            found["dataplane"] = pid
        elif b"kvblend.api.uvicorn_workers" in argv:
            found["api"] = pid
    return found


def status_kib(pid: int) -> tuple[int, int] | None:
    """(VmRSS, RssAnon) in KiB, or None when the process is gone."""
    fields_: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon"):
                    fields_[key] = int(value.split()[0])
    except OSError:
        return None
    return fields_.get("VmRSS", 0), fields_.get("RssAnon", 0)


def shm_usage(prefix: str) -> tuple[int, int, int, int]:
    """Bytes allocated and names under ``prefix`` in /dev/shm: (the service's own, their names,
    the engine's KV buffers, their names)."""
    names = Names(prefix)
    used = [0, 0, 0, 0]
    for path in glob.glob(f"{SHM_DIR}/{glob.escape(prefix)}*"):
        try:
            size = os.stat(path, follow_symlinks=False).st_blocks * 512
        except FileNotFoundError:
            continue
        i = 2 if names.is_kvbuf(os.path.basename(path)) else 0
        used[i] += size
        used[i + 1] += 1
    return used[0], used[1], used[2], used[3]


def lives(samples: list[Sample]) -> list[list[Sample]]:
    """The samples of each process, in the order the processes started."""
    by_pid: dict[int, list[Sample]] = defaultdict(list)
    for x in samples:
        by_pid[x.pid].append(x)
    return sorted(by_pid.values(), key=lambda xs: xs[0].t)


def life_line(xs: list[Sample]) -> str:
    a, b = xs[0], xs[-1]
    return (f"pid {a.pid}: {a.t / 60:5.1f} to {b.t / 60:5.1f} min, rss {a.rss / MIB:6.1f} -> "
            f"{b.rss / MIB:6.1f} ({(b.rss - a.rss) / MIB:+.1f}), anon {a.anon / MIB:6.1f} -> "
            f"{b.anon / MIB:6.1f} ({(b.anon - a.anon) / MIB:+.1f}) MiB")


def memory_table(mem: Memory) -> list[str]:
    """Per role: the whole run (the first sample of the first process to the last of the last),
    then each process (the data planes summed up: a kill starts a new one every few minutes)."""
    out = [f"{'process':<11}{'pids':>5}{'first':>9}{'last':>9}{'max':>9}{'growth':>9}  (rss MiB)"]
    for role in ROLES:
        s = mem.procs[role]
        if s:
            out.append(f"{role:<11}{len(lives(s)):>5}{s[0].rss / MIB:>9.1f}{s[-1].rss / MIB:>9.1f}"
                       f"{max(x.rss for x in s) / MIB:>9.1f}{(s[-1].rss - s[0].rss) / MIB:>+9.1f}")
    for role in ("supervisor", "api"):
        out += [f"  {role} {life_line(xs)}" for xs in lives(mem.procs[role])]
    dps = [xs for xs in lives(mem.procs["dataplane"]) if len(xs) > 1]
    if dps:
        grow = sorted((xs[-1].anon - xs[0].anon) / MIB for xs in dps)
        start = sorted(xs[0].anon / MIB for xs in dps)
        longest = max(dps, key=lambda xs: xs[-1].t - xs[0].t)
        out.append(f"  dataplane: {len(dps)} processes sampled twice or more; anon at the first "
                   f"sample {start[0]:.1f} / {start[len(start) // 2]:.1f} / {start[-1]:.1f} MiB "
                   f"(min / median / max), growth within a process {grow[0]:+.1f} / "
                   f"{grow[len(grow) // 2]:+.1f} / {grow[-1]:+.1f} MiB")
        out.append(f"  dataplane longest-lived {life_line(longest)}")
    return out


def shm_table(mem: Memory, points: int = 7) -> list[str]:
    """/dev/shm use at a few moments of the run, and its range: the service's own names, and the
    engine's KV buffers (one per model it holds an instance of; their size follows the layout)."""
    pick = sorted({round(i * (len(mem.shm) - 1) / (points - 1)) for i in range(points)})
    out = [f"/dev/shm ({mem.prefix}*), service names + engine buffers:"]
    out += [f"  {t / 60:5.1f} min  {own / MIB:.2f} MiB in {n} names + {bufs / MIB:.2f} MiB in "
            f"{nb} buffers" for t, own, n, bufs, nb in (mem.shm[i] for i in pick)]
    for what, col in (("service", 1), ("engine buffers", 3)):
        used = [x[col] for x in mem.shm]
        names = sorted({x[col + 1] for x in mem.shm})
        out.append(f"  {what}: first {used[0] / MIB:.2f}, last {used[-1] / MIB:.2f}, max "
                   f"{max(used) / MIB:.2f} MiB, growth {(used[-1] - used[0]) / MIB:+.2f} MiB; "
                   f"names {', '.join(map(str, names))}")
    return out


def write_samples(mem: Memory, path: Path) -> None:
    """Every sample as CSV (seconds, role, pid, rss and anon bytes; role ``shm``: the four
    /dev/shm figures)."""
    with path.open("w") as f:
        f.write("t,role,pid,rss,anon\n")
        for role, samples in mem.procs.items():
            f.writelines(f"{x.t:.1f},{role},{x.pid},{x.rss},{x.anon}\n" for x in samples)
        f.writelines(f"{t:.1f},shm,{own},{n},{bufs},{nb}\n" for t, own, n, bufs, nb in mem.shm)


def run(args: argparse.Namespace, prefix: str) -> int:
    args.workdir.mkdir(parents=True, exist_ok=True)
    log = args.workdir / "serve.log"
    log.unlink(missing_ok=True)
    mem = Memory(prefix)
    churn = Churn(prefix, log, args.seed, Sizes(), LONG)
    t0 = time.monotonic()
    failure = ""
    try:
        with churn:
            assert churn.service is not None
            next_sample = 0.0
            while time.monotonic() - t0 < args.minutes * 60:
                churn.step()
                if time.monotonic() - t0 >= next_sample:
                    next_sample += args.every
                    mem.sample(churn.service.proc.pid)
                    print(f"{(time.monotonic() - t0) / 60:5.1f} min  {churn.counts.line()}\n"
                          f"           {mem.line()}", flush=True)
            churn.checkpoint()
            mem.sample(churn.service.proc.pid)
            errors = churn.service.errors()
    except (SoakFailure, ServiceExited, PollTimeout) as exc:
        failure = str(exc)
        errors = []
    c = churn.counts
    print(f"\n{(time.monotonic() - t0) / 60:.1f} min, seed {args.seed}: {c.documents} documents "
          f"({c.chunks} chunks, {c.kv_bytes / MIB:.0f} MiB of KV), {c.restores} re-stores, "
          f"{c.models} models, {c.evictions} evictions, {c.clears} clears, {c.kills} data-plane "
          f"kills ({c.kills_in_flight} with a store in flight, {c.interrupted} cut one short), "
          f"{c.restarts} restarts, {c.not_indexed} chunks stored not indexed, {c.checkpoints} "
          f"checkpoints passed ({c.checked_chunks} held chunks checked, at most {c.most_held})")
    if mem.shm:
        print("\n".join(["", *memory_table(mem), "", *shm_table(mem)]))
        write_samples(mem, args.workdir / "samples.csv")
    if failure:
        print(f"\nFAILED: {failure}")
    if errors:
        print("\nFAILED: the service logged errors:\n" + "\n".join(errors[-20:]))
    return 1 if failure or errors else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--every", type=float, default=60.0,
                        help="seconds between samples (one progress line each)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/kvblend-soak"),
                        help="where the service's log goes")
    args = parser.parse_args()
    prefix = unique_prefix("kvbsoak")
    try:
        return run(args, prefix)
    finally:
        remove_prefix(prefix)


if __name__ == "__main__":
    sys.exit(main())
