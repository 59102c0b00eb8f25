"""K turned on retrieve equals the model's own K at the new positions, for a model cast to bf16 or
fp16 with ``.to()`` (which also rounds its rotary frequencies), for each rope scaling kvblend
turns, a document moved by 256, 4k and 30k positions; through the reference engine's registration
and a real data plane, on the CPU and (marked ``gpu``) on CUDA."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvblend.dataplane import rotary
from kvblend.dataplane.client import BlendClient
from kvblend.engine.blend import BlendEngine, model_rotary, rotary_config
from kvblend.engine.rotary import KTurn
from tests.harness import remove_prefix
from tests.scalings import SCALINGS
from tests.dataplane.conftest import CHUNK, DataPlaneProc, create_store, start_dataplane

L, HKV, DH, V = 2, 2, 64, 1000
N = 8 * CHUNK  # the document
SHIFTS = (256, 4096, 30_000)
TOLERANCE = {torch.bfloat16: 0.01, torch.float16: 0.002}  # bf16 keeps 8 bits, fp16 11
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module", params=DEVICES)
def device_plane(request: pytest.FixtureRequest) -> Iterator[tuple[str, DataPlaneProc]]:
    prefix = f"kvbt_{uuid.uuid4().hex[:10]}"
    create_store(prefix)
    try:
        dp = start_dataplane(prefix, request.param)
        yield request.param, dp
        assert dp.stop() == 0
    finally:
        remove_prefix(prefix)


def cast_llama(scaling: str, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=HKV, head_dim=DH,
                      rope_parameters=SCALINGS[scaling], max_position_embeddings=1 << 16)
    return LlamaForCausalLM(cfg).to(device).to(dtype).eval()


def own_k(model: LlamaForCausalLM, ids: np.ndarray, first: int) -> torch.Tensor:
    """The model's K ``[L, n, HKV * DH]`` of ``ids`` prefilled alone at positions ``first..``."""
    dev = next(model.parameters()).device
    pos = torch.arange(first, first + len(ids), device=dev)[None]
    with torch.no_grad():
        cache = model.model(input_ids=torch.from_numpy(ids).to(dev)[None], position_ids=pos,
                            use_cache=True).past_key_values
    return torch.stack([cache.layers[i].keys[0].transpose(0, 1).reshape(len(ids), -1)
                        for i in range(L)])


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_retrieved_k_is_the_cast_models_own(device_plane: tuple[str, DataPlaneProc],
                                            scaling: str, dtype: torch.dtype) -> None:
    device, dp = device_plane
    model = cast_llama(scaling, dtype, device)
    doc = np.random.default_rng(7).integers(0, V, N)
    name = f"turn-{scaling}-{str(dtype)[6:]}-{uuid.uuid4().hex[:6]}"
    with BlendClient(dataplane_address=dp.address) as client:
        eng = BlendEngine(model, client, name, num_tokens=N)
        assert eng.precompute(doc).ok  # stored from position 0
        # the same buffer, turned with the exact frequencies of the config: how it was done before
        exact = client.register_kv_cache(eng.kv, model_name=name,
                                         rotary=rotary_config(model.config))
        matches = client.lookup(doc, name).matches
        assert len(matches) == N // CHUNK
        for shift in SHIFTS:
            want = own_k(model, doc, shift)
            assert client.retrieve(eng.inst, doc, matches, first_position=shift).wait(
                timeout=60).ok
            for layer in range(L):
                err = rel_l2(eng.kv[0, layer, :N], want[layer])
                assert err <= TOLERANCE[dtype], (shift, layer, err)
            # the test can tell: K turned with the unrounded frequencies is off (by 4-77 %)
            assert client.retrieve(exact, doc, matches, first_position=shift).wait(timeout=60).ok
            if shift >= 4096:
                assert rel_l2(eng.kv[0, 0, :N], want[0]) > 2 * TOLERANCE[dtype], shift
        client.unregister(exact)
        eng.close()


@pytest.mark.slow
@pytest.mark.parametrize("scaling", list(SCALINGS))
def test_the_engine_turns_k_as_the_data_plane_does(device_plane: tuple[str, DataPlaneProc],
                                                   scaling: str) -> None:
    """``KTurn`` (the engine turning K on its own stream, after an unturned retrieve) gives the
    bytes the data plane's turn gives, for every scaling and shift, on CPU and GPU."""
    device, dp = device_plane
    model = cast_llama(scaling, torch.bfloat16, device)
    doc = np.random.default_rng(8).integers(0, V, N)
    name = f"kturn-{scaling}-{uuid.uuid4().hex[:6]}"
    with BlendClient(dataplane_address=dp.address) as client:
        eng = BlendEngine(model, client, name, num_tokens=N)
        assert eng.precompute(doc, first_position=3).ok
        matches = client.lookup(doc, name).matches
        assert len(matches) == N // CHUNK
        for shift in SHIFTS:
            assert client.retrieve(eng.inst, doc, matches, first_position=shift).wait(
                timeout=60).ok
            by_data_plane = eng.kv[0, :, :N].clone()
            assert client.retrieve(eng.inst, doc, matches, first_position=shift,
                                   rotate=False).wait(timeout=60).ok
            unturned = eng.kv[0, :, :N].clone()
            turn = KTurn(eng.rotary, matches, shift, HKV, eng.device)
            for layer in range(L):
                turn.layer(eng.kv, layer)
            differ = (eng.kv[0, :, :N] != by_data_plane).float().mean().item()
            assert differ <= 1e-3, (shift, differ)  # a last-bit rounding here and there at most
            assert rel_l2(unturned, by_data_plane) > 0.1  # the test can tell a turn from none
        eng.close()


def test_the_registration_carries_the_models_own_frequencies() -> None:
    model = cast_llama("llama3", torch.bfloat16, "cpu")
    cfg = model_rotary(model)
    inv_freq = model.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.bfloat16
    assert cfg.inv_freq == inv_freq.float().tolist()
    # the config's own (float32) frequencies are not those
    assert rotary_config(model.config).inv_freq is None
    exact = torch.from_numpy(rotary.frequencies(rotary_config(model.config)))
    assert torch.allclose(exact, inv_freq.float(), rtol=2 ** -8)
    assert not torch.equal(exact, inv_freq.float())
