"""The engine's fused K turn (``engine.turn_kernel``) gives the bits of the step by step torch
turn (``dataplane.rotary.rotate`` on the gathered rows) that ``engine.rotary.KTurn`` used before:
on the GPU (marked ``gpu``) for every dtype, and on the CPU through Triton's interpreter for
float16 and float32 (its bfloat16 rounding is an approximation of the hardware's)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from kvblend.dataplane import rotary
from kvblend.dataplane.registration import RotaryConfig
from kvblend.engine import turn_kernel
from kvblend.engine.rotary import KTurn

CASES = [("neox", 0), ("gptj", 0), ("neox", 32)]  # style, rotary_dim (0: the whole head)


def step_by_step(k: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 heads: int, cfg: RotaryConfig) -> torch.Tensor:
    """What ``KTurn.layer`` did before the kernel: gather, ``rotary.rotate``, scatter."""
    out = k.clone()
    part = out[rows]
    rotary.rotate(part.view(len(rows), heads, -1), cos, sin, cfg)
    out[rows] = part
    return out


def compare(device: str, dtypes: list[torch.dtype]) -> list[str]:
    """Each case turned both ways: the cases whose bits differ, and those the turn left
    unchanged (a turn that did nothing would pass the comparison of a no-op)."""
    bad = []
    g = torch.Generator().manual_seed(7)
    for dtype in dtypes:
        for style, rotary_dim in CASES:
            cfg = RotaryConfig(head_dim=64, rotary_dim=rotary_dim, theta=10000.0, style=style)
            heads, rows_n = 3, 40
            k = torch.randn(rows_n, heads * 64, generator=g).to(dtype).to(device)
            rows = torch.tensor([1, 2, 3, 7, 8, 20, 21, 22, 23, 39], device=device)
            old = np.arange(len(rows)) * 3
            cos, sin = rotary.turn_on(rotary.frequencies(cfg), old, old + 1000, device)
            want = step_by_step(k, rows, cos, sin, heads, cfg)
            got = k.clone()
            assert turn_kernel.available(got)
            turn_kernel.turn_rows(got, rows, cos, sin, heads, 64, cfg.dim, style == "gptj")
            if not torch.equal(got, want):
                bad.append(f"{dtype} {style} {rotary_dim}: "
                           f"{int((got != want).sum())} of {got.numel()} differ")
            if torch.equal(got, k):
                bad.append(f"{dtype} {style} {rotary_dim}: nothing turned")
    return bad


INTERPRETED = textwrap.dedent("""
    import torch
    from tests.engine.test_turn_kernel import compare
    print(compare("cpu", [torch.float16, torch.float32]))
""")


def test_the_kernel_gives_the_torch_turns_bits_in_the_interpreter() -> None:
    pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA torch)")
    out = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


UNBUILDABLE = textwrap.dedent("""
    import logging
    from types import SimpleNamespace
    import torch
    from kvblend.dataplane.registration import RotaryConfig
    from kvblend.engine import turn_kernel
    from kvblend.engine.rotary import KTurn
    from tests.engine.test_turn_kernel import step_by_step
    logging.basicConfig(level=logging.WARNING)
    # the gate opened on a CPU without the interpreter: Triton has no driver here, so the
    # kernel's launch fails as it does on a GPU that Triton cannot build for
    turn_kernel._INTERPRETED = True
    cfg = RotaryConfig(head_dim=64, theta=10000.0)
    kv = torch.randn(2, 2, 40, 3 * 64)
    turn = KTurn(cfg, [SimpleNamespace(old_st=0, old_ed=8, cur_st=5, cur_ed=13)], 2, 3,
                 torch.device("cpu"))
    want = kv.clone()
    for layer in (0, 1):
        want[0, layer] = step_by_step(kv[0, layer], turn.rows, turn.cos, turn.sin, 3, cfg)
    assert turn_kernel.available(kv)
    turn.layer(kv, 0)
    assert not turn_kernel.available(kv)
    turn.layer(kv, 1)
    print(torch.equal(kv, want))
""")


def test_kturn_falls_back_to_the_torch_turn_where_the_kernel_cannot_run() -> None:
    """Triton there but unable to launch the kernel: K is turned step by step (the same bits),
    the failure logged once, and the kernel not tried again."""
    pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA torch)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", UNBUILDABLE], capture_output=True, text=True,
                         env=env, timeout=600, check=True)
    assert out.stdout.strip() == "True", out.stdout + out.stderr[-2000:]
    assert out.stderr.count("the fused K turn cannot run on this device") == 1, out.stderr


@pytest.mark.gpu
def test_the_kernel_gives_the_torch_turns_bits_on_the_gpu() -> None:
    assert compare("cuda", [torch.bfloat16, torch.float16, torch.float32]) == []


@pytest.mark.gpu
def test_kturn_turns_a_buffer_layer_with_the_kernel_as_before() -> None:
    """A buffer ``[2, L, T, D]`` of an 8B model's shape, two matches moved: the layer turned by
    ``KTurn`` equals the step by step turn, and the other layers and V are untouched."""
    from types import SimpleNamespace
    cfg = RotaryConfig(head_dim=128, theta=500000.0, scaling="llama3", factor=8.0)
    kv = torch.randn(2, 3, 600, 8 * 128, device="cuda").to(torch.bfloat16)
    matches = [SimpleNamespace(old_st=0, old_ed=256, cur_st=1, cur_ed=257),
               SimpleNamespace(old_st=0, old_ed=256, cur_st=300, cur_ed=556)]
    turn = KTurn(cfg, matches, 5, 8, torch.device("cuda"))
    want = kv.clone()
    want[0, 1] = step_by_step(kv[0, 1], turn.rows, turn.cos, turn.sin, 8, cfg)
    got = kv.clone()
    turn.layer(got, 1)
    assert torch.equal(got, want)
    assert not torch.equal(got[0, 1], kv[0, 1])
