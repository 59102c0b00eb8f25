"""Every compiled kernel the data plane runs, warmed in one call: at its start-up
(``dataplane.__main__``) and in the image's build step (``Dockerfile``), from this one list.

It owns the list, not the kernels: the store's and fingerprint index's (``shm.warm``), the CPU turn
of K (``dataplane.cpu_rotary``), the paged segment table (``dataplane.segments``) and the CPU's
paged copy (``dataplane.cpu_paged``).
"""

from __future__ import annotations


def warm(prefix: str) -> float:
    """Compile (or load from numba's cache) every kernel, a log line before and after; returns
    the seconds taken.

    Args:
        prefix: the service's prefix (``shm.warm`` builds its scratch store beside it).
    """
    from kvblend.dataplane import cpu_paged, cpu_rotary, segments
    from kvblend.shm.warm import warm as warm_store
    # the store's and index's kernels, then K's turn, the segment table and the paged copy
    return warm_store(prefix, also=(cpu_rotary.warm, segments.warm, cpu_paged.warm))


__all__ = ["warm"]
