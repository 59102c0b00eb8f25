"""Where engine KV buffers live: the one ``Backend`` (the service's and the data plane's setting,
and what its ``Pong`` reports) and the resolution of ``auto``. Standard library only, so the
service's settings take it without loading the data plane."""

from __future__ import annotations

from enum import StrEnum


class Backend(StrEnum):
    """``AUTO`` resolves to ``CUDA`` when a GPU is present (``resolve``); a data plane runs, and
    reports, ``CPU`` or ``CUDA``."""

    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


def resolve(backend: Backend | str) -> Backend:
    """``AUTO`` -> ``CUDA`` when torch sees a GPU, else ``CPU``. Probes only when asked."""
    backend = Backend(backend)
    if backend is not Backend.AUTO:
        return backend
    try:
        import torch
    except ImportError:
        return Backend.CPU
    return Backend.CUDA if torch.cuda.is_available() else Backend.CPU


__all__ = ["Backend", "resolve"]
