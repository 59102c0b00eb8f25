"""A store or retrieve in flight, and the interprocess events it carries.

This module owns what a ``BlendClient`` store or retrieve gives back (``Transfer``, and
``TransferResult`` once it completed) and the CUDA events of one call: the engine's event the data
plane waits for, the call's own done event and, for a layer-wise call, one event per group of
layers; and the conversion of token ids and block tables to their wire bytes. It does not build or
send the calls (``dataplane.client``) nor hold the instances' event pools
(``dataplane.client_instances``).

``Transfer.cuda_event`` (CUDA buffers; None otherwise) is an interprocess event of this call
alone, which the data plane records on the instance's stream right after the call's last copy
and before it replies (``dataplane.client``'s docstring says how to wait on it). It stays this
call's event until ``Transfer.release()`` gives it back to the instance's pool.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvblend.dataplane import streamword
from kvblend.dataplane.channel import Pending
from kvblend.dataplane.client_instances import IpcEvent, Registered
from kvblend.dataplane.errors import BadRequest, DataPlaneUnavailable
from kvblend.dataplane.messages import MATCH_BYTES, ChunkFailure, LayersReady, TransferDone
from kvblend.shm.hashing import DIGEST_BYTES, as_tokens


@dataclass(frozen=True)
class TransferResult:
    """How a store or retrieve ended.

    Attributes:
        ok: every chunk was done.
        num_chunks: chunks the call covered.
        failed: chunk indexes (store) or match indexes (retrieve) not done.
        copied: chunks copied (a store skips chunks already stored).
        nbytes: bytes copied.
        not_indexed: chunk indexes of a store that were stored but that lookups will not find
            (the fingerprint index is full of live entries); ``ok`` does not count them.
        reasons: why each index of ``failed`` was not done.
    """

    ok: bool
    num_chunks: int
    failed: list[int]
    copied: int = 0
    nbytes: int = 0
    not_indexed: list[int] = field(default_factory=list)
    reasons: dict[int, ChunkFailure] = field(default_factory=dict)


class Transfer:
    """A store or retrieve in flight."""

    def __init__(self, pending: Pending, cuda_event: Any = None,
                 events: list[IpcEvent] | None = None,
                 pool: list[IpcEvent] | None = None,
                 layer_bounds: list[int] | None = None,
                 layer_events: list[IpcEvent] | None = None, device: Any = None,
                 num_layers: int = 0, ready_of: Registered | None = None) -> None:
        self._pending = pending
        self.cuda_event = cuda_event
        self._events, self._pool = events, pool  # ours until the call completed
        self._result: TransferResult | None = None
        self._bounds, self._layer_events, self._device = layer_bounds, layer_events, device
        self._num_layers = num_layers
        self._announce: Any = None  # a layer-wise store's LayersWritten sender
        self._announced = 0  # groups announced
        self._ready_of = ready_of  # a layer-wise retrieve's instance, by its ready word
        self._waited: int | None = None  # the highest ready count a stream was made to wait for

    def layers_written(self, layers: int) -> None:
        """For a layer-wise store: layers ``[0, layers)`` of the buffer now hold the call's KV.
        On a CUDA buffer, each group completed by them gets its event recorded on the current
        stream of the buffer's device (after the kernels that wrote it) before it is announced;
        the data plane copies the group once that event completed.

        Raises:
            BadRequest: not a layer-wise store, or ``layers`` past the buffer's.
            DataPlaneUnavailable: the connection broke.
        """
        if self._announce is None or self._bounds is None or not 0 < layers <= self._bounds[-1]:
            raise BadRequest(f"layers_written({layers}) of a call that is not a layer-wise store "
                             "or has fewer layers")
        g = self._announced
        while g < len(self._bounds) - 1 and self._bounds[g + 1] <= layers:
            if self._layer_events:
                self._layer_events[g].event.record(torch.cuda.current_stream(self._device))
            g += 1
        if g > self._announced:
            self._announced = g
            self._announce(self._bounds[g])

    def wait_queued(self, timeout: float | None = None) -> list[int]:
        """Return once the data plane queued every copy of the call, before it commits (store)
        or unpins (retrieve) and replies. On a CPU buffer the copies are done; on a CUDA buffer
        the current stream of the buffer's device was made to wait (without blocking this
        thread) on ``cuda_event``, which the data plane recorded after the last copy. From then
        on, in that stream's order, a store's buffer may be overwritten and a retrieve's read.

        Returns:
            The chunk indexes (store) or match indexes (retrieve) that are not copied.

        Raises:
            Timeout: not queued within ``timeout``.
            RemoteError: the call was refused or failed.
        """
        ready = self._pending.progress(max(1, self._num_layers), timeout)
        if ready is None:  # the call ended first: its result says how
            return self.wait(0).failed
        # a layer-wise retrieve's last group event (or ready count) follows its last copy (the
        # done event may not be recorded yet when that group is announced)
        if not self._wait_ready(ready):
            retrieve_groups = self._layer_events and self._announce is None
            last = self._layer_events[-1].event if retrieve_groups else self.cuda_event
            if last is not None:
                torch.cuda.current_stream(self._device).wait_event(last)
        return list(ready.failed)

    def wait_layer(self, layer: int, timeout: float | None = None) -> list[int]:
        """For a layer-wise retrieve: return once ``layer`` can be read. On a CPU buffer its
        bytes are there; on a CUDA buffer the current stream of the buffer's device was made to
        wait (without blocking this thread) for the copies of its group.

        Returns:
            The match indexes that are not copied (the engine computes those tokens itself).

        Raises:
            BadRequest: not a layer-wise retrieve, or no such layer.
            Timeout: the layer was not ready within ``timeout``.
            RemoteError: the call was refused or failed.
        """
        if self._bounds is None or self._announce is not None or not 0 <= layer < self._bounds[-1]:
            raise BadRequest(f"layer {layer} of a retrieve that is not layer-wise or lacks it")
        ready = self._pending.progress(layer + 1, timeout)
        if ready is None:  # the call ended first: its result says how
            return self.wait(0).failed
        if not self._wait_ready(ready) and self._layer_events:
            group = next(g for g in range(len(self._bounds) - 1) if self._bounds[g + 1] > layer)
            torch.cuda.current_stream(self._device).wait_event(self._layer_events[group].event)
        return list(ready.failed)

    def _wait_ready(self, ready: LayersReady) -> bool:
        """Make the current stream wait for the ready count of a progress frame, if it names
        one (a layer-wise retrieve on an instance with a ready word)."""
        if ready.ready is None or self._ready_of is None:
            return False
        self._ready_of.wait_ready(ready.ready)
        if self._waited is None or streamword.later(ready.ready, self._waited):
            self._waited = ready.ready
        return True

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Block until the data plane completed the call.

        Raises:
            Timeout: not completed within ``timeout`` (None forever, 0 at once, > 0 seconds).
            RemoteError: the call was refused (UnknownInstance, OutOfRange, ...).
        """
        if self._result is None:
            try:
                done: TransferDone = self._pending.result(timeout)
            except DataPlaneUnavailable:
                if self._waited is not None and self._ready_of is not None:
                    self._ready_of.unblock(self._waited)  # no data plane will write it now
                    self._waited = None
                raise
            self._result = TransferResult(not done.failed, done.num_chunks, list(done.failed),
                                          done.copied, done.nbytes, list(done.not_indexed),
                                          dict(zip(done.failed, done.reasons)))
        return self._result

    def done(self) -> bool:
        return self._pending.done()

    def release(self) -> None:
        """Give this call's interprocess events back to the instance for later calls (CUDA
        buffers); ``cuda_event`` is not this call's any more. Only a completed call gives them
        back (the data plane may still open them before); otherwise they are dropped. A
        ``with`` block releases on exit; without a release the events are simply not reused."""
        events, self._events = self._events, None
        if events and self._pool is not None and self._pending.done():
            self._pool.extend(events)
        self.cuda_event = None

    def __enter__(self) -> "Transfer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()



@dataclass
class CallEvents:
    """The interprocess events of one store or retrieve (none on a CPU buffer).

    Attributes:
        engine: the handle of the event the data plane waits for before its first copy.
        order: the count of the instance's order word it waits for instead (written now).
        done: the handle of the event it records after the call's last copy.
        held: the events of the instance's pool that the call holds (its layer events first,
            its done event last).
        pool: the instance's pool, which a released call gives ``held`` back to.
        bounds: a layer-wise call's group bounds (layers ``[bounds[g], bounds[g + 1])``).
        layers: a layer-wise call's event per group (CUDA buffers).
    """

    engine: bytes | None = None
    order: int | None = None
    done: bytes | None = None
    held: list[IpcEvent] = field(default_factory=list)
    pool: list[IpcEvent] | None = None
    bounds: list[int] | None = None
    layers: list[IpcEvent] = field(default_factory=list)

    @property
    def layer_handles(self) -> list[bytes]:
        return [e.handle for e in self.layers]

    def transfer(self, pending: Pending, reg: Registered | None) -> Transfer:
        """The ``Transfer`` of the call just sent with these events."""
        by_word = reg is not None and bool(reg.ready) and self.bounds is not None
        return Transfer(pending, self.held[-1].event if self.held else None, self.held,
                        self.pool, self.bounds, self.layers,
                        reg.kv.device if reg is not None else None,
                        reg.num_layers if reg is not None else 0, reg if by_word else None)


def call_events(reg: Registered | None, event: Any, layer_groups: int,
                retrieve: bool) -> CallEvents:
    """The events of a store or retrieve on ``reg``'s buffer: ``event`` (the engine's, or else
    the next count of the instance's order word written now on the current stream, or else one
    of the pool recorded there), a done event and, with ``layer_groups``, the group bounds and,
    on a CUDA buffer, one event per group (a retrieve's where the instance has no ready word:
    otherwise the data plane names a count of it per group).

    Raises:
        BadRequest: a CUDA event given for a CPU buffer (or an instance not of this client).
    """
    engine, order, done, used, pool = _events(reg, event)
    bounds, layer_events = _layer_groups(reg, layer_groups, retrieve)
    return CallEvents(engine, order, done, layer_events + used, pool, bounds, layer_events)


def _events(reg: Registered | None, event: Any) -> tuple[
        bytes | None, int | None, bytes | None, list[IpcEvent], list[IpcEvent] | None]:
    """(engine event handle, order count, done event handle, events this call holds, their
    pool)."""
    if reg is None or not reg.kv.is_cuda:
        if event is not None:
            raise BadRequest("a CUDA event was given for a CPU buffer (or unknown instance)")
        return None, None, None, [], None
    done = reg.take()
    if event is not None:
        return bytes(event.ipc_handle()), None, done.handle, [done], reg.events
    stream = torch.cuda.current_stream(reg.kv.device)
    order = reg.order(stream)
    if order is not None:
        return None, order, done.handle, [done], reg.events
    mine = reg.take()
    mine.event.record(stream)
    return mine.handle, None, done.handle, [mine, done], reg.events


def _layer_groups(reg: Registered | None, layer_groups: int, retrieve: bool
                  ) -> tuple[list[int] | None, list[IpcEvent]]:
    """A layer-wise call's group bounds and, on a CUDA buffer, one event per group (a store's;
    a retrieve's where the instance has no ready word)."""
    if not layer_groups:
        return None, []
    num_layers = reg.num_layers if reg is not None else layer_groups
    bounds = [num_layers * g // layer_groups for g in range(layer_groups + 1)]
    if reg is not None and reg.kv.is_cuda and not (retrieve and reg.ready):
        return bounds, [reg.take() for _ in range(layer_groups)]
    return bounds, []


_MATCH_ROW = struct.Struct(f"<4q{DIGEST_BYTES}s")  # a row of messages.MATCH_WORDS int64 words
assert _MATCH_ROW.size == MATCH_BYTES


def match_bytes(matches: Sequence[Any]) -> bytes:
    """Lookup matches (``shm.matches.Match`` or anything with its fields) as the wire's packed
    rows (``dataplane.messages.MATCH_WORDS`` int64 words: old_st, old_ed, cur_st, cur_ed and the
    chunk hash's bytes): one bytes object, not an object per match.

    Raises:
        BadRequest: a chunk hash that is not ``DIGEST_BYTES`` bytes long, or a position that is
            not an int64 integer.
    """
    pack, n = _MATCH_ROW.pack, DIGEST_BYTES
    try:  # the row format pads or cuts a hash to its length: those of another length are left out
        rows = [pack(m.old_st, m.old_ed, m.cur_st, m.cur_ed, m.chunk_hash) for m in matches
                if len(m.chunk_hash) == n]
    except struct.error as exc:
        raise BadRequest(f"a match is not four int64 positions and a hash: {exc}") from exc
    if len(rows) != len(matches):
        bad = next(j for j, m in enumerate(matches) if len(m.chunk_hash) != n)
        raise BadRequest(f"match {bad} has a chunk_hash of {len(matches[bad].chunk_hash)} "
                         f"bytes, not {n}")
    return b"".join(rows)


def block_table_bytes(table: Any) -> bytes | None:
    """Block ids as little-endian int32 bytes (None: a contiguous buffer's call)."""
    if table is None:
        return None
    if isinstance(table, torch.Tensor):
        table = table.detach().cpu().numpy()
    ids = np.asarray(table)
    if ids.ndim != 1 or (ids.size and (ids.min() < -1 or ids.max() >= 2**31)):
        raise BadRequest("a block table is a 1-D sequence of int32 block ids (-1: unused)")
    return ids.astype("<i4").tobytes()


def tokens(token_ids: Any) -> np.ndarray:
    """Token ids (a tensor, an array, a sequence) as ``shm.hashing``'s uint32 array."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    return as_tokens(token_ids)


__all__ = ["CallEvents", "Transfer", "TransferResult", "block_table_bytes", "call_events",
           "match_bytes", "tokens"]
