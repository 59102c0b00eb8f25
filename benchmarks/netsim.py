"""Faults at scale, simulated: N ``kvblend serve`` hosts and M Redis cluster masters, each in a
network namespace of its own on a shaped link; a master is killed and a host paused mid-load.

    sudo python benchmarks/netsim.py [--hosts 3] [--masters 3] [--mbit 20] [--rtt-ms 20]
                                     [--mode records|both|values] [--phase-s 15]

Needs root, ``ip netns``, ``/dev/net/tun``, ``redis-server``. docs/remote.md ("Faults at scale,
simulated") tells what it does and reads its table. Exit code 1: a wrong chunk was seen.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import itertools
import os
import selectors
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack, suppress
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis
import torch
from redis.cluster import key_slot

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvblend.dataplane.client import BlendClient  # noqa: E402
from kvblend.shm.hashing import Namespace, chunk_hashes  # noqa: E402
from tests.harness import Service, poll, remove_prefix, unique_prefix  # noqa: E402
from tests.remote.conftest import RedisProc, _cluster_info  # noqa: E402

C, L, D, MODEL, MTU, SLOTS, SENTINEL = 256, 2, 64, "netsim", 16000, 16384, -12345
REDIS_PORT, BUS_PORT, API_PORT = 6379, 16379, 8780
TOKEN, KEY_TEXT = "netsim-api-token-0123456789abcdef", "netsim-remote-key-0123456789abcdef"
PHASES = ("warm", "master killed", "host paused", "back")
RESERVE, SETTLE_S, QUEUE_MS = 6, 3.0, 100.0  # RESERVE: host 0's documents kept unread till paused
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000


def switch_main(names: list[str], ips: list[str], mbit: float, rtt_ms: float) -> None:
    """The switch (a child process) between TUN devices: a packet leaves its sender's uplink,
    crosses both links' latency (rtt / 4 each), enters the receiver's downlink; the links are
    FIFOs of ``mbit`` that drop what would wait past QUEUE_MS, except link 0 (the driver's)."""
    fds, sel = [os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK) for _ in names], \
        selectors.DefaultSelector()
    for i, (fd, name) in enumerate(zip(fds, names, strict=True)):
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
        sel.register(fd, selectors.EVENT_READ, i)
    by_ip = {bytes(map(int, ip.split("."))): i for i, ip in enumerate(ips)}
    bps, lat, limit, order = mbit * 1e6, rtt_ms / 4e3, QUEUE_MS / 1e3, itertools.count()
    free, heap = {"up": [0.0] * len(fds), "down": [0.0] * len(fds)}, []
    print("ready", flush=True)

    def arrival(i: int, j: int, size: int, t: float) -> float | None:
        for k, side in ((i, "up"), (j, "down")):
            t += lat * ((i != 0) + (j != 0)) * (side == "down")
            if k != 0:
                start = max(t, free[side][k])
                if start - t > limit:
                    return None
                free[side][k] = t = start + size * 8 / bps
        return t

    while True:
        for key, _ in sel.select(max(0.0, heap[0][0] - time.monotonic()) if heap else None):
            with suppress(OSError):  # until the device has no more (or is gone, at the end)
                while pkt := os.read(key.fd, 65536):
                    j = by_ip.get(pkt[16:20]) if len(pkt) >= 20 and pkt[0] >> 4 == 4 else None
                    at = None if j is None else arrival(key.data, j, len(pkt), time.monotonic())
                    if at is not None:
                        heapq.heappush(heap, (at, next(order), j, pkt))  # type: ignore[misc]
        while heap and heap[0][0] <= time.monotonic():
            _, _, j, pkt = heapq.heappop(heap)
            with suppress(OSError):  # the receiver's queue is full: a drop, as on a wire
                os.write(fds[j], pkt)


def sh(*argv: str, check: bool = True) -> str:
    return subprocess.run(argv, check=check, capture_output=True, text=True).stdout


def preconditions(subnet: str) -> str | None:
    """Why this cannot run here, or None (``ip`` failing later stops the run with its error)."""
    missing = [t for t in ("ip", "redis-server") if shutil.which(t) is None] + ["root"] * (
        os.geteuid() != 0) + ["/dev/net/tun"] * (not os.access("/dev/net/tun", os.R_OK | os.W_OK))
    if missing:
        return f"needs {', '.join(missing)}, missing here (root: run it with sudo)"
    in_use = f" {subnet}." in sh("ip", "-o", "addr")
    return f"{subnet}.0/24 is in use here: pick another --subnet" if in_use else None


def ns_signal(ns: str, *sigs: int) -> None:
    """``sigs`` to every process in namespace ``ns`` (kvblend's children lead process groups)."""
    for sig, pid in itertools.product(sigs, map(int, sh("ip", "netns", "pids", ns,
                                                         check=False).split())):
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


def network(nodes: int, args: argparse.Namespace, stack: ExitStack) -> list[tuple[str, str]]:
    """The switch and a namespace per node: each node's (namespace, address)."""
    rid = os.urandom(2).hex()
    tuns, ips = [f"kvb{rid}t{i}" for i in range(nodes + 1)], [
        f"{args.subnet}.{i + 1}" for i in range(nodes + 1)]
    switch = subprocess.Popen([sys.executable, __file__, "--switch", ",".join(tuns), ",".join(ips),
                               str(args.mbit), str(args.rtt_ms)], stdout=subprocess.PIPE)
    stack.callback(switch.wait)
    stack.callback(switch.kill)  # its TUN devices go with it
    if switch.stdout is None or switch.stdout.readline().strip() != b"ready":
        raise RuntimeError("the switch did not start")
    sh("ip", "addr", "add", f"{ips[0]}/24", "dev", tuns[0])
    sh("ip", "link", "set", tuns[0], "mtu", str(MTU), "up")
    for i, (tun, ip) in enumerate(zip(tuns[1:], ips[1:], strict=True)):
        ns = f"kvbsim{rid}n{i}"
        stack.callback(sh, "ip", "netns", "del", ns, check=False)
        stack.callback(ns_signal, ns, signal.SIGCONT, signal.SIGKILL)
        for cmd in (f"netns add {ns}", f"link set {tun} netns {ns}", f"-n {ns} link set lo up",
                    f"-n {ns} addr add {ip}/24 dev {tun}", f"-n {ns} link set {tun} mtu {MTU} up"):
            sh("ip", *cmd.split())
    return [(f"kvbsim{rid}n{i}", ip) for i, ip in enumerate(ips[1:])]


class Master(RedisProc):
    """A cluster-mode ``redis-server`` (tests/remote's) in a namespace, protected mode off (the
    namespaces' network is private); ``start()`` after ``kill()`` rejoins as the same node."""

    def __init__(self, ns: str, ip: str, stack: ExitStack) -> None:
        super().__init__(cluster=True)
        self.ns, self.ip, self.port, self.cluster_port = ns, ip, REDIS_PORT, BUS_PORT
        stack.callback(self.close)

    def _args(self) -> list[str]:
        args = super()._args()
        args[args.index("--bind") + 1] = self.ip
        return ["ip", "netns", "exec", self.ns, *args, "--protected-mode", "no"]

    def client(self, **options: object) -> redis.Redis:
        return redis.Redis(host=self.ip, port=self.port, socket_connect_timeout=2, socket_timeout=5)

    def records(self) -> int:
        """Records in this master's streams; 0 when it does not answer."""
        with suppress(redis.RedisError), self.client() as c:
            return sum(int(c.xlen(k)) for k in c.keys("kvblend:1:fp*"))
        return 0


def cluster_ok(masters: list[Master]) -> bool:
    with suppress(redis.RedisError, KeyError):
        return all((info := _cluster_info(m))["cluster_state"] == "ok" and
                   info["cluster_known_nodes"] == str(len(masters)) for m in masters)
    return False


def make_cluster(masters: list[Master]) -> None:
    """Masters with no replicas, each serving a contiguous range of slots (as tests/remote)."""
    for i, m in enumerate(masters):
        m.start()
        with m.client() as c:
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * SLOTS // len(masters),
                              (i + 1) * SLOTS // len(masters) - 1)
            c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
            for other in masters[:i]:
                c.execute_command("CLUSTER", "MEET", other.ip, REDIS_PORT, BUS_PORT)
    poll(lambda: cluster_ok(masters), 90, "cluster_state:ok on every master")


def master_of(key: str, masters: int) -> int:
    return next(i for i in range(masters) if key_slot(key.encode()) < (i + 1) * SLOTS // masters)


class Host(Service):
    """A ``kvblend serve`` (tests.harness's) in a namespace, its endpoint record on master
    ``endpoint``, and a client here with a 4-chunk CPU buffer: stores from [0, 2C), retrieves
    into [2C, 4C). A pause takes both ``locks``, so it never catches a call in flight."""

    def __init__(self, ns: str, ip: str, remote: str, workdir: Path, args: argparse.Namespace,
                 stack: ExitStack, endpoint: int) -> None:
        self.ns, self.paused, self.stopped = ns, False, False
        self.locks = [threading.Lock(), threading.Lock()]
        peer = {"records": ["--remote-peer", "--remote-peer-records-only"],
                "both": ["--remote-peer"], "values": []}[args.mode]
        prefix = next(p for p in (unique_prefix("kvbnet") for _ in range(10**5))
                      if master_of(f"kvblend:1:peer:{ip}/{p}", args.masters) == endpoint)
        super().__init__(prefix, "--host", ip, "--storage-mb", "256", "--remote",
                         remote, "--remote-peer-host", ip, *peer, port=API_PORT, token=TOKEN,
                         log=workdir / f"host-{ip}.log", wait=False,
                         env={"KVBLEND_REMOTE_KEY_FILE": str(workdir / "remote.key")})
        stack.callback(self.close)
        self.url = self.http.base_url = f"http://{ip}:{API_PORT}"  # Service's is on loopback
        self.endpoint = endpoint  # the master of its record (dataplane.peerread.endpoint_key)

    def _spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        return super()._spawn(["ip", "netns", "exec", self.ns, *argv], env)

    def connect(self) -> None:
        self.wait_ready(300)
        self.client = BlendClient(self.url, api_token=TOKEN, timeout=60)
        self.kv = self.client.cpu_kv_buffer(num_layers=L, num_tokens=4 * C, hidden_dim=D,
                                            dtype=torch.bfloat16)
        self.inst = self.client.register_kv_cache(self.kv, model_name=MODEL)

    def pause(self, on: bool) -> None:
        self.paused = on
        with self.locks[0], self.locks[1]:
            ns_signal(self.ns, signal.SIGSTOP if on else signal.SIGCONT)
            self.stopped = on

    def close(self) -> None:
        ns_signal(self.ns, signal.SIGCONT)  # a paused host, too
        with ExitStack() as stack:  # all of it, whatever fails
            stack.callback(remove_prefix, self.prefix)
            stack.callback(self.kill)
            stack.callback(getattr(self, "client", self.http).close)


@dataclass
class Doc:
    """A two-chunk document of ``owner``'s, its tokens and KV drawn from ``ident``."""

    ident: int
    owner: int
    phase: int
    dead: set[int] = field(default_factory=set)     # chunks whose master was down when stored
    kept: bool = False  # unread until its owner is paused
    readers: dict[int, int] = field(default_factory=dict)  # reader: phase tried, len(PHASES): done
    stored_at: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> np.ndarray:
        return np.random.default_rng(self.ident).integers(0, 50_000, 2 * C, dtype=np.uint32)

    def kv(self) -> torch.Tensor:
        return torch.randint(-2**15, 2**15, (2, L, 2 * C, D), dtype=torch.int16,
                             generator=torch.Generator().manual_seed(self.ident))


class Load:
    """A writer and a reader thread per host; counts go to ``stats[phase]``."""

    def __init__(self, hosts: list[Host], args: argparse.Namespace) -> None:
        self.hosts, self.args = hosts, args
        self.phase, self.dead, self.docs = 0, -1, list[Doc]()
        self.stats, self.lat = [Counter[str]() for _ in PHASES], [list[float]() for _ in PHASES]
        self.guard, self.stopping = threading.Lock(), threading.Event()
        self.threads = [threading.Thread(target=f, args=(i,), daemon=True)
                        for i in range(len(hosts)) for f in (self.write, self.read)]

    def count(self, phase: int, **n: int) -> None:
        with self.guard:
            self.stats[phase].update(n)

    def write(self, i: int) -> None:
        host = self.hosts[i]
        for ident in itertools.count(10**6 * (i + 1)):
            if self.stopping.wait(self.args.store_every_s):
                return
            doc = Doc(ident, i, self.phase)
            doc.dead = {k for k, h in enumerate(chunk_hashes(Namespace(MODEL), doc.tokens, C))
                        if master_of(f"kvblend:1:{h.hex()}:0", self.args.masters) == self.dead}
            with host.locks[0]:
                if host.paused:
                    continue
                host.kv.view(torch.int16)[:, :, :2 * C] = doc.kv()
                ok = host.client.store_pre_computed(host.inst, doc.tokens).wait().ok
            self.count(doc.phase, docs_stored=1, store_failed=int(not ok))
            with self.guard:
                doc.kept = ok and i == 0 and sum(d.owner == 0 for d in self.docs) < RESERVE
                self.docs += [doc] if ok else []

    def next_doc(self, i: int) -> Doc | None:
        """The oldest settled unread document of another host's (the kept ones first)."""
        kept_due = self.hosts[0].stopped or self.phase == len(PHASES) - 1
        with self.guard:
            due = [d for d in self.docs if d.owner != i and d.readers.get(i, -1) < self.phase
                   and time.monotonic() - d.stored_at >= SETTLE_S and (not d.kept or kept_due)]
            doc = min(due, key=lambda d: (not d.kept, d.stored_at), default=None)
            if doc is not None:
                doc.readers[i] = self.phase
            return doc

    def read(self, i: int) -> None:
        while not self.stopping.is_set():
            doc = None if self.hosts[i].paused else self.next_doc(i)
            if doc is None:
                self.stopping.wait(0.1)
            else:
                self.read_doc(i, doc)

    def read_doc(self, i: int, doc: Doc) -> None:
        """Looks ``doc`` up on host ``i``, retrieves what it found, checks every byte."""
        host = self.hosts[i]
        with host.locks[1]:
            if host.paused:
                return doc.readers.pop(i, None)  # type: ignore[return-value]
            phase, start = self.phase, time.monotonic()
            remote = [m for m in host.client.lookup(doc.tokens, model_name=MODEL).matches
                      if m.location == "remote"]
            host.kv.view(torch.int16)[:, :, 2 * C:] = SENTINEL
            res = host.client.retrieve(host.inst, doc.tokens, remote, offset=2 * C,
                                       rotate=False).wait()
            took, found = time.monotonic() - start, {m.cur_st // C for m in remote}
            failed = {remote[j].cur_st // C for j in res.failed}
            wrong = self.check(host, doc, found, failed)
        owner = "owner_" if doc.kept else ""
        if not owner:  # where each chunk was written, and whether lookup found it
            self.count(doc.phase, found_live=len(found - doc.dead), chunks_live=2 - len(doc.dead),
                       found_dead=len(found & doc.dead), chunks_dead=len(doc.dead))
        self.count(phase, **{f"{owner}hit": len(found - failed), f"{owner}miss": len(failed),
                             "wrong": wrong, "miss_ep": len(failed) * (
                                 self.hosts[doc.owner].endpoint == self.args.masters - 1)})
        with self.guard:
            self.lat[phase].append(took)
            if not (failed and owner):  # else read again in a later phase
                doc.readers[i] = len(PHASES)

    def check(self, host: Host, doc: Doc, found: set[int], failed: set[int]) -> int:
        """Wrong chunks: copied but not the owner's bytes, or not copied but not the sentinel."""
        got, want = host.kv.view(torch.int16)[:, :, 2 * C:], doc.kv()
        chunk = [(got[:, :, k * C:(k + 1) * C], want[:, :, k * C:(k + 1) * C]) for k in range(2)]
        return sum(not torch.equal(*chunk[k]) if k in found - failed
                   else bool((chunk[k][0] != SENTINEL).any()) for k in range(2))


def run_phases(load: Load, hosts: list[Host], masters: list[Master], args: argparse.Namespace
               ) -> list[tuple[str, float, Counter[str], list[int]]]:
    """Per phase: name, length, the hosts' counter deltas (a paused host's count once it is
    back), records added to each master's streams. The last master is killed."""
    last, rows, victim = [Counter[str]() for _ in hosts], [], masters[-1]

    def sample() -> list[int]:
        for i, h in enumerate(hosts):
            last[i] = last[i] if h.paused else Counter(h.metrics())
        return [m.records() for m in masters]

    for t in load.threads:
        t.start()
    for phase, name in enumerate(PHASES):
        t0, records0, before = time.monotonic(), sample(), [Counter(c) for c in last]
        print(f"  .. {time.strftime('%X')} phase {name}", file=sys.stderr, flush=True)
        load.phase = phase
        if phase == 1:
            load.dead = masters.index(victim)
            victim.kill()
        elif phase == 2:
            hosts[0].pause(True)
        elif phase == 3:
            hosts[0].pause(False)
            victim.start()
            poll(lambda: cluster_ok(masters), 90, "the cluster ok again")
            load.dead = -1
        time.sleep(max(0.0, args.phase_s - (time.monotonic() - t0)))  # the phase's length
        records = sample()
        rows.append((name, time.monotonic() - t0, sum((a - b for a, b in zip(
            last, before, strict=True)), Counter()), [b - a if b >= a else b for a, b in zip(
                records0, records, strict=True)]))
    time.sleep(SETTLE_S)  # the last documents' reads
    load.stopping.set()
    for t in load.threads:
        t.join(SETTLE_S + 10)
    return rows


def table(load: Load, rows: list[tuple[str, float, Counter[str], list[int]]]) -> None:
    print("\n| phase | s | docs | written | failed | replayed | records per master | found, live "
          "masters | found, dead master | hit | miss | of which owner's endpoint on it | WRONG "
          f"| paused owner's hit / miss | retrieve p50 / max ms |\n|{'---|' * 15}")
    for (name, took, m, records), s, lat in zip(rows, load.stats, load.lat, strict=True):
        lat = sorted(lat) or [0.0]
        written, failed, replayed = (m[f"kvblend_remote_{n}_total"] for n in (
            "written_chunks", "failed_writes", "replayed_writes"))
        print(f"| {name} | {took:.0f} | {s['docs_stored']} | {written:.0f} | {failed:.0f} | "
              f"{replayed:.0f} | {' / '.join(map(str, records))} | {s['found_live']} of "
              f"{s['chunks_live']} | {s['found_dead']} of {s['chunks_dead']} | {s['hit']} | "
              f"{s['miss']} | {s['miss_ep']} | {s['wrong']} | {s['owner_hit']} / "
              f"{s['owner_miss']} | {lat[len(lat) // 2] * 1e3:.0f} / {lat[-1] * 1e3:.0f} |")


def simulate(args: argparse.Namespace, workdir: Path, stack: ExitStack) -> int:
    """The whole run, each thing it starts closed by ``stack``; returns the wrong chunks."""
    nodes = network(args.hosts + args.masters, args, stack)
    (workdir / "remote.key").write_text(KEY_TEXT + "\n")
    masters = [Master(*nodes[args.hosts + j], stack) for j in range(args.masters)]
    make_cluster(masters)
    remote = "redis+cluster://" + ",".join(f"{m.ip}:{REDIS_PORT}" for m in masters)
    hosts = [Host(*nodes[i], remote, workdir, args, stack, -i % args.masters)  # 1: on the last
             for i in range(args.hosts)]
    for h in hosts:
        h.connect()
    load = Load(hosts, args)
    rows = run_phases(load, hosts, masters, args)
    print(f"\n{args.hosts} hosts x {args.masters} masters, mode {args.mode}, {args.mbit:g} Mbit/s, "
          f"{args.rtt_ms:g} ms RTT, chunks of {L * C * D >> 8} KiB, a 2-chunk document every "
          f"{args.store_every_s:g} s per host; endpoint records on masters "
          f"{[h.endpoint for h in hosts]}")
    table(load, rows)
    wrong = sum(s["wrong"] for s in load.stats)
    print(f"\nwrong chunks: {wrong or 'NONE'}")
    return wrong


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=3, help="kvblend hosts, at least 2")
    p.add_argument("--masters", type=int, default=3, help="Redis cluster masters, at least 2")
    p.add_argument("--mbit", type=float, default=20.0, help="each link's Mbit/s, each way")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="round trip between namespaces")
    p.add_argument("--mode", choices=("records", "both", "values"), default="records")
    p.add_argument("--phase-s", type=float, default=15.0, help="each phase's length")
    p.add_argument("--store-every-s", type=float, default=0.5, help="per host")
    p.add_argument("--subnet", default="10.213.77", help="the first three octets of a free /24")
    p.add_argument("--switch", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not (args.switch or 2 <= min(args.hosts, args.masters) and args.hosts + args.masters
            <= 250 and min(args.phase_s, args.mbit) > 0):
        p.error("needs --hosts >= 2, --masters >= 2, 250 in all, --phase-s > 0, --mbit > 0")
    return args


def main() -> None:
    args = parse()
    if args.switch:
        names, ips, mbit, rtt = args.switch
        return switch_main(names.split(","), ips.split(","), float(mbit), float(rtt))
    if why := preconditions(args.subnet):
        raise SystemExit(f"netsim: {why}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cleans up like Ctrl+C
    with ExitStack() as stack:  # closes the hosts, the masters, then the namespaces
        workdir = Path(tempfile.mkdtemp(prefix="kvblend-netsim-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        try:
            wrong = simulate(args, workdir, stack)
        except subprocess.CalledProcessError as e:  # ip netns, TUN or addresses refused
            raise SystemExit(f"netsim: `{' '.join(e.cmd)}` failed: {e.stderr.strip()}") from None
    raise SystemExit(1 if wrong else 0)


if __name__ == "__main__":
    main()
