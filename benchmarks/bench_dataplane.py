"""Data-plane throughput: store and retrieve GB/s through the whole call path, against the limit.

Each timed call goes client -> channel -> data plane (reserve/pin, one strided copy per chunk,
wait for completion, commit/unpin) -> reply, for ``--chunks`` chunks; the ``x4`` ops send four
calls back to back on one instance and wait for all (calls in flight). The ``ready`` ops time what
an engine waits for instead of the reply: from the call until its copies completed (the client's
``wait_queued``, then the stream synchronized), the retrieve's bytes readable or the store's
buffer free again; the commits, unpins and reply that follow are not timed. Side by side in the
same run:

- CUDA: a plain pinned ``copy_`` of the same bytes each way (the PCIe limit), and both directions
  at once on two streams; and, for reference only, the same strided copies the data plane issues
  (one ``cudaMemcpy2DAsync`` per chunk between the ``[2, L, T, D]`` buffer and a pinned host
  buffer), from this process with nothing else around them: the DMA's own cost of the layout;
- CPU: ``numpy.copyto`` of the same bytes (memcpy).

Before the table, an empty call's round trip back to back and after 4 ms of idleness (every
thread asleep, as between an engine's transfers): what waking sleeping threads costs a call.
``--fixed-cost`` also times one caller's retrieves of 8, 16, 32 and 64 chunks and fits a line
through them: its intercept is what a call costs besides its bytes (the client, the channel, the
data plane's steps before the first copy and after the last), printed beside what 0.92 of the
limit leaves a call of ``--chunks`` chunks for all of that.

Usage::

    python benchmarks/bench_dataplane.py --backend cuda          # Llama-3-8B-like and small layouts
    python benchmarks/bench_dataplane.py --backend cpu --layouts small
    python benchmarks/bench_dataplane.py --backend cpu --layouts tiny   # the per-call work alone
    python benchmarks/bench_dataplane.py --layouts small --fixed-cost   # a call's fixed cost
    python benchmarks/bench_dataplane.py --layouts small --fixed-cost --order-events
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvblend.api.settings import Settings  # noqa: E402
from kvblend.dataplane import default_address  # noqa: E402
from kvblend.dataplane.client import BlendClient  # noqa: E402
from kvblend.dataplane.messages import Ping  # noqa: E402
from kvblend.shm.events import EventLog  # noqa: E402
from kvblend.shm.fingerprint import FingerprintIndex  # noqa: E402
from kvblend.shm.names import destroy  # noqa: E402
from kvblend.shm.store import Store, StoreConfig  # noqa: E402

# (L, D), bfloat16; "tiny" chunks (8 KiB) time the per-call work itself, not the bytes
LAYOUTS = {"llama8b": (32, 1024), "small": (24, 128), "2mib": (16, 128), "tiny": (1, 8)}
IN_FLIGHT = 4  # calls sent back to back by the "x4" ops
CHUNK = 256


def median_time(fn: Callable[[], object], iters: int, before: Callable[[], object] | None = None
                ) -> float:
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def start_dataplane(prefix: str, backend: str) -> subprocess.Popen:
    # the road of kvblend serve: its settings (KVBLEND_DP_FIRST_MIB and the like apply) build
    # the data plane's, handed over whole
    settings = Settings(shm_prefix=prefix, backend=backend, log_level="warning"
                        ).dataplane_settings()
    proc = subprocess.Popen([sys.executable, "-m", "kvblend.dataplane"], stdout=subprocess.PIPE,
                            env={**os.environ, **settings.to_env()},
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(b"dataplane ready"):
        raise RuntimeError(f"data plane failed to start: {line!r}")
    return proc


class Case:
    def __init__(self, client: BlendClient, backend: str, L: int, D: int, chunks: int,
                 model: str) -> None:
        self.client, self.backend, self.chunks = client, backend, chunks
        self.T = chunks * CHUNK
        self.nbytes = 2 * L * self.T * D * 2
        self.rng = np.random.default_rng(0)
        self.drawn: list[np.ndarray] = []  # tokens of the next stores (``draw``)
        self.open: list = []  # ``ready`` calls not yet ended (``settle``)
        self.L, self.D = L, D
        self.kv = [self._buffer(L, D) for _ in range(2)]
        self.inst = [client.register_kv_cache(kv, model_name=model) for kv in self.kv]
        self.model = model
        self.tokens = self.fresh()
        done = client.store_pre_computed(self.inst[0], self.tokens).wait()
        assert done.ok and done.copied == chunks, done
        self.matches = client.lookup(self.tokens, model).matches
        assert len(self.matches) == chunks

    def _buffer(self, L: int, D: int) -> torch.Tensor:
        if self.backend == "cuda":
            return torch.randn((2, L, self.T, D), device="cuda").to(torch.bfloat16)
        kv = self.client.cpu_kv_buffer(L, self.T, D, torch.bfloat16)
        kv.view(torch.int16).copy_(torch.randint(-2**15, 2**15, kv.shape, dtype=torch.int16))
        return kv

    def fresh(self) -> np.ndarray:
        return self.rng.integers(0, 2**31, self.T)

    def draw(self, k: int = 1) -> None:
        """Fresh tokens for the next ``k`` stores, drawn before the timed call (drawing 16k
        random tokens takes about 0.1 ms, which is not the data plane's)."""
        self.drawn = [self.fresh() for _ in range(k)]

    def take(self) -> np.ndarray:
        return self.drawn.pop() if self.drawn else self.fresh()

    def store(self, inst: int = 1) -> None:
        tokens = self.take()
        with self.client.store_pre_computed(self.inst[inst], tokens) as t:
            done = t.wait()  # the with block gives the call's CUDA events back for reuse
        assert done.ok and done.copied == self.chunks, done

    def refill(self) -> None:
        """Re-store whatever of the retrieved set the timed stores evicted (untimed)."""
        with self.client.store_pre_computed(self.inst[0], self.tokens) as t:
            assert t.wait().ok

    def retrieve(self, inst: int = 0) -> None:
        with self.client.retrieve(self.inst[inst], self.tokens, self.matches) as t:
            assert t.wait().ok

    def first(self, k: int, ready: bool) -> Callable[[], None]:
        """A retrieve of the first ``k`` matches, until its reply or (``ready``) until its copies
        completed."""
        def run() -> None:
            t = self.client.retrieve(self.inst[0], self.tokens, self.matches[:k])
            self.open.append(t)
            if ready:
                assert not t.wait_queued()
                self.sync()
            else:
                assert t.wait().ok
        return run

    def settle(self) -> None:
        """Let the untimed rest of the ``ready`` calls end, and give their events back."""
        while self.open:
            t = self.open.pop()
            assert t.wait().ok
            t.release()

    def store_ready(self) -> None:
        """A store until the engine may reuse its buffer (its copies completed)."""
        t = self.client.store_pre_computed(self.inst[1], self.take())
        self.open.append(t)
        assert not t.wait_queued()
        self.sync()

    def retrieve_ready(self) -> None:
        """A retrieve until the engine may read the bytes (its copies completed)."""
        self.first(self.chunks, True)()

    def sync(self) -> None:
        if self.backend == "cuda":
            torch.cuda.current_stream().synchronize()

    def stores_in_flight(self) -> None:
        calls = [self.client.store_pre_computed(self.inst[1], self.take())
                 for _ in range(IN_FLIGHT)]
        for c in calls:
            done = c.wait()
            c.release()
            assert done.ok and done.copied == self.chunks, done

    def retrieves_in_flight(self) -> None:
        calls = [self.client.retrieve(self.inst[0], self.tokens, self.matches)
                 for _ in range(IN_FLIGHT)]
        assert all(c.wait().ok for c in calls)
        for c in calls:
            c.release()

    def turned(self, rotate: bool) -> Callable[[], None]:
        """A retrieve into a buffer registered with Llama-3.1's rotary config (head dim 128),
        turning K to positions 1000 further on, or not."""
        if not hasattr(self, "rot"):
            from kvblend.dataplane.registration import RotaryConfig
            cfg = RotaryConfig(head_dim=128, theta=500000.0, scaling="llama3", factor=8.0,
                               low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)
            self.rot_kv = self._buffer(self.L, self.D)
            self.rot = self.client.register_kv_cache(self.rot_kv, model_name=self.model,
                                                     rotary=cfg)

        def run() -> None:
            with self.client.retrieve(self.rot, self.tokens, self.matches, first_position=1000,
                                      rotate=rotate) as t:
                assert t.wait().ok
        return run

    def both(self) -> None:
        r = self.client.retrieve(self.inst[0], self.tokens, self.matches)
        s = self.client.store_pre_computed(self.inst[1], self.take())
        assert r.wait().ok and s.wait().ok
        r.release(), s.release()


FIT_CHUNKS = (8, 16, 32, 64)  # chunks a call in the fit of --fixed-cost
TARGET = 0.92  # the share of copy_ that one caller's small chunks are to reach


def fixed_cost(case: Case, name: str, iters: int, limit: float) -> None:
    """Time one caller's retrieves of 8 to 64 chunks and fit time = fixed + per_chunk x chunks
    (least squares): what a call costs besides its bytes, printed beside what ``TARGET`` of
    ``limit`` (bytes/s) leaves a call of ``--chunks`` chunks for everything but its copies."""
    ks = [k for k in FIT_CHUNKS if k <= case.chunks]
    per = case.nbytes / case.chunks
    allowed = (1 / TARGET - 1) * case.nbytes / limit
    for label, ready in (("retrieve", False), ("retr. ready", True)):
        # the sizes in turn, iteration by iteration: a machine drifting in speed moves them all
        times = np.array([[median_time(case.first(k, ready), 1,
                                       lambda: (case.settle(), case.refill())) for k in ks]
                          for _ in range(iters)])
        case.settle()
        slope, fixed = np.polyfit(ks, np.median(times, axis=0), 1)
        print(f"#   {name} {label}: a call costs {1e6 * fixed:.0f} us besides its bytes (fit of "
              f"{ks[0]}-{ks[-1]} chunks: {1e6 * slope:.1f} us a chunk, {per / slope / 1e9:.2f} "
              f"GB/s); {TARGET} of the limit at {case.chunks} chunks leaves "
              f"{1e6 * allowed:.0f} us", flush=True)


IDLE_GAP_MS = 4.0  # about one small transfer's copies: every thread sleeps that long between calls


def ping_round_trips(client: BlendClient, n: int, gap_ms: float = 0.0) -> float:
    """Empty-call round trip over the channel (client -> data plane -> client), the calls back to
    back or each after the client slept ``gap_ms`` (every thread of both processes idle, as
    between the transfers of a real engine); prints and returns the median in µs."""
    times = []
    for _ in range(n):
        if gap_ms:
            time.sleep(gap_ms / 1e3)
        t0 = time.perf_counter()
        client._channel.call(Ping())
        times.append(time.perf_counter() - t0)
    us = np.array(times) * 1e6
    after = f" each after {gap_ms:g} ms idle" if gap_ms else " back to back"
    print(f"# empty call (Ping) round trip{after}, {n} calls: p50 {np.median(us):.0f} us, "
          f"p99 {np.percentile(us, 99):.0f} us", flush=True)
    return float(np.median(us))


def limits_cuda(nbytes: int, iters: int, L: int, D: int, chunks: int) -> dict[str, float]:
    gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    gpu2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def d2h() -> None:
        host.copy_(gpu, non_blocking=True)
        torch.cuda.synchronize()

    def h2d() -> None:
        gpu.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    def both() -> None:
        with torch.cuda.stream(s1):
            host.copy_(gpu, non_blocking=True)
        with torch.cuda.stream(s2):
            gpu2.copy_(host2, non_blocking=True)
        torch.cuda.synchronize()

    import cupy
    rt = cupy.cuda.runtime
    row, T = D * 2, chunks * CHUNK
    width, pitch = CHUNK * row, T * row
    chunk_bytes = 2 * L * width
    g, h, stream = gpu.data_ptr(), host.data_ptr(), s1.cuda_stream

    def d2h_2d() -> None:
        for i in range(chunks):
            rt.memcpy2DAsync(h + i * chunk_bytes, width, g + i * width, pitch, width, 2 * L,
                             rt.memcpyDeviceToHost, stream)
        s1.synchronize()

    def h2d_2d() -> None:
        for i in range(chunks):
            rt.memcpy2DAsync(g + i * width, pitch, h + i * chunk_bytes, width, width, 2 * L,
                             rt.memcpyHostToDevice, stream)
        s1.synchronize()

    d2h(), h2d(), both(), d2h_2d(), h2d_2d()
    return {"store": nbytes / median_time(d2h, iters), "retrieve": nbytes / median_time(h2d, iters),
            "both": 2 * nbytes / median_time(both, iters),
            "store_2d": nbytes / median_time(d2h_2d, iters),
            "retrieve_2d": nbytes / median_time(h2d_2d, iters)}


def limits_cpu(nbytes: int, iters: int) -> dict[str, float]:
    a = np.ones(nbytes, np.uint8)
    b = np.ones(nbytes, np.uint8)
    c = np.ones(nbytes, np.uint8)
    copy = lambda: np.copyto(b, a)
    one = nbytes / median_time(copy, iters)

    def both() -> None:
        import threading
        t = threading.Thread(target=np.copyto, args=(c, a))
        t.start()
        np.copyto(b, a)
        t.join()

    return {"store": one, "retrieve": one, "both": 2 * nbytes / median_time(both, iters)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layouts", default="llama8b,small")
    p.add_argument("--chunks", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--storage-gib", type=float, default=7.0)
    p.add_argument("--page-mib", type=int, default=256)
    p.add_argument("--fixed-cost", action="store_true",
                   help="also fit one caller's retrieve time against its chunk count: a call's "
                        "cost besides its bytes, beside what the target share leaves it")
    p.add_argument("--rotary", action="store_true",
                   help="also retrieve into a buffer that turns K (Llama-3.1 rotary, "
                        "head dim 128) and print its time against the same retrieve unturned")
    p.add_argument("--order-events", action="store_true",
                   help="order the calls by interprocess events, not by the order word "
                        "(dataplane.streamword, the client's default)")
    args = p.parse_args()
    prefix = f"kvbench_{os.getpid()}"
    t0 = time.perf_counter()
    Store.open(prefix, StoreConfig(capacity_bytes=int(args.storage_gib * (1 << 30)),
                                   page_bytes=args.page_mib << 20)).close()
    FingerprintIndex.open(prefix, CHUNK, capacity=1 << 16).close()
    proc = start_dataplane(prefix, args.backend)
    print(f"# store {args.storage_gib} GiB created and data plane ready in "
          f"{time.perf_counter() - t0:.1f} s; backend {args.backend}; {args.chunks} chunks a call")
    device = torch.cuda.get_device_name() if args.backend == "cuda" else f"{os.cpu_count()} CPUs"
    print(f"# device: {device}")
    limit_name = "pinned copy_" if args.backend == "cuda" else "memcpy"
    print(f"{'layout':<9} {'chunk MiB':>9} {'op':<11} {'dataplane GB/s':>12} "
          f"{limit_name + ' GB/s':>17} {'ratio':>6} {'ms a call':>9}")
    events = EventLog.open(prefix)
    try:
        with BlendClient(dataplane_address=default_address(prefix),
                         order_words=not args.order_events) as client:
            hot = ping_round_trips(client, 5000)
            idle = ping_round_trips(client, 300, IDLE_GAP_MS)
            print(f"#   {idle / hot:.1f}x after idleness: threads that slept wake slowly (a "
                  "transfer wakes four or five)", flush=True)
            for name in args.layouts.split(","):
                L, D = LAYOUTS[name]
                case = Case(client, args.backend, L, D, args.chunks, f"bench-{name}")
                limits = (limits_cuda(case.nbytes, args.iters, L, D, args.chunks)
                          if args.backend == "cuda" else limits_cpu(case.nbytes, args.iters))
                case.store(), case.refill(), case.retrieve(), case.refill(), case.both()  # warm
                got = {"store": case.nbytes / median_time(case.store, args.iters, case.draw),
                       "retrieve": case.nbytes / median_time(case.retrieve, args.iters,
                                                             case.refill),
                       "both": 2 * case.nbytes / median_time(
                           case.both, args.iters, lambda: (case.refill(), case.draw())),
                       "store ready": case.nbytes / median_time(
                           case.store_ready, args.iters, lambda: (case.settle(), case.draw())),
                       "retr. ready": case.nbytes / median_time(
                           case.retrieve_ready, args.iters, lambda: (case.settle(),
                                                                      case.refill()))}
                case.settle()
                limits["store ready"], limits["retr. ready"] = limits["store"], limits["retrieve"]
                if IN_FLIGHT * case.nbytes <= args.storage_gib * (1 << 30) / 2:
                    x = f"x{IN_FLIGHT}"
                    got["store " + x] = IN_FLIGHT * case.nbytes / median_time(
                        case.stores_in_flight, args.iters, lambda: case.draw(IN_FLIGHT))
                    got["retrieve " + x] = IN_FLIGHT * case.nbytes / median_time(
                        case.retrieves_in_flight, args.iters, case.refill)
                    limits["store " + x], limits["retrieve " + x] = limits["store"], limits["retrieve"]
                if args.rotary and D % 128 == 0:
                    plain = median_time(case.turned(False), args.iters, case.refill)
                    turned = median_time(case.turned(True), args.iters, case.refill)
                    print(f"#   {name} retrieve turning K: {1e3 * turned:.1f} ms against "
                          f"{1e3 * plain:.1f} ms unturned ({turned / plain - 1:+.1%})", flush=True)
                chunk_mib = case.nbytes / args.chunks / (1 << 20)
                for op in got:
                    # the op's time; x4: a call's share of the four
                    ms = 1e3 * case.nbytes * (2 if op == "both" else 1) / got[op]
                    print(f"{name:<9} {chunk_mib:>9.3f} {op:<11} {got[op] / 1e9:>12.2f} "
                          f"{limits[op] / 1e9:>17.2f} {got[op] / limits[op]:>6.3f} {ms:>9.3f}",
                          flush=True)
                for op in ("store", "retrieve"):
                    if op + "_2d" in limits:
                        lim = limits[op + "_2d"]
                        print(f"#   {name} {op}: the same strided copies alone {lim / 1e9:.2f} GB/s"
                              f" ({lim / limits[op]:.3f} of copy_; data plane at "
                              f"{got[op] / lim:.3f} of them)", flush=True)
                ends = events.recent(8 * args.iters)
                for kind in ("store_end", "retrieve_end"):
                    ms = [1e3 * e["duration_s"] for e in ends if e["kind"] == kind]
                    print(f"#   {name} {kind}: in-data-plane median {statistics.median(ms):.2f} ms"
                          f" over the last timed calls")
                if args.fixed_cost:
                    fixed_cost(case, name, args.iters, limits["retrieve"])
                for i in case.inst:
                    client.unregister(i)
                del case
    finally:
        events.close()
        proc.terminate()
        proc.wait(timeout=60)
        destroy(prefix)


if __name__ == "__main__":
    main()
