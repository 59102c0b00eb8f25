"""``BlendClient``: what an engine worker uses to talk to kvblend.

This module owns the engine side: finding the service, creating CPU buffers in shared memory,
sharing CUDA buffers and events by IPC, and turning channel replies into ``Transfer`` results.
Control (register, unregister, lookup) goes through ``dataplane.control``: over HTTP to the API, or
without a URL (``dataplane_address=...``) to the data plane and the shared-memory store directly;
store and retrieve go straight to the data plane over the local channel. Importing this module
loads torch, httpx, msgspec and the channel, never the store's kernels.

Example::

    client = BlendClient("http://127.0.0.1:8780", api_token=None)
    kv = client.cpu_kv_buffer(num_layers=L, num_tokens=T, hidden_dim=D, dtype=torch.float16)
    inst = client.register_kv_cache(kv, model_name="m", world_size=1, worker_id=0)
    client.store_pre_computed(inst, token_ids, offset=0, event=None).wait()
    res = client.lookup(token_ids, model_name="m", world_size=1, cache_salt="")
    client.retrieve(inst, token_ids, res.matches, offset=0, event=None).wait()
    client.unregister(inst); client.close()

Paged caches (``dataplane.paged``: per-layer tensors of a named layout; every call names the
instance's token slots by a block table of int32 block ids)::

    layers = client.cpu_paged_kv_cache(L, num_blocks, block_size, kv_heads, head_dim,
                                       torch.bfloat16, layout="flash_attn")
    inst = client.register_paged_kv_cache(layers, "flash_attn", block_size, kv_heads, head_dim,
                                          model_name="m")
    client.store_pre_computed(inst, token_ids, block_table=[7, 2, 9]).wait()

CUDA ordering: ``event`` is the engine's interprocess ``torch.cuda.Event`` recorded after it wrote
(store) or last read (retrieve) the buffer; the data plane waits for it on the instance's stream
before its first copy. When ``event`` is None for a CUDA buffer, the client records one of the
instance's own interprocess events on the current stream (a small pool per instance: an event is
reused only once the call that carried it completed and was released, so the data plane keeps
it opened).

Instances are capabilities (docs/security.md): registration answers a token that every later
call on the instance carries, and a lease that the client renews from a background thread every
third of the lease while the instance is registered. An engine that dies stops renewing, and the
data plane drops its instances once the lease ran out.

``Transfer.cuda_event`` (CUDA buffers; None otherwise) is an interprocess event of this call
alone, which the data plane records on the instance's stream right after the call's last copy
and before it replies. So once ``wait()`` returned (or ``done()`` is True) it marks exactly the
completion of this call's copies (already complete: ``stream.wait_event(t.cuda_event)`` then
orders the stream after them without stalling it). Before the reply it may not be recorded yet,
and waiting on it then orders after nothing: use ``wait()``. It stays this call's event until
``Transfer.release()`` (or the end of ``with client.retrieve(...) as t:``) gives it back to the
instance's pool for a later call.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvblend.dataplane import paged
from kvblend.dataplane.channel import Channel, Pending
from kvblend.dataplane.control import Control, DirectControl, HttpControl
from kvblend.dataplane.errors import BadRequest, DataPlaneError
from kvblend.dataplane.messages import (ChunkFailure, CudaIpcBuffer, InstanceInfo, InstanceList,
                                        LayersWritten, ListInstances, MatchSpec, PagedBuffer,
                                        PagedLayer, Ping, Pong, Prefetching, PrefetchChunks,
                                        Registration, RenewLease, RotaryConfig, RetrieveChunks,
                                        ShmBuffer, StoreChunks, StoreKind, TransferDone,
                                        UnregisterInstance, WireDType)
from kvblend.shm.hashing import Namespace, as_tokens, chunk_hashes
from kvblend.shm.layout import DType
from kvblend.shm.matches import LookupResult, Match
from kvblend.shm.names import KVBUF_HEX, Names
from kvblend.shm.segment import Segment

_TORCH_DTYPES = {torch.float16: DType.FLOAT16, torch.bfloat16: DType.BFLOAT16,
                 torch.float32: DType.FLOAT32}
log = logging.getLogger("kvblend.client")


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
                 events: "list[_IpcEvent] | None" = None,
                 pool: "list[_IpcEvent] | None" = None,
                 layer_bounds: list[int] | None = None,
                 layer_events: "list[_IpcEvent] | None" = None, device: Any = None,
                 num_layers: int = 0) -> None:
        self._pending = pending
        self.cuda_event = cuda_event
        self._events, self._pool = events, pool  # ours until the call completed
        self._result: TransferResult | None = None
        self._bounds, self._layer_events, self._device = layer_bounds, layer_events, device
        self._num_layers = num_layers
        self._announce: Any = None  # a layer-wise store's LayersWritten sender
        self._announced = 0  # groups announced

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
        # a layer-wise retrieve's last group event follows its last copy (the done event may
        # not be recorded yet when that group is announced)
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
        if self._layer_events:
            group = next(g for g in range(len(self._bounds) - 1) if self._bounds[g + 1] > layer)
            torch.cuda.current_stream(self._device).wait_event(self._layer_events[group].event)
        return list(ready.failed)

    def wait(self, timeout: float | None = None) -> TransferResult:
        """Block until the data plane completed the call.

        Raises:
            Timeout: not completed within ``timeout`` (None forever, 0 at once, > 0 seconds).
            RemoteError: the call was refused (UnknownInstance, OutOfRange, ...).
        """
        if self._result is None:
            done: TransferDone = self._pending.result(timeout)
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


@dataclass(frozen=True)
class _IpcEvent:
    event: Any
    handle: bytes


@dataclass
class _Registered:
    kv: torch.Tensor
    token: str
    num_layers: int
    events: list[_IpcEvent] = field(default_factory=list)  # free interprocess events

    def take(self) -> _IpcEvent:
        try:
            return self.events.pop()
        except IndexError:
            with torch.cuda.device(self.kv.device):  # created on the buffer's device
                ev = torch.cuda.Event(interprocess=True)
                return _IpcEvent(ev, bytes(ev.ipc_handle()))


class BlendClient:
    """A client of one kvblend service.

    Args:
        url: the API's base URL; the data plane's address is read from ``GET /v1/status``.
        api_token: sent as ``Authorization: Bearer`` when set.
        dataplane_address: talk to the data plane directly (no API): register over the channel,
            look up in the shared-memory store of the data plane's prefix.
        store_prefix: the service's shm prefix (default: asked from the data plane).
        timeout: seconds for HTTP requests and control calls.
    """

    def __init__(self, url: str | None = None, api_token: str | None = None, *,
                 dataplane_address: str | None = None, store_prefix: str | None = None,
                 timeout: float = 30.0) -> None:
        if url is None and dataplane_address is None:
            raise ValueError("give the service's url or a dataplane_address")
        self._timeout = timeout
        http = HttpControl(url, api_token, timeout) if url is not None else None
        try:
            address = dataplane_address or http.dataplane_address()  # type: ignore[union-attr]
            self._channel = Channel(address)
        except BaseException:
            if http is not None:
                http.close()
            raise
        pong: Pong = self._channel.call(Ping(), timeout)
        self.chunk_size = pong.chunk_size
        self.prefix = store_prefix or pong.shm_prefix
        self._control: Control = http or DirectControl(self._channel, self.prefix,
                                                       self.chunk_size, timeout)
        self._lock = threading.Lock()
        self._buffers: dict[int, Segment] = {}  # data_ptr -> segment we created
        self._instances: dict[int, _Registered] = {}
        self._leaving: set[int] = set()  # being unregistered: no lease renewal, no warning
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()

    # -- buffers ----------------------------------------------------------------------------

    def cpu_kv_buffer(self, num_layers: int, num_tokens: int, hidden_dim: int,
                      dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """A zeroed ``[2, L, T, D]`` tensor over a new POSIX shm segment (0600), named under the
        service's prefix and unlinked when unregistered or when the client closes."""
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"unsupported dtype {dtype}: use float16, bfloat16 or float32")
        nbytes = 2 * num_layers * num_tokens * hidden_dim * dtype.itemsize
        name = Names(self.prefix).kvbuf(secrets.token_hex(KVBUF_HEX // 2))  # what it admits
        seg = Segment(name, nbytes, create=True)
        kv = torch.frombuffer(seg.buf, dtype=torch.uint8).view(dtype).view(
            2, num_layers, num_tokens, hidden_dim)
        with self._lock:
            self._buffers[kv.data_ptr()] = seg
        return kv

    def cpu_paged_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                           head_dim: int, dtype: torch.dtype = torch.float16,
                           layout: str = "flash_attn") -> list[torch.Tensor]:
        """Zeroed per-layer tensors of a named paged layout (``dataplane.paged``: flash_attn
        ``[2, B, S, H, Dh]``, flashinfer ``[B, 2, S, H, Dh]``, cpu_kt ``[B, H, S, 2*Dh]``) over
        one new POSIX shm segment, unlinked when unregistered or when the client closes."""
        shapes = {"flash_attn": (2, num_blocks, block_size, kv_heads, head_dim),
                  "flashinfer": (num_blocks, 2, block_size, kv_heads, head_dim),
                  "cpu_kt": (num_blocks, kv_heads, block_size, 2 * head_dim)}
        if layout not in shapes:
            raise ValueError(f"no paged layout {layout!r} here: one of {', '.join(shapes)}")
        per = 2 * num_blocks * block_size * kv_heads * head_dim
        whole = self.cpu_kv_buffer(1, 1, num_layers * per // 2, dtype).view(num_layers, per)
        return [whole[layer].view(shapes[layout]) for layer in range(num_layers)]

    def share_cpu_tensor(self, t: torch.Tensor) -> None:
        """Move CPU tensor ``t``'s memory (its whole storage) into a new POSIX shm segment of
        this service, in place (``shm.segment.Segment.adopt``): same address, same bytes, and
        every view of it, the engine's own included, now reads and writes the segment. Then
        ``register_paged_kv_cache`` takes tensors over it without a staging copy: how an engine
        that allocates its own CPU KV cache (vLLM) shares it. When the instance over it is
        unregistered, or the client closes, the memory becomes private again (same bytes) and the
        segment is unlinked: unregister or close before the engine frees that memory.

        Raises:
            BadRequest: a CUDA tensor, or memory already shared by this client.
        """
        if t.is_cuda:
            raise BadRequest("share_cpu_tensor takes CPU tensors; CUDA memory is shared by IPC")
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        with self._lock:
            if any(b <= ptr < b + s.size for b, s in self._buffers.items()):
                raise BadRequest("this memory is shared already")
        name = Names(self.prefix).kvbuf(secrets.token_hex(KVBUF_HEX // 2))
        seg = Segment.adopt(name, ptr, nbytes)
        with self._lock:
            self._buffers[seg.base] = seg

    def _buffer_spec(self, kv: torch.Tensor) -> ShmBuffer | CudaIpcBuffer:
        if kv.is_cuda:
            storage = kv.untyped_storage()
            shared = storage._share_cuda_()  # (device, handle, size, offset in block, ...)
            base_offset = int(shared[3])
            handle = _ipc_mem_handle(bytes(shared[1]), storage.data_ptr() - base_offset)
            uuid_text = str(torch.cuda.get_device_properties(kv.device).uuid)
            return CudaIpcBuffer(handle=handle, offset=base_offset +
                                 kv.storage_offset() * kv.element_size(), device_uuid=uuid_text)
        seg, at = self._segment_of(kv)
        if at:
            raise BadRequest("a CPU buffer must be a whole tensor of cpu_kv_buffer()")
        return ShmBuffer(name=seg.name)

    def _segment_of(self, t: torch.Tensor) -> tuple[Segment, int]:
        """The segment of ours that holds CPU tensor ``t``, and ``t``'s byte offset in it."""
        ptr = t.data_ptr()
        with self._lock:
            for base, seg in self._buffers.items():
                if base <= ptr and ptr + t.numel() * t.element_size() <= base + seg.size:
                    return seg, ptr - base
        raise BadRequest("a CPU buffer must come from cpu_kv_buffer() or cpu_paged_kv_cache() "
                         "(POSIX shared memory)")

    # -- control ----------------------------------------------------------------------------

    def register_kv_cache(self, kv: torch.Tensor, model_name: str, world_size: int = 1,
                          worker_id: int | None = 0, request_id: str | None = None,
                          rotary: RotaryConfig | None = None) -> int:
        """Register an engine buffer ``[2, L, T, D]``; returns the instance id. With ``rotary``
        (the model's rotary config) retrieves turn K to the prompt's positions.

        Raises:
            BadRequest: not 4-D ``[2, ...]`` and contiguous, an unsupported dtype, or a CPU
                tensor not made by ``cpu_kv_buffer``.
            LayoutMismatch: the model's chunks were stored with another layout.
            ValueError: a model name ``shm.hashing.check_label`` refuses.
        """
        if kv.dim() != 4 or kv.shape[0] != 2 or not kv.is_contiguous():
            raise BadRequest(f"the KV buffer must be a contiguous [2, L, T, D] tensor, got "
                             f"{tuple(kv.shape)}")
        if kv.dtype not in _TORCH_DTYPES:
            raise BadRequest(f"unsupported dtype {kv.dtype}")
        _, L, T, D = (int(x) for x in kv.shape)
        spec = self._buffer_spec(kv)
        iid, token, lease = self._control.register(Registration(
            model_name=model_name, world_size=world_size, worker_id=worker_id, num_layers=L,
            num_tokens=T, hidden_dim=D, dtype=WireDType(str(_TORCH_DTYPES[kv.dtype])), buffer=spec,
            rotary=rotary), request_id)
        self._track(iid, kv, token, lease, L)
        return iid

    def register_paged_kv_cache(self, layers: Sequence[torch.Tensor], layout: str,
                                block_size: int, kv_heads: int, head_dim: int, model_name: str,
                                world_size: int = 1, worker_id: int | None = 0,
                                request_id: str | None = None,
                                rotary: RotaryConfig | None = None) -> int:
        """Register a paged cache: one contiguous tensor per layer, all of one named layout
        (``dataplane.paged``) and dtype; returns the instance id. Calls then name its token slots
        by a block table. With ``rotary`` retrieves turn K to the prompt's positions.

        Raises:
            BadRequest: layers of different sizes, dtypes or devices, a layout that does not fit
                them, or CPU tensors not made by ``cpu_paged_kv_cache``.
            LayoutMismatch: the model's chunks were stored with another shard layout or dtype.
            ValueError: a model name ``shm.hashing.check_label`` refuses.
        """
        if not layers:
            raise BadRequest("a paged cache has at least one layer")
        first = layers[0]
        if any(t.numel() != first.numel() or t.dtype != first.dtype or t.device != first.device
               or not t.is_contiguous() for t in layers):
            raise BadRequest("every layer must be a contiguous tensor of one size, dtype, device")
        if first.dtype not in _TORCH_DTYPES:
            raise BadRequest(f"unsupported dtype {first.dtype}")
        per_block = 2 * block_size * kv_heads * head_dim
        if min(block_size, kv_heads, head_dim) < 1 or first.numel() % per_block:
            raise BadRequest(f"a layer of {first.numel()} elements is not whole blocks of "
                             f"2 x {block_size} tokens x {kv_heads} heads x {head_dim}")
        num_blocks = first.numel() // per_block
        try:
            k, v = paged.placements(layout, num_blocks, block_size, kv_heads, head_dim)
        except ValueError as exc:
            raise BadRequest(str(exc)) from exc
        buffers: list[ShmBuffer | CudaIpcBuffer] = []
        refs = []
        for t in layers:  # each allocation or segment once; a layer is an offset in one
            if t.is_cuda:
                ipc = self._buffer_spec(t)
                assert isinstance(ipc, CudaIpcBuffer), "a CUDA tensor is shared by IPC"
                at, buf = ipc.offset, CudaIpcBuffer(handle=ipc.handle, offset=0,
                                                    device_uuid=ipc.device_uuid)
            else:
                seg, at = self._segment_of(t)
                buf = ShmBuffer(name=seg.name)
            if buf not in buffers:
                buffers.append(buf)
            refs.append(PagedLayer(buffers.index(buf), at))
        spec = PagedBuffer(block_size=block_size, num_blocks=num_blocks, kv_heads=kv_heads,
                           head_dim=head_dim, k=k, v=v,
                           layer_bytes=first.numel() * first.element_size(), buffers=buffers,
                           layers=refs)
        iid, token, lease = self._control.register(Registration(
            model_name=model_name, world_size=world_size, worker_id=worker_id,
            num_layers=len(layers), num_tokens=num_blocks * block_size,
            hidden_dim=kv_heads * head_dim, dtype=WireDType(str(_TORCH_DTYPES[first.dtype])),
            buffer=spec, rotary=rotary), request_id)
        self._track(iid, first, token, lease, len(layers))
        return iid

    def _track(self, iid: int, kv: torch.Tensor, token: str, lease: float,
               num_layers: int) -> None:
        with self._lock:
            self._instances[iid] = _Registered(kv, token, num_layers)
            if self._renewer is None:
                self._renewer = threading.Thread(target=self._renew, args=(lease / 3,),
                                                 name="kvblend-lease", daemon=True)
                self._renewer.start()

    def _registered(self, instance_id: int) -> "_Registered | None":
        with self._lock:
            return self._instances.get(instance_id)

    def _token(self, instance_id: int) -> str:
        reg = self._registered(instance_id)
        return reg.token if reg is not None else ""

    def _renew(self, interval: float) -> None:
        """Renew the lease of every registered instance every ``interval`` seconds."""
        while not self._stop.wait(interval):
            with self._lock:
                held = [(iid, reg.token) for iid, reg in self._instances.items()]
            for iid, token in held:
                try:
                    self._channel.call(RenewLease(instance_id=iid, token=token), self._timeout)
                except DataPlaneError as exc:  # retried next round; a restart re-opens it
                    with self._lock:
                        gone = iid in self._leaving or iid not in self._instances
                    if not gone:  # an instance unregistered meanwhile needs no lease
                        log.warning("could not renew the lease of instance %d: %s", iid, exc)

    def unregister(self, instance_id: int) -> None:
        """Unregister after every call sent for the instance completed; unlinks the CPU buffer
        segment if this client created it."""
        with self._lock:
            self._leaving.add(instance_id)
        try:
            self._control.unregister(instance_id, self._token(instance_id))
        except BaseException:
            with self._lock:
                self._leaving.discard(instance_id)
            raise
        with self._lock:
            self._leaving.discard(instance_id)
            reg = self._instances.pop(instance_id, None)
            seg = None
            if reg is not None:  # the segment holding the registered memory, if ours
                ptr = reg.kv.data_ptr()
                base = next((b for b, s in self._buffers.items() if b <= ptr < b + s.size), None)
                seg = self._buffers.pop(base) if base is not None else None
        if seg is not None:
            seg.restore()  # memory shared in place is the engine's again, private
            seg.unlink()

    def list_instances(self) -> list[InstanceInfo]:
        reply: InstanceList = self._channel.call(ListInstances(), self._timeout)
        return reply.instances

    def lookup(self, token_ids: Any, model_name: str, world_size: int = 1,
               cache_salt: str = "", *, standalone_only: bool = False) -> LookupResult:
        """Stored chunks of the namespace found in ``token_ids`` (pins nothing). Each match
        says where its chunk's KV was computed (``old_st``) and how (``origin``:
        ``pre_computed``, ``final``); ``standalone_only`` finds ``pre_computed`` chunks only."""
        return self._control.lookup(_tokens(token_ids), model_name, world_size, cache_salt,
                                    standalone_only)

    # -- transfers --------------------------------------------------------------------------

    def store_pre_computed(self, instance_id: int, token_ids: Any, offset: int = 0,
                           event: Any = None, *, cache_salt: str = "", block_table: Any = None,
                           layer_groups: int = 0, layer_wait_s: float = 30.0,
                           first_position: int = 0, request_id: str | None = None) -> Transfer:
        """Store a document computed on its own from ``offset`` in the buffer; its KV was computed
        at positions from ``first_position`` (1 for a document prefilled behind a BOS token).

        ``block_table`` (paged caches only): the block ids holding logical positions
        ``[0, offset + len(token_ids))``, ``block_size`` positions each.

        ``layer_groups`` > 0: a layer-wise store, sent before the engine has written the layers;
        the engine calls ``Transfer.layers_written(n)`` as its forward writes them, and the data
        plane copies that many groups of layers in order as they are announced (at most
        ``MAX_LAYER_GROUP_MATCHES`` chunks; the call fails when a group is not announced within
        ``layer_wait_s`` seconds)."""
        return self._store_call(StoreKind.PRE_COMPUTED, instance_id, token_ids, offset, event,
                                cache_salt, block_table, layer_groups, layer_wait_s,
                                first_position, request_id)

    def store_final(self, instance_id: int, token_ids: Any, offset: int = 0, event: Any = None,
                    *, cache_salt: str = "", block_table: Any = None, layer_groups: int = 0,
                    layer_wait_s: float = 30.0, first_position: int = 0,
                    request_id: str | None = None) -> Transfer:
        """Store a whole (blended) request so that later requests can reuse it."""
        return self._store_call(StoreKind.FINAL, instance_id, token_ids, offset, event,
                                cache_salt, block_table, layer_groups, layer_wait_s,
                                first_position, request_id)

    def _store_call(self, kind: StoreKind, instance_id: int, token_ids: Any, offset: int,
                    event: Any, cache_salt: str, block_table: Any, layer_groups: int,
                    layer_wait_s: float, first_position: int,
                    request_id: str | None) -> Transfer:
        ev, done, used, pool = self._events(instance_id, event)
        reg = self._registered(instance_id)
        bounds, layer_events = self._layer_groups(reg, layer_groups)
        used = layer_events + used  # the done event stays last
        msg = StoreChunks(instance_id=instance_id, token_ids=_tokens(token_ids).tobytes(),
                          offset=offset, block_table=_block_table(block_table),
                          layer_groups=layer_groups, layer_events=[e.handle for e in layer_events],
                          layer_wait_s=layer_wait_s, first_position=first_position, kind=kind,
                          cache_salt=cache_salt, event=ev, done_event=done,
                          token=self._token(instance_id), request_id=request_id)
        pending = self._channel.submit(msg)
        t = _transfer(pending, reg, used, pool, bounds, layer_events)
        if layer_groups:
            token, channel, call = msg.token, self._channel, pending.call_id
            t._announce = lambda layers: channel.send(LayersWritten(
                instance_id=instance_id, call=call, layers=layers, token=token))
        return t

    @staticmethod
    def _layer_groups(reg: "_Registered | None", layer_groups: int
                      ) -> tuple[list[int] | None, list[_IpcEvent]]:
        """A layer-wise call's group bounds and, on a CUDA buffer, one event per group."""
        if not layer_groups:
            return None, []
        num_layers = reg.num_layers if reg is not None else layer_groups
        bounds = [num_layers * g // layer_groups for g in range(layer_groups + 1)]
        if reg is not None and reg.kv.is_cuda:
            return bounds, [reg.take() for _ in range(layer_groups)]
        return bounds, []

    def retrieve(self, instance_id: int, token_ids: Any, matches: Sequence[Any], offset: int = 0,
                 event: Any = None, *, cache_salt: str = "", block_table: Any = None,
                 layer_groups: int = 0, first_position: int = 0, rotate: bool = True,
                 request_id: str | None = None) -> Transfer:
        """Copy each match's chunk into ``buffer[:, :, offset+cur_st : offset+cur_ed, :]`` (a
        paged cache: into the slots ``block_table`` gives those logical positions).

        ``layer_groups`` > 0: copy the layers in that many groups in order; the engine reads
        layer i after ``Transfer.wait_layer(i)`` while later layers still load (at most
        ``MAX_LAYER_GROUP_MATCHES`` matches).

        On an instance registered with a rotary config, K of each chunk is turned from the
        position it was stored at to ``first_position + cur_st`` (``first_position``: the model's
        position of the prompt's token 0), unless ``rotate`` is False."""
        ev, done, used, pool = self._events(instance_id, event)
        reg = self._registered(instance_id)
        bounds, layer_events = self._layer_groups(reg, layer_groups)
        used = layer_events + used  # the done event stays last
        specs = [MatchSpec(int(m.old_st), int(m.old_ed), int(m.cur_st), int(m.cur_ed),
                           bytes(m.chunk_hash)) for m in matches]
        msg = RetrieveChunks(instance_id=instance_id, token_ids=_tokens(token_ids).tobytes(),
                             matches=specs, offset=offset, block_table=_block_table(block_table),
                             layer_groups=layer_groups,
                             layer_events=[e.handle for e in layer_events],
                             first_position=first_position, rotate=rotate,
                             cache_salt=cache_salt, event=ev,
                             done_event=done, token=self._token(instance_id),
                             request_id=request_id)
        return _transfer(self._channel.submit(msg), reg, used, pool, bounds, layer_events)

    def prefetch(self, instance_id: int, token_ids: Any, matches: Sequence[Any], *,
                 cache_salt: str = "", request_id: str | None = None) -> int:
        """Start fetching the lookup's ``remote`` matches from the remote tier into the local
        store, without waiting (a service without ``--remote`` ignores it); a ``retrieve`` of
        them later waits for those fetches instead of fetching them itself. Call it as soon as
        the lookup answered, so the fetches overlap the engine's other work. Returns how many
        chunks are being fetched."""
        specs = [MatchSpec(int(m.old_st), int(m.old_ed), int(m.cur_st), int(m.cur_ed),
                           bytes(m.chunk_hash)) for m in matches
                 if getattr(m, "location", "remote") == "remote"]
        if not specs:
            return 0
        reply: Prefetching = self._channel.call(PrefetchChunks(
            instance_id=instance_id, token_ids=_tokens(token_ids).tobytes(), matches=specs,
            cache_salt=cache_salt, token=self._token(instance_id), request_id=request_id),
            self._timeout)
        return reply.started

    def _events(self, instance_id: int, event: Any
                ) -> tuple[bytes | None, bytes | None, list[_IpcEvent], list[_IpcEvent] | None]:
        """(engine event handle, done event handle, events this call holds, their pool)."""
        reg = self._registered(instance_id)
        if reg is None or not reg.kv.is_cuda:
            if event is not None:
                raise BadRequest("a CUDA event was given for a CPU buffer (or unknown instance)")
            return None, None, [], None
        done = reg.take()
        if event is None:
            mine = reg.take()
            mine.event.record(torch.cuda.current_stream(reg.kv.device))
            return mine.handle, done.handle, [mine, done], reg.events
        return bytes(event.ipc_handle()), done.handle, [done], reg.events

    # -- plumbing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister this client's instances, close the channel and HTTP client, and unlink
        every CPU buffer this client created."""
        self._stop.set()
        with self._lock:
            segs, self._buffers = list(self._buffers.values()), {}
            held, self._instances = dict(self._instances), {}
        pending = []
        for iid, reg in held.items():  # best effort: an instance left behind expires anyway
            try:
                pending.append(self._channel.submit(UnregisterInstance(instance_id=iid,
                                                                       token=reg.token)))
            except DataPlaneError:
                break
        for p in pending:
            try:
                p.result(self._timeout)
            except DataPlaneError:
                pass
        for seg in segs:
            seg.restore()  # memory shared in place is the engine's again, private
            seg.unlink()
            seg.close()
        self._channel.close()
        self._control.close()

    def __enter__(self) -> "BlendClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _transfer(pending: Pending, reg: _Registered | None, used: list[_IpcEvent],
              pool: list[_IpcEvent] | None, bounds: list[int] | None,
              layer_events: list[_IpcEvent]) -> Transfer:
    """The ``Transfer`` of a store or retrieve just sent; ``used[-1]`` is its done event."""
    return Transfer(pending, used[-1].event if used else None, used, pool, bounds, layer_events,
                    reg.kv.device if reg is not None else None,
                    reg.num_layers if reg is not None else 0)


def _ipc_mem_handle(torch_handle: bytes, base_ptr: int) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` of the allocation at ``base_ptr``.

    torch's own handle string carries a one-byte type prefix (``c``: a cudaMalloc block) in
    recent versions; cupy, when present, asks the runtime directly.
    """
    try:
        import cupy
    except ImportError:
        cupy = None
    if cupy is not None:
        return bytes(cupy.cuda.runtime.ipcGetMemHandle(base_ptr))
    if len(torch_handle) == 65 and torch_handle[:1] == b"c":
        return torch_handle[1:]
    if len(torch_handle) == 64:
        return torch_handle
    raise BadRequest("cannot share this CUDA tensor by cudaIpc (expandable segments?); "
                     "install cupy or allocate the KV buffer with cudaMalloc")


def _block_table(table: Any) -> bytes | None:
    """Block ids as little-endian int32 bytes (None: a contiguous buffer's call)."""
    if table is None:
        return None
    if isinstance(table, torch.Tensor):
        table = table.detach().cpu().numpy()
    ids = np.asarray(table)
    if ids.ndim != 1 or (ids.size and (ids.min() < -1 or ids.max() >= 2**31)):
        raise BadRequest("a block table is a 1-D sequence of int32 block ids (-1: unused)")
    return ids.astype("<i4").tobytes()


def _tokens(token_ids: Any) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    return as_tokens(token_ids)


# the client and what its calls take and give: an engine imports these from here, nothing of
# kvblend.shm (docs/architecture.md)
__all__ = ["BlendClient", "Transfer", "TransferResult", "LookupResult", "Match", "Namespace",
           "chunk_hashes"]
