"""``AsyncBlendClient``: the engine client's surface for asyncio engines.

This module owns the asyncio face of ``dataplane.client.BlendClient`` and nothing else: every call
that may wait (an HTTP request, a data-plane round trip, a transfer's completion, creating and
pre-faulting a shared-memory buffer) runs the sync client's own code on a worker thread
(``asyncio.to_thread``), so an event loop, such as an engine's scheduler, never blocks on kvblend,
and behaviour, checks and errors are exactly the sync client's. Calls that only look at local state
(``Transfer.done``, the chunk size) stay synchronous.

NOTE: CUDA's current stream is per thread. What the sync client does on "the current stream"
(record the engine's event before a call; make the stream wait for copied layers; record a
layer-wise store's group events) therefore happens on the caller's thread: the engine event is
recorded before the call goes to a worker thread, a transfer waits on a worker thread only until
the data plane reached the point, then the sync call, with nothing left to wait for, makes the
caller's stream wait, and ``layers_written`` is a plain call (it records and sends, it never waits).

    async with AsyncBlendClient("http://127.0.0.1:8780") as client:
        matches = (await client.lookup(prompt, "llama")).matches
        t = await client.retrieve(iid, prompt, matches)
        result = await t.wait()
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvblend.dataplane.client import BlendClient, Transfer, TransferResult
from kvblend.dataplane.errors import Timeout
from kvblend.dataplane.messages import InstanceInfo
from kvblend.shm.matches import LookupResult


class AsyncTransfer:
    """A store or retrieve in flight (``dataplane.client.Transfer``), awaited."""

    def __init__(self, transfer: Transfer) -> None:
        self.sync = transfer

    async def wait(self, timeout: float | None = None) -> TransferResult:
        return await asyncio.to_thread(self.sync.wait, timeout)

    async def wait_queued(self, timeout: float | None = None) -> list[int]:
        try:
            return self.sync.wait_queued(0)
        except Timeout:
            await asyncio.to_thread(self.sync._pending.progress,
                                    max(1, self.sync._num_layers), timeout)
            return self.sync.wait_queued(0)

    async def wait_layer(self, layer: int, timeout: float | None = None) -> list[int]:
        try:
            return self.sync.wait_layer(layer, 0)  # also refuses a layer the call lacks
        except Timeout:
            await asyncio.to_thread(self.sync._pending.progress, layer + 1, timeout)
            return self.sync.wait_layer(layer, 0)

    def layers_written(self, layers: int) -> None:
        self.sync.layers_written(layers)

    def done(self) -> bool:
        return self.sync.done()

    def release(self) -> None:
        self.sync.release()


class AsyncBlendClient:
    """``BlendClient`` for asyncio: the same arguments, methods and errors, awaited (module
    docstring). Connect with ``async with`` or ``await connect()``; ``sync`` is the client."""

    def __init__(self, url: str | None = None, api_token: str | None = None,
                 **kwargs: Any) -> None:
        self._args, self._kwargs = (url, api_token), kwargs
        self._sync: BlendClient | None = None

    async def connect(self) -> "AsyncBlendClient":
        if self._sync is None:
            self._sync = await asyncio.to_thread(BlendClient, *self._args, **self._kwargs)
        return self

    @property
    def sync(self) -> BlendClient:
        if self._sync is None:
            raise RuntimeError("not connected: use `async with` or `await connect()` first")
        return self._sync

    @property
    def chunk_size(self) -> int:
        return self.sync.chunk_size

    async def __aenter__(self) -> "AsyncBlendClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._sync is not None:
            await asyncio.to_thread(self._sync.close)

    # -- buffers and instances ----------------------------------------------------------------

    async def cpu_kv_buffer(self, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self.sync.cpu_kv_buffer, *args, **kwargs)

    async def cpu_paged_kv_cache(self, *args: Any, **kwargs: Any) -> list[Any]:
        return await asyncio.to_thread(self.sync.cpu_paged_kv_cache, *args, **kwargs)

    async def share_cpu_tensor(self, t: Any) -> None:
        await asyncio.to_thread(self.sync.share_cpu_tensor, t)

    async def register_kv_cache(self, *args: Any, **kwargs: Any) -> int:
        return await asyncio.to_thread(self.sync.register_kv_cache, *args, **kwargs)

    async def register_paged_kv_cache(self, *args: Any, **kwargs: Any) -> int:
        return await asyncio.to_thread(self.sync.register_paged_kv_cache, *args, **kwargs)

    async def unregister(self, instance_id: int) -> None:
        await asyncio.to_thread(self.sync.unregister, instance_id)

    async def list_instances(self) -> list[InstanceInfo]:
        return await asyncio.to_thread(self.sync.list_instances)

    # -- lookups and transfers ----------------------------------------------------------------

    async def lookup(self, token_ids: Any, model_name: str, world_size: int = 1,
                     cache_salt: str = "", *, standalone_only: bool = False) -> LookupResult:
        return await asyncio.to_thread(self.sync.lookup, token_ids, model_name, world_size,
                                       cache_salt, standalone_only=standalone_only)

    async def store_pre_computed(self, instance_id: int, token_ids: Any, offset: int = 0,
                                 event: Any = None, **kwargs: Any) -> AsyncTransfer:
        event = self._engine_event(instance_id, event)
        return AsyncTransfer(await asyncio.to_thread(
            self.sync.store_pre_computed, instance_id, token_ids, offset, event, **kwargs))

    async def store_final(self, instance_id: int, token_ids: Any, offset: int = 0,
                          event: Any = None, **kwargs: Any) -> AsyncTransfer:
        event = self._engine_event(instance_id, event)
        return AsyncTransfer(await asyncio.to_thread(
            self.sync.store_final, instance_id, token_ids, offset, event, **kwargs))

    async def retrieve(self, instance_id: int, token_ids: Any, matches: Sequence[Any],
                       offset: int = 0, event: Any = None, **kwargs: Any) -> AsyncTransfer:
        event = self._engine_event(instance_id, event)
        return AsyncTransfer(await asyncio.to_thread(
            self.sync.retrieve, instance_id, token_ids, matches, offset, event, **kwargs))

    async def prefetch(self, instance_id: int, token_ids: Any, matches: Sequence[Any],
                       **kwargs: Any) -> int:
        return await asyncio.to_thread(self.sync.prefetch, instance_id, token_ids, matches,
                                       **kwargs)

    def _engine_event(self, instance_id: int, event: Any) -> Any:
        """On a CUDA instance without an event of the caller's: one recorded now on the caller's
        current stream (the sync client would record on the worker thread's)."""
        reg = self.sync._registered(instance_id)
        if event is not None or reg is None or not reg.kv.is_cuda:
            return event
        import torch
        mine = torch.cuda.Event(interprocess=True)
        mine.record(torch.cuda.current_stream(reg.kv.device))
        return mine


__all__ = ["AsyncBlendClient", "AsyncTransfer"]
