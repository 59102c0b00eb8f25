"""Engine buffers as the data plane opens them: CPU memory in POSIX shared memory, CUDA memory by
IPC handle.

This module owns the shared-memory segments a ``BlendClient`` created or adopted for an engine's
CPU buffers (named under the service's prefix, mode 0600, unlinked when their instance is
unregistered, when the client closes, when it is garbage-collected and at interpreter exit), and
the description of a buffer sent with a registration (``ShmBuffer``, ``CudaIpcBuffer``,
``PagedBuffer``). It does not register anything (the client's
control does) nor copy anything (the data plane does).

Each segment is held by a descriptor with a shared ``flock`` for as long as this process holds it:
the kernel drops the lock with the process, SIGKILL included, which is how the data plane proves
a dead engine's segment an orphan and removes it (``shm.kvbufs``).

NOTE: the clean-up runs in the process that created the segments only: a forked child that
exits does not unlink its parent's buffers.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from collections.abc import Sequence

import torch

from kvblend.dataplane import paged
from kvblend.dataplane.errors import BadRequest
from kvblend.dataplane.messages import CudaIpcBuffer, PagedBuffer, PagedLayer, ShmBuffer
from kvblend.shm.kvbufs import hold
from kvblend.shm.layout import DType
from kvblend.shm.names import KVBUF_HEX, Names
from kvblend.shm.segment import Segment

TORCH_DTYPES = {torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16,
                torch.float32: DType.FLOAT32}


class Buffers:
    """The shared-memory segments of one client's CPU buffers, by their base address.

    Args:
        prefix: the service's shm prefix; segments are named ``Names(prefix).kvbuf(...)``.
    """

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._lock = threading.Lock()
        self._held: dict[int, Segment] = {}  # data_ptr -> segment we created
        self._fds: dict[str, int] = {}       # segment name -> descriptor holding its flock
        self._finalizer = weakref.finalize(self, _release_all, self._held, self._fds, self._lock,
                                           os.getpid())

    def cpu_kv_buffer(self, num_layers: int, num_tokens: int, hidden_dim: int,
                      dtype: torch.dtype) -> torch.Tensor:
        """A zeroed ``[2, L, T, D]`` tensor over a new segment (``BlendClient.cpu_kv_buffer``)."""
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"unsupported dtype {dtype}: use float16, bfloat16 or float32")
        nbytes = 2 * num_layers * num_tokens * hidden_dim * dtype.itemsize
        seg = Segment(self._new_name(), nbytes, create=True)
        try:
            fd = hold(seg.name)
        except BaseException:
            seg.unlink()
            seg.close()
            raise
        kv = torch.frombuffer(seg.buf, dtype=torch.uint8).view(dtype).view(
            2, num_layers, num_tokens, hidden_dim)
        with self._lock:
            self._held[kv.data_ptr()] = seg
            self._fds[seg.name] = fd
        return kv

    def cpu_paged_kv_cache(self, num_layers: int, num_blocks: int, block_size: int,
                           kv_heads: int, head_dim: int, dtype: torch.dtype,
                           layout: str) -> list[torch.Tensor]:
        """Zeroed per-layer tensors of a paged layout over one new segment
        (``BlendClient.cpu_paged_kv_cache``)."""
        shapes = {"flash_attn": (2, num_blocks, block_size, kv_heads, head_dim),
                  "flashinfer": (num_blocks, 2, block_size, kv_heads, head_dim),
                  "cpu_kt": (num_blocks, kv_heads, block_size, 2 * head_dim)}
        if layout not in shapes:
            raise ValueError(f"no paged layout {layout!r} here: one of {', '.join(shapes)}")
        per = 2 * num_blocks * block_size * kv_heads * head_dim
        whole = self.cpu_kv_buffer(1, 1, num_layers * per // 2, dtype).view(num_layers, per)
        return [whole[layer].view(shapes[layout]) for layer in range(num_layers)]

    def adopt(self, t: torch.Tensor) -> None:
        """Move CPU tensor ``t``'s whole storage into a new segment, in place
        (``BlendClient.share_cpu_tensor``).

        Raises:
            BadRequest: a CUDA tensor, or memory already shared by this client.
        """
        if t.is_cuda:
            raise BadRequest("share_cpu_tensor takes CPU tensors; CUDA memory is shared by IPC")
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            if any(b <= ptr < b + s.size for b, s in self._held.items()):
                raise BadRequest("this memory is shared already")
        seg = Segment.adopt(self._new_name(), ptr, nbytes)
        try:
            fd = hold(seg.name)
        except BaseException:
            _let_go(seg, None)
            raise
        with self._lock:
            self._held[seg.base] = seg
            self._fds[seg.name] = fd

    def spec(self, kv: torch.Tensor) -> ShmBuffer | CudaIpcBuffer:
        """How the data plane opens the whole buffer ``kv``: its CUDA allocation by IPC handle
        (and ``kv``'s offset in it), or the segment of ours it fills.

        Raises:
            BadRequest: a CPU tensor that is not a whole tensor of ``cpu_kv_buffer``, or CUDA
                memory that cannot be shared by IPC.
        """
        if kv.is_cuda:
            storage = kv.untyped_storage()
            shared = storage._share_cuda_()  # (device, handle, size, offset in block, ...)
            base_offset = int(shared[3])
            handle = _ipc_mem_handle(bytes(shared[1]), storage.data_ptr() - base_offset)
            uuid_text = str(torch.cuda.get_device_properties(kv.device).uuid)
            return CudaIpcBuffer(handle=handle, offset=base_offset +
                                 kv.storage_offset() * kv.element_size(), device_uuid=uuid_text)
        seg, at = self.segment_of(kv)
        if at:
            raise BadRequest("a CPU buffer must be a whole tensor of cpu_kv_buffer()")
        return ShmBuffer(name=seg.name)

    def paged_spec(self, layers: Sequence[torch.Tensor], layout: str, block_size: int,
                   kv_heads: int, head_dim: int) -> PagedBuffer:
        """How the data plane opens a paged cache: its layers' allocations or segments (each
        once) and each layer's offset in one (``BlendClient.register_paged_kv_cache``).

        Raises:
            BadRequest: layers of different sizes, dtypes or devices, a layout that does not fit
                them, or CPU tensors not made by ``cpu_paged_kv_cache``.
        """
        num_blocks = _num_blocks(layers, block_size, kv_heads, head_dim)
        try:
            k, v = paged.placements(layout, num_blocks, block_size, kv_heads, head_dim)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        buffers: list[ShmBuffer | CudaIpcBuffer] = []
        refs = []
        for t in layers:  # each allocation or segment once; a layer is an offset in one
            if t.is_cuda:
                ipc = self.spec(t)
                assert isinstance(ipc, CudaIpcBuffer), "a CUDA tensor is shared by IPC"
                at, buf = ipc.offset, CudaIpcBuffer(handle=ipc.handle, offset=0,
                                                    device_uuid=ipc.device_uuid)
            else:
                seg, at = self.segment_of(t)
                buf = ShmBuffer(name=seg.name)
            if buf not in buffers:
                buffers.append(buf)
            refs.append(PagedLayer(buffers.index(buf), at))
        first = layers[0]
        return PagedBuffer(block_size=block_size, num_blocks=num_blocks, kv_heads=kv_heads,
                           head_dim=head_dim, k=k, v=v,
                           layer_bytes=first.numel() * first.element_size(), buffers=buffers,
                           layers=refs)

    def segment_of(self, t: torch.Tensor) -> tuple[Segment, int]:
        """The segment of ours that holds CPU tensor ``t``, and ``t``'s byte offset in it."""
        ptr = t.data_ptr()
        with self._lock:
            for base, seg in self._held.items():
                if base <= ptr and ptr + t.numel() * t.element_size() <= base + seg.size:
                    return seg, ptr - base
        raise BadRequest("a CPU buffer must come from cpu_kv_buffer() or cpu_paged_kv_cache() "
                         "(POSIX shared memory)")

    def release(self, kv: torch.Tensor) -> None:
        """Unlink the segment of ours holding ``kv``'s address, if any (its instance was
        unregistered); memory shared in place is the engine's again, private. The mapping
        stays: the engine may still hold tensors over it."""
        ptr = kv.data_ptr()
        with self._lock:
            base = next((b for b, s in self._held.items() if b <= ptr < b + s.size), None)
            seg = self._held.pop(base) if base is not None else None
            fd = self._fds.pop(seg.name, None) if seg is not None else None
        if seg is not None:
            seg.restore()
            seg.unlink()
            if fd is not None:
                os.close(fd)

    def close(self) -> None:
        """Unlink and close every segment (the client closes); once."""
        self._finalizer()

    def _new_name(self) -> str:
        return Names(self._prefix).kvbuf(secrets.token_hex(KVBUF_HEX // 2))  # what it admits


def _release_all(held: dict[int, Segment], fds: dict[str, int], lock: threading.Lock,
                 creator: int) -> None:
    """Unlink and close every segment of ``held`` (the client closes, is collected, or the
    interpreter exits), in the process that created them only."""
    if os.getpid() != creator:
        return
    with lock:
        segs = list(held.values())
        taken = dict(fds)
        held.clear()
        fds.clear()
    for seg in segs:
        try:
            _let_go(seg, taken.pop(seg.name, None))
        except OSError:
            pass  # its name is gone already, or not ours any more: the others still go
    for fd in taken.values():
        os.close(fd)


def _let_go(seg: Segment, fd: int | None) -> None:
    """Memory shared in place is the engine's again (private); the name goes, then its lock."""
    seg.restore()
    seg.unlink()
    seg.close()
    if fd is not None:
        os.close(fd)


def _num_blocks(layers: Sequence[torch.Tensor], block_size: int, kv_heads: int,
                head_dim: int) -> int:
    """The blocks of each layer of a paged cache, once the layers are checked alike."""
    if not layers:
        raise BadRequest("a paged cache has at least one layer")
    first = layers[0]
    if any(t.numel() != first.numel() or t.dtype != first.dtype or t.device != first.device
           or not t.is_contiguous() for t in layers):
        raise BadRequest("every layer must be a contiguous tensor of one size, dtype, device")
    if first.dtype not in TORCH_DTYPES:
        raise BadRequest(f"unsupported dtype {first.dtype}")
    per_block = 2 * block_size * kv_heads * head_dim
    if min(block_size, kv_heads, head_dim) < 1 or first.numel() % per_block:
        raise BadRequest(f"a layer of {first.numel()} elements is not whole blocks of "
                         f"2 x {block_size} tokens x {kv_heads} heads x {head_dim}")
    return first.numel() // per_block


def _ipc_mem_handle(torch_handle: bytes, base_ptr: int) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` of the allocation at ``base_ptr``.

    torch's own handle string carries a one-byte type prefix (``c``: a cudaMalloc block) in
    recent versions; cupy, when present, asks the runtime directly.
    """
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        return bytes(cupy.cuda.runtime.ipcGetMemHandle(base_ptr))
    if len(torch_handle) == 65 and torch_handle[:1] == b"c":
        return torch_handle[1:]
    if len(torch_handle) == 64:
        return torch_handle
    raise BadRequest("cannot share this CUDA tensor by cudaIpc (expandable segments?); "
                     "install cupy or allocate the KV buffer with cudaMalloc")


__all__ = ["Buffers", "TORCH_DTYPES"]
