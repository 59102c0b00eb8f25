"""The CPU turn kernel against ``dataplane.rotary.rotate`` (itself checked against transformers):
the same bits for bf16 and float32, half-split and interleaved pairs, partial rotary, contiguous
rows and strided (paged, K transposed) ones; only the addressed rows change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvblend.dataplane import cpu_rotary, rotary
from kvblend.dataplane.rotary import RotaryConfig

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


WARM_CHECK = """
import mmap, sys
import numpy as np
from kvblend.dataplane import cpu_rotary
from kvblend.dataplane.cpu import _kernel_turn
import torch
cpu_rotary.warm()
before = len(cpu_rotary.turn_raw.signatures)
# K as the CPU engines of dataplane.cpu view it: a contiguous buffer's layer reshaped [T, 1, H, D],
# and paged layers as ndarrays over an mmap with each layout's strides (flash_attn C-contiguous,
# cpu_kt transposed)
B, S, H, D = 2, 4, 2, 8
cfg = type("Cfg", (), {"dim": D, "style": "neox"})()
cos, sin = torch.ones(1, S, D // 2), torch.zeros(1, S, D // 2)
for raw, name in ((np.uint16, "BFLOAT16"), (np.uint32, "FLOAT32")):
    isz = np.dtype(raw).itemsize
    buf = np.zeros((2, 1, B * S, H * D), raw)
    _kernel_turn([buf[0, 0].reshape(B * S, 1, H, D)], np.arange(S), np.zeros(S, np.int64), cos,
                 sin, cfg, name)
    m = mmap.mmap(-1, 2 * B * S * H * D * isz)
    for strides in ((S * H * D, H * D, D, 1), (H * S * 2 * D, 1, S * 2 * D, S)):
        k = np.ndarray((B, S, H, D), raw, m, 0, strides=tuple(x * isz for x in strides))
        _kernel_turn([k], np.zeros(S, np.int64), np.arange(S), cos, sin, cfg, name)
print(len(cpu_rotary.turn_raw.signatures) - before, before)
"""


@pytest.mark.slow
def test_warm_compiles_every_kind_of_k_the_cpu_engines_pass() -> None:
    """In a fresh interpreter (this one has compiled kernels in other tests): after ``warm``,
    turning K as ``dataplane.cpu`` views it compiles no new signature."""
    import subprocess
    import sys
    from pathlib import Path
    out = subprocess.run([sys.executable, "-c", WARM_CHECK], capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    new, warmed = map(int, out.stdout.split())
    assert (new, warmed) == (0, 4)
