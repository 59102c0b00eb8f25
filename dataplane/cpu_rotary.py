"""Re-rotating K on CPU buffers in one pass: a numba kernel over the engine's raw K elements.

This module owns the kernel; ``dataplane.cpu`` says where each token's K sits and passes the
turn's float32 ``cos``/``sin`` (``dataplane.rotary.Turn``). The arithmetic is that of
``dataplane.rotary.rotate`` step for step, so the bits are the same (a test checks it): each
element widened to float32, ``a*c - b*s`` and ``b*c + a*s`` as float32 products and sums rounded one
by one (numba without fastmath emits no fused multiply-add), written back in the buffer's dtype
(bf16 rounded to nearest even; a NaN stays a NaN, its bits may differ from torch's).

K is addressed as a 4-D array ``k[i0, i1, head, dim]`` of raw integers (uint16 for bf16, uint32 for
float32; any strides) and token ``t``'s row is ``k[i0[t], i1[t]]``: a contiguous buffer's layer is
``[T, 1, H, Dh]`` with ``i0`` the token, a paged layer ``[blocks, slots, H, Dh]`` with the token's
block and slot. fp16 buffers keep the torch path of ``dataplane.rotary``.

NOTE: one thread, without the GIL (``nogil``), not numba's parallel loops: the data plane turns on
each instance's worker thread, so several turns run at once, and numba's default threading layer
(workqueue, where OpenMP or TBB is missing) aborts the process when parallel kernels are launched
from two threads at a time. Each head's pairs are two 1-D views of its row, widened into one
float32 scratch per call (read and written through integer views of it), turned, and rounded back;
loops over 1-D views, one per step, run faster than indexing a 2-D row per element did
(docs/benchmarks.md).
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import numpy as np
from numba import njit


@njit(nogil=True, cache=True)
def turn_raw(k, i0, i1, cos, sin, d, gptj, bf16):  # pragma: no cover (compiled)
    """Turn the first ``d`` dims of every head of token ``t``'s K row ``k[i0[t], i1[t]]`` by
    ``cos[t]``/``sin[t]`` (float32 ``[n, d/2]``), in place. ``bf16``: the raw elements are bf16
    (else float32)."""
    n, heads, half = i0.shape[0], k.shape[2], d // 2
    a_u, b_u = np.empty(half, np.uint32), np.empty(half, np.uint32)
    ra, rb = np.empty(half, np.float32), np.empty(half, np.float32)
    a, b, ra_u, rb_u = a_u.view(np.float32), b_u.view(np.float32), ra.view(np.uint32), \
        rb.view(np.uint32)
    for t in range(n):
        row, c, s = k[i0[t], i1[t]], cos[t], sin[t]
        for h in range(heads):
            # a head's pairs as two 1-D views: its halves (neox) or its even and odd dims (gptj)
            xa = row[h, 0:2 * half - 1:2] if gptj else row[h, :half]
            xb = row[h, 1:2 * half:2] if gptj else row[h, half:2 * half]
            if bf16:
                for i in range(half):
                    a_u[i] = np.uint32(xa[i]) << np.uint32(16)
                    b_u[i] = np.uint32(xb[i]) << np.uint32(16)
            else:
                for i in range(half):
                    a_u[i], b_u[i] = np.uint32(xa[i]), np.uint32(xb[i])
            for i in range(half):
                ra[i] = a[i] * c[i] - b[i] * s[i]
                rb[i] = b[i] * c[i] + a[i] * s[i]
            if bf16:
                for i in range(half):
                    xa[i], xb[i] = _to_bf16(ra_u[i]), _to_bf16(rb_u[i])
            else:
                for i in range(half):
                    xa[i], xb[i] = ra_u[i], rb_u[i]


@njit(cache=True, inline="always")
def _to_bf16(u):  # pragma: no cover (compiled)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16(0x7FC0)
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
                     >> np.uint32(16))


def supports(dtype_name: str) -> bool:
    """Whether the kernel turns buffers of this ``shm.layout.DType`` name."""
    return dtype_name in ("BFLOAT16", "FLOAT32")


def turn(k: np.ndarray, i0: np.ndarray, i1: np.ndarray, cos: np.ndarray, sin: np.ndarray,
         d: int, gptj: bool, dtype_name: str) -> None:
    """``turn_raw`` with its arguments checked and typed."""
    assert k.ndim == 4 and k.dtype in (np.uint16, np.uint32), (k.shape, k.dtype)
    turn_raw(k, np.ascontiguousarray(i0, np.int64), np.ascontiguousarray(i1, np.int64),
             np.ascontiguousarray(cos, np.float32), np.ascontiguousarray(sin, np.float32),
             int(d), bool(gptj), dtype_name == "BFLOAT16")


def warm() -> None:
    """Compile (or load from numba's cache) the kernel for each kind of K the data plane passes:
    bf16 and float32, C-contiguous (a contiguous buffer's layer, a flash_attn paged layer) and
    strided (a transposed cpu_kt layer), so that the first turn of a real call compiles nothing."""
    rows, trig = np.zeros(1, np.int64), np.ones((1, 1), np.float32)
    for raw, name in ((np.uint16, "BFLOAT16"), (np.uint32, "FLOAT32")):
        k = np.zeros((1, 1, 1, 4), raw)
        for view in (k, k[..., ::2]):
            turn(view, rows, rows, trig, trig, 2, False, name)


__all__ = ["turn", "supports", "warm"]
