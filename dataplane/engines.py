"""The backend choice: which copy engine a data plane runs (``make_engine``). It imports the
implementations (``dataplane.cpu``, ``dataplane.cuda_engine``), which import the interface
(``dataplane.backend``): the factory sits above both, so no module imports one that imports it."""

from __future__ import annotations

from kvblend.dataplane.backend import CopyEngine
from kvblend.dataplane.backends import Backend, resolve
from kvblend.dataplane.calls import Tuning
from kvblend.shm.store import Store


def make_engine(backend: Backend | str, store: Store, tuning: Tuning = Tuning()) -> CopyEngine:
    """The copy engine for ``backend`` (``cpu``, ``cuda`` or ``auto``: CUDA when a GPU is
    present; ``tuning``: its staging). CUDA code is imported here, lazily: CPU-only machines
    have no cupy.

    Raises:
        ValueError: not a backend.
    """
    try:
        chosen = resolve(backend)
    except ValueError:
        raise ValueError(f"unknown backend {backend!r}: use cpu, cuda or auto") from None
    if chosen is Backend.CUDA:
        from kvblend.dataplane.cuda_engine import CudaEngine
        return CudaEngine(store, tuning.staging_bytes, tuning.layer_dma_bytes)
    from kvblend.dataplane.cpu import CpuEngine
    return CpuEngine(store)


__all__ = ["make_engine"]
