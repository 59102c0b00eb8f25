"""The CPU copy engine: engine buffers in POSIX shared memory, copies with memcpy (numpy) and,
for paged caches, one compiled pass a layer (``dataplane.cpu_paged``).

This module owns opening a ``ShmBuffer`` and the copies; it serves CPU-only engines, tests and CI
with the same semantics as the CUDA engine. numpy releases the GIL inside large copies and the
compiled kernels run without it, so the worker threads of different instances copy in parallel.

A buffer is opened only when the client proves it is its own (docs/security.md): its name is
``<prefix>_kvbuf_<32 lowercase hex>`` (a form no segment of kvblend's has), it is opened with
``O_NOFOLLOW``, and ``fstat`` on that descriptor shows a regular file owned by the registering
peer's uid, with one link, large enough for the layout, whose (st_dev, st_ino) is none of the
service's own objects (``shm.kvbufs.service_identities``, taken at start and at each check: a hard
link of the store's metadata under a buffer name is the metadata). The engine unlinks it; the
data plane removes it only once it proved its owner gone (``shm.kvbufs``), from the file it
opened here (``segments``).
"""

from __future__ import annotations

import mmap
import os
import stat
from typing import Any

import numpy as np

from kvblend.dataplane import paged
from kvblend.dataplane.backend import CopyEngine, Direction, InstanceBuffer
from kvblend.dataplane.backends import Backend
from kvblend.dataplane.errors import BackendError, BadRequest
from kvblend.dataplane.registration import (BufferSpec, CudaIpcBuffer, KVPlacement, PagedBuffer,
                                            ShmBuffer)
from kvblend.shm.kvbufs import Identity, service_identities
from kvblend.shm.layout import KVLayout
from kvblend.shm.names import Names
from kvblend.shm.private import shm_path
from kvblend.shm.store import Store

def torch_view(a: np.ndarray, dtype: Any) -> Any:
    """``a``'s bytes (raw integers or uint8 rows, last axis contiguous) as a torch tensor of
    ``dtype`` sharing its memory."""
    import torch
    return torch.from_numpy(a).view(dtype)


class CpuBuffer(InstanceBuffer):
    def __init__(self, mapping: mmap.mmap, layout: KVLayout, slab: np.ndarray) -> None:
        self.layout = layout
        self._mmap = mapping
        row = layout.hidden_dim * layout.dtype.itemsize
        self._buf = np.ndarray((2, layout.num_layers, layout.num_tokens, row), np.uint8, mapping)
        self._slab = slab
        self._row = row

    def _slot(self, slab_offset: int, chunk_size: int) -> np.ndarray:
        n = 2 * self.layout.num_layers * chunk_size * self._row
        return self._slab[slab_offset:slab_offset + n].reshape(
            2, self.layout.num_layers, chunk_size, self._row)

    def begin(self, engine_event: bytes | None, order: int | None = None) -> None:
        if engine_event is not None:
            raise BadRequest("a CPU buffer takes no CUDA event")

    def copy(self, direction: Direction, token_starts: list[int], chunk_size: int,
             slab_offsets: list[int], layers: tuple[int, int] | None = None) -> None:
        first, last = layers or (0, self.layout.num_layers)
        for t, off in zip(token_starts, slab_offsets):
            slot = self._slot(off, chunk_size)[:, first:last]
            mine = self._buf[:, first:last, t:t + chunk_size]
            if direction is Direction.TO_SLAB:
                np.copyto(slot, mine)
            else:
                np.copyto(mine, slot)

    def turn_k(self, token_starts: list[int], chunk_size: int, turn: Any, cfg: Any,
               first: int, last: int) -> None:
        from kvblend.dataplane import cpu_rotary, rotary
        cos, sin = turn.cos_sin()
        name = self.layout.dtype.name
        if cpu_rotary.supports(name):  # a layer's K as [T, 1, heads, dims]: row t is token t
            rows = (np.asarray(token_starts, np.int64)[:, None] + np.arange(chunk_size)).ravel()
            raw = np.dtype(f"u{self.layout.dtype.itemsize}")
            _kernel_turn([self._buf[0, layer].view(raw).reshape(self.layout.num_tokens, 1, -1,
                                                                cfg.head_dim)
                          for layer in range(first, last)], rows, np.zeros_like(rows), cos, sin,
                         cfg, name)
            return
        dtype = rotary.torch_dtype(name)
        for j, t in enumerate(token_starts):
            rows = torch_view(self._buf[0, first:last, t:t + chunk_size], dtype)  # [l, C, D]
            rotary.rotate(rows.unflatten(-1, (-1, cfg.head_dim)), cos[j], sin[j], cfg)

    def end(self, done_event: bytes | None) -> None:
        if done_event is not None:
            raise BadRequest("a CPU buffer takes no CUDA event")

    def close(self) -> None:
        self.__dict__.pop("_buf", None)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a copy's view is still alive; the mapping goes with it


class CpuPagedBuffer(paged.BlockTableCalls, InstanceBuffer):
    """A paged cache in shm buffers: per layer, its raw elements (numpy checks each layer lies
    inside its mapping), copied to and from the chunks by one compiled pass a layer
    (``dataplane.cpu_paged``), and a strided view of its K ``[blocks, slots, heads, dims]`` for
    turning K."""

    def __init__(self, mappings: list[mmap.mmap], spec: PagedBuffer, layout: KVLayout,
                 slab: np.ndarray) -> None:
        self.layout = layout
        self._mmaps, self._spec = mappings, spec
        self._raw = np.dtype(f"u{layout.dtype.itemsize}")  # copies move bits, never values
        isz = self._raw.itemsize
        self._slab = slab[:len(slab) // isz * isz].view(self._raw)
        self._flat = [np.frombuffer(mappings[ly.buffer], self._raw, spec.layer_bytes // isz,
                                    ly.offset) for ly in spec.layers]
        self._place = np.array([[p.offset, p.block, p.token, p.head, p.dim]
                                for p in (spec.k, spec.v)], np.int64)
        self._k = [self._view(mappings[ly.buffer], ly.offset, spec.k) for ly in spec.layers]
        self._table: paged.BlockTable | None = None

    def _view(self, mapping: mmap.mmap, offset: int, p: KVPlacement) -> np.ndarray:
        s, isz = self._spec, self._raw.itemsize
        return np.ndarray((s.num_blocks, s.block_size, s.kv_heads, s.head_dim), self._raw, mapping,
                          offset + p.offset * isz,
                          strides=(p.block * isz, p.token * isz, p.head * isz, p.dim * isz))

    def begin(self, engine_event: bytes | None, order: int | None = None) -> None:
        if engine_event is not None:
            raise BadRequest("a CPU buffer takes no CUDA event")

    def copy(self, direction: Direction, token_starts: list[int], chunk_size: int,
             slab_offsets: list[int], layers: tuple[int, int] | None = None) -> None:
        from kvblend.dataplane.cpu_paged import copy_layer  # numba: the data plane's alone
        assert self._table is not None, "bind() comes first"
        s, L = self._spec, self.layout.num_layers
        first, last = layers or (0, L)
        starts = np.asarray(token_starts, np.int64)
        slots = np.asarray(slab_offsets, np.int64) // self._raw.itemsize
        for layer in range(first, last):
            bad = copy_layer(self._flat[layer], self._slab, self._table.ids, s.block_size,
                             s.num_blocks, starts, chunk_size, slots, layer, L, self._place,
                             s.kv_heads, s.head_dim, direction is Direction.TO_SLAB)
            assert bad < 0, (f"token {bad} of layer {layer} passes its block table, layer or "
                             "slot: BlockTable.check or paged.check let it through")

    def turn_k(self, token_starts: list[int], chunk_size: int, turn: Any, cfg: Any,
               first: int, last: int) -> None:
        from kvblend.dataplane import cpu_rotary, rotary
        assert self._table is not None, "bind() comes first"
        cos, sin = turn.cos_sin()
        name = self.layout.dtype.name
        if cpu_rotary.supports(name):  # the layers' strided K views, rows by block and slot
            at = self._table.chunk_slots(np.asarray(token_starts, np.int64), chunk_size)
            _kernel_turn(self._k[first:last], at.block.ravel(), at.slot.ravel(), cos, sin, cfg,
                         name)
            return
        dtype = rotary.torch_dtype(name)
        for j, t in enumerate(token_starts):
            at = self._table.slots(t, chunk_size)
            for layer in range(first, last):
                k = self._k[layer][at.block, at.slot]  # [C, heads, dims], a copy
                rotary.rotate(torch_view(k, dtype), cos[j], sin[j], cfg)
                self._k[layer][at.block, at.slot] = k

    def end(self, done_event: bytes | None) -> None:
        if done_event is not None:
            raise BadRequest("a CPU buffer takes no CUDA event")

    def close(self) -> None:
        for views in ("_k", "_flat"):
            self.__dict__.pop(views, None)
        for m in self._mmaps:
            try:
                m.close()
            except BufferError:
                pass  # a copy's view is still alive; the mapping goes with it


class CpuEngine(CopyEngine):
    backend = Backend.CPU

    def __init__(self, store: Store) -> None:
        self._slab = store.slab
        self._names = Names(store.name)
        self._own = service_identities(store.name)  # the service's objects, as they were at start

    def open(self, spec: BufferSpec, layout: KVLayout, owner_uid: int,
             order_word: CudaIpcBuffer | None = None,
             ready_word: bool = False) -> InstanceBuffer:
        if order_word is not None or ready_word:
            raise BadRequest("the CPU data plane takes no order_word (it orders CUDA buffers)")
        if isinstance(spec, PagedBuffer):
            paged.check(spec, layout.num_layers, layout.num_tokens, layout.hidden_dim,
                        layout.dtype.itemsize)
            if not all(isinstance(b, ShmBuffer) for b in spec.buffers):
                raise BadRequest("the CPU data plane takes shm buffers only (got a CUDA buffer)")
            if len({b.name for b in spec.buffers}) != len(spec.buffers):  # type: ignore[union-attr]
                raise BadRequest("a paged buffer names each shm buffer once")
            mappings: list[mmap.mmap] = []
            opened: list[tuple[str, Identity]] = []
            try:
                for b, need in zip(spec.buffers, paged.buffer_extents(spec)):
                    mappings.append(self._map(b, owner_uid, need, opened))  # type: ignore[arg-type]
            except BaseException:
                for m in mappings:
                    m.close()
                raise
            buf: InstanceBuffer = CpuPagedBuffer(mappings, spec, layout, self._slab)
        elif isinstance(spec, ShmBuffer):
            opened = []
            buf = CpuBuffer(self._map(spec, owner_uid, layout.nbytes, opened), layout, self._slab)
        else:
            raise BadRequest("the CPU data plane takes shm buffers only (got a CUDA buffer)")
        buf.segments = tuple(opened)
        return buf

    def _map(self, spec: ShmBuffer, owner_uid: int, nbytes: int,
             opened: list[tuple[str, Identity]]) -> mmap.mmap:
        """Map the engine's segment (``_open_owned``'s checks); its name and file go to
        ``opened``."""
        if not self._names.is_kvbuf(spec.name):
            raise BadRequest(f"shm buffer {spec.name!r} is not an engine buffer of this service: "
                             f"name it '{self._names.prefix}_kvbuf_<32 lowercase hex>' "
                             "(BlendClient.cpu_kv_buffer does)")
        own = self._own | service_identities(self._names.prefix)
        fd = _open_owned(spec.name, owner_uid, nbytes, own)
        try:
            mapping = mmap.mmap(fd, max(1, nbytes), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            opened.append((spec.name, Identity.of(os.fstat(fd))))
            return mapping
        except OSError as exc:
            raise BackendError(f"cannot map shm buffer {spec.name!r}: {exc}") from exc
        finally:
            os.close(fd)


def _kernel_turn(layers: list[np.ndarray], i0: np.ndarray, i1: np.ndarray, cos: Any, sin: Any,
                 cfg: Any, dtype_name: str) -> None:
    """Turn token rows ``k[i0, i1]`` of each layer's raw K view with ``dataplane.cpu_rotary``
    (``cos``/``sin``: torch ``[chunks, C, d/2]``, converted once for every layer)."""
    from kvblend.dataplane import cpu_rotary
    half = cos.shape[-1]
    c, s = cos.reshape(-1, half).numpy(), sin.reshape(-1, half).numpy()
    for k in layers:
        cpu_rotary.turn(k, i0, i1, c, s, cfg.dim, cfg.style == "gptj", dtype_name)


def _open_owned(name: str, owner_uid: int, nbytes: int, own: frozenset[Identity]) -> int:
    """A descriptor of ``/dev/shm/<name>``: a regular file of ``owner_uid`` with one link, of >=
    ``nbytes``, none of the files ``own``."""
    try:
        fd = os.open(shm_path(name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise BadRequest(f"cannot open shm buffer {name!r}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BadRequest(f"shm buffer {name!r} is not a regular shared-memory object")
        if st.st_nlink != 1:
            raise BadRequest(f"shm buffer {name!r} has {st.st_nlink} links: an engine buffer "
                             "has its one name only")
        if Identity.of(st) in own:
            raise BadRequest(f"shm buffer {name!r} is one of the service's own objects")
        if st.st_uid != owner_uid:
            raise BadRequest(f"shm buffer {name!r} belongs to uid {st.st_uid}, not to the "
                             f"registering client's uid {owner_uid}")
        if st.st_size < nbytes:
            raise BadRequest(f"shm buffer {name!r} holds {st.st_size} bytes, the layout needs "
                             f"{nbytes}")
    except BaseException:
        os.close(fd)
        raise
    return fd


__all__ = ["CpuEngine", "CpuBuffer", "CpuPagedBuffer"]
