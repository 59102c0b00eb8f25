"""The reference engine's exactness gates, on a tiny random Llama built here and a real data plane:
the layer loop equals the model, a 100 % recompute equals full prefill bit for bit, naive reuse
equals the model run over a cache re-rotated by hand with transformers' own rotary code."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvblend.dataplane.client import BlendClient
from kvblend.engine.blend import (FULL, NAIVE, BlendEngine, Mode, cacheblend, epic, random_blend,
                                  rotary_config)
from tests.harness import remove_prefix
from tests.dataplane.conftest import CHUNK, DataPlaneProc, create_store, start_dataplane

L, HKV, DH, V = 3, 2, 16, 1000
ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def dataplane() -> Iterator[DataPlaneProc]:
    prefix = f"kvbt_{uuid.uuid4().hex[:10]}"
    create_store(prefix)
    try:
        dp = start_dataplane(prefix)
        yield dp
        assert dp.stop() == 0
    finally:
        remove_prefix(prefix)


def tiny_llama(dtype: torch.dtype) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=HKV, head_dim=DH,
                      rope_parameters=ROPE, max_position_embeddings=1 << 16)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def engine(request: pytest.FixtureRequest, dataplane: DataPlaneProc) -> Iterator[BlendEngine]:
    model = tiny_llama(request.param)
    with BlendClient(dataplane_address=dataplane.address) as client:
        eng = BlendEngine(model, client, f"tiny-{uuid.uuid4().hex[:6]}", num_tokens=512)
        yield eng
        eng.close()


def docs_and_prompt(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, V, 2 * CHUNK), rng.integers(0, V, 3 * CHUNK)
    prompt = np.concatenate([rng.integers(0, V, 5), a, rng.integers(0, V, 7), b,
                             rng.integers(0, V, 9)])
    return a, b, prompt


def model_logits(model: LlamaForCausalLM, ids: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids)[None]).logits[0].float()


def test_the_rotary_config_follows_the_model() -> None:
    cfg = rotary_config(tiny_llama(torch.float32).config)
    assert (cfg.head_dim, cfg.dim, cfg.scaling, cfg.theta, cfg.factor) == (DH, DH, "llama3",
                                                                           500000.0, 8.0)


@pytest.mark.slow
def test_the_layer_loop_equals_the_model(engine: BlendEngine) -> None:
    ids = np.random.default_rng(1).integers(0, V, 70)
    got = engine.prefill(ids, FULL).logits
    want = model_logits(engine.model, ids)
    if engine.dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:
        assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


@pytest.mark.slow
def test_recomputing_every_token_equals_full_prefill(engine: BlendEngine) -> None:
    a, b, prompt = docs_and_prompt(2)
    assert engine.precompute(a).ok and engine.precompute(b).ok
    full = engine.prefill(prompt, FULL)
    blended = engine.prefill(prompt, cacheblend(1.0))
    assert blended.hit.sum() == len(a) + len(b)  # the chunks were found and loaded
    assert blended.computed == [len(prompt)] * L
    assert torch.equal(blended.logits[-1], full.logits[-1])  # bit for bit, in the model's dtype
    assert engine.generate(prompt, cacheblend(1.0), 6) == engine.generate(prompt, FULL, 6)


@pytest.mark.slow
@pytest.mark.parametrize("turn_here", [False, True], ids=["dataplane-turns", "engine-turns"])
def test_naive_reuse_equals_a_cache_turned_by_hand(dataplane: DataPlaneProc,
                                                   turn_here: bool) -> None:
    model = tiny_llama(torch.float32)
    rng = np.random.default_rng(3)
    a, b, q = rng.integers(0, V, 2 * CHUNK), rng.integers(0, V, 3 * CHUNK), rng.integers(0, V, 9)
    prompt = np.concatenate([a, b, q])
    with BlendClient(dataplane_address=dataplane.address) as client:
        eng = BlendEngine(model, client, f"tiny-naive-{turn_here}", num_tokens=256,
                          turn_here=turn_here)
        assert eng.precompute(a).ok and eng.precompute(b, first_position=1).ok
        got = eng.prefill(prompt, NAIVE)
        eng.close()
    assert got.computed == [len(q)] * L and got.hit.sum() == len(a) + len(b)
    # by hand: each document prefilled alone where it was stored, K turned with transformers'
    # rotary embedding by the distance to where it sits in the prompt (rotations compose)
    cache = DynamicCache(config=model.config)
    parts = []
    for doc, stored_at, at in ((a, 0, 0), (b, 1, len(a))):
        with torch.no_grad():
            out = model(input_ids=torch.from_numpy(doc)[None],
                        position_ids=torch.arange(stored_at, stored_at + len(doc))[None],
                        use_cache=True)
        shift = torch.full((1, len(doc)), at - stored_at)
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), shift)
        parts.append([(apply_rotary_pos_emb(layer.keys, layer.keys, cos, sin)[0], layer.values)
                      for layer in out.past_key_values.layers])
    for i in range(L):
        cache.update(torch.cat([p[i][0] for p in parts], 2), torch.cat([p[i][1] for p in parts], 2),
                     i)
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(q)[None], cache=cache,
                     position_ids=torch.arange(len(a) + len(b), len(prompt))[None]).logits[0, -1]
    assert float((got.logits[-1] - want).abs().max()) <= 1e-4 * float(want.abs().max())
    unturned = model_logits(model, prompt)[-1]  # and it is not the full prefill's answer
    assert float((got.logits[-1] - unturned).abs().max()) > 1e-3


@pytest.mark.slow
def test_modes_compute_what_they_say(engine: BlendEngine) -> None:
    a, b, prompt = docs_and_prompt(4)
    assert engine.precompute(a).ok and engine.precompute(b).ok
    hits = len(a) + len(b)
    n = len(prompt)
    naive = engine.prefill(prompt, NAIVE)
    assert naive.computed == [n - hits] * L
    blend = engine.prefill(prompt, cacheblend(0.25))
    assert blend.computed == [n, n] + [n - hits + int(np.ceil(0.25 * hits))] * (L - 2)
    first = engine.prefill(prompt, epic(3))
    assert first.computed == [n - hits + 3 * (hits // CHUNK)] * L
    # cacheblend's rows: the non-hit ones and the hit ones whose layer-1 KV (as full prefill
    # computes it) is farthest from the loaded (turned) KV the buffer now holds
    fresh = engine.prefill(prompt, FULL).cache
    hit_rows = np.flatnonzero(blend.hit)
    dist = [float(sum(((c[1][0, :, r].float() - engine.kv[kv, 1, r].view(HKV, DH).float()) ** 2)
                      .sum() for kv, c in enumerate((fresh.k, fresh.v)))) for r in hit_rows]
    top = hit_rows[np.argsort(dist, kind="stable")[::-1][:int(np.ceil(0.25 * hits))]]
    assert sorted(blend.positions.tolist()) == sorted(
        np.flatnonzero(~blend.hit).tolist() + top.tolist())
    drawn = engine.prefill(prompt, random_blend(0.25, seed=1))
    assert drawn.computed == blend.computed
    assert not np.array_equal(drawn.positions, blend.positions)  # other rows than cacheblend's
    assert naive.positions.tolist() == np.flatnonzero(~naive.hit).tolist()
    for p in (naive, blend, first, drawn):
        assert bool(torch.isfinite(p.logits).all())
    # the buffer holds the chunks from the last retrieve: the same blend without kvblend's calls
    spans = [(5, len(a)), (5 + len(a) + 7, len(b))]
    again = engine.prefill(prompt, NAIVE, loaded=spans)
    assert again.hit.tolist() == naive.hit.tolist() and torch.equal(again.logits, naive.logits)
    assert again.times["lookup"] == 0 and naive.times["lookup"] > 0
    with pytest.raises(ValueError, match="does not fit"):
        engine.prefill(np.zeros(513, np.int64), FULL)


@pytest.mark.slow
def test_the_selection_variants_compute_what_they_say(engine: BlendEngine) -> None:
    a, b, prompt = docs_and_prompt(5)
    assert engine.precompute(a).ok and engine.precompute(b).ok
    hits, n = len(a) + len(b), len(prompt)
    keep = int(np.ceil(0.25 * hits))
    # gradual filtering: half the chunk rows after layer 0, a quarter of them after layer 1,
    # among those the first step kept
    wide = engine.prefill(prompt, cacheblend(0.5, check_layer=0))
    gradual = engine.prefill(prompt, cacheblend(0.25, check_layer=0, widen=2.0))
    assert gradual.computed == [n, n - hits + int(np.ceil(0.5 * hits)), n - hits + keep]
    assert set(gradual.positions.tolist()) < set(wide.positions.tolist())
    drawn = Mode("random", ratio=0.25, check_layer=0, widen=2.0, first=3)
    first_step = Mode("random", ratio=0.5, check_layer=0, first=3)
    assert set(engine.prefill(prompt, drawn).positions.tolist()) < set(
        engine.prefill(prompt, first_step).positions.tolist())
    # the first rows of each stored run (a, then b) are recomputed, within the same budget
    sunk = engine.prefill(prompt, cacheblend(0.25, sinks=2))
    runs = [5, 5 + len(a) + 7]
    assert set(runs + [r + 1 for r in runs]) <= set(sunk.positions.tolist())
    assert sunk.computed == engine.prefill(prompt, cacheblend(0.25)).computed
    # the deviation summed over layers 1..1 ranks as layer 1's alone
    assert np.array_equal(engine.prefill(prompt, cacheblend(0.25, accumulate=True)).positions,
                          engine.prefill(prompt, cacheblend(0.25)).positions)
    # V's deviation alone: the top rows by V's distance from the loaded V
    by_v = engine.prefill(prompt, cacheblend(0.25, score="v"))
    fresh = engine.prefill(prompt, FULL).cache
    hit_rows = np.flatnonzero(by_v.hit)
    dist = [float(((fresh.v[1][0, :, r].float() - engine.kv[1, 1, r].view(HKV, DH).float()) ** 2)
                  .sum()) for r in hit_rows]
    top = hit_rows[np.argsort(dist, kind="stable")[::-1][:keep]]
    assert sorted(by_v.positions.tolist()) == sorted(np.flatnonzero(~by_v.hit).tolist() +
                                                     top.tolist())
    with pytest.raises(ValueError, match="score"):
        cacheblend(0.25, score="q")
    with pytest.raises(ValueError, match="widen"):
        cacheblend(0.25, widen=0.5)


@pytest.mark.slow
def test_a_blend_waits_for_a_loaded_layer_only_where_it_reads_it(engine: BlendEngine) -> None:
    """CacheBlend computes every row of the layers up to its check layer, so their loads are
    waited for at the check (the deviation reads them), not before layer 0: the first layers'
    compute hides the retrieve. Naive reuse reads every layer's loaded rows."""
    a, b, prompt = docs_and_prompt(6)
    assert engine.precompute(a).ok and engine.precompute(b).ok
    order: list[tuple[str, int]] = []
    hooks = [layer.register_forward_pre_hook(lambda _m, _a, i=i: order.append(("compute", i)))
             for i, layer in enumerate(engine.model.model.layers)]
    retrieve = engine.client.retrieve

    def spied(*args: object, **kwargs: object) -> object:
        transfer = retrieve(*args, **kwargs)
        wait_layer = transfer.wait_layer

        def waited(layer: int, timeout: float | None = None) -> list[int]:
            order.append(("wait", layer))
            return wait_layer(layer, timeout)
        transfer.wait_layer = waited  # type: ignore[method-assign]
        return transfer

    engine.client.retrieve = spied  # type: ignore[method-assign]
    try:
        blend = engine.prefill(prompt, cacheblend(0.25))
        blended = list(order)
        order.clear()
        naive = engine.prefill(prompt, NAIVE)
    finally:
        del engine.client.retrieve
        for h in hooks:
            h.remove()
    assert blended == [("compute", 0), ("compute", 1), ("wait", 0), ("wait", 1), ("wait", 2),
                       ("compute", 2)]
    assert order == [("wait", 0), ("compute", 0), ("wait", 1), ("compute", 1), ("wait", 2),
                     ("compute", 2)]
    assert blend.hit.sum() == naive.hit.sum() == len(a) + len(b)
    assert blend.computed == [len(prompt)] * 2 + [len(prompt) - blend.hit.sum() +
                                                  int(np.ceil(0.25 * blend.hit.sum()))]
