"""Paged engine KV: where each token's K and V sit in an engine's per-layer tensors.

This module owns the layout descriptor of a paged KV cache (the wire form ``PagedBuffer`` is
in ``dataplane.registration``), its validation, the named layouts of common engines, and the
mapping of a call's token positions to physical slots through its block table. It moves no
bytes: the copy engines (``dataplane.cpu``, ``dataplane.cuda``) do, and it imports nothing heavy
(an engine's client uses the presets).

An engine keeps layer l of its KV in ``buffers[layers[l].buffer]`` from byte ``layers[l].offset``.
Element (block b, token slot s, head h, dim d) of K sits, in elements of the dtype, at::

    k.offset + b * k.block + s * k.token + h * k.head + d * k.dim        (V: the same with v)

so one descriptor covers every layout that is a strided view, and K and V may differ (a
transposed K). The named layouts, per layer, with B blocks of S tokens, H kv heads, dim Dh::

    name          layer tensor            K: offset  block    token  head     dim   V: offset
    flash_attn    [2, B, S, H, Dh]        0          S*H*Dh   H*Dh   Dh       1     B*S*H*Dh
    flashinfer    [B, 2, S, H, Dh]        0          2*S*H*Dh H*Dh   Dh       1     S*H*Dh
    cpu_kt        [B, H, S, 2*Dh]         0          H*S*2Dh  1      S*2*Dh   S     S*Dh
                  (K of a (block, head) transposed [Dh, S], then V [S, Dh]; V token stride Dh,
                   dim stride 1)
    contiguous    [2, L, T, H*Dh] whole   0          (B = 1, S = T)  H*Dh  Dh   1     L*T*H*Dh
                  (layer l from byte l*T*H*Dh*itemsize of the one buffer)

A call names the engine's slots by a block table: logical token position p of the call (the
``offset`` plus the token's index, as for a contiguous buffer) lives in block
``block_table[p // S]``, slot ``p % S``. Blocks need not be in order or adjacent; entries a call
does not touch may be -1. In the slab every chunk keeps the one canonical layout
``[2, L, C, H*Dh]``, so engines of different layouts (same model, shard and dtype) share chunks.

Every number of a descriptor arrives from a client: ``check`` bounds each one and proves that
every element a layer can address lies inside the bytes that layer declares (``layer_bytes``),
before any buffer is opened; the copy engines check ``offset + layer_bytes`` against each
buffer's real size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvblend.dataplane.errors import BadRequest, OutOfRange
from kvblend.dataplane.registration import MAX_PAGED_BUFFERS, KVPlacement, PagedBuffer

LAYOUTS = ("flash_attn", "flashinfer", "cpu_kt", "contiguous")


def placements(name: str, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
               num_layers: int = 1) -> tuple[KVPlacement, KVPlacement]:
    """K and V placements of a named layout (see the table above).

    Raises:
        ValueError: an unknown name.
    """
    B, S, H, Dh = num_blocks, block_size, kv_heads, head_dim
    if name == "flash_attn":
        return KVPlacement(0, S * H * Dh, H * Dh, Dh, 1), KVPlacement(B * S * H * Dh, S * H * Dh,
                                                                      H * Dh, Dh, 1)
    if name == "flashinfer":
        return (KVPlacement(0, 2 * S * H * Dh, H * Dh, Dh, 1),
                KVPlacement(S * H * Dh, 2 * S * H * Dh, H * Dh, Dh, 1))
    if name == "cpu_kt":
        return (KVPlacement(0, H * S * 2 * Dh, 1, S * 2 * Dh, S),
                KVPlacement(S * Dh, H * S * 2 * Dh, Dh, S * 2 * Dh, 1))
    if name == "contiguous":
        if B != 1:
            raise ValueError("the contiguous layout is one block of all the buffer's tokens")
        return (KVPlacement(0, S * H * Dh, H * Dh, Dh, 1),
                KVPlacement(num_layers * S * H * Dh, S * H * Dh, H * Dh, Dh, 1))
    raise ValueError(f"unknown paged layout {name!r}: one of {', '.join(LAYOUTS)}")


def _last(p: KVPlacement, spec: PagedBuffer) -> int:
    """The highest element index ``p`` can address in one layer."""
    return (p.offset + (spec.num_blocks - 1) * p.block + (spec.block_size - 1) * p.token
            + (spec.kv_heads - 1) * p.head + (spec.head_dim - 1) * p.dim)


def check(spec: PagedBuffer, num_layers: int, num_tokens: int, hidden_dim: int,
          itemsize: int) -> None:
    """Refuse a descriptor that disagrees with the registration or reaches past its layers.

    Raises:
        BadRequest: naming the first field that is wrong.
    """
    if min(spec.block_size, spec.num_blocks, spec.kv_heads, spec.head_dim) < 1:
        raise BadRequest("block_size, num_blocks, kv_heads and head_dim must be >= 1")
    if spec.kv_heads * spec.head_dim != hidden_dim:
        raise BadRequest(f"kv_heads * head_dim = {spec.kv_heads * spec.head_dim}, but hidden_dim "
                         f"is {hidden_dim}")
    if spec.num_blocks * spec.block_size != num_tokens:
        raise BadRequest(f"num_blocks * block_size = {spec.num_blocks * spec.block_size}, but "
                         f"num_tokens is {num_tokens}")
    if len(spec.layers) != num_layers:
        raise BadRequest(f"{len(spec.layers)} layers described, num_layers is {num_layers}")
    if not 1 <= len(spec.buffers) <= MAX_PAGED_BUFFERS:
        raise BadRequest(f"a paged buffer names 1 to {MAX_PAGED_BUFFERS} buffers")
    if spec.layer_bytes % itemsize:
        raise BadRequest(f"layer_bytes {spec.layer_bytes} is not a multiple of the dtype's "
                         f"{itemsize} bytes")
    for name, p in (("k", spec.k), ("v", spec.v)):
        if _last(p, spec) >= spec.layer_bytes // itemsize:
            raise BadRequest(f"{name} reaches element {_last(p, spec)} of a layer that holds "
                             f"{spec.layer_bytes // itemsize}")
    for i, layer in enumerate(spec.layers):
        if layer.buffer >= len(spec.buffers):
            raise BadRequest(f"layer {i} names buffer {layer.buffer} of {len(spec.buffers)}")
        if layer.offset % itemsize:
            raise BadRequest(f"layer {i} starts at byte {layer.offset}, not a multiple of the "
                             f"dtype's {itemsize} bytes")


def buffer_extents(spec: PagedBuffer) -> list[int]:
    """Bytes each of ``spec.buffers`` must hold: the end of its last layer."""
    need = [0] * len(spec.buffers)
    for layer in spec.layers:
        need[layer.buffer] = max(need[layer.buffer], layer.offset + spec.layer_bytes)
    return need


@dataclass(frozen=True)
class Slots:
    """A call's physical token slots: ``block[i], slot[i]`` of logical position ``start + i``."""

    block: np.ndarray
    slot: np.ndarray


class BlockTable:
    """One call's block table, checked against the engine's block count.

    Args:
        raw: little-endian int32 block ids, one per ``block_size`` logical tokens.
        block_size: tokens per block.
        num_blocks: blocks in the engine's cache.

    Raises:
        BadRequest: not whole int32 values.
    """

    def __init__(self, raw: bytes, block_size: int, num_blocks: int) -> None:
        if len(raw) % 4:
            raise BadRequest(f"a block table is little-endian int32 values, got {len(raw)} bytes")
        self.ids = np.frombuffer(raw, "<i4").astype(np.int64)
        self.block_size, self.num_blocks = block_size, num_blocks

    @property
    def num_tokens(self) -> int:
        """Logical token positions the table covers."""
        return len(self.ids) * self.block_size

    def slots(self, start: int, count: int) -> Slots:
        """The physical slots of logical positions ``[start, start + count)``.

        Raises:
            OutOfRange: the range passes the table's end, or names a block outside the cache
                (-1 included) for a position it touches.
        """
        at = self.chunk_slots(np.array([start], np.int64), count)
        return Slots(at.block[0], at.slot[0])

    def chunk_slots(self, starts: np.ndarray, count: int) -> Slots:
        """``slots`` of ``[start, start + count)`` for every start at once, shaped
        ``[len(starts), count]``."""
        starts = np.asarray(starts, np.int64)
        if len(starts) and (starts.min() < 0 or starts.max() + count > self.num_tokens):
            bad = int(starts[(starts < 0) | (starts + count > self.num_tokens)][0])
            raise OutOfRange(f"tokens [{bad}, {bad + count}) pass the block table's "
                             f"{self.num_tokens}")
        pos = starts[:, None] + np.arange(count, dtype=np.int64)
        block = self.ids[pos // self.block_size]
        if block.size and (block.min() < 0 or block.max() >= self.num_blocks):
            bad = int(block[(block < 0) | (block >= self.num_blocks)][0])
            raise OutOfRange(f"the block table names block {bad} for tokens it touches; the "
                             f"cache has blocks [0, {self.num_blocks})")
        return Slots(block, pos % self.block_size)

    def check(self, starts: np.ndarray, count: int) -> np.ndarray:
        """``starts`` as int64, once every chunk of ``count`` tokens from them is checked to
        have slots, in compiled code (``dataplane.segments.first_bad``).

        Raises:
            OutOfRange: as ``chunk_slots``, which words the error.
        """
        from kvblend.dataplane.segments import first_bad  # numba: the data plane's alone
        starts = np.ascontiguousarray(starts, np.int64)
        if first_bad(self.ids, self.block_size, self.num_blocks, starts, count) >= 0:
            self.chunk_slots(starts, count)  # raises, naming what is wrong
            raise AssertionError("first_bad and chunk_slots disagree")  # a test holds them equal
        return starts


def table_segments(table: BlockTable, starts: np.ndarray, count: int, layers: np.ndarray,
                   kv_at: np.ndarray, block_bytes: np.ndarray, token_bytes: int, num_layers: int,
                   first: int, last: int, chunk_at: np.ndarray, to_slab: bool) -> np.ndarray:
    """``(dst, src, nbytes)`` rows between an engine's blocks and the chunks of ``count`` tokens
    at logical ``starts`` of ``table``, in the slab's layout ``[2, L, C, token_bytes]`` (in a
    staging area or in their slab slots), for layers ``[first, last)`` of every chunk at once
    (the CUDA data plane's gather and scatter).

    A run is a stretch of a chunk's tokens in consecutive slots of one block; for a layout whose
    token is ``token_bytes`` contiguous bytes and whose slots follow each other, its K (or V) of
    one layer is one byte range, so a row never passes its block's end. The rows are built in one
    compiled pass that reads the slots from the block table itself (``dataplane.segments``: in
    numpy the slots' ``[n, count]`` arrays alone took about 0.12 ms of a layer-wise call's layer 0
    on an H100's host, docs/benchmarks.md).

    Args:
        layers: each layer's start address.
        kv_at: bytes from a layer's start to its K and its V.
        block_bytes: bytes between blocks, for K and for V.
        chunk_at: where each chunk's ``[2, L, C, token_bytes]`` starts.
        to_slab: gather (engine -> chunks) when True, else scatter.

    Raises:
        OutOfRange: as ``BlockTable.chunk_slots``.
    """
    from kvblend.dataplane.segments import table_segments as rows  # numba: the data plane's
    starts = table.check(starts, count)
    return rows(table.ids, table.block_size, starts, int(count), np.asarray(layers, np.int64),
                np.asarray(kv_at, np.int64), np.asarray(block_bytes, np.int64),
                int(token_bytes), int(num_layers), int(first), int(last),
                np.asarray(chunk_at, np.int64), bool(to_slab))


class LayerWindows:
    """The plan of a layer-wise retrieve through two staging halves (``dataplane.cuda_paged``):
    layer 0 alone, then windows of ``window`` layers, window ``k`` in half ``k % 2``. In a half,
    chunk ``j``'s K of layer ``l`` of the window ``[a, b)`` is at ``j * 2W * width + (l - a) *
    width``, its V ``W * width`` further (``width``: one layer's K of one chunk, ``W``: the
    window); the slots hold chunks as ``[2, L, C, token_bytes]``, so a window's K rows of a
    chunk are one piece, and its V rows another."""

    def __init__(self, num_layers: int, window: int, width: int, halves: tuple[int, int],
                 slots: np.ndarray) -> None:
        assert num_layers > 1 and window >= 1
        self.num_layers, self.window, self.width, self.halves = num_layers, window, width, halves
        self.slots = np.asarray(slots, np.int64)
        self.stride = 2 * window * width  # a chunk's place in a half
        self.starts = [0, *range(1, num_layers, window)]
        self.ends = [*self.starts[1:], num_layers]

    @staticmethod
    def choose(num_layers: int, width: int, chunks: int, half: int, min_piece: int,
               batched: bool, mapped: bool) -> int:
        """The window (layers) a layer-wise retrieve of ``chunks`` chunks takes through halves
        of ``half`` bytes, or 0 for the kernel that reads the slab (``mapped``: the device may
        read it). Windows where a window of one chunk's K is at least ``min_piece`` bytes and
        the driver has the batched copy (``batched``), or where no kernel may read the slab;
        measured (docs/benchmarks.md): 1 MiB pieces by batched DMA 0.93-0.94 of a pinned copy
        against the kernel's 0.87; 960 KiB pieces brought layer 0 later than the kernel."""
        if num_layers < 2 or not chunks:
            return 0
        window = min(num_layers - 1, half // (2 * width * chunks))
        if window and ((batched and window * width >= min_piece) or not mapped):
            return window
        return 0

    def of(self, layer: int) -> int:
        """The window of ``layer``."""
        return 0 if layer == 0 else 1 + (layer - 1) // self.window

    def pieces(self, k: int) -> tuple[np.ndarray, np.ndarray, int]:
        """Window ``k``'s copies from the slots: destinations, sources (a chunk's K rows, then
        its V rows, chunk by chunk) and the bytes of each."""
        a, b, w = self.starts[k], self.ends[k], self.width
        at = self.halves[k % 2] + np.arange(len(self.slots), dtype=np.int64) * self.stride
        dsts = np.stack([at, at + self.window * w], axis=1).ravel()
        srcs = np.stack([self.slots + a * w, self.slots + (self.num_layers + a) * w],
                        axis=1).ravel()
        return dsts, srcs, (b - a) * w

    def row(self, layer: int) -> int:
        """Where chunk 0's K rows of ``layer`` are staged."""
        k = self.of(layer)
        return self.halves[k % 2] + (layer - self.starts[k]) * self.width

    def chunk_at(self, layer: int) -> np.ndarray:
        """``table_segments``' ``chunk_at`` for ``layer`` with ``window`` as its layer count:
        where each chunk would start if the half held every layer before it."""
        return (self.row(layer) - layer * self.width
                + np.arange(len(self.slots), dtype=np.int64) * self.stride)


class BlockTableCalls:
    """``bind`` and ``check`` of an ``InstanceBuffer`` over a paged cache (``_spec``)."""

    _spec: PagedBuffer
    _table: BlockTable | None

    def bind(self, block_table: bytes | None) -> int:
        if block_table is None:
            raise BadRequest("a paged buffer needs the call's block table")
        self._table = BlockTable(block_table, self._spec.block_size, self._spec.num_blocks)
        return self._table.num_tokens

    def check(self, token_starts: np.ndarray, chunk_size: int) -> None:
        assert self._table is not None, "bind() comes first"
        self._table.check(token_starts, chunk_size)


__all__ = ["placements", "check", "buffer_extents", "table_segments", "BlockTable",
           "BlockTableCalls", "LayerWindows", "Slots", "LAYOUTS"]
