"""The CUDA copy engine: host registration of the slab (``cudaHostRegister`` in pieces of at most
64 GiB) and the opening of engine buffers shared by CUDA IPC on the device named by UUID, as
contiguous buffers (``dataplane.cuda``) or paged caches (``dataplane.cuda_paged``).

NOTE: the slab is registered with ``cudaHostRegisterPortable`` so every device and context sees it
as pinned (a copy from an unregistered page would fall back to staged, pageable speed), and
``Mapped`` so kernels may read it where the device uses host pointers of registered memory
(``dataplane.cuda_paged``).
"""

from __future__ import annotations

import ctypes
import threading

import cupy
import torch

from kvblend.dataplane import paged, streamword
from kvblend.dataplane.backend import CopyEngine, InstanceBuffer
from kvblend.dataplane.cuda import CudaBuffer, normalize_uuid
from kvblend.dataplane.cuda_paged import CudaPagedBuffer, check_gatherable
from kvblend.dataplane.backends import Backend
from kvblend.dataplane.errors import BackendError, BadRequest
from kvblend.dataplane.cuda_rotary import turner_kernels
from kvblend.dataplane.gather import can_use_host_pointer, copier_kernel
from kvblend.dataplane.registration import BufferSpec, CudaIpcBuffer, PagedBuffer
from kvblend.shm.layout import KVLayout
from kvblend.shm.store import Store

PIECE = 64 << 30
HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_MAPPED = 2  # kernels may read the slab (a paged layer-wise retrieve does)
IPC_LAZY_PEER_ACCESS = 1


def load_kernels(device: int) -> None:
    """Load every kernel the data plane runs on ``device``, if not yet: called before each
    instance is opened there, so the first one loads them before any instance's stream exists
    (a kernel's load waits for the device's streams: ``gather.load_kernel``).

    Raises:
        BackendError: a kernel could not be compiled or loaded.
    """
    try:
        copier_kernel(device)
        turner_kernels(device)
    except Exception as exc:  # cupy's compile or driver errors, whatever their type
        raise BackendError(f"the data plane's kernels could not be loaded on GPU {device}: "
                           f"{type(exc).__name__}: {exc}") from exc


class CudaEngine(CopyEngine):
    backend = Backend.CUDA

    def __init__(self, store: Store, staging_bytes: int = 128 << 20,
                 layer_dma_bytes: int = 1 << 20) -> None:
        if not torch.cuda.is_available():
            raise BackendError("no CUDA device: start the data plane with --backend cpu")
        self._devices = {normalize_uuid(torch.cuda.get_device_properties(i).uuid): i
                         for i in range(torch.cuda.device_count())}
        self._slab_ptr = int(store.slab.ctypes.data)
        self._staging_bytes, self._layer_dma_bytes = staging_bytes, layer_dma_bytes
        self._size = int(store.size)
        self._pieces: list[int] = []
        self._lock = threading.Lock()
        cupy.cuda.runtime.setDevice(0)
        for off in range(0, self._size, PIECE):
            ptr = self._slab_ptr + off
            cupy.cuda.runtime.hostRegister(ptr, min(PIECE, self._size - off),
                                           HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED)
            self._pieces.append(ptr)

    def open(self, spec: BufferSpec, layout: KVLayout, owner_uid: int,
             order_word: CudaIpcBuffer | None = None,
             ready_word: bool = False) -> InstanceBuffer:
        if order_word is not None and not streamword.available():
            raise BadRequest("this data plane's driver has no stream memory operations: "
                             "register without an order_word")
        if isinstance(spec, PagedBuffer):
            buf: CudaBuffer = self._open_paged(spec, layout)
        elif not isinstance(spec, CudaIpcBuffer):
            raise BadRequest("the CUDA data plane takes CUDA IPC buffers (got an shm buffer)")
        else:
            device = self._devices.get(normalize_uuid(spec.device_uuid))
            if device is None:
                raise BadRequest(f"no GPU with UUID {spec.device_uuid} on this host")
            load_kernels(device)
            base = self._open_ipc(device, spec, layout.nbytes)
            buf = CudaBuffer(device, base, spec.offset, layout, self._slab_ptr)
        if order_word is not None:
            try:
                buf.order_by(*self._open_word(buf.device, order_word, ready_word), ready_word)
            except BaseException:
                buf.close()
                raise
        return buf

    def _open_word(self, device: int, spec: CudaIpcBuffer, ready: bool) -> tuple[int, int]:
        """(base, address) of an order word: an int32 on ``device`` in an IPC allocation (the
        ready word another one after it)."""
        if self._devices.get(normalize_uuid(spec.device_uuid)) != device:
            raise BadRequest("the order_word must be on the buffer's GPU")
        if spec.offset % 4:
            raise BadRequest(f"the order_word's offset {spec.offset} is not a multiple of 4")
        base = self._open_ipc(device, spec, 8 if ready else 4)
        return base, base + spec.offset

    def _open_paged(self, spec: PagedBuffer, layout: KVLayout) -> CudaPagedBuffer:
        paged.check(spec, layout.num_layers, layout.num_tokens, layout.hidden_dim,
                    layout.dtype.itemsize)
        check_gatherable(spec)
        if not all(isinstance(b, CudaIpcBuffer) for b in spec.buffers):
            raise BadRequest("the CUDA data plane takes CUDA IPC buffers (got an shm buffer)")
        devices = {self._devices.get(normalize_uuid(b.device_uuid)) for b in spec.buffers}
        device = devices.pop() if len(devices) == 1 else None
        if device is None:
            raise BadRequest("a paged cache's buffers must all be on one GPU of this host")
        load_kernels(device)
        bases: list[int] = []
        try:
            for b, need in zip(spec.buffers, paged.buffer_extents(spec)):
                bases.append(self._open_ipc(device, b, need))  # type: ignore[arg-type]
            return CudaPagedBuffer(device, bases, spec, layout, self._slab_ptr,
                                   can_use_host_pointer(device), self._staging_bytes,
                                   self._layer_dma_bytes)
        except BaseException:
            for base in bases:
                cupy.cuda.runtime.ipcCloseMemHandle(base)
            raise

    def _open_ipc(self, device: int, spec: CudaIpcBuffer, nbytes: int) -> int:
        """The base of an opened IPC allocation that holds ``spec.offset + nbytes`` bytes."""
        if len(spec.handle) != 64 or spec.offset < 0:
            raise BadRequest("a CUDA IPC handle is 64 bytes and its offset >= 0")
        try:
            with self._lock:
                cupy.cuda.runtime.setDevice(device)
                base = cupy.cuda.runtime.ipcOpenMemHandle(spec.handle, IPC_LAZY_PEER_ACCESS)
                size = allocation_size(base)
        except cupy.cuda.runtime.CUDARuntimeError as exc:
            raise BackendError(f"cannot open the CUDA IPC buffer: {exc}") from exc
        if spec.offset + nbytes > size:
            cupy.cuda.runtime.ipcCloseMemHandle(base)
            raise BadRequest(f"the CUDA allocation holds {size} bytes; offset {spec.offset} + the "
                             f"layout's {nbytes} bytes do not fit in it")
        return base

    def close(self) -> None:
        for ptr in self._pieces:
            try:
                cupy.cuda.runtime.hostUnregister(ptr)
            except cupy.cuda.runtime.CUDARuntimeError:
                pass
        self._pieces = []


def allocation_size(base: int) -> int:
    """Bytes of the device allocation that starts at ``base`` (``cuMemGetAddressRange``): a
    registration must not describe more memory than the engine shared."""
    lib = ctypes.CDLL("libcuda.so.1")
    start, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = lib.cuMemGetAddressRange_v2(ctypes.byref(start), ctypes.byref(size),
                                     ctypes.c_uint64(base))
    if rc != 0:
        raise BackendError(f"cuMemGetAddressRange failed with CUDA error {rc}")
    return int(size.value) - (base - int(start.value))


__all__ = ["CudaEngine", "allocation_size", "load_kernels"]
