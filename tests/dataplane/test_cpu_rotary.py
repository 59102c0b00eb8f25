"""The CPU turn kernel against ``dataplane.rotary.rotate`` (itself checked against transformers):
the same bits for bf16 and float32, half-split and interleaved pairs, partial rotary, contiguous
rows and strided (paged, K transposed) ones; only the addressed rows change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dataplane import cpu_rotary, rotary
from dataplane.rotary import RotaryConfig

H, DH, T = 4, 64, 40


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cfg", [
    RotaryConfig(head_dim=DH, theta=500000.0, scaling="llama3", factor=8.0),
    RotaryConfig(head_dim=DH, style="gptj"),
    RotaryConfig(head_dim=DH, rotary_dim=32, theta=25000.0),
], ids=["llama3", "gptj", "partial"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "paged-transposed"])
def test_the_kernel_equals_the_torch_turn(dtype: torch.dtype, cfg: RotaryConfig,
                                          strided: bool) -> None:
    g = torch.Generator().manual_seed(5)
    k = torch.randn((T, H, DH), generator=g).to(dtype)
    k[3, 1, 5] = float("nan")  # a NaN stays a NaN
    old = np.arange(100, 100 + T)
    new = old + np.where(np.arange(T) % 2, 30_000, -97)  # up and down, per token
    cos, sin = rotary.turn(rotary.frequencies(cfg), old, new)
    want = k.clone()
    rotary.rotate(want, cos, sin, cfg)
    raw = np.uint16 if dtype == torch.bfloat16 else np.uint32
    blocks, slots = 8, 8
    if strided:  # blocks of 8 slots, per (block, head) K stored [DH, slots] (vLLM's CPU layout)
        store = np.zeros((blocks, H, DH, slots), raw)
        view = store.transpose(0, 3, 1, 2)  # [blocks, slots, H, DH], strided
        order = np.random.default_rng(6).permutation(blocks * slots)[:T]
        i0, i1 = order // slots, order % slots
    else:
        store = np.zeros((T + 3, 1, H, DH), raw)
        view = store
        i0, i1 = np.arange(T) + 3, np.zeros(T, np.int64)
    bits = k.view(torch.int16 if raw == np.uint16 else torch.int32).numpy().view(raw)
    view[i0, i1] = bits
    untouched = store.copy()
    cpu_rotary.turn(view, i0, i1, cos.numpy(), sin.numpy(), cfg.dim, cfg.style == "gptj",
                    "BFLOAT16" if dtype == torch.bfloat16 else "FLOAT32")
    got = view[i0, i1]
    nan = want.isnan().numpy()
    assert nan.sum() == 2  # the NaN's pair: both elements
    bits_want = want.view(torch.int16 if raw == np.uint16 else torch.int32).numpy().view(raw)
    assert np.array_equal(got[~nan], bits_want[~nan])
    as_float = torch.from_numpy(got.view(np.int16 if raw == np.uint16 else np.int32)).view(dtype)
    assert bool(as_float.isnan().numpy()[nan].all())  # NaN bits may differ: torch's vector
    #                                                   conversion keeps them, its scalar one not
    mask = np.ones(view.shape[:2], bool)
    mask[i0, i1] = False
    assert np.array_equal(view[mask], untouched.transpose(0, 3, 1, 2)[mask] if strided
                          else untouched[mask])
