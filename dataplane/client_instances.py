"""The instances a ``BlendClient`` registered: their tokens, their interprocess events, their
leases.

This module owns the client's side of an instance after the registration answered: the token
(the capability every later call carries), the pool of interprocess CUDA events its calls reuse,
and the thread that renews every instance's lease. It does not register or unregister (the
client asks its control for that) nor own the buffers (``dataplane.client_buffers``).

NOTE: an instance being unregistered is "leaving": the lease thread does not warn when its
renewal fails, and it is forgotten (no longer leaving, no longer registered) in one step under
the lock, so that the thread never sees it unregistered yet still held.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from kvblend.dataplane import streamword
from kvblend.dataplane.channel import Channel
from kvblend.dataplane.errors import DataPlaneError
from kvblend.dataplane.messages import RenewLease

log = logging.getLogger("kvblend.client")


@dataclass(frozen=True)
class IpcEvent:
    """An interprocess CUDA event and the handle the data plane opens it by."""

    event: Any
    handle: bytes


@dataclass
class Registered:
    """An instance of this client: its buffer (the first layer of a paged cache), token, layer
    count, free interprocess events, order word (``dataplane.streamword``: its device address,
    its last count, the stream that writes it) and the data plane's ready word after it."""

    kv: torch.Tensor
    token: str
    num_layers: int
    events: list[IpcEvent] = field(default_factory=list)  # free interprocess events
    word: int = 0  # its device address; 0: none
    count: int = 0
    word_stream: int | None = None
    ready: int = 0  # the ready word's device address; 0: none
    allocation: int = 0  # the words' allocation (``streamword.free``)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def order(self, stream: Any) -> int | None:
        """The next count of the order word, its write queued now on ``stream`` (a
        ``torch.cuda.Stream``: after the engine's work queued there). None without a word, or on
        another stream than the one that wrote it first: only one stream's writes keep the
        counts in order. A driver that refuses the write leaves the instance to events."""
        if not self.word:
            return None
        with self.lock:
            if self.word_stream is None:
                self.word_stream = stream.cuda_stream
            elif stream.cuda_stream != self.word_stream:
                return None
            count = (self.count + 1) & streamword.MASK
            try:
                streamword.write(stream.cuda_stream, self.word, count)
            except RuntimeError as exc:
                log.warning("ordering calls by interprocess events from now on: %s", exc)
                self.word = 0
                return None
            self.count = count
        return count

    def wait_ready(self, count: int) -> None:
        """Make the current stream of the buffer's device wait (without blocking this thread)
        until the data plane's stream wrote ``count`` into the ready word."""
        streamword.wait(torch.cuda.current_stream(self.kv.device).cuda_stream, self.ready, count)

    def unblock(self, count: int) -> None:
        """Write ``count`` into the ready word from a stream of our own, and wait for it: the
        data plane that named it is gone, and the engine's streams waiting for it go on."""
        with torch.cuda.device(self.kv.device):
            side = torch.cuda.Stream(self.kv.device)
            try:
                streamword.write(side.cuda_stream, self.ready, count)
            except RuntimeError as exc:
                log.error("could not release the ready word of a lost data plane: %s", exc)
            side.synchronize()

    def take(self) -> IpcEvent:
        """A free event of the pool, or a new one on the buffer's device."""
        try:
            return self.events.pop()
        except IndexError:
            with torch.cuda.device(self.kv.device):  # created on the buffer's device
                ev = torch.cuda.Event(interprocess=True)
                return IpcEvent(ev, bytes(ev.ipc_handle()))


class Instances:
    """The registered instances of one client, by id, and their lease renewal: every third of
    the lease (the first registration's) from a daemon thread, started with the first one.

    Args:
        channel: the data plane's channel (renewals go over it).
        timeout: seconds for each renewal call.
    """

    def __init__(self, channel: Channel, timeout: float) -> None:
        self._channel, self._timeout = channel, timeout
        self._lock = threading.Lock()
        self._held: dict[int, Registered] = {}
        self._leaving: set[int] = set()  # being unregistered: no lease renewal, no warning
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()

    def track(self, iid: int, kv: torch.Tensor, token: str, lease: float,
              num_layers: int, word: int = 0) -> None:
        """Hold a new registration (``word``: its order word, if any, and the ready word after
        it); the first one starts the lease thread."""
        with self._lock:
            self._held[iid] = Registered(kv, token, num_layers, word=word,
                                         ready=word + 4 if word else 0, allocation=word)
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew, args=(lease / 3,),
                                                 name="kvblend-lease", daemon=True)
                self._renewer.start()

    def get(self, iid: int) -> Registered | None:
        with self._lock:
            return self._held.get(iid)

    def token(self, iid: int) -> str:
        """The instance's token ("" for an instance not of this client: the data plane refuses
        it)."""
        reg = self.get(iid)
        return reg.token if reg is not None else ""

    def leave(self, iid: int) -> None:
        """The instance is being unregistered."""
        with self._lock:
            self._leaving.add(iid)

    def stay(self, iid: int) -> None:
        """Its unregistration failed: it is held as before."""
        with self._lock:
            self._leaving.discard(iid)

    def forget(self, iid: int) -> Registered | None:
        """Its unregistration completed: drop it; what it was, if held."""
        with self._lock:
            self._leaving.discard(iid)
            return self._held.pop(iid, None)

    def close(self) -> dict[int, Registered]:
        """Stop renewing; every instance held, which this object forgets."""
        self._stop.set()
        with self._lock:
            held, self._held = self._held, {}
        return held

    def _renew(self, interval: float) -> None:
        """Renew the lease of every registered instance every ``interval`` seconds."""
        while not self._stop.wait(interval):
            with self._lock:
                held = [(iid, reg.token) for iid, reg in self._held.items()]
            for iid, token in held:
                try:
                    self._channel.call(RenewLease(instance_id=iid, token=token), self._timeout)
                except DataPlaneError as exc:  # retried next round; a restart re-opens it
                    with self._lock:
                        gone = iid in self._leaving or iid not in self._held
                    if not gone:  # an instance unregistered meanwhile needs no lease
                        log.warning("could not renew the lease of instance %d: %s", iid, exc)


__all__ = ["Instances", "IpcEvent", "Registered"]
