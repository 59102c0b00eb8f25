"""The engine's turn of loaded K, side by side in one run: the step by step torch version
(``KTurn.steps``, where the kernel does not run: gather the chunks' rows, ``dataplane.rotary``'s
turn, scatter) against the fused Triton kernel (``engine.turn_kernel``), for the 32 layers of an
8B model's K (8 KV heads of 128, bf16, llama3 frequencies), prompts of 8k and 16k tokens whose
chunks fill all but the last 256 rows. GPU time by CUDA events, the median of ``--iters``; prints
the ratio.

    python benchmarks/bench_kturn.py [--lengths 8192,16384] [--iters 7]
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from kvblend.dataplane.registration import RotaryConfig
from kvblend.engine import turn_kernel
from kvblend.engine.rotary import KTurn

LAYERS, HEADS, HEAD_DIM, DOC = 32, 8, 128, 1024


def gpu_ms(fn, iters: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up (the kernel compiles here)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="8192,16384")
    p.add_argument("--iters", type=int, default=7)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_kturn.py needs a CUDA GPU")
    cfg = RotaryConfig(head_dim=HEAD_DIM, theta=500000.0, scaling="llama3", factor=8.0)
    print(f"# {torch.cuda.get_device_name()}; {LAYERS} layers of K, {HEADS} x {HEAD_DIM}, bf16; "
          f"GPU ms, median of {args.iters}")
    print(f"{'tokens':>7} {'rows':>6} {'torch ms':>9} {'kernel ms':>10} {'torch / kernel':>15}")
    for n in (int(x) for x in args.lengths.split(",")):
        kv = torch.randn(2, LAYERS, n, HEADS * HEAD_DIM, device="cuda").to(torch.bfloat16)
        matches = [SimpleNamespace(old_st=0, old_ed=DOC, cur_st=1 + j * DOC,
                                   cur_ed=1 + (j + 1) * DOC) for j in range((n - 256) // DOC)]
        turn = KTurn(cfg, matches, 0, HEADS, torch.device("cuda"))

        def steps() -> None:
            for layer in range(LAYERS):
                turn.steps(kv, layer)

        def fused() -> None:
            for layer in range(LAYERS):
                turn_kernel.turn_rows(kv[0, layer], turn.rows, turn.cos, turn.sin, HEADS,
                                      HEAD_DIM, cfg.dim, False)
        torch_ms, kernel_ms = gpu_ms(steps, args.iters), gpu_ms(fused, args.iters)
        print(f"{n:>7} {len(turn.rows):>6} {torch_ms:>9.2f} {kernel_ms:>10.2f} "
              f"{torch_ms / kernel_ms:>15.1f}")


if __name__ == "__main__":
    main()
