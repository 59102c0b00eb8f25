"""Re-rotating K on the GPU: one kernel turns every retrieved token's K in the engine's buffer.

This module owns the kernel and its table. The caller (``dataplane.cuda``, ``dataplane.cuda_paged``)
says where each token's K row of a layer starts; the frequencies and the turn's arithmetic are
those of ``dataplane.rotary`` (its docstring has the formulas), so a GPU turn equals the CPU one.

Where K lives: the K row of token ``j`` in layer ``l`` (``heads * head_dim`` elements, heads
contiguous, dims contiguous) starts at byte address ``layer[l] + row[j]``::

    contiguous [2, L, T, D]   layer[l] = buffer + l*T*D*isz          row[j] = t_j*D*isz
    paged (flash_attn, ...)   layer[l] = K of layer l's allocation   row[j] = block_j*block_bytes
                                                                              + slot_j*token_bytes

The table, int64 words uploaded on the instance's stream ahead of the kernel
(``dataplane.gather.UploadRing``)::

    [0, 3n)                (row[j], old[j], new[j]) per token: the K row's offset, the position
                           its K was computed at, the position it is turned to
    [3n, 3n+nl)            layer[l] of the layers turned
    [3n+nl, 3n+nl+d/2)     the frequencies f_i (float32 values held as float64 bits)

One thread per (token, head, pair ``i``) computes the pair's turn once, ``fl32(new*f_i) -
fl32(old*f_i)`` in float64 with float64 ``sincos`` rounded to float32, and applies it to that
pair in every layer: float32 products and sums rounded one by one (``__fmul_rn``: no fused
multiply-add, as torch's CPU arithmetic in ``rotary.rotate``), written back in the buffer's dtype
(bf16 and fp16 rounded to nearest even). Pairs: ``neox`` dims ``(i, i + d/2)``, ``gptj``
``(2i, 2i + 1)``; dims past ``d`` are not touched.
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np

from kvblend.dataplane.gather import UploadRing, external_stream, load_kernel, stream_handle

THREADS = 256
BLOCKS_PER_SM = 8

_SOURCE = r"""
struct F32 {
    typedef float S;
    static __device__ __forceinline__ float get(float x) { return x; }
    static __device__ __forceinline__ float put(float x) { return x; }
};
struct F16 {
    typedef unsigned short S;
    static __device__ __forceinline__ float get(unsigned short x) {
        float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f;
    }
    static __device__ __forceinline__ unsigned short put(float f) {
        unsigned short x; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(x) : "f"(f)); return x;
    }
};
struct BF16 {
    typedef unsigned short S;
    static __device__ __forceinline__ float get(unsigned short x) {
        return __uint_as_float((unsigned int)x << 16);
    }
    static __device__ __forceinline__ unsigned short put(float f) {
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;  // NaN
        u += 0x7fffu + ((u >> 16) & 1u);  // to nearest, ties to even
        return (unsigned short)(u >> 16);
    }
};

template <class K>
__device__ void turn(const long long* __restrict__ tab, long long n, int nl, int half, int heads,
                     int head_dim, int gptj) {
    const long long* layer = tab + 3 * n;
    const double* freq = reinterpret_cast<const double*>(tab + 3 * n + nl);
    const long long total = n * heads * half;
    for (long long g = blockIdx.x * (long long)blockDim.x + threadIdx.x; g < total;
         g += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(g % half);
        const int h = (int)((g / half) % heads);
        const long long j = g / ((long long)half * heads);
        const float f = (float)freq[i];
        const float a_old = __fmul_rn((float)tab[3 * j + 1], f);
        const float a_new = __fmul_rn((float)tab[3 * j + 2], f);
        double sd, cd;
        sincos((double)a_new - (double)a_old, &sd, &cd);
        const float c = (float)cd, s = (float)sd;
        const int ia = h * head_dim + (gptj ? 2 * i : i);
        const int ib = h * head_dim + (gptj ? 2 * i + 1 : i + half);
        const long long row = tab[3 * j];
        for (int l = 0; l < nl; ++l) {
            typename K::S* p = reinterpret_cast<typename K::S*>(layer[l] + row);
            const float a = K::get(p[ia]), b = K::get(p[ib]);
            p[ia] = K::put(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
            p[ib] = K::put(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
        }
    }
}

extern "C" __global__ void turn_f32(const long long* t, long long n, int nl, int half, int heads,
                                    int head_dim, int gptj) {
    turn<F32>(t, n, nl, half, heads, head_dim, gptj);
}
extern "C" __global__ void turn_f16(const long long* t, long long n, int nl, int half, int heads,
                                    int head_dim, int gptj) {
    turn<F16>(t, n, nl, half, heads, head_dim, gptj);
}
extern "C" __global__ void turn_bf16(const long long* t, long long n, int nl, int half, int heads,
                                     int head_dim, int gptj) {
    turn<BF16>(t, n, nl, half, heads, head_dim, gptj);
}
"""

_KERNELS = {"FLOAT32": "turn_f32", "FLOAT16": "turn_f16", "BFLOAT16": "turn_bf16"}


def turner_kernels(device: int) -> dict[str, Any]:
    """The turn kernel of each dtype on ``device``, loaded (``gather.load_kernel``)."""
    idle = (np.int64(0), *(np.int32(0),) * 5)
    return {dtype: load_kernel(device, _SOURCE, ("-std=c++17",), name, idle)
            for dtype, name in _KERNELS.items()}


class KTurner:
    """Turns K rows in place on one device, one kernel launch per call.

    Args:
        device: the CUDA device holding the engine's buffer.
        dtype: the buffer's ``shm.layout.DType`` name (``FLOAT32``, ``FLOAT16``, ``BFLOAT16``).
    """

    def __init__(self, device: int, dtype: str) -> None:
        self.device = device
        self._kernel = turner_kernels(device)[dtype]
        with cupy.cuda.Device(device):
            sms = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
        self._max_blocks = int(sms) * BLOCKS_PER_SM
        self._ring = UploadRing(device)
        self._streams: dict[int, Any] = {}

    def turn(self, layers: np.ndarray, rows: np.ndarray, old: np.ndarray, new: np.ndarray,
             freqs: np.ndarray, heads: int, head_dim: int, gptj: bool, stream: Any) -> None:
        """Enqueue the turn of K rows ``layers[l] + rows[j]`` (byte addresses) of each layer from
        positions ``old[j]`` to ``new[j]`` on ``stream``; returns without waiting for it."""
        n, half = len(rows), len(freqs)
        if not n or not len(layers):
            return
        words = np.empty(3 * n + len(layers) + half, np.int64)
        tok = words[:3 * n].reshape(n, 3)
        tok[:, 0], tok[:, 1], tok[:, 2] = rows, old, new
        words[3 * n:3 * n + len(layers)] = layers
        words[3 * n + len(layers):] = np.asarray(freqs, np.float32).astype(np.float64).view(
            np.int64)
        with cupy.cuda.Device(self.device):
            handle = stream_handle(stream)
            ext = self._streams.get(handle)
            if ext is None:
                ext = self._streams[handle] = external_stream(handle, self.device)
            slot = self._ring.upload(words, ext)
            total = n * heads * half
            blocks = max(1, min((total + THREADS - 1) // THREADS, self._max_blocks))
            self._kernel((blocks,), (THREADS,),
                         (slot.dev, np.int64(n), np.int32(len(layers)), np.int32(half),
                          np.int32(heads), np.int32(head_dim), np.int32(gptj)), stream=ext)
            slot.launched(ext)


__all__ = ["KTurner", "turner_kernels"]
