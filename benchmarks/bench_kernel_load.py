"""Does loading a kernel wait for another stream of its device, and does its first launch?

The data plane loads its kernels when a GPU's first instance is opened
(``kvblend.dataplane.gather.load_kernel``), because a load was seen to wait for a stream held
by an order word that another engine had not written yet. This probe times the two steps apart:

- the parent allocates an order word (``streamword.allocate``);
- a spawned child opens it by CUDA IPC and holds a stream of its own behind it (a wait for a
  count the parent has not written), then asks the parent to open the gate ``--gate-ms`` later;
- the child then compiles and loads a kernel that does nothing (cupy's ``RawKernel.compile``:
  NVRTC, then the module's load), launches it once on another stream, then once more.

A step that takes about ``--gate-ms`` waited for the held stream; one that takes microseconds
did not. The ask is sent before the compile, so a waiting step ends when the gate opens instead
of hanging. ``CUDA_MODULE_LOADING=EAGER`` in the environment runs the same with eager loading.
Needs a CUDA GPU; prints one line.

    python benchmarks/bench_kernel_load.py [--gate-ms 300]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time

GATE = 9  # the count the held stream waits for


def _child(handle: bytes, asked: "mp.synchronize.Event", out: "mp.Queue[str]") -> None:
    import cupy
    import numpy as np
    import torch

    from kvblend.dataplane import streamword

    torch.cuda.init()
    torch.cuda.synchronize()
    shared = cupy.cuda.runtime.ipcOpenMemHandle(handle, 1)
    held = torch.cuda.Stream()
    streamword.wait(held.cuda_stream, shared + 4, GATE)
    kernel = cupy.RawKernel(r'extern "C" __global__ void idle(int n) {}', "idle")
    stream = cupy.cuda.Stream(non_blocking=True)
    asked.set()  # before the compile: a compile that waits ends when the gate opens
    t0 = time.perf_counter()
    kernel.compile()
    t1 = time.perf_counter()
    kernel((1,), (1,), (np.int32(0),), stream=stream)
    t2 = time.perf_counter()
    kernel((1,), (1,), (np.int32(0),), stream=stream)
    t3 = time.perf_counter()
    held.synchronize()
    stream.synchronize()
    cupy.cuda.runtime.ipcCloseMemHandle(shared)
    out.put(f"compile and load {1e3 * (t1 - t0):.1f} ms, first launch {1e3 * (t2 - t1):.3f} ms, "
            f"second launch {1e3 * (t3 - t2):.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gate-ms", type=float, default=300.0)
    args = ap.parse_args()
    import torch

    from kvblend.dataplane import streamword

    torch.zeros(1, device="cuda")  # the device's context current on this thread
    word, handle = streamword.allocate(2)
    ctx = mp.get_context("spawn")
    asked, out = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_child, args=(handle, asked, out))
    child.start()

    def open_gate() -> None:
        # the parent's own thread and stream: nothing of the child's process can hold them
        if asked.wait(120):
            time.sleep(args.gate_ms / 1e3)
            torch.cuda.set_device(0)
            streamword.write(torch.cuda.current_stream().cuda_stream, word + 4, GATE)
            torch.cuda.synchronize()

    threading.Thread(target=open_gate, daemon=True).start()
    loading = os.environ.get("CUDA_MODULE_LOADING", "LAZY (the default)")
    print(f"{out.get(timeout=120)}; gate {args.gate_ms:.0f} ms, module loading {loading}")
    child.join(30)
    streamword.free(word)


if __name__ == "__main__":
    main()
