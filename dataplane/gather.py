"""The segment copier: one kernel moves a list of scattered byte runs between GPU and host memory.

This module owns the kernel that gathers paged KV blocks (vLLM's ``[2, num_blocks, 16, H, Dh]``
per layer, FlashInfer's ``[num_blocks, 2, 16, H, Dh]``) into a chunk's contiguous slab slot and
scatters them back, the asynchronous upload of its segment table, and the mapping of a host range
into the device's address space (``HostMapping``). It does not own the slab, the block tables or
the streams: the caller builds the table ``(dst_ptr, src_ptr, nbytes)`` from its block table and
passes the stream the copy is ordered on.

Memory access pattern of ``copy_segments``: pieces of at most ``PIECE`` bytes (longer segments are
split on the host), one thread block per piece, grid-stride over pieces. Inside a piece the block's
threads read ``UNROLL`` consecutive-stride 16-byte words each into registers, then store them: 256
threads move 16 KiB per step with coalesced, 16-byte-aligned accesses, and each thread keeps 4
loads in flight, which is what a load across PCIe (a retrieve from the mapped slab) needs. When
``dst`` and ``src`` differ in alignment mod 16 the piece falls back to 8-, 4- or 1-byte words; a
misaligned head and a short tail are copied byte by byte. Correct for any size and alignment; fast
when both ends agree mod 16 (KV blocks and slab slots are 4 KiB aligned).

The choice, measured (``docs/benchmarks.md``, ``benchmarks/bench_gather.py``; one H200, PCIe Gen5
x16, Llama-3.1-8B blocks of 32 KiB, 1 GiB each way, medians of 7 runs, two runs; pinned ``copy_``
55 GB/s both ways): per-block ``cudaMemcpyAsync`` 10-13 GB/s (18-24 %); this kernel straight into
the mapped slab 47-49 GB/s (86-89 %); this kernel into a GPU staging area, then one DMA per chunk
51-54 GB/s (93-97 %). The data plane should use the staged form: it is the fastest, and the kernel
holds SMs only for the GPU-to-GPU gather (not timed alone; the whole staged path is 3-7 % behind
one contiguous DMA, which bounds it) while the copy engines cross PCIe; the direct form keeps SMs
busy for the whole PCIe transfer, beside the engine's kernels. The benchmark staged a whole call
(1 GiB); a ring of a few chunk-sized staging slots is not measured yet. The direct form
(``HostMapping``) stays for callers that cannot spare staging memory.

NOTE: the direct form needs the host range mapped for kernels. ``HostMapping`` registers with
``cudaHostRegisterPortable | cudaHostRegisterMapped`` and asks ``cuMemHostGetDevicePointer`` for the
address, which equals the host address when every visible device reports
``cudaDevAttrCanUseHostPointerForRegisteredMem``. On the H200 above that attribute is 1 and even a
Portable-only registration (what ``dataplane.cuda`` does) came back mapped at the host address; the
Mapped flag makes it so on other systems. The staged form needs no mapping: its DMA needs only
the pinning.

NOTE: lifetime of the segment table. ``copy`` writes the table into a pinned host buffer, enqueues
its upload and the kernel on the caller's stream, and records an event after the kernel; the pinned
and device buffers belong to one slot of a ring of ``RING`` slots and are reused only after that
slot's event completed (``copy`` waits for it, which happens only when ``RING`` copies are still in
flight). The caller's segments array may be dropped or changed as soon as ``copy`` returns. A table
from ``upload`` (copied many times, shifted: the layers of a layer-wise call) has buffers of its
own outside the ring, with the same event re-recorded after its upload and after each kernel; once
released, its buffers serve a later ``upload`` only after that event completed.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import cupy
import numpy as np

PIECE = 64 << 10
THREADS = 256
BLOCKS_PER_SM = 8
UNROLL = 4
RING = 8
HELD_TABLES = 8  # released tables whose buffers are kept for reuse
HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2
ATTR_CAN_USE_HOST_POINTER = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem
H2D = cupy.cuda.runtime.memcpyHostToDevice

_SOURCE = r"""
template <typename T>
__device__ __forceinline__ void copy_run(char* dst, const char* src, long long nb,
                                         int tid, int step) {
    const long long w = sizeof(T);
    long long head = (w - (long long)((unsigned long long)dst & (w - 1))) & (w - 1);
    if (head > nb) head = nb;
    for (long long i = tid; i < head; i += step) dst[i] = src[i];
    dst += head; src += head; nb -= head;
    const long long nw = nb / w;
    T* d = reinterpret_cast<T*>(dst);
    const T* s = reinterpret_cast<const T*>(src);
    long long i = tid;
    for (; i + (UNROLL - 1) * (long long)step < nw; i += UNROLL * (long long)step) {
        T v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = s[i + u * step];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) d[i + u * step] = v[u];
    }
    for (; i < nw; i += step) d[i] = s[i];
    for (long long j = nw * w + tid; j < nb; j += step) dst[j] = src[j];
}

extern "C" __global__ void copy_segments(const long long* __restrict__ seg, long long n,
                                         long long dst_shift, long long src_shift) {
    for (long long k = blockIdx.x; k < n; k += gridDim.x) {
        char* dst = reinterpret_cast<char*>(seg[3 * k] + dst_shift);
        const char* src = reinterpret_cast<const char*>(seg[3 * k + 1] + src_shift);
        const long long nb = seg[3 * k + 2];
        const unsigned long long mis = (unsigned long long)dst ^ (unsigned long long)src;
        const int t = threadIdx.x, step = blockDim.x;
        if ((mis & 15) == 0) copy_run<uint4>(dst, src, nb, t, step);
        else if ((mis & 7) == 0) copy_run<unsigned long long>(dst, src, nb, t, step);
        else if ((mis & 3) == 0) copy_run<unsigned int>(dst, src, nb, t, step);
        else copy_run<unsigned char>(dst, src, nb, t, step);
    }
}
"""


def split_segments(segments: np.ndarray, piece: int = PIECE) -> np.ndarray:
    """Split every segment longer than ``piece`` bytes into runs of ``piece`` (the last shorter).

    Both ends move by the same multiple of ``piece``, so a piece keeps its segment's alignment.
    """
    seg = np.asarray(segments, dtype=np.int64)
    if seg.ndim != 2 or seg.shape[1] != 3:
        raise ValueError(f"segments must be an (n, 3) array of (dst, src, nbytes), got {seg.shape}")
    if seg.size and int(seg[:, 2].min()) < 0:
        raise ValueError("a segment's byte count is negative")
    seg = seg[seg[:, 2] > 0]
    counts = (seg[:, 2] + piece - 1) // piece
    if not seg.size or int(counts.max()) == 1:
        return np.ascontiguousarray(seg)
    row = np.repeat(np.arange(len(seg)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    shift = (np.arange(len(row)) - first) * piece
    out = seg[row].copy()
    out[:, 0] += shift
    out[:, 1] += shift
    out[:, 2] = np.minimum(out[:, 2] - shift, piece)
    return out


def stream_handle(stream: Any) -> int:
    """The raw ``cudaStream_t`` of a torch stream, a cupy stream, or an int handle."""
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    return int(stream)


class _StreamHandle:
    """A raw stream handle behind the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def external_stream(handle: int, device: int) -> Any:
    """A cupy view of a stream cupy did not create: ``Stream.from_external`` (cupy >= 14),
    else ``ExternalStream`` (deprecated in 14)."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None:
        try:
            stream = from_external(_StreamHandle(handle))
        except (TypeError, ValueError, AttributeError):
            stream = None
        if stream is not None and int(stream.ptr) == handle:
            return stream
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(handle, device)


class _Slot:
    """One table in flight: pinned host words, device words, the event after its kernel."""

    def __init__(self, words: int) -> None:
        self.words = words
        self.pinned = cupy.cuda.alloc_pinned_memory(words * 8)
        self.host = np.frombuffer(self.pinned, np.int64, words)
        self.dev = cupy.empty(words, dtype=np.int64)
        self.done = cupy.cuda.Event(disable_timing=True)
        self.busy = False

    def launched(self, stream: Any) -> None:
        """Mark the table read by the kernel just enqueued on ``stream``."""
        self.done.record(stream)
        self.busy = True


class UploadRing:
    """Tables (int64 words) uploaded to the device on the kernel's stream, ``RING`` in flight.

    ``upload`` writes the words into a pinned buffer and enqueues their copy; the caller enqueues
    the kernel that reads ``slot.dev`` and then calls ``slot.launched(stream)``. A slot is reused
    only once the event after its kernel completed.
    """

    def __init__(self, device: int) -> None:
        self.device = device
        self._ring: list[_Slot | None] = [None] * RING
        self._next = 0

    def upload(self, words: np.ndarray, stream: Any) -> _Slot:
        """A slot holding ``words`` on the device once ``stream`` reaches this point."""
        i, self._next = self._next, (self._next + 1) % RING
        slot = self._ring[i]
        if slot is not None and slot.busy:
            slot.done.synchronize()  # the table RING calls ago may still be read by its kernel
            slot.busy = False
        if slot is None or slot.words < len(words):
            slot = self._ring[i] = _Slot(max(len(words), 2 * slot.words if slot else 3072))
        slot.host[:len(words)] = words
        cupy.cuda.runtime.memcpyAsync(slot.dev.data.ptr, slot.host.ctypes.data, words.nbytes, H2D,
                                      stream.ptr)
        return slot

    def synchronize(self) -> None:
        """Wait until every kernel that reads a table completed."""
        for slot in self._ring:
            if slot is not None and slot.busy:
                slot.done.synchronize()
                slot.busy = False


@dataclass(frozen=True)
class Table:
    """Segments uploaded (``SegmentCopier.upload``, ``upload_ahead``): ``count`` pieces in
    ``slot``."""

    slot: "_Slot | None"  # None: no segments
    count: int


_LOADED: dict[tuple[int, str], Any] = {}  # (device, kernel name): the kernel (``load_kernel``)
_LOAD_LOCK = threading.Lock()


def load_kernel(device: int, source: str, options: tuple[str, ...], name: str,
                idle: tuple[Any, ...]) -> Any:
    """The kernel ``name`` of ``source`` on ``device``: compiled, loaded and launched once a
    process (its first argument a table it does not read, ``idle`` the rest: arguments under
    which it does nothing), then the same object for every caller.

    Loading a kernel's code waits for every stream of the device, as measured
    (``benchmarks/bench_kernel_load.py``: cupy's compile and load of a kernel took as long as
    another process's held stream, lazily or eagerly loaded; its first launch after that did
    not wait), and with lazy loading (CUDA's default since 12.2) a kernel not loaded yet loads
    at its first launch. A stream held by an engine (a count of its order word not written yet,
    an event behind long GPU work) would hold another instance's first copy with it. So the data
    plane loads its kernels when a device's first instance is opened (``CudaEngine.open``),
    before any instance's stream exists there.
    """
    with _LOAD_LOCK:
        kernel = _LOADED.get((device, name))
        if kernel is None:
            with cupy.cuda.Device(device):
                kernel = cupy.RawModule(code=source, options=options).get_function(name)
                stream = cupy.cuda.Stream(non_blocking=True)
                kernel((1,), (THREADS,), (cupy.empty(3, np.int64), *idle), stream=stream)
                stream.synchronize()
            _LOADED[(device, name)] = kernel
        return kernel


def copier_kernel(device: int) -> Any:
    """``copy_segments`` on ``device``, loaded (``load_kernel``)."""
    return load_kernel(device, _SOURCE, ("-std=c++17", f"-DUNROLL={UNROLL}"), "copy_segments",
                       (np.int64(0), np.int64(0), np.int64(0)))


class SegmentCopier:
    """Copies ``(dst_ptr, src_ptr, nbytes)`` segments with one kernel launch per call.

    Pointers are device addresses: device memory, or host memory mapped by ``HostMapping``.

    Args:
        device: the CUDA device the kernel runs on (the one owning the device-side pointers).
    """

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self._kernel = copier_kernel(device)
        with cupy.cuda.Device(device):
            sms = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
        self._max_blocks = int(sms) * BLOCKS_PER_SM
        self._ring = UploadRing(device)
        self._tables: list[_Slot] = []  # released tables' buffers (``upload``)
        self._streams: dict[int, Any] = {}

    def copy(self, segments: np.ndarray, stream: Any, pieces: bool = False) -> None:
        """Enqueue the copy of every segment on ``stream``; returns without waiting for it.

        Segments must not overlap each other's destinations; their order is not kept.

        Args:
            segments: int64 ``(n, 3)`` rows of ``(dst_ptr, src_ptr, nbytes)``.
            stream: a torch or cupy stream, or a raw ``cudaStream_t``.
            pieces: the caller's rows are C-contiguous int64 ``(n, 3)``, each of 1 to ``PIECE``
                bytes: taken as they are (``split_segments`` neither splits nor checks them).

        Raises:
            ValueError: the table is not ``(n, 3)`` or has a negative byte count.
        """
        seg = segments if pieces else split_segments(segments)
        if not len(seg):
            return
        with cupy.cuda.Device(self.device):
            ext = self._stream(stream_handle(stream))
            slot = self._ring.upload(seg.ravel(), ext)
            self._launch(slot, len(seg), 0, 0, ext)

    def upload_ahead(self, segments: np.ndarray, stream: Any, pieces: bool = False) -> "Table":
        """Upload ``segments`` on ``stream`` for one ``copy_table``, on ``stream`` or on a stream
        made to wait for this point of it, before the next ``RING`` uploads. A retrieve staged
        through a side stream uploads there, ahead of the DMAs it queues next: on the copy's own
        stream, after its wait for those DMAs, the upload met the next batch's DMAs on the copy
        engine (docs/benchmarks.md).
        Not ``release``d: the ring reuses it once its kernel completed. ``pieces``: as ``copy``'s.

        Raises:
            ValueError: the table is not ``(n, 3)`` or has a negative byte count.
        """
        seg = segments if pieces else split_segments(segments)
        if not len(seg):
            return Table(None, 0)
        with cupy.cuda.Device(self.device):
            return Table(self._ring.upload(seg.ravel(), self._stream(stream_handle(stream))),
                         len(seg))

    def upload(self, segments: np.ndarray, stream: Any, pieces: bool = False) -> "Table":
        """Upload ``segments`` once, for any number of ``copy_table`` calls on ``stream`` (the
        groups of a layer-wise call: one table, shifted to each layer). ``release`` it after
        the last. ``pieces``: as ``copy``'s.

        Raises:
            ValueError: the table is not ``(n, 3)`` or has a negative byte count.
        """
        seg = (segments if pieces else split_segments(segments)).ravel()
        with cupy.cuda.Device(self.device):
            ext = self._stream(stream_handle(stream))
            # a held table is reused once its last kernel completed; else a new one
            held = next((t for t in self._tables if t.words >= len(seg) and t.done.done), None)
            if held is not None:
                self._tables.remove(held)
            slot = held or _Slot(max(len(seg), 3072))
            slot.host[:len(seg)] = seg
            cupy.cuda.runtime.memcpyAsync(slot.dev.data.ptr, slot.host.ctypes.data, seg.nbytes,
                                          H2D, ext.ptr)
            slot.launched(ext)  # the pinned words are not rewritten before the upload ran
        return Table(slot, len(seg) // 3)

    def copy_table(self, table: "Table", stream: Any, dst_shift: int = 0,
                   src_shift: int = 0) -> None:
        """Enqueue the copy of ``table``'s segments, every destination moved by ``dst_shift``
        bytes and every source by ``src_shift``, on ``stream`` (the one it was uploaded on, or
        one made to wait for it after the upload)."""
        if table.count:
            assert table.slot is not None
            with cupy.cuda.Device(self.device):
                self._launch(table.slot, table.count, dst_shift, src_shift,
                             self._stream(stream_handle(stream)))

    def release(self, table: "Table") -> None:
        """Give ``table`` back; its buffers serve a later ``upload`` once its kernels ran."""
        self._tables.append(table.slot)
        while len(self._tables) > HELD_TABLES:  # drop idle ones only: kernels may read the rest
            idle = next((t for t in self._tables if t.done.done), None)
            if idle is None:
                break
            self._tables.remove(idle)

    def _launch(self, slot: "_Slot", count: int, dst_shift: int, src_shift: int,
                ext: Any) -> None:
        blocks = min(count, self._max_blocks)
        self._kernel((blocks,), (THREADS,), (slot.dev, np.int64(count), np.int64(dst_shift),
                                             np.int64(src_shift)), stream=ext)
        slot.launched(ext)

    def _stream(self, handle: int) -> Any:
        ext = self._streams.get(handle)
        if ext is None:
            ext = self._streams[handle] = external_stream(handle, self.device)
        return ext

    def synchronize(self) -> None:
        """Wait until every copy enqueued so far completed."""
        self._ring.synchronize()


class HostMapping:
    """A host range page-locked and mapped into the device's address space (for kernels).

    Registers with ``cudaHostRegisterPortable | cudaHostRegisterMapped``; ``device_ptr`` is the
    address kernels use (the host address itself where the device can use host pointers).
    ``close()`` unregisters, once.

    Args:
        ptr: start of the host range (page-aligned, as the slab is).
        nbytes: length of the range.
        device: the device made current for the registration.
    """

    def __init__(self, ptr: int, nbytes: int, device: int = 0) -> None:
        self.ptr, self.nbytes = int(ptr), int(nbytes)
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.hostRegister(self.ptr, self.nbytes,
                                           HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED)
            try:
                self.device_ptr = host_device_pointer(self.ptr)
            except RuntimeError:
                cupy.cuda.runtime.hostUnregister(self.ptr)
                raise
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            cupy.cuda.runtime.hostUnregister(self.ptr)

    def __enter__(self) -> "HostMapping":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def host_device_pointer(ptr: int) -> int:
    """The device address of registered host memory at ``ptr`` (``cuMemHostGetDevicePointer``).

    Raises:
        RuntimeError: the range is not registered as mapped.
    """
    lib = ctypes.CDLL("libcuda.so.1")
    out = ctypes.c_uint64(0)
    rc = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(ptr), ctypes.c_uint(0))
    if rc != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer failed with CUDA error {rc}")
    return int(out.value)


def can_use_host_pointer(device: int = 0) -> bool:
    """Whether kernels on ``device`` may use a registered host range's own address."""
    return bool(cupy.cuda.runtime.deviceGetAttribute(ATTR_CAN_USE_HOST_POINTER, device))


__all__ = ["SegmentCopier", "Table", "UploadRing", "HostMapping", "split_segments",
           "host_device_pointer", "can_use_host_pointer", "copier_kernel", "load_kernel",
           "stream_handle"]
