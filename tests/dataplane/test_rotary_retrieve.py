"""Position-correct retrieve through a real data-plane process, with a random transformers Llama
as the engine: a document's KV prefilled at positions 0.. and stored, retrieved into a prompt at
other positions, equals the KV the model computes for the document at those positions."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaModel

from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.errors import BadRequest
from kvblend.dataplane.messages import ChunkFailure
from kvblend.shm.matches import Match
from kvblend.dataplane.registration import RotaryConfig
from tests.dataplane.conftest import CHUNK, DataPlaneProc

pytestmark = pytest.mark.slow

L, HKV, DH = 2, 2, 16
D, T = HKV * DH, 8 * CHUNK
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
ROTARY = RotaryConfig(head_dim=DH, theta=500000.0, scaling="llama3", factor=8.0,
                      low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192)


@pytest.fixture(scope="module")
def model() -> Iterator[LlamaModel]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=HKV, head_dim=DH,
                      rope_parameters=ROPE, max_position_embeddings=1 << 16)
    yield LlamaModel(cfg).eval()


def prefill(model: LlamaModel, tokens: np.ndarray, first: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[L, len, D]`` of ``tokens`` prefilled alone at positions ``first..``."""
    ids = torch.from_numpy(tokens.astype(np.int64))[None]
    pos = torch.arange(first, first + len(tokens))[None]
    with torch.no_grad():
        cache = model(input_ids=ids, position_ids=pos, use_cache=True).past_key_values
    def flat(x: torch.Tensor) -> torch.Tensor:  # [1, HKV, n, DH] -> [n, HKV * DH]
        return x[0].permute(1, 0, 2).reshape(len(tokens), D)
    return (torch.stack([flat(cache.layers[i].keys) for i in range(L)]),
            torch.stack([flat(cache.layers[i].values) for i in range(L)]))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("first_position,doc_from,stored_at", [
    (0, 0, 0), (30_000, 0, 1), (0, 2 * CHUNK, 0), (7, 0, 1000)])
def test_retrieved_k_is_at_the_prompts_positions(dataplane: DataPlaneProc, model: LlamaModel,
                                                 first_position: int, doc_from: int,
                                                 stored_at: int) -> None:
    rng = np.random.default_rng(first_position + doc_from)
    doc = rng.integers(0, 1000, 4 * CHUNK)
    k_doc, v_doc = prefill(model, doc, stored_at)  # e.g. behind a BOS token: from 1
    # the prompt: 5 other tokens, then the document from token doc_from (the matched chunks'
    # positions move by 5 - doc_from + first_position: up, down by 27, or up by 30,005)
    prompt = np.concatenate([rng.integers(0, 1000, 5), doc[doc_from:]])
    with BlendClient(dataplane_address=dataplane.address) as client:
        src = client.cpu_kv_buffer(L, T, D, torch.float32)
        src[0, :, :len(doc)], src[1, :, :len(doc)] = k_doc, v_doc
        a = client.register_kv_cache(src, model_name="rope", rotary=ROTARY)
        assert client.store_pre_computed(a, doc, first_position=stored_at).wait(timeout=60).ok
        # stored again from other positions: the chunks exist, the first store's positions stay
        assert client.store_pre_computed(a, doc, first_position=stored_at + 9).wait(
            timeout=60).copied == 0
        matches = client.lookup(prompt, "rope").matches
        assert len(matches) == (len(doc) - doc_from) // CHUNK
        dst = client.cpu_kv_buffer(L, T, D, torch.float32)
        b = client.register_kv_cache(dst, model_name="rope", rotary=ROTARY)
        assert client.retrieve(b, prompt, matches, first_position=first_position).wait(
            timeout=60).ok
        # the whole document (its chunks' stored context) at positions that put token doc_from
        # at the prompt's position 5 (a negative start is fine for the model's rotary code)
        n = len(matches) * CHUNK
        want_k = prefill(model, doc, first_position + 5 - doc_from)[0][:, doc_from:doc_from + n]
        got_k, got_v = dst[0, :, 5:5 + n], dst[1, :, 5:5 + n]
        # layer 0's K depends on the token and its position only: as exact as fp32 allows
        assert rel(got_k[0], want_k[0]) <= 1e-5
        # deeper layers: the model's own hidden states move by ~1e-6 with the positions
        assert rel(got_k[1], want_k[1]) <= 1e-4
        assert torch.equal(got_v, v_doc[:, doc_from:doc_from + n])  # V is never touched
        assert rel(k_doc[0, doc_from:doc_from + n], want_k[0]) > 1e-2  # unturned K is far off
        # opting out copies K as stored
        assert client.retrieve(b, prompt, matches, rotate=False).wait(timeout=60).ok
        assert torch.equal(dst[0, :, 5:5 + n], k_doc[:, doc_from:doc_from + n])


def test_an_unturned_retrieve_copies_only_chunks_stored_where_their_match_says(
        dataplane: DataPlaneProc) -> None:
    """An engine that turns K itself (``rotate=False``) turns from each match's ``old_st``: a
    chunk stored from another position is not copied (it would be turned by the wrong angle);
    a retrieve the data plane turns reads the stored position and copies it."""
    doc = np.random.default_rng(4).integers(0, 1000, 3 * CHUNK)
    with BlendClient(dataplane_address=dataplane.address) as client:
        src = client.cpu_kv_buffer(L, T, D, torch.float32)
        src.normal_()
        a = client.register_kv_cache(src, model_name="rope-m", rotary=ROTARY)
        assert client.store_pre_computed(a, doc, first_position=7).wait(timeout=60).ok
        matches = client.lookup(doc, "rope-m").matches
        assert [m.old_st for m in matches] == [7, 7 + CHUNK, 7 + 2 * CHUNK]
        dst = client.cpu_kv_buffer(L, T, D, torch.float32)
        b = client.register_kv_cache(dst, model_name="rope-m", rotary=ROTARY)
        assert client.retrieve(b, doc, matches, rotate=False).wait(timeout=60).ok
        assert torch.equal(dst[:, :, :len(doc)], src[:, :, :len(doc)])
        # the match of chunk 1 says it was computed 3 positions earlier than it was
        said = list(matches)
        said[1] = dataclasses.replace(said[1], old_st=said[1].old_st - 3,
                                      old_ed=said[1].old_ed - 3)
        got = client.retrieve(b, doc, said, rotate=False).wait(timeout=60)
        assert got.failed == [1] and got.reasons == {1: ChunkFailure.MOVED}
        assert client.retrieve(b, doc, said).wait(timeout=60).ok  # turned from where it is


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_paged_cache_turns_layer_by_layer(dataplane: DataPlaneProc, model: LlamaModel) -> None:
    S, B = 8, 64
    doc = np.random.default_rng(9).integers(0, 1000, 3 * CHUNK)
    k_doc, v_doc = prefill(model, doc, 0)
    prompt = np.concatenate([np.arange(3), doc])
    with BlendClient(dataplane_address=dataplane.address) as client:
        src = client.cpu_kv_buffer(L, T, D, torch.float32)
        src[0, :, :len(doc)], src[1, :, :len(doc)] = k_doc, v_doc
        a = client.register_kv_cache(src, model_name="rope-p", rotary=ROTARY)
        assert client.store_pre_computed(a, doc).wait(timeout=60).ok
        layers = client.cpu_paged_kv_cache(L, B, S, HKV, DH, torch.float32, layout="cpu_kt")
        b = client.register_paged_kv_cache(layers, "cpu_kt", S, HKV, DH, model_name="rope-p",
                                           rotary=ROTARY)
        table = np.random.default_rng(10).permutation(B)[:(len(prompt) + 100 + S - 1) // S]
        matches = client.lookup(prompt, "rope-p").matches
        t = client.retrieve(b, prompt, matches, offset=100, block_table=table, layer_groups=L,
                            first_position=40_000)
        want_k, _ = prefill(model, doc, 40_003)
        pos = 100 + 3 + np.arange(len(doc))
        blk, slot = table[pos // S], pos % S
        for layer in range(L):
            assert t.wait_layer(layer, timeout=60) == []
            # cpu_kt: per (block, head) K transposed [DH, S], then V [S, DH]
            kt = layers[layer].reshape(B, HKV, 2 * S * DH)[:, :, :S * DH].reshape(B, HKV, DH, S)
            k = kt[blk, :, :, slot]  # [tokens, heads, DH]
            assert rel(k.reshape(len(doc), D), want_k[layer]) <= (1e-5 if layer == 0 else 1e-4)
        assert t.wait(timeout=60).ok


def test_configs_that_do_not_fit_are_refused(dataplane: DataPlaneProc) -> None:
    with BlendClient(dataplane_address=dataplane.address) as client:
        kv = client.cpu_kv_buffer(L, T, D, torch.float32)
        with pytest.raises(BadRequest, match="exceeds head_dim"):
            client.register_kv_cache(kv, model_name="rope-x",
                                     rotary=RotaryConfig(head_dim=DH, rotary_dim=2 * DH))
        with pytest.raises(BadRequest, match="does not fit the buffer"):
            client.register_kv_cache(kv, model_name="rope-x", rotary=RotaryConfig(head_dim=12))
        b = client.register_kv_cache(kv, model_name="rope-x", rotary=ROTARY)
        far = Match(0, CHUNK, 0, CHUNK, b"\0" * 16)
        with pytest.raises(BadRequest, match="cannot be turned"):
            client.retrieve(b, np.arange(CHUNK), [far], first_position=(1 << 24) - 1).wait(60)
        with pytest.raises(BadRequest, match="passes the largest position"):
            client.store_pre_computed(b, np.arange(CHUNK), first_position=(1 << 24) - 1).wait(60)
