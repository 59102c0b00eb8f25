"""The whole service end to end: ``kvblend serve --backend cpu`` as a subprocess, driven by
``BlendClient`` and httpx exactly as an engine would.

Register a CPU KV buffer, store two documents, look up a prompt holding them at unaligned offsets,
retrieve into another region of the buffer and check every byte, ``store_final`` the prompt, check
status, metrics and events; SIGKILL the data plane and check the supervisor restarts it with the
cache intact; SIGTERM the service, check a clean exit, and check that a new ``kvblend serve`` on the
same prefix still finds the cached chunks.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest
import torch

from kvblend.dataplane.client import BlendClient
from kvblend.shm.lock import pid_alive
from tests.harness import Service, Services

pytestmark = pytest.mark.slow

CHUNK = 256
L, T, D = 2, 4096, 64
MODEL = "e2e-model"


def documents() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    doc_a = rng.integers(0, 2**32, 3 * CHUNK, dtype=np.uint32)
    doc_b = rng.integers(0, 2**32, 2 * CHUNK + 100, dtype=np.uint32)  # a partial tail chunk
    prompt = np.concatenate([rng.integers(0, 50_000, 37, dtype=np.uint32), doc_b,
                             rng.integers(0, 50_000, 50, dtype=np.uint32), doc_a,
                             rng.integers(0, 50_000, 13, dtype=np.uint32)])
    return doc_a, doc_b, prompt


def lookup_binary(svc: Service, prompt: np.ndarray) -> dict[str, Any]:
    r = svc.http.post("/v1/lookup", content=prompt.astype("<u4").tobytes(),
                      params={"model_name": MODEL},
                      headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200, r.text
    return dict(r.json())


def check_retrieve(client: BlendClient, inst: int, kv: torch.Tensor, prompt: np.ndarray,
                   matches: list[Any], chunk_kv: dict[bytes, torch.Tensor], offset: int) -> None:
    """Retrieve into ``offset`` and check each chunk landed at ``offset + cur_st``, nothing else
    changed."""
    kv[:, :, offset:offset + len(prompt)] = -3.0
    before = kv.clone()
    result = client.retrieve(inst, prompt, matches, offset=offset).wait(timeout=60)
    assert result.ok and result.num_chunks == len(matches) and result.failed == []
    expect = before.clone()
    for m in matches:
        expect[:, :, offset + m.cur_st:offset + m.cur_ed] = chunk_kv[m.chunk_hash]
    assert torch.equal(kv, expect)


def check_paged(svc: Service, client: BlendClient, prompt: np.ndarray, matches: list[Any],
                chunks: dict[int, torch.Tensor]) -> None:
    """A paged cache (FlashAttention layout, 16-token blocks, 4 heads) registered over HTTP takes
    the chunks a contiguous buffer stored, through a block table with holes."""
    S, H = 16, 4
    layers = client.cpu_paged_kv_cache(L, 64, S, H, D // H, torch.float16, layout="flash_attn")
    inst = client.register_paged_kv_cache(layers, "flash_attn", S, H, D // H, model_name=MODEL)
    assert svc.http.get(f"/v1/instances/{inst}").json()["kv_layout"]["num_tokens"] == 64 * S
    first, last = matches[0].cur_st // S, (matches[-1].cur_ed - 1) // S
    assert last - first < 64
    table = [-1] * first + [(7 * j) % 64 for j in range(first, last + 1)]  # no block twice
    result = client.retrieve(inst, prompt, matches, block_table=table).wait(timeout=60)
    assert result.ok and result.copied == len(matches)
    for m in matches:
        pos = torch.arange(m.cur_st, m.cur_ed)
        block, slot = torch.tensor(table)[pos // S], pos % S
        for layer in range(L):
            got = layers[layer][:, block, slot].reshape(2, CHUNK, D)
            assert torch.equal(got, chunks[m.old_st // CHUNK][:, layer])
    client.unregister(inst)


def test_service_end_to_end(services: Services) -> None:
    svc = services.start()
    doc_a, doc_b, prompt = documents()
    a_at = 37 + len(doc_b) + 50

    client = BlendClient(svc.url)
    kv = client.cpu_kv_buffer(num_layers=L, num_tokens=T, hidden_dim=D, dtype=torch.float16)
    inst = client.register_kv_cache(kv, model_name=MODEL, world_size=1, worker_id=0)
    listed = svc.http.get(f"/v1/instances/{inst}").json()
    assert listed["kv_layout"] == {"num_layers": L, "num_tokens": T, "hidden_dim": D,
                                   "dtype": "float16", "bytes_per_token": 2 * L * D * 2}
    assert [i["instance_id"] for i in svc.status()["instances"]] == [inst]

    # the engine computed each document on its own (positions from 0) and stores it
    gen = torch.Generator().manual_seed(3)
    kv[:, :, 0:len(doc_a)] = torch.randn(2, L, len(doc_a), D, generator=gen).half()
    kv[:, :, 1024:1024 + len(doc_b)] = torch.randn(2, L, len(doc_b), D, generator=gen).half()
    for doc, off, n in ((doc_a, 0, 3), (doc_b, 1024, 2)):
        res = client.store_pre_computed(inst, doc, offset=off).wait(timeout=60)
        assert res.ok and res.num_chunks == n
    ka = {i: kv[:, :, i * CHUNK:(i + 1) * CHUNK].clone() for i in range(3)}
    kb = {i: kv[:, :, 1024 + i * CHUNK:1024 + (i + 1) * CHUNK].clone() for i in range(2)}

    # look the prompt up: both documents, at unaligned offsets
    res = client.lookup(prompt, model_name=MODEL)
    got = [(m.old_st, m.cur_st) for m in res.matches]
    assert got == [(0, 37), (256, 293)] + [(i * CHUNK, a_at + i * CHUNK) for i in range(3)]
    assert res.hit_tokens == 5 * CHUNK and res.requested_tokens == len(prompt) // CHUNK * CHUNK
    as_binary = lookup_binary(svc, prompt)
    assert [m["chunk_hash"] for m in as_binary["matches"]] == [m.chunk_hash.hex()
                                                               for m in res.matches]
    chunk_kv = {m.chunk_hash: (kb if m.cur_st < a_at else ka)[m.old_st // CHUNK]
                for m in res.matches}
    check_retrieve(client, inst, kv, prompt, res.matches, chunk_kv, offset=2048)
    assert svc.status()["storage"]["num_pinned"] == 0

    # the blended request is stored whole for later requests
    final = client.store_final(inst, prompt, offset=2048).wait(timeout=60)
    assert final.ok and final.num_chunks == len(prompt) // CHUNK
    status = svc.status()
    assert status["storage"]["num_chunks"] == 5 + final.num_chunks
    assert status["fingerprints"]["num_entries"] == 5 + final.num_chunks
    assert status["dataplane"]["alive"] and status["dataplane"]["restarts"] == 0
    m = svc.metrics()
    assert m["kvblend_stores_total"] == 3 and m["kvblend_store_chunks_total"] == 10
    assert m["kvblend_store_bytes_total"] == 10 * CHUNK * 2 * L * D * 2
    assert m["kvblend_retrieves_total"] == 1 and m["kvblend_retrieve_chunks_total"] == 5
    assert m["kvblend_lookups_total"] == 2 and m["kvblend_lookup_hit_tokens_total"] == 10 * CHUNK
    assert m["kvblend_stored_chunks"] == 10 and m["kvblend_pinned_chunks"] == 0
    kinds = [e["kind"] for e in svc.http.get("/v1/events", params={"limit": 1000}).json()["events"]]
    for kind in ("store_start", "store_end", "retrieve_start", "retrieve_end", "lookup_end"):
        assert kind in kinds

    # the data plane dies; the supervisor restarts it; the cache and the instance survive
    old_pid = status["dataplane"]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    restarted = svc.dataplane_after(old_pid)
    assert restarted["restarts"] == 1
    assert svc.metrics()["kvblend_dataplane_restarts_total"] == 1
    res2 = client.lookup(prompt, model_name=MODEL)
    assert res2.hit_tokens >= 5 * CHUNK
    again = client.lookup(np.concatenate([doc_b[:2 * CHUNK], doc_a]), model_name=MODEL)
    assert [mm.chunk_hash for mm in again.matches] == [mm.chunk_hash for mm in res.matches]
    check_retrieve(client, inst, kv, prompt, res.matches, chunk_kv, offset=2048)
    check_paged(svc, client, prompt, [m for m in res.matches if m.cur_st >= a_at], ka)
    client.unregister(inst)
    client.close()

    # SIGTERM: a clean exit, children gone, the cache left in shared memory
    new_pid = restarted["pid"]
    assert svc.stop() == 0
    assert not pid_alive(new_pid)

    svc2 = services.start()  # the same prefix
    status = svc2.status()
    assert status["storage"]["num_chunks"] == 10 and status["dataplane"]["restarts"] == 1
    after = lookup_binary(svc2, prompt)
    cached = lookup_binary(svc2, np.concatenate([doc_b[:2 * CHUNK], doc_a]))
    assert after["hit_tokens"] >= 5 * CHUNK
    assert [mm["chunk_hash"] for mm in cached["matches"]] == [mm.chunk_hash.hex()
                                                              for mm in res.matches]
    assert svc2.stop() == 0
