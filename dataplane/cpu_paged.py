"""The CPU backend's paged copies in one compiled pass: a numba kernel per layer, every chunk.

This module owns the kernel that moves a layer's K and V between an engine's paged cache in shm
and the chunks' slab slots; ``dataplane.cpu`` (``CpuPagedBuffer``) hands it raw element views and
the placement (``dataplane.paged``: offsets and strides in elements), and checks everything first.
A chunk goes run by run (its tokens in consecutive slots of one block, as read from the block
table): where a token's dims, its heads and the tokens follow each other (flash_attn, flashinfer)
a run is one range; where only the dims do (cpu_kt's V), a range a token and head; else (cpu_kt's
K, transposed) element by element. Copies are loops over views or with unsigned indices, which
run at memcpy's pace for ranges: numba's slice assignment copies through a temporary where the
two may overlap, and checks every signed index for a negative value.

NOTE: raw elements (uint16 for bf16 and fp16, uint32 for float32: bits are moved, never values),
one thread without the GIL (``nogil``) as ``dataplane.cpu_rotary``, for the same reason: each
instance copies on its own worker thread. Every run's block and ends are checked against their
arrays before it moves (``copy_layer`` returns the first bad token): the caller's checks
(``paged.check``, ``BlockTable.check``) already prove them in range, so one means a bug there.
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def _run(dst, d, src, s, n):  # pragma: no cover (compiled)
    """``dst[d:d + n] = src[s:s + n]``, as a loop over views (the module's docstring says
    why)."""
    to, of = dst[d:d + n], src[s:s + n]
    for k in range(n):
        to[k] = of[k]


@njit(nogil=True, cache=True)
def _move(dst, d, dst_at, src, s, src_at, n, heads, head_dim):  # pragma: no cover (compiled)
    """A run of ``n`` tokens' K or V from ``src[s]`` to ``dst[d]``, each side's (token, head,
    dim) strides in ``*_at``: one range where both sides hold the run contiguously (flash_attn,
    flashinfer), a range a token and head where both sides' dims are (cpu_kt's V), else element
    by element (cpu_kt's K) with unsigned indices: numba checks a signed index for a negative
    value at every access, which halved that loop's speed."""
    row = heads * head_dim
    if dst_at == src_at == (row, head_dim, 1):
        _run(dst, d, src, s, n * row)
    elif dst_at[2] == src_at[2] == 1:
        for t in range(n):
            for h in range(heads):
                _run(dst, d + t * dst_at[0] + h * dst_at[1], src,
                     s + t * src_at[0] + h * src_at[1], head_dim)
    else:
        u = np.uint64
        for t in range(n):
            for h in range(heads):
                x = u(d) + u(t) * u(dst_at[0]) + u(h) * u(dst_at[1])
                y = u(s) + u(t) * u(src_at[0]) + u(h) * u(src_at[1])
                for k in range(head_dim):
                    dst[x + u(k) * u(dst_at[2])] = src[y + u(k) * u(src_at[2])]


@njit(nogil=True, cache=True)
def copy_layer(eng, slab, ids, block_size, num_blocks, starts, count, slot_at, layer,
               num_layers, place, heads, head_dim, to_slab):  # pragma: no cover (compiled)
    """Copy layer ``layer``'s K and V of the chunks of ``count`` tokens at logical ``starts``
    between ``eng`` (the layer's raw elements) and ``slab`` (chunk ``j`` at element
    ``slot_at[j]``, shaped ``[2, num_layers, count, heads, head_dim]``); ``place[kv]`` is
    (offset, block, token, head, dim) in elements, K then V. A chunk goes run by run: tokens in
    consecutive slots of one block. Returns -1, or the index of the first token (chunk ``j``,
    token ``i``: ``j * count + i``) of a run whose block or elements would pass an array; the
    copy stops there."""
    row = heads * head_dim
    for j in range(starts.shape[0]):
        i = 0
        while i < count:
            p = starts[j] + i
            q, s = p // block_size, p % block_size
            if p < 0 or q >= ids.shape[0] or ids[q] < 0 or ids[q] >= num_blocks:
                return j * count + i
            n = min(block_size - s, count - i)
            for kv in range(2):
                pl = place[kv]
                e = pl[0] + ids[q] * pl[1] + s * pl[2]
                c = slot_at[j] + ((kv * num_layers + layer) * count + i) * row
                last = e + (n - 1) * pl[2] + (heads - 1) * pl[3] + (head_dim - 1) * pl[4]
                if e < 0 or last >= eng.shape[0] or c < 0 or c + n * row > slab.shape[0]:
                    return j * count + i
                at = (pl[2], pl[3], pl[4])
                if to_slab:
                    _move(slab, c, (row, head_dim, 1), eng, e, at, n, heads, head_dim)
                else:
                    _move(eng, e, at, slab, c, (row, head_dim, 1), n, heads, head_dim)
            i += n
    return -1


def warm() -> None:
    """Compile (or load from numba's cache) the kernel for the raw element types the CPU data
    plane passes (``CpuPagedBuffer``: uint16 and uint32), each way, before the first paged call."""
    place = np.array([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], np.int64)
    one = np.zeros(1, np.int64)
    for raw in (np.uint16, np.uint32):
        eng = np.frombuffer(bytearray(2 * np.dtype(raw).itemsize), raw)  # as over an mmap
        slab = np.frombuffer(bytearray(2 * np.dtype(raw).itemsize), np.uint8).view(raw)
        for to_slab in (True, False):
            assert copy_layer(eng, slab, one, 1, 1, one, 1, one, 0, 1, place, 1, 1,
                              to_slab) == -1


__all__ = ["copy_layer", "warm"]
