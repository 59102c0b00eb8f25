"""AsyncBlendClient on a real GPU: without an event of the caller's, a store and a retrieve
follow the work already queued on the caller's current stream (CUDA's current stream is per
thread, so the client records it on the caller's thread, not on its worker's), and ``wait``
makes the caller's stream wait for the copy."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kvblend.dataplane.async_client import AsyncBlendClient
from tests.dataplane.conftest import CHUNK, DataPlaneProc

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
L, T, D = 4, 1024, 128


def test_calls_follow_the_callers_stream(cuda_dataplane: DataPlaneProc) -> None:
    doc = np.arange(4 * CHUNK) + 11

    async def main() -> None:
        async with AsyncBlendClient(dataplane_address=cuda_dataplane.address) as client:
            kv = torch.zeros((2, L, T, D), dtype=torch.bfloat16, device="cuda")
            dst = torch.zeros_like(kv)
            a = await client.register_kv_cache(kv, model_name="async-gpu")
            b = await client.register_kv_cache(dst, model_name="async-gpu")
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):  # the caller's current stream
                torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the engine writes
                kv.view(torch.int16).fill_(4321)
                # sent at once: only the event recorded on this stream keeps the copy from
                # reading the zeros
                stored = await (await client.store_pre_computed(a, doc)).wait(timeout=60)
                assert stored.ok and stored.copied == 4
                matches = (await client.lookup(doc, "async-gpu")).matches
                torch.cuda._sleep(200_000_000)
                dst.view(torch.int16).fill_(-1)  # the engine's last use of the region
                t = await client.retrieve(b, doc, matches, offset=0)
                assert (await t.wait(timeout=60)).copied == 4
                seen = dst.view(torch.int16)[:, :, :4 * CHUNK].clone()  # in this stream's order
            torch.cuda.synchronize()
            assert bool((seen == 4321).all())
            await client.unregister(a)
            await client.unregister(b)

    asyncio.run(main())
