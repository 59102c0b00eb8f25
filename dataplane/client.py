"""``BlendClient``: what an engine worker uses to talk to kvblend.

This module owns the engine side's face: finding the service, and each call an engine makes
(buffers, registration, lookup, store, retrieve), built here and handed to the modules behind it.
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
before its first copy. When ``event`` is None for a CUDA buffer (and the client was not made with
``order_words=False``), the client writes the next count of the instance's order word on the
current stream (``dataplane.streamword``: a word of its own on the buffer's GPU, registered with
the buffer, where the driver has stream memory operations; the data plane's stream waits for
that count: on an H100 an empty call ordered so cost 24 us, one ordered by a fresh interprocess
event 298 us, ``benchmarks/bench_callfloor.py --values``). Only the stream that wrote the word
first writes it (its counts stay in order); a call from another stream, or where there is no
word, records one of the instance's own interprocess events instead (a small pool per instance:
an event is reused only once the call that carried it completed and was released, so the data
plane keeps it opened). The word after the order word is the instance's ready word: a
layer-wise retrieve's groups are announced with a count of it that the data plane's stream writes
after their copies, and ``Transfer.wait_layer`` has the current stream wait for that count instead
of for one interprocess event per group.

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

``BlendClient`` is the face of the engine side; behind it, ``dataplane.client_buffers`` holds the
shared-memory segments of CPU buffers and describes a buffer to the data plane,
``dataplane.client_instances`` the registered instances (tokens, event pools, the lease thread),
and ``dataplane.client_transfer`` ``Transfer`` and the events of one call.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from kvblend.dataplane import streamword
from kvblend.dataplane.channel import Channel
from kvblend.dataplane.client_buffers import TORCH_DTYPES, Buffers
from kvblend.dataplane.client_instances import Instances, Registered
from kvblend.dataplane.client_transfer import (Transfer, TransferResult, block_table_bytes,
                                               call_events, match_bytes, tokens)
from kvblend.dataplane.control import Control, DirectControl, HttpControl
from kvblend.dataplane.errors import BadRequest, DataPlaneError
from kvblend.dataplane.messages import (CudaIpcBuffer, InstanceInfo, InstanceList, LayersWritten,
                                        ListInstances, PagedBuffer, Ping, Pong,
                                        Prefetching, PrefetchChunks, Registration,
                                        RetrieveChunks, RotaryConfig, ShmBuffer, StoreChunks,
                                        StoreKind, UnregisterInstance, WireDType)
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.matches import LookupResult, Match

log = logging.getLogger("kvblend.client")


class BlendClient:
    """A client of one kvblend service.

    Args:
        url: the API's base URL; the data plane's address is read from ``GET /v1/status``.
        api_token: sent as ``Authorization: Bearer`` when set.
        dataplane_address: talk to the data plane directly (no API): register over the channel,
            look up in the shared-memory store of the data plane's prefix.
        store_prefix: the service's shm prefix (default: asked from the data plane).
        timeout: seconds for HTTP requests and control calls.
        order_words: register CUDA buffers with an order word and order their calls by it
            (``dataplane.streamword``, where the driver has it); False: by interprocess events.
    """

    def __init__(self, url: str | None = None, api_token: str | None = None, *,
                 dataplane_address: str | None = None, store_prefix: str | None = None,
                 timeout: float = 30.0, order_words: bool = True) -> None:
        if url is None and dataplane_address is None:
            raise ValueError("give the service's url or a dataplane_address")
        self._timeout, self._order_words = timeout, order_words
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
        self._buffers = Buffers(self.prefix)
        self._instances = Instances(self._channel, timeout)
        # a client dropped without close(): its leases stop (the data plane drops the instances
        # when they run out) and its buffers are unlinked (Buffers' own finalizer)
        self._finalizer = weakref.finalize(self, _let_go, self._instances, self._channel,
                                           self._control)

    # -- buffers ----------------------------------------------------------------------------

    def cpu_kv_buffer(self, num_layers: int, num_tokens: int, hidden_dim: int,
                      dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """A zeroed ``[2, L, T, D]`` tensor over a new POSIX shm segment (0600), named under the
        service's prefix and unlinked when unregistered or when the client closes."""
        return self._buffers.cpu_kv_buffer(num_layers, num_tokens, hidden_dim, dtype)

    def cpu_paged_kv_cache(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                           head_dim: int, dtype: torch.dtype = torch.float16,
                           layout: str = "flash_attn") -> list[torch.Tensor]:
        """Zeroed per-layer tensors of a named paged layout (``dataplane.paged``: flash_attn
        ``[2, B, S, H, Dh]``, flashinfer ``[B, 2, S, H, Dh]``, cpu_kt ``[B, H, S, 2*Dh]``) over
        one new POSIX shm segment, unlinked when unregistered or when the client closes."""
        return self._buffers.cpu_paged_kv_cache(num_layers, num_blocks, block_size, kv_heads,
                                                head_dim, dtype, layout)

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
        self._buffers.adopt(t)

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
        if kv.dtype not in TORCH_DTYPES:
            raise BadRequest(f"unsupported dtype {kv.dtype}")
        _, L, T, D = (int(x) for x in kv.shape)
        spec = self._buffers.spec(kv)
        return self._register(_registration(model_name, world_size, worker_id, L, T, D,
                                             kv.dtype, spec, rotary), request_id, kv, L)

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
        spec = self._buffers.paged_spec(layers, layout, block_size, kv_heads, head_dim)
        first = layers[0]
        return self._register(_registration(
            model_name, world_size, worker_id, len(layers), spec.num_blocks * block_size,
            kv_heads * head_dim, first.dtype, spec, rotary), request_id, first, len(layers))

    def _register(self, registration: Registration, request_id: str | None, kv: torch.Tensor,
                  num_layers: int) -> int:
        """Register, with an order word on a CUDA buffer when asked (``dataplane.streamword``,
        where the driver has one); the instance (``kv``: its buffer or first layer) is held from
        then on."""
        word = 0
        if self._order_words and kv.is_cuda and streamword.available():
            try:
                with torch.cuda.device(kv.device):
                    torch.cuda.synchronize()  # the device's context current on this thread
                    word, handle = streamword.allocate(2)  # the order word, the ready word
            except RuntimeError as exc:
                log.warning("no order word: calls are ordered by interprocess events (%s)", exc)
            else:
                uuid = str(torch.cuda.get_device_properties(kv.device).uuid)
                registration = msgspec.structs.replace(registration, order_word=CudaIpcBuffer(
                    handle=handle, offset=0, device_uuid=uuid), ready_word=True)
        try:
            iid, token, lease = self._control.register(registration, request_id)
        except BaseException:
            streamword.free(word)
            raise
        self._instances.track(iid, kv, token, lease, num_layers, word)
        return iid

    def _registered(self, instance_id: int) -> Registered | None:
        return self._instances.get(instance_id)

    def _token(self, instance_id: int) -> str:
        return self._instances.token(instance_id)

    def unregister(self, instance_id: int) -> None:
        """Unregister after every call sent for the instance completed; unlinks the CPU buffer
        segment if this client created it."""
        self._instances.leave(instance_id)
        try:
            self._control.unregister(instance_id, self._token(instance_id))
        except BaseException:
            self._instances.stay(instance_id)
            raise
        reg = self._instances.forget(instance_id)
        if reg is not None:  # the segment holding the registered memory, if ours
            self._buffers.release(reg.kv)
            streamword.free(reg.allocation)  # the data plane closed its mapping of it

    def list_instances(self) -> list[InstanceInfo]:
        reply: InstanceList = self._channel.call(ListInstances(), self._timeout)
        return reply.instances

    def lookup(self, token_ids: Any, model_name: str, world_size: int = 1,
               cache_salt: str = "", *, standalone_only: bool = False) -> LookupResult:
        """Stored chunks of the namespace found in ``token_ids`` (pins nothing). Each match
        says where its chunk's KV was computed (``old_st``) and how (``origin``:
        ``pre_computed``, ``final``); ``standalone_only`` finds ``pre_computed`` chunks only."""
        return self._control.lookup(tokens(token_ids), model_name, world_size, cache_salt,
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
        reg = self._registered(instance_id)
        events = call_events(reg, event, layer_groups, retrieve=False)
        msg = StoreChunks(instance_id=instance_id, token_ids=tokens(token_ids).tobytes(),
                          offset=offset, block_table=block_table_bytes(block_table),
                          layer_groups=layer_groups, layer_events=events.layer_handles,
                          layer_wait_s=layer_wait_s, first_position=first_position, kind=kind,
                          cache_salt=cache_salt, event=events.engine, order=events.order,
                          done_event=events.done, token=self._token(instance_id),
                          request_id=request_id)
        pending = self._channel.submit(msg)
        t = events.transfer(pending, reg)
        if layer_groups:
            token, channel, call = msg.token, self._channel, pending.call_id
            t._announce = lambda layers: channel.send(LayersWritten(
                instance_id=instance_id, call=call, layers=layers, token=token))
        return t

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
        reg = self._registered(instance_id)
        events = call_events(reg, event, layer_groups, retrieve=True)
        msg = RetrieveChunks(instance_id=instance_id, token_ids=tokens(token_ids).tobytes(),
                             matches=match_bytes(matches), offset=offset,
                             block_table=block_table_bytes(block_table),
                             layer_groups=layer_groups, layer_events=events.layer_handles,
                             first_position=first_position, rotate=rotate,
                             cache_salt=cache_salt, event=events.engine, order=events.order,
                             done_event=events.done, token=self._token(instance_id),
                             request_id=request_id)
        return events.transfer(self._channel.submit(msg), reg)

    def prefetch(self, instance_id: int, token_ids: Any, matches: Sequence[Any], *,
                 cache_salt: str = "", request_id: str | None = None) -> int:
        """Start fetching the lookup's ``remote`` matches from the remote tier into the local
        store, without waiting (a service without ``--remote`` ignores it); a ``retrieve`` of
        them later waits for those fetches instead of fetching them itself. Call it as soon as
        the lookup answered, so the fetches overlap the engine's other work. Returns how many
        chunks are being fetched."""
        remote = [m for m in matches if getattr(m, "location", "remote") == "remote"]
        if not remote:
            return 0
        reply: Prefetching = self._channel.call(PrefetchChunks(
            instance_id=instance_id, token_ids=tokens(token_ids).tobytes(),
            matches=match_bytes(remote),
            cache_salt=cache_salt, token=self._token(instance_id), request_id=request_id),
            self._timeout)
        return reply.started

    # -- plumbing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Unregister this client's instances, close the channel and HTTP client, and unlink
        every CPU buffer this client created. A client never closed does the last two when it is
        garbage-collected or the interpreter exits (its instances then expire with their lease,
        and the data plane drops them)."""
        held = self._instances.close()
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
        self._buffers.close()
        self._finalizer()

    def __enter__(self) -> "BlendClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _let_go(instances: Instances, channel: Channel, control: Control) -> None:
    """Stop renewing leases and close the connections (a client closed or collected)."""
    instances.close()
    channel.close()
    control.close()


def _registration(model_name: str, world_size: int, worker_id: int | None, num_layers: int,
                  num_tokens: int, hidden_dim: int, dtype: torch.dtype,
                  buffer: ShmBuffer | CudaIpcBuffer | PagedBuffer,
                  rotary: RotaryConfig | None) -> Registration:
    """The registration of an engine buffer (the one place the client builds it)."""
    return Registration(model_name=model_name, world_size=world_size, worker_id=worker_id,
                        num_layers=num_layers, num_tokens=num_tokens, hidden_dim=hidden_dim,
                        dtype=WireDType(str(TORCH_DTYPES[dtype])), buffer=buffer, rotary=rotary)


# the client and what its calls take and give: an engine imports these from here, nothing of
# kvblend.shm (docs/architecture.md)
__all__ = ["BlendClient", "Transfer", "TransferResult", "LookupResult", "Match", "Namespace",
           "chunk_hashes"]
