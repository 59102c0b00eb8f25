"""The CPU copy engine: engine buffers in POSIX shared memory, copies with memcpy (numpy).

This module owns opening a ``ShmBuffer`` and the copies; it serves CPU-only engines, tests and CI
with the same semantics as the CUDA engine. numpy releases the GIL inside large copies, so the
worker threads of different instances copy in parallel.
"""

from __future__ import annotations

import numpy as np

from dataplane.backend import CopyEngine, InstanceBuffer
from dataplane.errors import BackendError, BadRequest
from dataplane.messages import Backend, BufferSpec, ShmBuffer
from shm.layout import KVLayout
from shm.segment import Segment
from shm.store import Store


class CpuBuffer(InstanceBuffer):
    def __init__(self, seg: Segment, layout: KVLayout, slab: np.ndarray) -> None:
        self.layout = layout
        self._seg = seg
        row = layout.hidden_dim * layout.dtype.itemsize
        self._buf = np.ndarray((2, layout.num_layers, layout.num_tokens, row), np.uint8, seg.buf)
        self._slab = slab
        self._row = row

    def _slot(self, slab_offset: int, chunk_size: int) -> np.ndarray:
        n = 2 * self.layout.num_layers * chunk_size * self._row
        return self._slab[slab_offset:slab_offset + n].reshape(
            2, self.layout.num_layers, chunk_size, self._row)

    def begin(self, engine_event: bytes | None) -> None:
        if engine_event is not None:
            raise BadRequest("a CPU buffer takes no CUDA event")

    def to_slab(self, token_start: int, chunk_size: int, slab_offset: int) -> None:
        np.copyto(self._slot(slab_offset, chunk_size),
                  self._buf[:, :, token_start:token_start + chunk_size])

    def from_slab(self, slab_offset: int, chunk_size: int, token_start: int) -> None:
        np.copyto(self._buf[:, :, token_start:token_start + chunk_size],
                  self._slot(slab_offset, chunk_size))

    def end(self, done_event: bytes | None) -> None:
        if done_event is not None:
            raise BadRequest("a CPU buffer takes no CUDA event")

    def close(self) -> None:
        self.__dict__.pop("_buf", None)
        self._seg.close()


class CpuEngine(CopyEngine):
    backend = Backend.CPU

    def __init__(self, store: Store) -> None:
        self._slab = store.slab

    def open(self, spec: BufferSpec, layout: KVLayout) -> InstanceBuffer:
        if not isinstance(spec, ShmBuffer):
            raise BadRequest("the CPU data plane takes shm buffers only (got a CUDA buffer)")
        try:
            seg = Segment(spec.name)
        except (FileNotFoundError, OSError, ValueError) as exc:
            raise BackendError(f"cannot map shm buffer {spec.name!r}: {exc}") from exc
        if seg.size < layout.nbytes:
            seg.close()
            raise BadRequest(f"shm buffer {spec.name!r} holds {seg.size} bytes, the layout "
                             f"{layout.shape} needs {layout.nbytes}")
        return CpuBuffer(seg, layout, self._slab)


__all__ = ["CpuEngine", "CpuBuffer"]
