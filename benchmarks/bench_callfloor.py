"""A call's floor: the least a retrieve can cost across two processes on this machine.

The data plane's retrieve of 64 small chunks (3 MiB each) costs 0.55-0.94 ms besides its bytes
(``bench_dataplane.py --fixed-cost``); 0.92 of the PCIe limit leaves it about 0.32 ms. This
benchmark times the same call stripped to what no implementation can skip, to tell how much of
that cost is the path's own work and how much is the machine's:

- the engine's process records its event on its stream, sends one frame (a header and 48 bytes a
  chunk, the size of the product's match rows) over a Unix socket and blocks for the reply;
- the other process, blocked in ``recv``, makes its stream wait for that event (IPC), queues one
  ``cuMemcpy2DAsync`` a chunk from its pinned slab into the engine's IPC-opened ``[2, L, T, D]``
  buffer (48 rows of 64 KiB: the ``small`` layout of ``bench_dataplane.py``), records an event,
  waits for it and sends an 8-byte reply.

No checks, pins, keys, commits or counters: the floor of any design with the copies in another
process. The same loops run compiled (numba, ``nogil``; the driver and libc called through
ctypes) and interpreted (the identical functions run by Python: ``py_func``), in alternating
blocks. Side by side in the same run: a pinned ``copy_`` of the same bytes (the limit) and the
same strided copies issued in this process with nothing around them. Before the table, an empty
call (no chunks) back to back and after 4 ms of idleness, each way.

With CUDA, probes take the call apart (compiled, back to back, in the same blocks; ``PROBES``):
the empty call with the socket alone, with the other process's own event, with its stream
waiting for an engine event that completed long before, with the engine recording it just
before it sends (the floor); the floor with the engine's event asked on the host first
(``cuEventQuery``, waited for only if not complete), and without waiting for it at all.
``--values`` adds the call ordered instead by a word of shared host memory that the engine's
stream writes (``cuStreamWriteValue32``) and the other stream waits for (``cuStreamWaitValue32``).

``--backend cpu`` (no GPU): the other process memcpy's each chunk's rows from its slab into its
own buffer, with no events: the protocol and the processes' wake-ups alone, against memcpy.

Usage::

    python benchmarks/bench_callfloor.py                  # CUDA, 64 chunks of 3 MiB
    python benchmarks/bench_callfloor.py --backend cpu --iters 20
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numba
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_dataplane import median_time  # noqa: E402

L, D, CHUNK, ISZ = 24, 128, 256, 2  # the small layout: 48 rows of 64 KiB a chunk, bfloat16
ROW_WORDS = 6  # a chunk's row in the frame: 48 bytes (slot, token start, four spare words)
WAITALL = 0x100  # MSG_WAITALL
H2D_TYPES = (1, 2)  # CU_MEMORYTYPE_HOST, CU_MEMORYTYPE_DEVICE
P_STREAM, P_ENGINE, P_DONE, P_SLAB, P_BUF, P_PITCH, P_CUDA, P_WORD = range(8)
# a call's probes (the header's second word): the server skips its wait for the engine's event,
# or its own event's record and wait, or asks the engine's event first and waits only if it has
# not completed; the caller skips recording the engine's event; VALUES (``--values``): instead
# of the event, the engine's stream writes the call's number (the word's bits 8 and up) into a
# word of shared host memory and the other stream waits until the word reaches it
NO_WAIT, NO_SYNC, QUERY, NO_RECORD, VALUES = 1, 2, 4, 8, 16


def _fn(lib: ctypes.CDLL, name: str, args: list, res: type = ctypes.c_int) -> Callable:
    f = lib[name]  # a new function object: each keeps its own signature
    f.argtypes, f.restype = args, res
    return f


def _libs(cuda: bool) -> tuple[Callable, ...]:
    """libc's send, recv and memcpy; the driver's stream wait, event record, event wait, 2-D
    copy, event query, and a stream's write of and wait for a word (without CUDA: ``getpid``
    under their signatures, never called)."""
    u64, i32, sz = ctypes.c_uint64, ctypes.c_int, ctypes.c_size_t
    libc = ctypes.CDLL(None)
    send = _fn(libc, "send", [i32, u64, sz, i32], ctypes.c_int64)
    recv = _fn(libc, "recv", [i32, u64, sz, i32], ctypes.c_int64)
    memcpy = _fn(libc, "memcpy", [u64, u64, sz], u64)
    if not cuda:
        drv, names = libc, ("getpid",) * 7
    else:
        drv = ctypes.CDLL("libcuda.so.1")
        names = ("cuStreamWaitEvent", "cuEventRecord", "cuEventSynchronize", "cuMemcpy2DAsync_v2",
                 "cuEventQuery", "cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2")
    word = [u64, u64, ctypes.c_uint32, ctypes.c_uint]
    sigs = ([u64, u64, ctypes.c_uint], [u64, u64], [u64], [u64, u64], [u64], word, word)
    return (send, recv, memcpy) + tuple(_fn(drv, n, a) for n, a in zip(names, sigs))


def make_loops(cuda: bool) -> tuple[Callable, Callable, Callable]:
    """The compiled ``copies``, ``serve`` and ``call``; each one's ``py_func`` is the same code
    run by Python."""
    send, recv, memcpy, wait_event, record, synchronize, copy2d, query, put, wait_word = _libs(cuda)
    width, height = CHUNK * D * ISZ, 2 * L

    @numba.njit(nogil=True)
    def copies(words: np.ndarray, n: int, desc: np.ndarray, p: np.ndarray, how: int) -> int:
        # words[2 + 6 i]: chunk i's slab slot, words[3 + 6 i]: its first token in the buffer;
        # how (the probes): NO_WAIT, NO_SYNC, QUERY (the engine's event asked on the host first)
        cuda = p[P_CUDA] != 0
        if cuda and how & VALUES:
            wait_word(p[P_STREAM], p[P_WORD], how >> 8, 0)  # CU_STREAM_WAIT_VALUE_GEQ
        elif cuda and not how & NO_WAIT and not (how & QUERY and query(p[P_ENGINE]) == 0):
            wait_event(p[P_STREAM], p[P_ENGINE], 0)
        for i in range(n):
            src = p[P_SLAB] + words[2 + ROW_WORDS * i] * width * height
            dst = p[P_BUF] + words[3 + ROW_WORDS * i] * D * ISZ
            if cuda:  # CUDA_MEMCPY2D: 16 words, host source, device destination
                desc[3], desc[11] = src, dst
                copy2d(desc.ctypes.data, p[P_STREAM])
            else:
                for r in range(height):
                    memcpy(dst + r * p[P_PITCH], src + r * width, width)
        if cuda and not how & NO_SYNC:
            record(p[P_DONE], p[P_STREAM])
            synchronize(p[P_DONE])
        return n

    @numba.njit(nogil=True)
    def serve(fd: int, words: np.ndarray, desc: np.ndarray, p: np.ndarray) -> int:
        """Serve calls until a header asks for another mode (returned) or the peer is gone."""
        at = words.ctypes.data
        while True:
            if recv(fd, at, 16, WAITALL) != 16:
                return -1
            n = words[0]
            if n < 0 or n > (len(words) - 2) // ROW_WORDS:
                return words[1]
            if n and recv(fd, at + 16, n * ROW_WORDS * 8, WAITALL) != n * ROW_WORDS * 8:
                return -1
            words[1] = copies(words, n, desc, p, words[1])
            if send(fd, at + 8, 8, 0) != 8:
                return -1

    @numba.njit(nogil=True)
    def call(fd: int, frame: np.ndarray, nbytes: int, reply: np.ndarray, p: np.ndarray) -> int:
        if p[P_CUDA] and frame[1] & VALUES:
            put(p[P_STREAM], p[P_WORD], frame[1] >> 8, 0)
        elif p[P_CUDA] and not frame[1] & NO_RECORD:
            record(p[P_ENGINE], p[P_STREAM])
        if send(fd, frame.ctypes.data, nbytes, 0) != nbytes:
            return -1
        if recv(fd, reply.ctypes.data, 8, WAITALL) != 8:
            return -1
        return reply[0]

    return copies, serve, call


def descriptor(pitch: int) -> np.ndarray:
    """A CUDA_MEMCPY2D (16 words) of one chunk: host rows of 64 KiB to device rows ``pitch``
    apart; the source and destination addresses (words 3 and 11) are set per chunk."""
    desc = np.zeros(16, np.int64)
    desc[2], desc[9] = H2D_TYPES
    desc[6], desc[13] = CHUNK * D * ISZ, pitch
    desc[14], desc[15] = CHUNK * D * ISZ, 2 * L
    return desc


def device_word(shm: shared_memory.SharedMemory) -> tuple[int, object]:
    """The device address of the first word of ``shm``, and the mapping that keeps it
    registered (``dataplane.gather.HostMapping``: portable and mapped)."""
    from kvblend.dataplane.gather import HostMapping
    mapping = HostMapping(ctypes.addressof(ctypes.c_char.from_buffer(shm.buf)), shm.size)
    return mapping.device_ptr, mapping


def _serve_main(path: str) -> None:
    """The other process: attach to the caller's buffer and event, then serve in each mode the
    caller names (0 compiled, 1 Python) until it says 2."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    setup = json.loads(sock.makefile("r").readline())
    cuda, chunks = setup["cuda"], setup["chunks"]
    chunk = CHUNK * D * ISZ * 2 * L
    p = np.zeros(8, np.int64)
    p[P_PITCH], p[P_CUDA] = setup["pitch"], int(cuda)
    keep: list = []
    if cuda:
        import cupy
        rt = cupy.cuda.runtime
        cupy.cuda.Device(0).use()
        stream = cupy.cuda.Stream(non_blocking=True)
        pinned = cupy.cuda.alloc_pinned_memory(chunks * chunk)
        slab = np.frombuffer(pinned, np.uint8, chunks * chunk)
        p[P_BUF] = rt.ipcOpenMemHandle(bytes.fromhex(setup["buffer"]))
        p[P_ENGINE] = rt.ipcOpenEventHandle(bytes.fromhex(setup["event"]))
        p[P_DONE] = rt.eventCreateWithFlags(2)  # disable timing
        p[P_STREAM] = stream.ptr
        keep += [stream, pinned]
        if "word" in setup:
            keep.append(shared_memory.SharedMemory(setup["word"]))
            p[P_WORD], mapping = device_word(keep[-1])
            keep.append(mapping)
    else:
        slab = np.empty(chunks * chunk, np.uint8)
        buf = np.zeros(setup["pitch"] * 2 * L, np.uint8)
        p[P_BUF] = buf.ctypes.data
        keep.append(buf)
    for i in range(chunks):
        slab[i * chunk:(i + 1) * chunk] = i % 251 + 1
    p[P_SLAB] = slab.ctypes.data
    copies, serve, _ = make_loops(cuda)
    words = np.zeros(2 + ROW_WORDS * chunks, np.int64)
    desc = descriptor(setup["pitch"])
    serve(-1, words, desc, p)  # compiled before the caller starts its clock (fd -1: returns)
    sock.sendall(b"ready\n")
    mode = 0
    while mode in (0, 1):
        mode = (serve if mode == 0 else serve.py_func)(sock.fileno(), words, desc, p)
    sock.close()


def median_ms(fn: Callable[[], object], iters: int, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    return median_time(fn, iters) * 1e3


class Caller:
    """This process's side: the engine's buffer, stream and event, the frame, the server."""

    def __init__(self, cuda: bool, chunks: int, values: bool = False) -> None:
        self.cuda, self.chunks, self.value, self.word = cuda, chunks, 0, None
        self.chunk = CHUNK * D * ISZ * 2 * L
        self.pitch = chunks * CHUNK * D * ISZ
        self.p = np.zeros(8, np.int64)
        self.p[P_CUDA], self.p[P_PITCH] = int(cuda), self.pitch
        self.copies, _, self.call_fn = make_loops(cuda)
        setup = {"cuda": cuda, "chunks": chunks, "pitch": self.pitch}
        if cuda:
            import cupy
            import torch
            rt = cupy.cuda.runtime
            cupy.cuda.Device(0).use()
            self.p[P_BUF] = rt.malloc(2 * L * self.pitch)  # an allocation of its own (IPC)
            self.p[P_ENGINE] = rt.eventCreateWithFlags(2 | 4)  # disable timing, interprocess
            self.stream = torch.cuda.Stream()
            self.p[P_STREAM] = self.stream.cuda_stream
            setup["buffer"] = bytes(rt.ipcGetMemHandle(int(self.p[P_BUF]))).hex()
            setup["event"] = bytes(rt.ipcGetEventHandle(int(self.p[P_ENGINE]))).hex()
            if values:
                self.word = shared_memory.SharedMemory(create=True, size=4096)
                self.word.buf[:8] = bytes(8)
                self.p[P_WORD], self._mapping = device_word(self.word)
                setup["word"] = self.word.name
        self.frame = np.zeros(2 + ROW_WORDS * chunks, np.int64)
        self.frame[0] = chunks
        self.frame[2::ROW_WORDS] = np.arange(chunks)  # chunk i from slot i ...
        self.frame[3::ROW_WORDS] = np.arange(chunks) * CHUNK  # ... to tokens i*C onwards
        self.reply = np.zeros(1, np.int64)
        self._start(setup)

    def _start(self, setup: dict) -> None:
        self._dir = tempfile.mkdtemp(prefix="callfloor-")
        path = os.path.join(self._dir, "s")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        listener.settimeout(300)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve", path])
        self.sock, _ = listener.accept()
        listener.close()
        self.sock.settimeout(300)
        self.sock.sendall((json.dumps(setup) + "\n").encode())
        if self.sock.makefile("rb").readline() != b"ready\n":
            raise RuntimeError("the serving process did not start")
        self.sock.settimeout(None)
        self.fd, self.mode = self.sock.fileno(), 0

    def use(self, mode: int) -> None:
        """Switch the server (and this side) to compiled (0) or Python (1) loops."""
        if mode != self.mode:
            self.sock.sendall(np.array([-1, mode], np.int64).tobytes())
            self.mode = mode

    def call(self, n: int, how: int = 0) -> None:
        fn = self.call_fn if self.mode == 0 else self.call_fn.py_func
        if how & VALUES:
            self.value += 1
            how |= self.value << 8
        self.frame[0], self.frame[1] = n, how
        if fn(self.fd, self.frame, 16 + n * ROW_WORDS * 8, self.reply, self.p) != n:
            raise RuntimeError("the serving process failed a call")

    def check(self) -> None:
        """Every chunk's first and last row arrived from its slot (fill value i % 251 + 1)."""
        if not self.cuda:
            return  # the CPU server writes a buffer of its own
        import cupy
        host = np.empty(2 * L * self.pitch, np.uint8)
        cupy.cuda.runtime.memcpy(host.ctypes.data, int(self.p[P_BUF]), host.nbytes, 2)
        rows = host.reshape(2 * L, self.chunks, CHUNK * D * ISZ)
        want = (np.arange(self.chunks) % 251 + 1).astype(np.uint8)
        for r in (0, 2 * L - 1):
            if not (rows[r] == want[:, None]).all():
                raise RuntimeError(f"row {r} of some chunk did not arrive from its slot")

    def close(self) -> None:
        self.sock.sendall(np.array([-1, 2], np.int64).tobytes())
        self.proc.wait(timeout=60)
        self.sock.close()
        os.unlink(os.path.join(self._dir, "s"))
        os.rmdir(self._dir)
        if self.word is not None:  # the server's resource tracker may have unlinked it first
            with contextlib.suppress(FileNotFoundError):
                self.word.unlink()


def limits(c: Caller, iters: int) -> tuple[float, float]:
    """The same bytes by a pinned copy_ (memcpy without CUDA), and the strided copies alone."""
    n = c.chunks * c.chunk
    p = c.p.copy()
    if c.cuda:
        import cupy
        import torch
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(1)
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")

        def limit() -> None:
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
        p[P_SLAB], p[P_STREAM] = host.data_ptr(), torch.cuda.current_stream().cuda_stream
        p[P_DONE] = cupy.cuda.runtime.eventCreateWithFlags(2)
        c.copies(c.frame, 0, descriptor(c.pitch), c.p, 0)  # the engine's event recorded once
    else:
        host, dev = np.ones(n, np.uint8), np.zeros(n, np.uint8)
        buf = np.zeros(2 * L * c.pitch, np.uint8)

        def limit() -> None:
            np.copyto(dev, host)
        p[P_SLAB], p[P_BUF] = host.ctypes.data, buf.ctypes.data
    desc = descriptor(c.pitch)
    alone = median_ms(lambda: c.copies(c.frame, c.chunks, desc, p, 0), iters)
    return median_ms(limit, iters), alone


def timed_calls(c: Caller, n: int, iters: int, idle_s: float = 0.0, how: int = 0) -> list[float]:
    times = []
    for _ in range(iters):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        c.call(n, how)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--iters", type=int, default=40, help="calls a block")
    ap.add_argument("--blocks", type=int, default=3, help="blocks of each mode, alternating")
    ap.add_argument("--values", action="store_true",
                    help="also order calls by a word in shared host memory (stream memory ops)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        _serve_main(args.serve)
        return
    cuda = args.backend == "cuda" if args.backend else _has_cuda()
    c = Caller(cuda, args.chunks, args.values)
    try:
        report(c, args)
    finally:
        c.close()


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


PROBES = (  # (what, chunks: 0 or all, how); compiled, back to back
    ("empty: the socket alone", 0, NO_RECORD | NO_WAIT | NO_SYNC),
    ("empty: + the server's own event recorded and waited for", 0, NO_RECORD | NO_WAIT),
    ("empty: + its stream waits for the engine's event, completed long before", 0, NO_RECORD),
    ("empty: + the engine records its event first (the floor)", 0, 0),
    ("empty: the floor, the engine's event asked first on the host", 0, QUERY),
    ("all chunks: the floor, the engine's event asked first on the host", -1, QUERY),
    ("all chunks: the floor without waiting for the engine's event", -1, NO_WAIT),
)
WORD_PROBES = (  # --values
    ("empty: ordered by a word the engine's stream writes, not by its event", 0, VALUES),
    ("all chunks: ordered by a word the engine's stream writes, not by its event", -1, VALUES),
)


def measure(c: Caller, args: argparse.Namespace) -> dict:
    """Every row's times (ms), blocks of each mode and of the probes alternating."""
    times: dict = {}
    for mode in (0, 1):
        c.use(mode)
        c.call(c.chunks)
        c.check()
    for _ in range(args.blocks):
        for mode in (0, 1):
            c.use(mode)
            timed_calls(c, c.chunks, 3)
            times.setdefault(("full", mode), []).extend(timed_calls(c, c.chunks, args.iters))
            for idle in (0.0, 0.004):
                times.setdefault(("empty", mode, idle), []).extend(timed_calls(c, 0, 20, idle))
        if c.cuda:
            c.use(0)
            for what, n, how in PROBES + (WORD_PROBES if args.values else ()):
                n = c.chunks if n < 0 else n
                timed_calls(c, n, 3, how=how)
                times.setdefault(what, []).extend(timed_calls(c, n, args.iters, how=how))
    return times


def report(c: Caller, args: argparse.Namespace) -> None:
    names = ("compiled", "Python")
    times = measure(c, args)
    med = {k: statistics.median(v) for k, v in times.items()}
    limit, alone = limits(c, args.iters)
    kind = "pinned copy_" if c.cuda else "memcpy"
    mib = c.chunks * c.chunk / 2**20
    print(f"# {c.chunks} chunks of {c.chunk / 2**20:.0f} MiB ({mib:.0f} MiB) a call, "
          f"{'CUDA' if c.cuda else 'CPU'}; {args.blocks} blocks of {args.iters} calls a mode")
    for mode in (0, 1):
        print(f"# empty call, {names[mode]}: back to back {med[('empty', mode, 0.0)] * 1e3:.0f} "
              f"us, after 4 ms idle {med[('empty', mode, 0.004)] * 1e3:.0f} us")
    print("| what | ms a call | share of the limit | besides the strided copies (us) |")
    print("|---|---:|---:|---:|")
    print(f"| limit: {kind} of the same bytes | {limit:.3f} | 1.000 | |")
    print(f"| the strided copies alone, this process | {alone:.3f} | {limit / alone:.3f} | 0 |")
    rows = [(f"the floor call, {names[m]}", med[("full", m)]) for m in (0, 1)]
    for what, n, _ in PROBES + WORD_PROBES:
        rows += [(what, med[what])] if n < 0 and what in med else []
    for what, ms in rows:
        print(f"| {what} | {ms:.3f} | {limit / ms:.3f} | {(ms - alone) * 1e3:.0f} |")
    print(f"# 0.92 of the limit leaves a call {(limit / 0.92 - alone) * 1e3:.0f} us besides its "
          "strided copies")
    for what, n, _ in PROBES + WORD_PROBES:
        if not n and what in med:
            print(f"# {what}: {med[what] * 1e3:.0f} us")


if __name__ == "__main__":
    main()
