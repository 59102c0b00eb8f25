"""Several calls in flight on one instance, against a real data-plane process: back-to-back calls
all complete, a retrieve sees the stores queued before it, unregistering waits for the calls in
flight, and ``Transfer.wait_queued`` frees a store's buffer before the reply."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.errors import BadRequest
from kvblend.dataplane.instance import MAX_IN_FLIGHT
from kvblend.shm.matches import Match
from kvblend.shm.hashing import Namespace, chunk_hashes
from tests.dataplane.conftest import CHUNK, DataPlaneProc

pytestmark = pytest.mark.slow

L, D = 4, 32


def fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.int16).copy_(torch.randint(-2**15, 2**15, t.shape, generator=g,
                                            dtype=torch.int16))


def matches_of(doc: np.ndarray, model: str) -> list[Match]:
    """The matches a lookup would give once ``doc`` is stored, computed here (no lookup)."""
    hashes = chunk_hashes(Namespace(model, 1, ""), doc, CHUNK)
    return [Match(i * CHUNK, (i + 1) * CHUNK, i * CHUNK, (i + 1) * CHUNK, h)
            for i, h in enumerate(hashes)]


def test_a_retrieve_queued_behind_stores_sees_them(dataplane: DataPlaneProc) -> None:
    rounds, docs_per_round = 6, 2 * MAX_IN_FLIGHT
    rng = np.random.default_rng(5)
    with BlendClient(dataplane_address=dataplane.address) as client:
        src = client.cpu_kv_buffer(L, docs_per_round * CHUNK, D, torch.float16)
        dst = client.cpu_kv_buffer(L, docs_per_round * CHUNK, D, torch.float16)
        a = client.register_kv_cache(src, model_name="pipe")
        b = client.register_kv_cache(dst, model_name="pipe")
        for r in range(rounds):
            fill(src, r)
            docs = [rng.integers(0, 50_000, CHUNK) for _ in range(docs_per_round)]
            # more calls than MAX_IN_FLIGHT, none waited for: each store, then at once a
            # retrieve on the same instance of what it stored (never looked up)
            calls = []
            for i, doc in enumerate(docs):
                calls.append(client.store_pre_computed(a, doc, offset=i * CHUNK))
                calls.append(client.retrieve(a, doc, matches_of(doc, "pipe"), offset=i * CHUNK))
            results = [c.wait(timeout=60) for c in calls]
            assert all(res.ok for res in results), results
            assert [res.copied for res in results[::2]] == [1] * docs_per_round
            # and another instance retrieves all of them, bit-exact
            prompt = np.concatenate(docs)
            got = client.retrieve(b, prompt, [
                Match(0, CHUNK, i * CHUNK, (i + 1) * CHUNK, matches_of(doc, "pipe")[0].chunk_hash)
                for i, doc in enumerate(docs)])
            assert got.wait(timeout=60).copied == docs_per_round
            assert torch.equal(dst.view(torch.int16), src.view(torch.int16))


def test_unregister_answers_after_every_call_in_flight(dataplane: DataPlaneProc) -> None:
    rng = np.random.default_rng(6)
    with BlendClient(dataplane_address=dataplane.address) as client:
        for r in range(3):
            src = client.cpu_kv_buffer(L, 4 * CHUNK, D, torch.float16)
            fill(src, r)
            inst = client.register_kv_cache(src, model_name="pipe-u")
            calls = [client.store_pre_computed(inst, rng.integers(0, 50_000, 4 * CHUNK))
                     for _ in range(2 * MAX_IN_FLIGHT)]
            client.unregister(inst)  # returns on the Unregistered reply
            assert all(c.done() for c in calls)  # their replies came first, on the same stream
            assert all(c.wait(0).ok for c in calls)


def test_a_store_frees_its_buffer_once_queued(dataplane: DataPlaneProc) -> None:
    doc = np.random.default_rng(7).integers(0, 50_000, 3 * CHUNK)
    with BlendClient(dataplane_address=dataplane.address) as client:
        src = client.cpu_kv_buffer(L, 3 * CHUNK, D, torch.float16)
        dst = client.cpu_kv_buffer(L, 3 * CHUNK, D, torch.float16)
        fill(src, 2)
        want = src.clone()
        a = client.register_kv_cache(src, model_name="pipe-q")
        b = client.register_kv_cache(dst, model_name="pipe-q")
        t = client.store_pre_computed(a, doc)
        assert t.wait_queued(timeout=60) == []
        fill(src, 3)  # the engine reuses its buffer before the reply
        assert t.wait(timeout=60).copied == 3
        r = client.retrieve(b, doc, client.lookup(doc, "pipe-q").matches)
        assert r.wait_queued(timeout=60) == []
        assert torch.equal(dst.view(torch.int16), want.view(torch.int16))  # CPU: copied
        assert r.wait(timeout=60).ok
        # a call that ends in an error raises from wait_queued too
        bad = client.retrieve(b, doc, [Match(0, CHUNK, 0, CHUNK + 1, b"x" * 16)])
        with pytest.raises(BadRequest, match="does not span one chunk"):
            bad.wait_queued(timeout=60)
