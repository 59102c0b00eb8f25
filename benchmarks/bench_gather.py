"""Scattered KV blocks to and from a host slab: per-block DMA, a segment kernel, kernel + staging.

The engine side is vLLM's FlashAttention layout, one tensor per layer ``[2, num_blocks, 16, H, Dh]``
with a random permutation as the block table; the host side is a slab in POSIX shared memory (page
aligned, registered Portable | Mapped as ``dataplane.gather.HostMapping`` does) holding each chunk
of ``--chunk`` tokens as ``[2, L, C, H*Dh]`` contiguous, slots in shuffled order. Timed, each way:

- ``pinned copy_``: ``torch`` ``copy_`` of the same bytes, one contiguous run (the PCIe ceiling);
- ``slab DMA``: one ``cudaMemcpyAsync`` of the same bytes between one GPU buffer and the slab;
- (a) ``per-block DMA``: one ``cudaMemcpyAsync`` per 16-token block, layer and K/V;
- (b) ``kernel <-> slab``: ``SegmentCopier`` reads/writes the mapped slab directly over PCIe;
- (c) ``kernel + staging``: ``SegmentCopier`` into a GPU staging area, one DMA per chunk
  (retrieve: one DMA per chunk into staging, then the kernel scatters);
- (d) ``batched DMA``: the segments of (a) in one ``cuMemcpyBatchAsync`` (``dataplane.dma``:
  the driver's CUDA 13 entry point), when the driver has it.

Then, for comparison, the same 1 GiB as contiguous pieces of ``--piece-mib`` (3 MiB, the size of a
small model's chunk): one DMA per piece against one kernel call over all pieces.

Each row is the median of ``--iters`` timed runs (after one warm-up); every candidate is checked
bit-exact once. Needs an NVIDIA GPU; not part of the test suite.

Usage::

    python benchmarks/bench_gather.py                  # Llama-3.1-8B shapes, 8k tokens, 7 runs
    python benchmarks/bench_gather.py --tokens 4096 --iters 5
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cupy  # noqa: E402

from kvblend.dataplane.dma import BatchCopier, copier  # noqa: E402
from kvblend.dataplane.gather import (HostMapping, SegmentCopier,  # noqa: E402
                                      can_use_host_pointer, host_device_pointer)

D2H = cupy.cuda.runtime.memcpyDeviceToHost
H2D = cupy.cuda.runtime.memcpyHostToDevice
D2D = cupy.cuda.runtime.memcpyDeviceToDevice
BLOCK = 16


class HostSlab:
    """Page-aligned host memory: POSIX shared memory when /dev/shm has room, else anonymous mmap."""

    def __init__(self, nbytes: int) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        try:
            st = os.statvfs("/dev/shm")
            if st.f_bavail * st.f_frsize < nbytes + (1 << 30):
                raise OSError("/dev/shm too small")
            self._shm = shared_memory.SharedMemory(create=True, size=nbytes)
            buf: object = self._shm.buf
            self.kind = "POSIX shm"
        except OSError:
            self._map = mmap.mmap(-1, nbytes)
            buf = self._map
            self.kind = "anonymous mmap (/dev/shm too small)"
        self.array = np.frombuffer(buf, dtype=np.uint8, count=nbytes)  # type: ignore[call-overload]
        self.array[::4096] = 0  # fault every page in before registration
        self.ptr = int(self.array.ctypes.data)

    def close(self) -> None:
        del self.array
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()


def probe_registration() -> str:
    """Whether a Portable-only registration (today's data plane) is addressable from kernels."""
    m = mmap.mmap(-1, 1 << 21)
    a = np.frombuffer(m, dtype=np.uint8)
    ptr = int(a.ctypes.data)
    cupy.cuda.runtime.hostRegister(ptr, 1 << 21, 1)
    try:
        dptr = host_device_pointer(ptr)
        got = f"device pointer {'==' if dptr == ptr else '!='} host pointer"
    except RuntimeError as exc:
        got = str(exc)
    cupy.cuda.runtime.hostUnregister(ptr)
    del a
    m.close()
    return (f"CanUseHostPointerForRegisteredMem={int(can_use_host_pointer(0))}; "
            f"Portable-only registration: {got}")


def batched(batch: BatchCopier, seg: np.ndarray, stream: int) -> Callable[[], None]:
    """``dataplane.dma``'s batched copy of a segment table ``(dst, src, nbytes)``, its arrays
    built once, outside the timing."""
    dsts, srcs, sizes = (np.ascontiguousarray(seg[:, i]).astype(np.uint64) for i in range(3))
    return lambda: batch.copy(dsts, srcs, sizes, stream)


def timed(fn: Callable[[], object], iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_segments(layer_ptrs: np.ndarray, table: np.ndarray, slots: np.ndarray, slab_dev: int,
                   layers: int, chunk: int, num_blocks: int, block_bytes: int) -> np.ndarray:
    """Store segments ``(slab, engine, block_bytes)`` for every chunk, K/V, layer and block."""
    per_chunk = chunk // BLOCK
    c, kv, layer, j = np.meshgrid(np.arange(len(slots)), np.arange(2), np.arange(layers),
                                  np.arange(per_chunk), indexing="ij")
    phys = table[c * per_chunk + j]
    src = layer_ptrs[layer] + (kv * num_blocks + phys) * block_bytes
    dst = slab_dev + slots[c] + ((kv * layers + layer) * per_chunk + j) * block_bytes
    seg = np.stack([dst.ravel(), src.ravel(), np.full(dst.size, block_bytes)], axis=1)
    return seg.astype(np.int64)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=8192, help="tokens stored and retrieved")
    p.add_argument("--chunk", type=int, default=256, help="tokens per slab chunk")
    p.add_argument("--iters", type=int, default=7, help="timed runs per row (median)")
    p.add_argument("--piece-mib", type=float, default=3.0, help="contiguous comparison piece")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.cuda.set_device(0)
    cupy.cuda.Device(0).use()
    L, H, Dh, C = args.layers, args.kv_heads, args.head_dim, args.chunk
    assert args.tokens % C == 0 and C % BLOCK == 0, "tokens must be whole chunks of whole blocks"
    nblocks, nchunks = args.tokens // BLOCK, args.tokens // C
    block_bytes = BLOCK * H * Dh * 2
    chunk_bytes = 2 * L * C * H * Dh * 2
    total = nchunks * chunk_bytes
    rng = np.random.default_rng(args.seed)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}, cupy {cupy.__version__}")
    print(f"# L={L} kv_heads={H} head_dim={Dh} bf16, {args.tokens} tokens = {nblocks} blocks of "
          f"{block_bytes >> 10} KiB per layer and K/V, {nchunks} chunks of {C} tokens "
          f"({chunk_bytes >> 20} MiB), {total / 2**30:.2f} GiB each way, median of {args.iters}")
    print(f"# {probe_registration()}")

    layers = [torch.randint(-2**15, 2**15, (2, nblocks, BLOCK, H, Dh), dtype=torch.int16,
                            device="cuda") for _ in range(L)]
    back = [torch.zeros_like(t) for t in layers]
    layer_ptrs = np.array([t.data_ptr() for t in layers], dtype=np.int64)
    back_ptrs = np.array([t.data_ptr() for t in back], dtype=np.int64)
    table = rng.permutation(nblocks).astype(np.int64)
    slots = rng.permutation(nchunks).astype(np.int64) * chunk_bytes
    slab = HostSlab(total)
    mapping = HostMapping(slab.ptr, total)
    print(f"# slab: {slab.kind}; mapped device pointer "
          f"{'==' if mapping.device_ptr == slab.ptr else '!='} host pointer")
    dev = mapping.device_ptr
    staging = torch.empty(total, dtype=torch.uint8, device="cuda")
    in_order = np.arange(nchunks, dtype=np.int64) * chunk_bytes

    def segments(engine: np.ndarray, base: int, where: np.ndarray, store: bool) -> np.ndarray:
        seg = build_segments(engine, table, where, base, L, C, nblocks, block_bytes)
        return seg if store else np.ascontiguousarray(seg[:, [1, 0, 2]])

    t0 = time.perf_counter()
    k_store = segments(layer_ptrs, dev, slots, True)
    build_ms = (time.perf_counter() - t0) * 1e3
    k_retrieve = segments(back_ptrs, dev, slots, False)
    d_store = segments(layer_ptrs, slab.ptr, slots, True)  # DMA takes the host address
    d_retrieve = segments(back_ptrs, slab.ptr, slots, False)
    s_store = segments(layer_ptrs, staging.data_ptr(), in_order, True)
    s_retrieve = segments(back_ptrs, staging.data_ptr(), in_order, False)
    print(f"# {len(k_store)} segments per direction; building one table took {build_ms:.1f} ms")

    stream = torch.cuda.Stream()
    sh = stream.cuda_stream
    copier = SegmentCopier(0)
    memcpy = cupy.cuda.runtime.memcpyAsync

    def per_segment(seg: np.ndarray, kind: int) -> Callable[[], None]:
        rows = seg.tolist()

        def run() -> None:
            for d, s, n in rows:
                memcpy(d, s, n, kind, sh)
        return run

    def kernel(seg: np.ndarray) -> Callable[[], None]:
        return lambda: copier.copy(seg, stream)

    def staged_store() -> None:
        copier.copy(s_store, stream)
        for c in range(nchunks):
            memcpy(slab.ptr + int(slots[c]), staging.data_ptr() + c * chunk_bytes, chunk_bytes,
                   D2H, sh)

    def staged_retrieve() -> None:
        for c in range(nchunks):
            memcpy(staging.data_ptr() + c * chunk_bytes, slab.ptr + int(slots[c]), chunk_bytes,
                   H2D, sh)
        copier.copy(s_retrieve, stream)

    def check_store() -> bool:
        ok = True
        per = C // BLOCK
        for c in range(nchunks):
            got = slab.array[slots[c]:slots[c] + chunk_bytes].view(np.int16)
            got = torch.from_numpy(got.reshape(2, L, per, BLOCK, H, Dh)).cuda()
            idx = torch.from_numpy(table[c * per:(c + 1) * per]).cuda()
            ok &= all(torch.equal(got[:, i], layers[i][:, idx]) for i in range(L))
        return ok

    def check_retrieve() -> bool:
        return all(torch.equal(a, b) for a, b in zip(layers, back))

    def reset_store() -> None:
        slab.array[:] = 0

    def reset_retrieve() -> None:
        for t in back:
            t.zero_()

    gpu_buf = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    rows: list[tuple[str, str, float]] = []

    def row(name: str, op: str, fn: Callable[[], object], check: Callable[[], bool] | None,
            nbytes: int = total) -> None:
        if check is not None:
            (reset_store if op == "store" else reset_retrieve)()
            torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            t = timed(fn, args.iters)
        flag = "" if check is None else (" bit-exact" if check() else " MISMATCH")
        rows.append((name, op, nbytes / t / 1e9))
        print(f"  {name:<26} {op:<9} {nbytes / t / 1e9:7.2f} GB/s{flag}", flush=True)

    print("scattered blocks:")
    row("pinned copy_", "store", lambda: pinned.copy_(gpu_buf, non_blocking=True), None)
    row("pinned copy_", "retrieve", lambda: gpu_buf.copy_(pinned, non_blocking=True), None)
    row("slab DMA, one run", "store",
        lambda: memcpy(slab.ptr, gpu_buf.data_ptr(), total, D2H, sh), None)
    row("slab DMA, one run", "retrieve",
        lambda: memcpy(gpu_buf.data_ptr(), slab.ptr, total, H2D, sh), None)
    candidates = [
        ("(a) per-block DMA", per_segment(d_store, D2H), per_segment(d_retrieve, H2D)),
        ("(b) kernel <-> slab", kernel(k_store), kernel(k_retrieve)),
        ("(c) kernel + staging", staged_store, staged_retrieve)]
    batch = copier()
    if batch is not None:
        candidates.append(("(d) batched DMA", batched(batch, d_store, sh),
                           batched(batch, d_retrieve, sh)))
    else:
        print("  (d) batched DMA: not measured, the driver lacks cuMemcpyBatchAsync_v2")
    for name, store_fn, retrieve_fn in candidates:
        try:
            row(name, "store", store_fn, check_store)  # a store leaves a full slab to retrieve
            row(name, "retrieve", retrieve_fn, check_retrieve)
        except RuntimeError as exc:
            print(f"  {name}: {exc}")

    piece = int(args.piece_mib * (1 << 20)) // 4096 * 4096
    n = total // piece
    where = rng.permutation(n).astype(np.int64) * piece
    ends = gpu_buf.data_ptr() + np.arange(n, dtype=np.int64) * piece

    def pieces(base: int, store: bool) -> np.ndarray:
        seg = np.stack([base + where, ends, np.full(n, piece)], axis=1).astype(np.int64)
        return seg if store else np.ascontiguousarray(seg[:, [1, 0, 2]])

    label = f"{piece / 2**20:.0f} MiB pieces"
    print(f"contiguous {label} ({n} of them, {n * piece / 2**30:.2f} GiB each way):")
    row(f"per-piece DMA, {label}", "store", per_segment(pieces(slab.ptr, True), D2H), None,
        n * piece)
    row(f"per-piece DMA, {label}", "retrieve", per_segment(pieces(slab.ptr, False), H2D), None,
        n * piece)
    row(f"kernel, {label}", "store", kernel(pieces(dev, True)), None, n * piece)
    row(f"kernel, {label}", "retrieve", kernel(pieces(dev, False)), None, n * piece)
    if any(name == "(d) batched DMA" for name, _, _ in candidates):
        for op, store in (("store", True), ("retrieve", False)):
            try:
                row(f"batched DMA, {label}", op, batched(batch, pieces(slab.ptr, store), sh),
                    None, n * piece)
            except RuntimeError as exc:
                print(f"  batched DMA, {label}: {exc}")

    ceiling = {op: gbs for name, op, gbs in rows if name == "pinned copy_"}
    print("\n| engine | op | GB/s | % of pinned copy_ |\n|---|---|---:|---:|")
    for name, op, gbs in rows:
        print(f"| {name} | {op} | {gbs:.2f} | {100 * gbs / ceiling[op]:.0f} % |")
    copier.synchronize()
    mapping.close()
    slab.close()


if __name__ == "__main__":
    main()
