"""Paged engine caches on the CUDA data plane: blocks gathered on the GPU, one DMA per chunk.

This module owns the CUDA side of a paged registration (``dataplane.paged``): the per-layer
device pointers of the engine's IPC-opened buffers, a staging area of one chunk on the GPU, and
the segment tables that ``dataplane.gather.SegmentCopier`` copies between the engine's blocks
and the staging area. Everything else (events, markers, the stream) is ``CudaBuffer``'s.

One chunk of a store, in order on the instance's stream (a retrieve is the reverse)::

    gather kernel   engine blocks (2 x L x runs)  ->  staging [2, L, C, H*Dh]   (GPU to GPU)
    DMA             staging                        ->  slab slot                 (one copy)

A run is a stretch of the chunk's tokens in consecutive slots of one block: its K (or V) of one
layer is one contiguous byte range in the engine's cache when a token's heads and dims are
contiguous and slots follow each other (flash_attn, flashinfer); other layouts (cpu_kt) are
refused at registration. The staged form was measured against a kernel writing straight into
the host slab and per-block DMA (docs/benchmarks.md, ``dataplane.gather``): 93-97 % of a pinned
copy against 86-89 % and 18-24 %.

NOTE: the staging area is reused by the next chunk while the stream may still be copying the
last one; both are on the instance's one stream, so the next gather runs only after that DMA.
"""

from __future__ import annotations

import cupy
import numpy as np

from dataplane import paged
from dataplane.cuda import D2H, H2D, CudaBuffer
from dataplane.errors import BadRequest
from dataplane.gather import SegmentCopier
from dataplane.messages import PagedBuffer
from shm.layout import KVLayout


def check_gatherable(spec: PagedBuffer) -> None:
    """Refuse a layout whose tokens are not contiguous runs of ``kv_heads * head_dim``.

    Raises:
        BadRequest: naming the placement.
    """
    for name, p in (("k", spec.k), ("v", spec.v)):
        if (p.dim, p.head, p.token) != (1, spec.head_dim, spec.kv_heads * spec.head_dim):
            raise BadRequest(f"the CUDA data plane needs each token's heads and dims contiguous "
                             f"and slots in order ({name}: token {spec.kv_heads * spec.head_dim},"
                             f" head {spec.head_dim}, dim 1), as in flash_attn and flashinfer")


class CudaPagedBuffer(paged.BlockTableCalls, CudaBuffer):
    def __init__(self, device: int, bases: list[int], spec: PagedBuffer, layout: KVLayout,
                 slab_ptr: int) -> None:
        super().__init__(device, 0, 0, layout, slab_ptr)
        self._bases, self._spec = bases, spec
        isz = layout.dtype.itemsize
        self._layers = np.array([bases[ly.buffer] + spec.buffers[ly.buffer].offset + ly.offset
                                 for ly in spec.layers], np.int64)
        self._kv_at = np.array([spec.k.offset, spec.v.offset], np.int64) * isz
        self._block_b = np.array([spec.k.block, spec.v.block], np.int64) * isz
        self._token_b = spec.kv_heads * spec.head_dim * isz  # == self._row
        self._staging: cupy.ndarray | None = None
        with cupy.cuda.Device(device):
            self._copier = SegmentCopier(device)
        self._table: paged.BlockTable | None = None

    def _stage(self, chunk_size: int) -> int:
        need = 2 * self.layout.num_layers * chunk_size * self._row
        if self._staging is None or self._staging.nbytes < need:
            with cupy.cuda.Device(self.device):
                self._staging = cupy.empty(need, dtype=np.uint8)
        return int(self._staging.data.ptr)

    def _segments(self, token_start: int, chunk_size: int, first: int, last: int,
                  staging: int, to_slab: bool) -> np.ndarray:
        """``(dst, src, nbytes)`` rows between the engine's blocks and the staging area for
        layers ``[first, last)`` of one chunk."""
        assert self._table is not None, "bind() comes first"
        at = self._table.slots(token_start, chunk_size)
        cut = np.flatnonzero((np.diff(at.block) != 0) | (np.diff(at.slot) != 1)) + 1
        start = np.concatenate([[0], cut])
        count = np.diff(np.concatenate([start, [chunk_size]]))
        L, row = self.layout.num_layers, self._row
        layer = np.arange(first, last)[None, :, None]                          # [1, n, 1]
        kv = np.arange(2)[:, None, None]                                      # [2, 1, 1]
        engine = (self._layers[layer] + self._kv_at[kv]
                  + at.block[start][None, None, :] * self._block_b[kv]
                  + at.slot[start][None, None, :] * self._token_b)
        stage = staging + ((kv * L + layer) * chunk_size + start[None, None, :]) * row
        nbytes = np.broadcast_to(count[None, None, :] * row, engine.shape)
        dst, src = (stage, engine) if to_slab else (engine, stage)
        return np.stack([np.broadcast_to(dst, engine.shape).ravel(),
                         np.broadcast_to(src, engine.shape).ravel(), nbytes.ravel()], axis=1)

    def to_slab_many(self, token_starts: list[int], chunk_size: int,
                     slab_offsets: list[int]) -> None:
        staging, n = self._stage(chunk_size), 2 * self.layout.num_layers * chunk_size * self._row
        stream = self.stream.cuda_stream
        for t, off in zip(token_starts, slab_offsets):
            self._copier.copy(self._segments(t, chunk_size, 0, self.layout.num_layers, staging,
                                             True), self.stream)
            cupy.cuda.runtime.memcpyAsync(self._slab + off, staging, n, D2H, stream)

    def from_slab_many(self, slab_offsets: list[int], chunk_size: int,
                       token_starts: list[int]) -> None:
        self.from_slab_layers(slab_offsets, chunk_size, token_starts, 0, self.layout.num_layers)

    def from_slab_layers(self, slab_offsets: list[int], chunk_size: int, token_starts: list[int],
                         first: int, last: int) -> None:
        staging, L = self._stage(chunk_size), self.layout.num_layers
        width = chunk_size * self._row  # one layer's K (or V) of the chunk
        stream = self.stream.cuda_stream
        for off, t in zip(slab_offsets, token_starts):
            for kv in (0, 1):  # the layers' rows are adjacent in the slot and in staging
                at = (kv * L + first) * width
                cupy.cuda.runtime.memcpyAsync(staging + at, self._slab + off + at,
                                              (last - first) * width, H2D, stream)
            self._copier.copy(self._segments(t, chunk_size, first, last, staging, False),
                              self.stream)

    def close(self) -> None:
        if self._bases:
            self.stream.synchronize()
            self._events.clear()
            cupy.cuda.runtime.setDevice(self.device)
            for base in self._bases:
                cupy.cuda.runtime.ipcCloseMemHandle(base)
            self._bases = []
            self._staging = None


__all__ = ["CudaPagedBuffer", "check_gatherable"]
