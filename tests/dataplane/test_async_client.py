"""AsyncBlendClient against a real data-plane process: the sync client's behaviour and errors,
awaited, and an event loop that goes on while a call waits."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from kvblend.dataplane.async_client import AsyncBlendClient
from kvblend.dataplane.errors import BadRequest
from tests.dataplane.conftest import CHUNK, DataPlaneProc

pytestmark = pytest.mark.slow

L, D = 6, 32
T = 4 * CHUNK


def test_store_lookup_retrieve_round_trip(dataplane: DataPlaneProc) -> None:
    doc = np.random.default_rng(7).integers(0, 50_000, 2 * CHUNK)

    async def main() -> None:
        async with AsyncBlendClient(dataplane_address=dataplane.address) as client:
            assert client.chunk_size == CHUNK
            src = await client.cpu_kv_buffer(L, T, D, torch.float16)
            dst = await client.cpu_kv_buffer(L, T, D, torch.float16)
            src.view(torch.int16).copy_(torch.randint(-2**15, 2**15, tuple(src.shape),
                                                      dtype=torch.int16))
            a = await client.register_kv_cache(src, model_name="async")
            b = await client.register_kv_cache(dst, model_name="async")
            assert {i.instance_id for i in await client.list_instances()} >= {a, b}
            stored = await (await client.store_pre_computed(a, doc, offset=CHUNK)).wait()
            assert stored.ok and stored.copied == 2
            matches = (await client.lookup(doc, "async")).matches
            assert [m.cur_st for m in matches] == [0, CHUNK]
            # local matches need no fetch; a data plane without a remote tier fetches nothing
            assert await client.prefetch(b, doc, matches) == 0
            far = [dataclasses.replace(m, location="remote") for m in matches]
            assert await client.prefetch(b, doc, far) == 0
            t = await client.retrieve(b, doc, matches, layer_groups=3)
            assert await t.wait_layer(L - 1, timeout=60) == []
            assert (await t.wait()).copied == 2
            assert torch.equal(dst[:, :, :2 * CHUNK].view(torch.int16),
                               src[:, :, CHUNK:3 * CHUNK].view(torch.int16))
            with pytest.raises(BadRequest):  # the sync client's checks and errors
                await client.register_kv_cache(torch.zeros(3, 3), model_name="async")
            with pytest.raises(BadRequest):
                await t.wait_layer(L, timeout=1)
            await client.unregister(a)

    asyncio.run(main())


def test_the_loop_runs_while_a_call_waits(dataplane: DataPlaneProc) -> None:
    """A layer-wise store completes only once its layers are announced: the announcing coroutine
    must run while another awaits the store (a wait that blocked the loop would leave the groups
    unannounced until the data plane gives up on them)."""
    doc = np.random.default_rng(8).integers(0, 50_000, 2 * CHUNK)

    async def main() -> None:
        async with AsyncBlendClient(dataplane_address=dataplane.address) as client:
            src = await client.cpu_kv_buffer(L, T, D, torch.float16)
            a = await client.register_kv_cache(src, model_name="async-loop")
            t = await client.store_pre_computed(a, doc, layer_groups=3, layer_wait_s=60)
            announced: list[int] = []

            async def forward() -> None:
                for layers in (2, 4, 6):
                    await asyncio.sleep(0)  # yield to the loop, as a forward's steps would
                    t.layers_written(layers)
                    announced.append(layers)

            result, _ = await asyncio.gather(t.wait(timeout=120), forward())
            assert result.ok and result.copied == 2 and announced == [2, 4, 6]

    asyncio.run(main())
