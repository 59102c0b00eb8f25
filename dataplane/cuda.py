"""The CUDA copy engine: engine buffers shared by CUDA IPC, DMA straight into host-registered slabs.

This module owns the CUDA side of a contiguous buffer: one stream per instance, waiting on the
engine's interprocess event before every store and retrieve, recording the completion event, and
one ``cudaMemcpy2DAsync`` per chunk (two for a range of layers).

A chunk in the engine buffer ``[2, L, T, D]`` is 2*L runs of C*D elements, ``T*D`` elements apart;
in the slab it is contiguous ``[2, L, C, D]``. One strided copy moves it::

    store:    dst = slab + slot      dpitch = C*D*isz   src = buf + t0*D*isz   spitch = T*D*isz
    retrieve: dst = buf + t0*D*isz   dpitch = T*D*isz   src = slab + slot      spitch = C*D*isz
              width = C*D*isz bytes, height = 2*L rows

A retrieve into an instance registered with a rotary config then turns K of its chunks with one
kernel on the same stream (``dataplane.cuda_rotary``), before the call's events are recorded.

NOTE: the engine's event is asked on the host (``cudaEventQuery``) before the stream is made to
wait for it, and one that completed already is not waited for: nothing is left to order after.
An event recorded just before the call is mostly not complete yet and is waited for as before:
on an H100 a freshly recorded interprocess event was seen complete by this process about 0.27 ms
after its record, even on an idle stream, which no ordering by that event avoids
(``benchmarks/bench_callfloor.py``; docs/benchmarks.md, "A call's floor").
An instance registered with an order word (``dataplane.streamword``) skips that: its calls name
a count of the word instead, and the stream waits for the word with ``cuStreamWaitValue32``.
Closing the buffer first writes the highest count any call named into the word from a stream of
its own, so that an engine that died (or never wrote it) cannot hold the stream forever. With a
ready word (the word after it), ``signal`` writes the instance's next count of it on the stream
after a layer-wise retrieve's group, for the engine's stream to wait for.

The engine that registers the slab and opens the buffers is ``dataplane.cuda_engine``'s. cupy and
torch are imported lazily by ``dataplane.engines.make_engine``: CPU machines have no cupy.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any

import cupy
import numpy as np
import torch

from kvblend.dataplane import streamword
from kvblend.dataplane.backend import Direction, InstanceBuffer
from kvblend.dataplane.errors import BackendError, BadRequest
from kvblend.shm.layout import KVLayout

log = logging.getLogger("kvblend.dataplane")
D2H = cupy.cuda.runtime.memcpyDeviceToHost
H2D = cupy.cuda.runtime.memcpyHostToDevice
EVENT_CACHE = 64
MARK_POOL = 256


def normalize_uuid(text: str) -> str:
    return str(text).lower().removeprefix("gpu-").replace("-", "")


class CudaBuffer(InstanceBuffer):
    def __init__(self, device: int, base: int, offset: int, layout: KVLayout,
                 slab_ptr: int) -> None:
        self.layout = layout
        self.device = device
        self._base, self._ptr, self._slab = base, base + offset, slab_ptr
        self._row = layout.hidden_dim * layout.dtype.itemsize
        self._rows = 2 * layout.num_layers
        with torch.cuda.device(device):
            self.stream = torch.cuda.Stream(device)
        self._events: collections.OrderedDict[bytes, Any] = collections.OrderedDict()
        self._marks: list[Any] = []  # completed group events, re-recorded by later calls
        self._turner: Any = None  # dataplane.cuda_rotary.KTurner, made by the first turn
        self._word: tuple[int, int] | None = None  # the order word's (IPC base, address)
        self._named: int | None = None  # the highest count a call named
        self._ready: int | None = None  # the ready word's address (after the order word)
        self._signalled = 0  # the ready word's last count
        self._word_lock = threading.Lock()

    def order_by(self, base: int, address: int, ready: bool = False) -> None:
        """Take the order word at ``address`` (in the IPC allocation opened at ``base``, closed
        with the buffer) and, if ``ready``, the ready word after it, whose counts go on from
        the one it holds (a data plane re-opening a saved instance: its predecessor's counts
        that landed, which the engine's streams may have waited for)."""
        self._word = (base, address)
        if ready:
            self._ready = address + 4
            held = np.zeros(1, np.uint32)
            cupy.cuda.runtime.setDevice(self.device)
            cupy.cuda.runtime.memcpy(held.ctypes.data, self._ready, 4, D2H)
            self._signalled = int(held[0])

    def signal(self) -> int | None:
        if self._ready is None:
            return None
        with self._word_lock:
            count = (self._signalled + 1) & streamword.MASK
            try:
                streamword.write(self.stream.cuda_stream, self._ready, count)
            except RuntimeError as exc:
                raise BackendError(f"cannot write the ready word: {exc}") from exc
            self._signalled = count
        return count

    @property
    def orders_by_word(self) -> bool:  # type: ignore[override]
        return self._word is not None

    def _event(self, handle: bytes) -> Any:
        ev = self._events.get(handle)
        if ev is None:
            try:
                ev = torch.cuda.Event.from_ipc_handle(self.device, handle)
            except RuntimeError as exc:
                raise BadRequest(f"cannot open the interprocess CUDA event: {exc}") from exc
            self._events[handle] = ev
            if len(self._events) > EVENT_CACHE:
                self._events.popitem(last=False)
        return ev

    def begin(self, engine_event: bytes | None, order: int | None = None) -> None:
        if self.released:
            raise BackendError("the instance's lease ran out: it is being dropped")
        cupy.cuda.runtime.setDevice(self.device)
        if engine_event is not None:
            ev = self._event(engine_event)
            if not ev.query():  # completed already: nothing to order after (the NOTE)
                self.stream.wait_event(ev)
        if order is not None:
            assert self._word is not None, "checked by check_order"
            with self._word_lock:  # no wait is queued after release() wrote the word
                if self.released:
                    raise BackendError("the instance's lease ran out: it is being dropped")
                if self._named is None or streamword.later(order, self._named):
                    self._named = order
                try:
                    streamword.wait(self.stream.cuda_stream, self._word[1], order)
                except RuntimeError as exc:
                    raise BadRequest(f"cannot wait for the order word: {exc}") from exc

    def copy(self, direction: Direction, token_starts: list[int], chunk_size: int,
             slab_offsets: list[int], layers: tuple[int, int] | None = None) -> None:
        # K rows of layers [first, last) are adjacent in the slab's [2, L, C, D] (C*D apart) and
        # in the buffer's [2, L, T, D] (T*D apart): one strided copy for K and V of every layer,
        # one for K and one for V of a range of them
        L, T = self.layout.num_layers, self.layout.num_tokens
        first, last = layers or (0, L)
        width, pitch, row = chunk_size * self._row, T * self._row, self._row
        buf, slab, stream = self._ptr, self._slab, self.stream.cuda_stream
        copy = cupy.cuda.runtime.memcpy2DAsync
        parts = [(0, 2 * L)] if (first, last) == (0, L) else [(first, last), (L + first, L + last)]
        for t, off in zip(token_starts, slab_offsets):
            for lo, hi in parts:  # rows [lo, hi) of the chunk's 2*L
                slot, mine = slab + off + lo * width, buf + lo * T * row + t * row
                if direction is Direction.TO_SLAB:
                    copy(slot, width, mine, pitch, width, hi - lo, D2H, stream)
                else:
                    copy(mine, pitch, slot, width, width, hi - lo, H2D, stream)

    def turn_k(self, token_starts: list[int], chunk_size: int, turn: Any, cfg: Any,
               first: int, last: int) -> None:
        # K of layer l is [T, D] at buffer + l*T*D*isz; a token's row t*D*isz into it
        T = self.layout.num_tokens
        tokens = np.asarray(token_starts, np.int64)[:, None] + np.arange(chunk_size)
        layers = self._ptr + np.arange(first, last, dtype=np.int64) * (T * self._row)
        self._turn(layers, tokens.ravel() * self._row, turn, cfg,
                   self.layout.hidden_dim // cfg.head_dim)

    def _turn(self, layers: np.ndarray, rows: np.ndarray, turn: Any, cfg: Any, heads: int) -> None:
        """Turn the K rows ``layers[l] + rows[j]`` on the instance's stream."""
        if self._turner is None:
            from kvblend.dataplane.cuda_rotary import KTurner
            self._turner = KTurner(self.device, self.layout.dtype.name)
        self._turner.turn(layers, rows, turn.old.ravel(), turn.new.ravel(), turn.freqs, heads,
                          cfg.head_dim, cfg.style == "gptj", self.stream)

    records_events = True

    def record(self, handle: bytes) -> None:
        self._event(handle).record(self.stream)

    def mark(self) -> Any:
        ev = self._marks.pop() if self._marks else torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def end(self, done_event: bytes | None) -> Any:
        if done_event is not None:
            self._event(done_event).record(self.stream)
        return self.mark()

    def wait(self, marker: Any) -> None:
        marker.synchronize()  # releases the GIL while it waits
        if len(self._marks) < MARK_POOL:
            self._marks.append(marker)

    def close(self) -> None:
        if self._base:
            self._release_word()
            self.stream.synchronize()
            self._events.clear()
            cupy.cuda.runtime.setDevice(self.device)
            cupy.cuda.runtime.ipcCloseMemHandle(self._base)
            self._base = 0
            self._close_word()

    def release(self) -> None:
        with self._word_lock:
            self.released = True
            self._release_word()

    def _release_word(self) -> None:
        """Let every wait for the order word end: write the highest count named into it from a
        stream of our own (an engine that wrote it already wrote as much or more)."""
        if self._word is not None and self._named is not None:
            cupy.cuda.runtime.setDevice(self.device)
            side = torch.cuda.Stream(self.device)
            try:
                streamword.write(side.cuda_stream, self._word[1], self._named)
            except RuntimeError as exc:  # the stream may then wait for the engine forever
                log.error("could not release an instance's order word: %s", exc)
            side.synchronize()

    def _close_word(self) -> None:
        """Close the order word's IPC allocation (after the stream drained)."""
        if self._word is not None:
            cupy.cuda.runtime.ipcCloseMemHandle(self._word[0])
            self._word = self._ready = None


__all__ = ["CudaBuffer", "normalize_uuid", "D2H", "H2D"]
