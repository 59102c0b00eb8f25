"""Paged engine caches on the CUDA data plane: blocks gathered on the GPU, one DMA per chunk.

This module owns the CUDA side of a paged registration (``dataplane.paged``): the per-layer
device pointers of the engine's IPC-opened buffers, a staging area of whole chunks on the GPU,
and the segment tables that ``dataplane.gather.SegmentCopier`` copies between the engine's blocks
and the staging area. Everything else (events, markers, the stream) is ``CudaBuffer``'s.

A batch of chunks of a store (a retrieve is the reverse)::

    gather kernel   engine blocks (2 x L x runs, every chunk of the batch)
                                      ->  staging, chunk j at j x [2, L, C, H*Dh]   (GPU to GPU)
    DMA, each chunk staging chunk j   ->  its slab slot                            (one copy)

A batch is as many chunks as half of the staging holds (``--staging-mib``, at least one); the
segment table of a batch is built by numpy in one pass (a table per chunk cost more CPU time
than its DMA).

A run is a stretch of the chunk's tokens in consecutive slots of one block: its K (or V) of one
layer is one contiguous byte range in the engine's cache when a token's heads and dims are
contiguous and slots follow each other (flash_attn, flashinfer); other layouts (cpu_kt) are
refused at registration. The staged form was measured against a kernel writing straight into
the host slab and per-block DMA (docs/benchmarks.md, ``dataplane.gather``): 93-97 % of a pinned
copy against 86-89 % and 18-24 %.

A layer-wise retrieve moves windows of layers through the staging halves (``_StagedLayers``):
layer 0 alone, then as many layers a window as a half holds of every chunk, each window two
pieces a chunk (its K rows, its V rows) in one batched DMA (``dataplane.dma``), and one scatter
kernel a layer. It is chosen where a window of one chunk's K is at least ``layer_dma_bytes``
(``--dp-layer-dma-mib``, 1 MiB) and the driver has the batched copy, or where no kernel may read
the slab (``paged.LayerWindows.choose``): measured on an H100 at 8k
tokens of an 8B model's KV (windows of two layers, 1 MiB pieces), 0.93-0.94 of a pinned copy for
the whole call against 0.87 for the direct kernel below, layer 0 as soon (docs/benchmarks.md);
with smaller pieces (a 135M-shaped model's 960 KiB) layer 0 came later than by the kernel. Below
the threshold, where the device may use the slab's host address
(``cudaDevAttrCanUseHostPointerForRegisteredMem``), one scatter kernel a layer reads the rows of
every chunk straight from their slots over PCIe (the copier's direct form, 86-89 % of a pinned
copy standalone; ``_DirectLayers``). Either way the segment table is built and uploaded once per
call, for one layer; every layer is that table shifted, so a layer costs the CPU one kernel
launch.

NOTE: the staging area is two halves used in turn, so a batch's gather (store) or DMAs (retrieve)
on a side stream overlap the other half's DMAs or scatter on the instance's stream. Events order
them: the instance's stream waits for each batch's side-stream work before using the half, the
side stream waits until the instance's stream is done with a half before refilling it, and the
side stream starts each call after everything the instance's stream holds (the engine's event
included: ``begin``). The call's markers stay on the instance's stream, after every copy of the
call. The halves alternate across all of a call's ``copy`` calls (the data plane makes one per
32 MiB group of a store, at an 8B model's 32 MiB chunks one a chunk, and one per pin batch of a
retrieve), so a call's first batch is the only one that waits for all of the instance's stream.
A retrieve uploads each batch's segment table on the side stream ahead of the batch's DMAs: on
the instance's stream the upload queued on the copy engine behind the next batch's DMAs, and the
scatter with it (docs/benchmarks.md, "The paged copies pipelined, the table uploaded ahead").
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np
import torch

from kvblend.dataplane import dma, paged
from kvblend.dataplane.backend import Direction, LayerCopies
from kvblend.dataplane.cuda import D2H, H2D, CudaBuffer
from kvblend.dataplane.errors import BadRequest
from kvblend.dataplane.gather import PIECE, SegmentCopier, Table
from kvblend.dataplane.registration import PagedBuffer
from kvblend.shm.layout import KVLayout

STAGING_BYTES = 128 << 20  # default GPU staging per instance (--staging-mib): whole chunks, >= 2


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
                 slab_ptr: int, slab_mapped: bool = False,
                 staging_bytes: int = STAGING_BYTES, layer_dma_bytes: int = 1 << 20) -> None:
        super().__init__(device, 0, 0, layout, slab_ptr)
        self._slab_mapped = slab_mapped  # kernels on this device may read the slab's host address
        self._staging_bytes, self._layer_dma_bytes = staging_bytes, layer_dma_bytes
        self._bases, self._spec = bases, spec
        isz = layout.dtype.itemsize
        self._layers = np.array([bases[ly.buffer] + spec.buffers[ly.buffer].offset + ly.offset
                                 for ly in spec.layers], np.int64)
        self._kv_at = np.array([spec.k.offset, spec.v.offset], np.int64) * isz
        self._block_b = np.array([spec.k.block, spec.v.block], np.int64) * isz
        self._token_b = spec.kv_heads * spec.head_dim * isz  # == self._row
        # a row is one run of a chunk's tokens inside one block: when a block's tokens fit a
        # piece of the copier, the rows need no splitting (nor its checks: none is empty)
        self._pieces = spec.block_size * self._token_b <= PIECE
        self._staging: cupy.ndarray | None = None
        with cupy.cuda.Device(device):
            self._copier = SegmentCopier(device)
        with torch.cuda.device(device):
            self._side = torch.cuda.Stream(device)  # fills or drains the other staging half
        self._table: paged.BlockTable | None = None
        # the staging halves across a call's batches (begin() resets them): the event after
        # the instance's stream last used each half, and the half the next batch takes
        self._freed: list[Any] = [None, None]
        self._next = 0

    def begin(self, engine_event: bytes | None, order: int | None = None) -> None:
        super().begin(engine_event, order)
        # the side stream fills or drains staging only after what the instance's stream holds
        # now (the engine's order included); from then on each half waits only for its own
        # last use (_take_half), so a call's batches pipeline across its copy() calls
        self._side.wait_event(self._after(self.stream))
        self._freed, self._next = [None, None], 0

    def _take_half(self, halves: list[int]) -> tuple[int, int]:
        """The half the next batch fills or drains (index, address), once the side stream has
        waited for its last use on the instance's stream."""
        h, self._next = self._next, 1 - self._next
        if self._freed[h] is not None:
            self._side.wait_event(self._freed[h])
            self._freed[h] = None
        return h, halves[h]

    def _stage(self, chunk_size: int) -> tuple[int, int]:
        """The staging area's address and how many chunks it holds."""
        chunk = 2 * self.layout.num_layers * chunk_size * self._row
        if self._staging is None or self._staging.nbytes < chunk:
            with cupy.cuda.Device(self.device):
                self._staging = cupy.empty(max(2 * chunk, self._staging_bytes // chunk * chunk),
                                           np.uint8)
        return int(self._staging.data.ptr), self._staging.nbytes // chunk

    def _segments(self, token_starts: list[int], chunk_size: int, first: int, last: int,
                  chunk_at: np.ndarray, to_slab: bool, num_layers: int | None = None
                  ) -> np.ndarray:
        """``paged.table_segments`` of this cache; ``num_layers``: the layers each chunk at
        ``chunk_at`` holds (all of them, or a window of the layer-wise staging)."""
        assert self._table is not None, "bind() comes first"
        return paged.table_segments(self._table, np.asarray(token_starts, np.int64), chunk_size,
                                    self._layers, self._kv_at, self._block_b, self._token_b,
                                    num_layers or self.layout.num_layers, first, last, chunk_at,
                                    to_slab)

    def _staged(self, staging: int, count: int, chunk_size: int) -> np.ndarray:
        return staging + np.arange(count, dtype=np.int64) * (
            2 * self.layout.num_layers * chunk_size * self._row)

    def _halves(self, chunk_size: int) -> tuple[list[int], int]:
        """The two staging halves' addresses and the chunks each holds (at least one)."""
        staging, per = self._stage(chunk_size)
        n = 2 * self.layout.num_layers * chunk_size * self._row
        return [staging, staging + per // 2 * n], per // 2

    def copy(self, direction: Direction, token_starts: list[int], chunk_size: int,
             slab_offsets: list[int], layers: tuple[int, int] | None = None) -> None:
        first, last = layers or (0, self.layout.num_layers)
        whole = (first, last) == (0, self.layout.num_layers)
        if direction is Direction.TO_SLAB and whole:
            self._store_staged(token_starts, chunk_size, slab_offsets)
        elif direction is Direction.TO_SLAB:
            self._store_direct(token_starts, chunk_size, slab_offsets, first, last)
        elif self._slab_mapped and not whole:
            # a layer group: one scatter kernel reading the slots over PCIe (no DMA per chunk)
            slots = self._slab + np.asarray(slab_offsets, np.int64)
            self._copier.copy(self._segments(token_starts, chunk_size, first, last, slots,
                                             False), self.stream, pieces=self._pieces)
        else:
            self._retrieve_staged(slab_offsets, chunk_size, token_starts, first, last)

    def _store_staged(self, token_starts: list[int], chunk_size: int,
                      slab_offsets: list[int]) -> None:
        # gathers on the side stream into one half while the main stream DMAs the other half:
        # the main stream (whose markers complete the call) waits for each gather, and the side
        # stream waits until the DMAs that last read a half are done before refilling it
        halves, per = self._halves(chunk_size)
        n, L = 2 * self.layout.num_layers * chunk_size * self._row, self.layout.num_layers
        stream, side = self.stream.cuda_stream, self._side
        for lo in range(0, len(token_starts), per):
            h, base = self._take_half(halves)
            starts, offs = token_starts[lo:lo + per], slab_offsets[lo:lo + per]
            self._copier.copy(self._segments(starts, chunk_size, 0, L,
                                             self._staged(base, len(starts), chunk_size), True),
                              side, pieces=self._pieces)
            self.stream.wait_event(self._after(side))
            for j, off in enumerate(offs):
                cupy.cuda.runtime.memcpyAsync(self._slab + off, base + j * n, n, D2H, stream)
            self._freed[h] = self._after(self.stream)

    @staticmethod
    def _after(stream: Any) -> Any:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _store_direct(self, token_starts: list[int], chunk_size: int, slab_offsets: list[int],
                      first: int, last: int) -> None:
        if not self._slab_mapped:
            raise BadRequest("a layer-wise store of a paged cache needs a GPU that can use the "
                             "slab's host address (cudaDevAttrCanUseHostPointerForRegisteredMem)")
        # a layer group: one gather kernel writing the slots over PCIe (no DMA per chunk)
        slots = self._slab + np.asarray(slab_offsets, np.int64)
        self._copier.copy(self._segments(token_starts, chunk_size, first, last, slots, True),
                          self.stream, pieces=self._pieces)

    def _retrieve_staged(self, slab_offsets: list[int], chunk_size: int, token_starts: list[int],
                         first: int, last: int) -> None:
        # DMAs into one half on the side stream while the main stream scatters the other half
        halves, per = self._halves(chunk_size)
        L, width = self.layout.num_layers, chunk_size * self._row  # a layer's K (or V) of a chunk
        n, side = 2 * L * width, self._side
        for lo in range(0, len(token_starts), per):
            h, base = self._take_half(halves)
            batch = token_starts[lo:lo + per]
            # the batch's table goes up ahead of its DMAs, on their stream
            table = self._copier.upload_ahead(
                self._segments(batch, chunk_size, first, last,
                               self._staged(base, len(batch), chunk_size), False),
                side, pieces=self._pieces)
            for j, off in enumerate(slab_offsets[lo:lo + per]):
                for kv in (0, 1):  # the layers' rows are adjacent in the slot and in staging
                    at = (kv * L + first) * width
                    cupy.cuda.runtime.memcpyAsync(base + j * n + at, self._slab + off + at,
                                                  (last - first) * width, H2D, side.cuda_stream)
            self.stream.wait_event(self._after(side))
            self._copier.copy_table(table, self.stream)
            self._freed[h] = self._after(self.stream)

    def layer_copies(self, direction: Direction, token_starts: list[int], chunk_size: int,
                     slab_offsets: list[int]) -> LayerCopies:
        if direction is Direction.FROM_SLAB and token_starts:
            self._stage(chunk_size)
            assert self._staging is not None
            window = paged.LayerWindows.choose(
                self.layout.num_layers, chunk_size * self._row, len(token_starts),
                _half(self._staging), self._layer_dma_bytes, dma.copier() is not None,
                self._slab_mapped)
            if window:
                return _StagedLayers(self, direction, token_starts, chunk_size, slab_offsets,
                                     window)
        if not self._slab_mapped:
            return super().layer_copies(direction, token_starts, chunk_size, slab_offsets)
        return _DirectLayers(self, direction, token_starts, chunk_size, slab_offsets)

    def turn_k(self, token_starts: list[int], chunk_size: int, turn: Any, cfg: Any,
               first: int, last: int) -> None:
        # K of layer l starts at its allocation's K offset; a token's row at block*block_bytes +
        # slot*token_bytes into it (heads and dims contiguous: check_gatherable)
        assert self._table is not None, "bind() comes first"
        at = self._table.chunk_slots(np.asarray(token_starts, np.int64), chunk_size)
        rows = at.block.ravel() * self._block_b[0] + at.slot.ravel() * self._token_b
        self._turn(self._layers[first:last] + self._kv_at[0], rows, turn, cfg, self._spec.kv_heads)

    def close(self) -> None:
        if self._bases:
            self._release_word()
            self.stream.synchronize()
            self._events.clear()
            cupy.cuda.runtime.setDevice(self.device)
            for base in self._bases:
                cupy.cuda.runtime.ipcCloseMemHandle(base)
            self._bases = []
            self._staging = None
            self._close_word()


class _DirectLayers(LayerCopies):
    """A layer-wise call's groups, each copied by the direct kernel from one segment table:
    the table of the first group's first layer is built and uploaded once, and every layer is
    that table shifted (the engine's side by the layer's base address, the slot's side by
    ``l * C`` token rows), one kernel launch a layer. A whole-cache group takes the staged path."""

    buf: CudaPagedBuffer

    def __init__(self, buf: CudaPagedBuffer, direction: Direction, token_starts: list[int],
                 chunk_size: int, slab_offsets: list[int]) -> None:
        super().__init__(buf, direction, token_starts, chunk_size, slab_offsets)
        self.to_slab = direction is Direction.TO_SLAB
        self._table: Table | None = None
        self._layer = 0  # the layer the table was built for

    def copy(self, first: int, last: int) -> None:
        buf = self.buf
        if (first, last) == (0, buf.layout.num_layers) or not self.token_starts:
            super().copy(first, last)
            return
        if self._table is None:
            slots = buf._slab + np.asarray(self.slab_offsets, np.int64)
            self._table = buf._copier.upload(
                buf._segments(self.token_starts, self.chunk_size, first, first + 1, slots,
                              self.to_slab), buf.stream, pieces=buf._pieces)
            self._layer = first
        row = self.chunk_size * buf._row
        for layer in range(first, last):
            engine = int(buf._layers[layer] - buf._layers[self._layer])
            slot = (layer - self._layer) * row
            buf._copier.copy_table(self._table, buf.stream, *((slot, engine) if self.to_slab
                                                             else (engine, slot)))

    def close(self) -> None:
        if self._table is not None:
            self.buf._copier.release(self._table)
            self._table = None


def _half(staging: Any) -> int:
    """Bytes of each half of the staging area for a layer-wise retrieve (256-byte aligned)."""
    return staging.nbytes // 2 // 256 * 256


class _StagedLayers(LayerCopies):
    """A layer-wise retrieve through the staging halves, a window of layers at a time
    (``paged.LayerWindows``): two DMAs a chunk (the window's K rows, its V rows) in one batched
    call into one half on the side stream while the instance's stream scatters the other
    half's layers, one kernel a layer from one segment table shifted to each layer and half.
    Layer 0 is a window of its own, so it is readable after one layer's DMA; from window 1 on,
    each window's DMAs are queued when the window before it starts, so the copy engine does not
    wait for the CPU. A half is refilled only after its last scatter (events), as in the staged
    whole call."""

    buf: CudaPagedBuffer

    def __init__(self, buf: CudaPagedBuffer, direction: Direction, token_starts: list[int],
                 chunk_size: int, slab_offsets: list[int], window: int) -> None:
        super().__init__(buf, direction, token_starts, chunk_size, slab_offsets)
        staging = buf._staging
        assert staging is not None, "layer_copies sized the staging"
        at = int(staging.data.ptr)
        self.plan = paged.LayerWindows(buf.layout.num_layers, window, chunk_size * buf._row,
                                       (at, at + _half(staging)),
                                       buf._slab + np.asarray(slab_offsets, np.int64))
        self.held = [-1, -1]  # the window each half holds (queued)
        self.ready: dict[int, Any] = {}  # window -> the event after its DMAs (until waited)
        # after a half's last scatter; the call's begin() ordered the side stream after the
        # instance's stream already
        self.freed: list[Any] = [None, None]
        self._table: Table | None = None
        self._first = 0  # the layer the table was built for

    def _fill(self, k: int) -> None:
        """Queue window ``k``'s DMAs into half ``k % 2`` on the side stream."""
        h, side = k % 2, self.buf._side
        if self.freed[h] is not None:
            side.wait_event(self.freed[h])
            self.freed[h] = None
        dsts, srcs, n = self.plan.pieces(k)
        batch = dma.copier()
        if batch is not None:
            batch.copy(dsts, srcs, np.full(len(dsts), n), side.cuda_stream)
        else:
            for d, s in zip(dsts.tolist(), srcs.tolist()):
                cupy.cuda.runtime.memcpyAsync(d, s, n, H2D, side.cuda_stream)
        self.held[h] = k
        self.ready[k] = self.buf._after(side)

    def copy(self, first: int, last: int) -> None:
        buf, plan = self.buf, self.plan
        for layer in range(first, last):
            k = plan.of(layer)
            if self.held[k % 2] != k:
                self._fill(k)
            if 0 < k < len(plan.starts) - 1 and self.held[(k + 1) % 2] != k + 1:
                # behind this window's DMAs on the side stream; not while layer 0 is under way:
                # DMAs queued behind it delay the engine's sight of it (the other context's wait)
                self._fill(k + 1)
            if k in self.ready:
                buf.stream.wait_event(self.ready.pop(k))
            if self._table is None:
                self._table = buf._copier.upload(
                    buf._segments(self.token_starts, self.chunk_size, layer, layer + 1,
                                  plan.chunk_at(layer), False, plan.window),
                    buf.stream, pieces=buf._pieces)
                self._first = layer
            l0 = self._first
            buf._copier.copy_table(self._table, buf.stream,
                                   int(buf._layers[layer] - buf._layers[l0]),
                                   plan.row(layer) - plan.row(l0))
            if layer + 1 == plan.ends[k]:
                self.freed[k % 2] = buf._after(buf.stream)

    def close(self) -> None:
        if self._table is not None:
            self.buf._copier.release(self._table)
            self._table = None


__all__ = ["CudaPagedBuffer", "check_gatherable"]
