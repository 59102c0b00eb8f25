"""The exception tree of the storage tier.

::

    ShmError                     anything the store raises on purpose
    ├── StoreFull                no free slot and nothing evictable (all pinned or reserved)
    ├── LayoutMismatch           existing segments or a chunk disagree with the requested layout/version
    ├── CapacityError            a fixed-size table (layout classes, pins, index entries) is full
    ├── Busy                     a timed wait for the cross-process lock ran out
    └── ForeignObject            a name we would use exists but is not ours (owner, mode, kind)
"""


class ShmError(Exception):
    """Base class of every error raised on purpose by ``shm``."""


class StoreFull(ShmError):
    """No free slot, and every candidate for eviction is pinned or reserved."""


class LayoutMismatch(ShmError):
    """Segments or a request disagree with the expected layout or format version."""


class CapacityError(ShmError):
    """A fixed-size table is full."""


class Busy(ShmError):
    """A timed wait for the cross-process lock ran out."""


class ForeignObject(ShmError):
    """A segment, lock, socket or state file under our names that this service did not create:
    another owner, group/other permission bits, a symlink or another kind of file. Never adopted,
    never removed: the operator must look at it."""
