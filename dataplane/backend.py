"""The copy-engine interface: what the data plane asks of a buffer backend (CPU or CUDA).

This module owns the interface; the implementations live in ``dataplane.cpu`` (POSIX shm
buffers, memcpy) and ``dataplane.cuda`` (CUDA IPC buffers, DMA into host-registered slabs), and
``dataplane.engines`` picks one (it imports them; they import this module, never the reverse).
The store logic (keys, reservations, pins, commit order) lives in ``dataplane.transfer`` and is
the same for both.

Life of one call on an ``InstanceBuffer`` (all on the instance's own worker thread, in order)::

    bind(block_table)          the call's token capacity (a paged buffer: through its block table)
    check(starts, chunk_size)  every chunk's tokens have slots (before any side effect)
    begin(engine_event)        wait (on the instance's stream) for the engine's event, if any
    to_slab_many(...) / from_slab_many(...)  enqueue one copy per chunk (CPU: done at once)
    mark()                     a marker for the copies enqueued so far (any number per call)
    end(done_event)            record the completion event after the last copy; a marker for all
    wait(marker)               block until the copies before that marker completed

NOTE: the data plane commits a reservation (and drops a pin) only after ``wait`` returned for a
marker taken after that chunk's copy, never before. ``finish`` = ``wait(end(done_event))``.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np

from kvblend.dataplane.backends import Backend
from kvblend.dataplane.errors import BadRequest
from kvblend.dataplane.messages import BufferSpec
from kvblend.shm.layout import KVLayout


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

    @abc.abstractmethod
    def begin(self, engine_event: bytes | None) -> None:
        """Order what follows after the engine's interprocess event (CUDA); no-op on CPU."""

    @abc.abstractmethod
    def to_slab(self, token_start: int, chunk_size: int, slab_offset: int) -> None:
        """Copy ``buffer[:, :, token_start:token_start+chunk_size, :]`` to the slab at
        ``slab_offset`` (``[2, L, C, D]`` contiguous)."""

    @abc.abstractmethod
    def from_slab(self, slab_offset: int, chunk_size: int, token_start: int) -> None:
        """The reverse of ``to_slab``."""

    def to_slab_many(self, token_starts: list[int], chunk_size: int,
                     slab_offsets: list[int]) -> None:
        """``to_slab`` for each (token start, slab offset) pair, in order."""
        for t, off in zip(token_starts, slab_offsets):
            self.to_slab(t, chunk_size, off)

    def from_slab_many(self, slab_offsets: list[int], chunk_size: int,
                       token_starts: list[int]) -> None:
        """``from_slab`` for each (slab offset, token start) pair, in order."""
        for off, t in zip(slab_offsets, token_starts):
            self.from_slab(off, chunk_size, t)

    def from_slab_layers(self, slab_offsets: list[int], chunk_size: int, token_starts: list[int],
                         first: int, last: int) -> None:
        """``from_slab_many`` of layers ``[first, last)`` only (a layer-wise retrieve)."""
        raise BadRequest(f"{type(self).__name__} has no layer-wise retrieve")

    def to_slab_layers(self, token_starts: list[int], chunk_size: int, slab_offsets: list[int],
                       first: int, last: int) -> None:
        """``to_slab_many`` of layers ``[first, last)`` only (a layer-wise store)."""
        raise BadRequest(f"{type(self).__name__} has no layer-wise store")

    def layer_copies(self, token_starts: list[int], chunk_size: int, slab_offsets: list[int],
                     to_slab: bool) -> "LayerCopies":
        """The copies of one layer-wise call, made group of layers by group (``LayerCopies``):
        what every group of the call shares is prepared once."""
        return LayerCopies(self, token_starts, chunk_size, slab_offsets, to_slab)

    def turn_k(self, token_starts: list[int], chunk_size: int, turn: Any, cfg: Any,
               first: int, last: int) -> None:
        """Turn K of layers ``[first, last)`` of each chunk in place, after the copies enqueued
        so far (``turn``: a ``dataplane.rotary.Turn`` of the chunks; ``cfg``: the rotary config)."""
        raise BadRequest(f"{type(self).__name__} cannot re-rotate K")

    records_events: bool = False
    """Whether ``record`` takes interprocess events (CUDA buffers)."""

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
    """The chunks of one layer-wise store (``to_slab``) or retrieve, copied group of layers by
    group: ``copy(first, last)`` enqueues layers ``[first, last)`` of every chunk; ``close()``
    after the last group. This one calls ``to_slab_layers`` or ``from_slab_layers`` per group;
    a backend may prepare once what the groups share (``dataplane.cuda_paged``)."""

    def __init__(self, buf: InstanceBuffer, token_starts: list[int], chunk_size: int,
                 slab_offsets: list[int], to_slab: bool) -> None:
        self.buf, self.token_starts, self.chunk_size = buf, token_starts, chunk_size
        self.slab_offsets, self.to_slab = slab_offsets, to_slab

    def copy(self, first: int, last: int) -> None:
        if self.to_slab:
            self.buf.to_slab_layers(self.token_starts, self.chunk_size, self.slab_offsets,
                                    first, last)
        else:
            self.buf.from_slab_layers(self.slab_offsets, self.chunk_size, self.token_starts,
                                      first, last)

    def close(self) -> None:
        pass


class CopyEngine(abc.ABC):
    """A process-wide backend: maps the slab once, opens instance buffers."""

    backend: Backend

    @abc.abstractmethod
    def open(self, spec: BufferSpec, layout: KVLayout, owner_uid: int) -> InstanceBuffer:
        """Open a registered buffer that ``owner_uid`` (the registering peer) must own.

        Raises:
            BadRequest: the spec is of another backend, names memory that is not the client's
                (docs/security.md), or does not fit the layout.
            BackendError: the buffer cannot be mapped.
        """

    def close(self) -> None:
        """Release process-wide resources (host registration of the slab)."""


__all__ = ["InstanceBuffer", "LayerCopies", "CopyEngine"]
