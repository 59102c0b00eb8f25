"""K turned in one fused pass on the engine's GPU (``turn_rows``): a Triton kernel that does what
``dataplane.rotary.rotate`` does to the gathered rows, in place in the buffer.

The step by step torch version (gather the chunks' rows, float32 copy, four products, two sums,
concatenation, cast, scatter) moves the rows' bytes about ten times: measured on an H100, 6.5 ms
for the 32 layers of an 8k-token prompt of an 8B model and 14.4 ms at 16k, most of what a blend
then spent over its floor (docs/benchmarks.md). This kernel reads each K row once and writes it
once.

The arithmetic is the torch version's, operation for operation: float32 products and sums each
rounded (no fused multiply-add: ``enable_fp_fusion=False``), the result rounded to the buffer's
dtype to nearest even; so both give the same bits (``tests/engine/test_turn_kernel.py``) and
match the data plane's kernel as before.

Triton comes with torch's CUDA builds; without it (or on a CPU) ``available()`` is False and
``engine.rotary.KTurn`` keeps the torch version. Where Triton is there but cannot build or launch
the kernel (a GPU or driver it does not support), the first call raises ``KernelUnavailable``,
logs why once, and ``available()`` is False for the rest of the process.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of torch: the torch version turns K
    triton = None

BLOCK_ROWS = 8
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
log = logging.getLogger(__name__)
_failed: str | None = None  # why the kernel could not run here (then the torch version turns K)


class KernelUnavailable(RuntimeError):
    """Triton could not build or launch the kernel here; nothing was written."""


def available(kv: torch.Tensor) -> bool:
    """Whether ``turn_rows`` can turn K of ``kv``: Triton, a CUDA tensor (or Triton's CPU
    interpreter, for tests) of a float dtype it writes, and no failure to build or launch the
    kernel so far in this process."""
    return (triton is not None and _failed is None and kv.dtype in DTYPES
            and (kv.is_cuda or _INTERPRETED))


def turn_rows(k: torch.Tensor, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              heads: int, head_dim: int, dim: int, gptj: bool) -> None:
    """Turn rows ``rows`` of ``k`` (``[T, heads * head_dim]``, rows contiguous) in place, on the
    current stream: in each head the first ``dim`` dims, as pairs (``neox``: ``i`` and
    ``i + dim/2``; ``gptj``: ``2i`` and ``2i + 1``) by ``cos``/``sin`` (float32 ``[len(rows),
    dim/2]``).

    Raises:
        ValueError: shapes or strides it does not take.
        KernelUnavailable: Triton could not build or launch the kernel (logged once; from then
            on ``available()`` is False).
    """
    half = dim // 2
    if (k.dim() != 2 or k.stride(1) != 1 or k.shape[1] != heads * head_dim or dim > head_dim
            or dim % 2 or cos.shape != (len(rows), half) or sin.shape != cos.shape
            or not (cos.is_contiguous() and sin.is_contiguous() and rows.is_contiguous())):
        raise ValueError("turn_rows takes K [T, heads * head_dim] with contiguous rows, int64 "
                         "rows and float32 cos/sin [rows, dim/2]")
    if not len(rows):
        return
    grid = (triton.cdiv(len(rows), BLOCK_ROWS),)
    try:
        _turn[grid](k, rows, cos, sin, len(rows), k.stride(0), HEADS=heads, HEAD_DIM=head_dim,
                    HALF=half, GPTJ=gptj, DOWNCAST=k.dtype != torch.float32,
                    BLOCK_ROWS=BLOCK_ROWS, BLOCK_PAIRS=triton.next_power_of_2(heads * half),
                    enable_fp_fusion=False)
    except Exception as exc:  # compiling or launching failed: no row was written
        global _failed
        if _failed is None:
            _failed = f"{type(exc).__name__}: {exc}"
            log.warning("the fused K turn cannot run on this device (%s); K is turned step by "
                        "step in torch from now on", _failed)
        raise KernelUnavailable(_failed) from exc


if triton is not None:
    @triton.jit(do_not_specialize=["n_rows"])
    def _turn(k_ptr, rows_ptr, cos_ptr, sin_ptr, n_rows, row_stride,  # type: ignore[no-untyped-def]
              HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
              GPTJ: tl.constexpr, DOWNCAST: tl.constexpr, BLOCK_ROWS: tl.constexpr,
              BLOCK_PAIRS: tl.constexpr):
        """One program: ``BLOCK_ROWS`` rows, every pair of every head of each."""
        r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        live = r < n_rows
        row = tl.load(rows_ptr + r, mask=live, other=0)
        j = tl.arange(0, BLOCK_PAIRS)
        head = j // HALF
        i = j % HALF
        if GPTJ:
            ia = head * HEAD_DIM + 2 * i
            ib = ia + 1
        else:
            ia = head * HEAD_DIM + i
            ib = ia + HALF
        mask = live[:, None] & (j < HEADS * HALF)[None, :]
        at = k_ptr + row[:, None] * row_stride
        a = tl.load(at + ia[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(at + ib[None, :], mask=mask, other=0.0).to(tl.float32)
        pair = r[:, None] * HALF + i[None, :]
        c = tl.load(cos_ptr + pair, mask=mask, other=0.0)
        s = tl.load(sin_ptr + pair, mask=mask, other=0.0)
        ra = a * c - b * s
        rb = b * c + a * s
        if DOWNCAST:
            ra = ra.to(k_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            rb = rb.to(k_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(at + ia[None, :], ra, mask=mask)
        tl.store(at + ib[None, :], rb, mask=mask)

    from triton.runtime.interpreter import InterpretedFunction
    _INTERPRETED = isinstance(_turn, InterpretedFunction)  # TRITON_INTERPRET=1: on the CPU


__all__ = ["available", "turn_rows", "KernelUnavailable"]
