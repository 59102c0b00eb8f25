"""Do stream memory operations on a word shared by CUDA IPC return at once?

The order word (``kvblend.dataplane.streamword``) has the data plane's stream wait for a word of
the engine's allocation, opened by CUDA IPC, and the ready word has that stream write into it.
Both are meant to be queued: the calling thread goes on while the stream waits. This probe
checks that on the machine, side by side for a word of the process's own allocation and one of
another process's allocation opened by IPC:

- the parent allocates two words (``streamword.allocate(2)``) and sets the first to 5;
- a spawned child opens the allocation, holds a stream of its own behind a gate (a wait for a
  word of its own pinned host memory, which a timer thread opens after ``--gate-ms``), and times
  how long queueing a write of the ready word and a wait for the order word (already at 5) hold
  its thread, then a wait for a count that another stream writes ``--gate-ms`` later; then the
  same for a word of its own allocation.

A call that returns in microseconds was queued; one that returns after about ``--gate-ms`` held
the thread until the stream reached it (the gate opened). Needs a CUDA GPU; prints one line a
word and operation.

    python benchmarks/bench_words.py [--gate-ms 300]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time

GATED, OPEN = 0, 1


def _timed(fn: object, *args: object) -> float:
    t0 = time.perf_counter()
    fn(*args)  # type: ignore[operator]
    return (time.perf_counter() - t0) * 1e3


def _write_on(stream: object, address: int, value: int) -> None:
    """Write ``value`` at ``address`` on ``stream`` from this thread (a timer's): the stream's
    device made current here first, as every thread that calls the driver needs."""
    import torch

    from kvblend.dataplane import streamword

    torch.cuda.set_device(stream.device)  # type: ignore[attr-defined]
    streamword.write(stream.cuda_stream, address, value)  # type: ignore[attr-defined]


def _child(handle: bytes, gate_ms: float, out: "mp.Queue[str]") -> None:
    import cupy
    import torch

    from kvblend.dataplane import streamword

    torch.cuda.init()
    torch.cuda.synchronize()
    shared = cupy.cuda.runtime.ipcOpenMemHandle(handle, 1)
    own, _ = streamword.allocate(2)
    gate = torch.zeros(1, dtype=torch.int32).pin_memory()
    for name, base in (("shared by IPC", shared), ("own allocation", own)):
        gate.fill_(GATED)
        stream = torch.cuda.Stream()
        streamword.wait(stream.cuda_stream, gate.data_ptr(), OPEN)  # the stream held
        opener = threading.Timer(gate_ms / 1e3, gate.fill_, (OPEN,))
        opener.start()
        write_ms = _timed(streamword.write, stream.cuda_stream, base + 4, 7)
        if name == "own allocation":
            streamword.write(torch.cuda.current_stream().cuda_stream, base, 5)
            torch.cuda.synchronize()
        wait_ms = _timed(streamword.wait, stream.cuda_stream, base, 5)
        opener.join()
        stream.synchronize()
        out.put(f"{name:15s} write queued in {write_ms:8.3f} ms, wait queued in {wait_ms:8.3f} "
                f"ms (the stream was held {gate_ms:.0f} ms)")
        # a wait for a count not written yet: another stream writes it after gate_ms
        writer = torch.cuda.Stream()
        opener = threading.Timer(gate_ms / 1e3, _write_on, (writer, base, 6))
        opener.start()
        unwritten_ms = _timed(streamword.wait, stream.cuda_stream, base, 6)
        opener.join()
        stream.synchronize()
        out.put(f"{name:15s} wait for a count written {gate_ms:.0f} ms later queued in "
                f"{unwritten_ms:8.3f} ms")
    streamword.free(own)
    cupy.cuda.runtime.ipcCloseMemHandle(shared)
    out.put("")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gate-ms", type=float, default=300.0)
    args = ap.parse_args()
    import torch

    from kvblend.dataplane import streamword

    torch.cuda.init()
    torch.cuda.synchronize()
    word, handle = streamword.allocate(2)
    streamword.write(torch.cuda.current_stream().cuda_stream, word, 5)
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    out: "mp.Queue[str]" = ctx.Queue()
    child = ctx.Process(target=_child, args=(handle, args.gate_ms, out))
    child.start()
    print(torch.cuda.get_device_name(), "driver stream memory operations:",
          streamword.available())
    while line := out.get(timeout=120):
        print(line)
    child.join(timeout=60)
    streamword.free(word)


if __name__ == "__main__":
    main()
