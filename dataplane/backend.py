"""The copy-engine interface: what the data plane asks of a buffer backend (CPU or CUDA).

This module owns the interface; the implementations live in ``dataplane.cpu`` (POSIX shm
buffers, memcpy) and ``dataplane.cuda`` (CUDA IPC buffers, DMA into host-registered slabs), and
``dataplane.engines`` picks one (it imports them; they import this module, never the reverse).
The store logic (keys, reservations, pins, commit order) lives in ``dataplane.transfer`` and is
the same for both.

One seam: ``copy(direction, token_starts, chunk_size, slab_offsets, layers)`` moves chunks
between the engine's buffer and their slab slots, every layer or a range of them. A call goes
through these states on an ``InstanceBuffer``, all on the instance's own worker thread, in order:

| state | method | what it does | next |
|---|---|---|---|
| idle | ``bind(block_table)`` | the call's token capacity (a paged buffer: its block table) | bound |
| bound | ``check(starts, chunk_size)`` | every chunk's tokens have slots; no side effect before | checked |
| checked | ``begin(engine_event)`` | the instance's stream waits for the engine's event (CUDA) | copying |
| copying | ``copy(...)``, ``turn_k(...)`` | enqueue copies / K turns in order (CPU: done at once) | copying |
| copying | ``begin(event)`` | wait for another engine event (a layer-wise store's group) | copying |
| copying | ``mark()`` / ``record(handle)`` | a marker / an interprocess event after what is enqueued | copying |
| copying | ``end(done_event)`` | the completion event after the last copy; a marker for all | ended |
| any | ``wait(marker)`` | block until the copies enqueued before ``marker`` completed | same |

NOTE: the data plane commits a reservation (and drops a pin) only after ``wait`` returned for a
marker taken after that chunk's copy, never before. ``finish`` = ``wait(end(done_event))``.
"""

from __future__ import annotations

import abc
import enum
from typing import Any

import numpy as np

from kvblend.dataplane.backends import Backend
from kvblend.dataplane.errors import BadRequest
from kvblend.dataplane.registration import BufferSpec, CudaIpcBuffer
from kvblend.shm.kvbufs import Identity
from kvblend.shm.layout import KVLayout


class Direction(enum.Enum):
    """Which way a copy moves a chunk: into its slab slot (a store) or out of it (a retrieve)."""

    TO_SLAB = "to_slab"
    FROM_SLAB = "from_slab"


class InstanceBuffer(abc.ABC):
    """One registered engine buffer, opened in the data plane: ``[2, L, T, D]`` contiguous, or
    paged (``dataplane.paged``). Token positions are the call's logical positions; a contiguous
    buffer's are its own."""

    layout: KVLayout

    def bind(self, block_table: bytes | None) -> int:
        """Take a call's block table; returns the logical token positions the call may use.

        Raises:
            BadRequest: a block table for a contiguous buffer (a paged one requires it).
        """
        if block_table is not None:
            raise BadRequest("a block table was given for a contiguous buffer")
        return self.layout.num_tokens

    def check(self, token_starts: np.ndarray, chunk_size: int) -> None:
        """Refuse chunks whose tokens have no slot (a paged buffer's block table); called before
        any side effect of the call.

        Raises:
            OutOfRange: a chunk's tokens pass the buffer or name a block outside it.
        """

    orders_by_word = False  # registered with an order word (``dataplane.streamword``)
    released = False  # ``release()`` let its waits end: its copies may precede the engine's work

    def release(self) -> None:
        """Let every wait for the engine end (an instance whose lease ran out: its engine is
        presumed gone and may never write its order word); from any thread. On a CUDA buffer no
        call begins from then on, and a store commits nothing its copies queued; a CPU buffer
        has no wait for the engine, so this does nothing there."""

    def check_order(self, order: int | None) -> None:
        """Refuse a call's ``order`` count for a buffer without an order word; called before any
        side effect of the call.

        Raises:
            BadRequest: ``order`` given, and no order word was registered.
        """
        if order is not None and not self.orders_by_word:
            raise BadRequest("the call names an order count, but the instance was registered "
                             "without an order_word")

    def signal(self) -> int | None:
        """Queue on the instance's stream, after the copies queued so far, the write of the next
        count of its ready word (``Registration.ready_word``) and return the count; None without
        a ready word (the caller orders the engine by an event, or waits itself)."""
        return None

    @abc.abstractmethod
    def begin(self, engine_event: bytes | None, order: int | None = None) -> None:
        """Order what follows after the engine's interprocess event and its order word reaching
        ``order`` (CUDA); no-op on CPU."""

    @abc.abstractmethod
    def copy(self, direction: "Direction", token_starts: list[int], chunk_size: int,
             slab_offsets: list[int], layers: tuple[int, int] | None = None) -> None:
        """Enqueue the copy of each chunk ``buffer[:, layers, t:t+chunk_size]`` to (``TO_SLAB``)
        or from (``FROM_SLAB``) its slot at ``slab_offset`` (``[2, L, C, D]`` contiguous), in
        order; ``layers``: ``(first, last)``, every layer when None.

        Raises:
            BadRequest: the backend cannot copy that layer range in that direction.
        """

    def layer_copies(self, direction: "Direction", token_starts: list[int], chunk_size: int,
                     slab_offsets: list[int]) -> "LayerCopies":
        """The copies of one layer-wise call, made group of layers by group (``LayerCopies``):
        what every group of the call shares is prepared once."""
        return LayerCopies(self, direction, token_starts, chunk_size, slab_offsets)

    def turn_k(self, token_starts: list[int], chunk_size: int, turn: Any, cfg: Any,
               first: int, last: int) -> None:
        """Turn K of layers ``[first, last)`` of each chunk in place, after the copies enqueued
        so far (``turn``: a ``dataplane.rotary.Turn`` of the chunks; ``cfg``: the rotary config)."""
        raise BadRequest(f"{type(self).__name__} cannot re-rotate K")

    records_events: bool = False
    """Whether ``record`` takes interprocess events (CUDA buffers)."""

    segments: tuple[tuple[str, Identity], ...] = ()
    """The engine's shm segments this buffer opened, each with the file it was at registration
    (``shm.kvbufs``: what the data plane may remove once the owner is gone)."""

    def record(self, handle: bytes) -> None:
        """Record the interprocess event ``handle`` after every copy enqueued so far (CUDA)."""
        raise BadRequest("a CPU buffer takes no CUDA event")

    def mark(self) -> Any:
        """A marker for every copy enqueued so far (CPU: they are done already)."""
        return None

    def end(self, done_event: bytes | None) -> Any:
        """Record ``done_event`` (CUDA) after every copy enqueued so far; a marker for them."""
        return self.mark()

    def wait(self, marker: Any) -> None:
        """Block until every copy enqueued before ``marker`` completed."""

    def finish(self, done_event: bytes | None) -> None:
        """Record ``done_event`` (CUDA) and return once every copy enqueued so far completed."""
        self.wait(self.end(done_event))

    @abc.abstractmethod
    def close(self) -> None:
        """Release the mapping (the engine's buffer itself is the engine's)."""


class LayerCopies:
    """The chunks of one layer-wise store or retrieve, copied group of layers by group:
    ``copy(first, last)`` enqueues layers ``[first, last)`` of every chunk; ``close()`` after the
    last group. This one calls the buffer's ``copy`` per group; a backend may prepare once what
    the groups share (``dataplane.cuda_paged``)."""

    def __init__(self, buf: InstanceBuffer, direction: "Direction", token_starts: list[int],
                 chunk_size: int, slab_offsets: list[int]) -> None:
        self.buf, self.direction, self.token_starts = buf, direction, token_starts
        self.chunk_size, self.slab_offsets = chunk_size, slab_offsets

    def copy(self, first: int, last: int) -> None:
        self.buf.copy(self.direction, self.token_starts, self.chunk_size, self.slab_offsets,
                      (first, last))

    def close(self) -> None:
        pass


class CopyEngine(abc.ABC):
    """A process-wide backend: maps the slab once, opens instance buffers."""

    backend: Backend

    @abc.abstractmethod
    def open(self, spec: BufferSpec, layout: KVLayout, owner_uid: int,
             order_word: CudaIpcBuffer | None = None,
             ready_word: bool = False) -> InstanceBuffer:
        """Open a registered buffer that ``owner_uid`` (the registering peer) must own, and its
        order word (``dataplane.streamword``) if one was registered, with the ready word after it
        if ``ready_word``.

        Raises:
            BadRequest: the spec is of another backend, names memory that is not the client's
                (docs/security.md), or does not fit the layout; an order word this backend
                cannot use or that is not a whole int32 (two with ``ready_word``) on the
                buffer's GPU.
            BackendError: the buffer cannot be mapped.
        """

    def close(self) -> None:
        """Release process-wide resources (host registration of the slab)."""


__all__ = ["Direction", "InstanceBuffer", "LayerCopies", "CopyEngine"]
